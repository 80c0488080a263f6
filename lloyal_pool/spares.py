"""Hot spares (Pool(spares=N)): workers started ahead of need, with the models the pool's workers hold
already loaded, so that crash recovery takes one instead of starting a worker and loading its models
while the caller waits.

    a model loads in a pool worker ─▶ Spares.sync (a thread): every ready spare loads it too
    a worker dies (recover=True) ─▶ _core.WorkerCore._recover: Spares.take ─▶ the spare's loaded models stand in
                                    for the dead worker's (what it lacks is loaded then) ─▶ a new spare
                                    starts in the background

Where a worker can fork (snapshot.fork_obstacle: Linux, the CPU variant, kernels without AMX), spares are
forked from a zygote: a frozen worker holding one load of each model the pool's workers hold (the same
mechanism as Pool.snapshot). A fork is ready in milliseconds and shares the zygote's pages, so a spare
comes back at once after a recovery, and a recovery that finds no spare ready (a second crash) forks one
on the spot instead of starting a worker. A model loaded later makes the zygote stale: the ready spares
load it themselves, and a new zygote is built (in the background) for the next forks. Elsewhere spares
start cold: a worker spawned, then each model loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from . import protocol as p
from .errors import LloyalError
from .variants import fork_obstacle

IDLE_BEFORE_FILL = 0.25
"""Seconds a recovered worker stays without calls in flight before a new spare starts."""

if TYPE_CHECKING:
    from ._process import WorkerProcess
    from .errors import WorkerCrashedError
    from .model import Model

log = logging.getLogger("lloyal_pool")


def model_key(model: Model) -> bytes:
    """What makes two loads the same: the file (or bytes) and how it was loaded."""
    return msgspec.msgpack.encode((model.path, model._load))


@dataclass
class Spare:
    """A started worker and the models loaded in it, by model_key (a list: two Models of one file are two
    loads)."""

    proc: WorkerProcess
    loaded: dict[bytes, list[p.ModelLoaded]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # loads (sync) and claims (recovery) in turn

    def claim(self, model: Model) -> p.ModelLoaded | None:
        """The spare's load of ``model``, taken (None: it has none)."""
        loads = self.loaded.get(model_key(model))
        return loads.pop() if loads else None

    def release_unclaimed(self) -> None:
        """Frees the loads nobody claimed (the pool loaded them for a worker that is not the dead one)."""
        for loads in self.loaded.values():
            for loaded in loads:
                try:
                    self.proc.call(p.FreeModel(model=loaded.model)).result()
                except LloyalError:
                    pass
        self.loaded.clear()


@dataclass(frozen=True)
class Zygote:
    """A frozen worker that spares fork from: one load of each model_key in ``loaded``, which every fork
    inherits under the same handles."""

    proc: WorkerProcess
    loaded: dict[bytes, p.ModelLoaded]


class Spares:
    """The pool's ready spares. ``spawn(fork_from, zygote=False)`` starts a worker of the pool's, ready or
    raising: a fresh one (fork_from None; with ``zygote``, one that can become a zygote), or a fork of a
    frozen zygote; ``models`` lists the models the pool's workers hold now; ``release`` ends a worker of
    the pool's."""

    def __init__(self, wanted: int, spawn: Callable[..., WorkerProcess], models: Callable[[], list[Model]],
                 release: Callable[[WorkerProcess], None]) -> None:
        self.wanted = wanted
        self._spawn = spawn
        self._models = models
        self._release = release
        self._lock = threading.Lock()
        self._ready: list[Spare] = []
        self._starting = 0
        self._closed = False
        #: How spares start: "fork" (from a zygote) or "cold"; "cold" from the moment a zygote could not
        #: be made.
        self.mode = "cold"
        self._zygote: Zygote | None = None
        self._zygote_lock = threading.Lock()  # one zygote built at a time

    @property
    def ready(self) -> int:
        """How many spares are ready now."""
        with self._lock:
            return len(self._ready)

    def start(self, fork: bool) -> None:
        """Starts the spares: forked from a zygote (``fork``) or cold."""
        self.mode = "fork" if fork and self.wanted else "cold"
        self.fill()

    def fill(self) -> None:
        """Starts, in the background, as many spares as are missing."""
        with self._lock:
            missing = 0 if self._closed else self.wanted - len(self._ready) - self._starting
            self._starting += max(0, missing)
        for _ in range(max(0, missing)):
            threading.Thread(target=self._start_one, daemon=True, name="lloyal-spare").start()

    def _start_one(self) -> None:
        try:
            spare = self._forked() if self.mode == "fork" else None
            if spare is None:
                spare = Spare(self._spawn(None))
            self._load_missing(spare)
        except BaseException as exc:
            log.error("[spares] a spare worker could not be started: %s", exc)
            with self._lock:
                self._starting -= 1
            return
        with self._lock:
            self._starting -= 1
            if not self._closed:
                self._ready.append(spare)
                closed = False
            else:
                closed = True
        if closed:
            spare.proc.close(1.0)
        else:
            self._watch(spare)

    def _watch(self, spare: Spare) -> None:
        """A ready spare that dies is dropped, and another starts in its place."""
        relay = spare.proc.on_death

        def on_death(proc: WorkerProcess, error: WorkerCrashedError) -> None:
            if relay is not None:
                relay(proc, error)
            self._drop(spare)

        spare.proc.on_death = on_death
        if not spare.proc.alive:  # it died before the watch was in place
            self._drop(spare)

    def _drop(self, spare: Spare) -> None:
        with self._lock:
            if spare not in self._ready:
                return  # taken (it died as a pool worker: recovery's) or dropped already
            self._ready.remove(spare)
        self.fill()

    def _load_missing(self, spare: Spare) -> None:
        """Loads into the spare every model the pool's workers hold that it has not loaded (once per
        model_key: a recovery claims the spare's load for the first Model of a file, loads the others)."""
        with spare.lock:
            for model in self._models():
                key = model_key(model)
                if spare.loaded.get(key) or not spare.proc.alive:
                    continue
                spare.loaded.setdefault(key, []).append(model._load_into(spare.proc).result())

    # -- forking ----------------------------------------------------------------------------------------
    def _forked(self, build: bool = True) -> Spare | None:
        """A spare forked from the zygote, which is built first when there is none or the pool's models
        changed since (unless not ``build``: then a stale one serves, and None when there is none). None
        where there is no zygote (it could not be built: spares start cold from then on, logged) or the
        fork failed (logged)."""
        zygote = self._current_zygote() if build else self._zygote
        if zygote is None or not zygote.proc.alive:
            return None
        try:
            proc = self._spawn(zygote.proc)
        except BaseException as exc:
            if not self._closed:
                log.warning("[spares] a spare could not be forked (%s); starting one cold", exc)
            return None
        return Spare(proc, {key: [loaded] for key, loaded in zygote.loaded.items()})

    def _is_current(self, zygote: Zygote | None) -> bool:
        """Whether ``zygote`` is alive and holds every model the pool's workers hold."""
        return zygote is not None and zygote.proc.alive and all(
            model_key(m) in zygote.loaded for m in self._models())

    def _current_zygote(self) -> Zygote | None:
        with self._zygote_lock:
            old = self._zygote
            if self._is_current(old):
                return old
            if self.mode != "fork" or self._closed:
                return None
            try:
                zygote: Zygote | None = self._build_zygote()
            except BaseException as exc:
                if not self._closed:
                    log.warning("[spares] no zygote to fork spares from (%s); spares start cold", exc)
                self.mode, zygote = "cold", None
            if zygote is not None and self._closed:  # the pool closed while it was built
                self._release(zygote.proc)
                zygote = None
            self._zygote = zygote
        if old is not None:
            self._release(old.proc)  # its forks live on
        return zygote

    def _build_zygote(self) -> Zygote:
        proc = self._spawn(None, zygote=True)
        try:
            why_not = fork_obstacle(proc.options.variant, proc.hello.get("build", {}))
            if why_not:
                raise LloyalError(why_not)
            loaded: dict[bytes, p.ModelLoaded] = {}
            for model in self._models():
                key = model_key(model)
                if key not in loaded:
                    loaded[key] = model._load_into(proc).result()
            proc.call(p.Freeze()).result()
        except BaseException:
            self._release(proc)
            raise
        return Zygote(proc, loaded)

    def sync(self) -> None:
        """A model was loaded in a pool worker: the ready spares load it too (on a thread of its own), and
        a zygote is built again with it."""
        def run() -> None:
            with self._lock:
                ready = list(self._ready)
            for spare in ready:
                try:
                    self._load_missing(spare)
                except BaseException as exc:
                    log.error("[spares] spare worker %d could not load a model: %s", spare.proc.worker_id, exc)
            if self.mode == "fork" and self._zygote is not None:
                try:
                    self._current_zygote()
                except BaseException as exc:
                    log.error("[spares] the zygote could not be built again: %s", exc)

        threading.Thread(target=run, daemon=True, name="lloyal-spare-sync").start()

    def take(self) -> Spare | None:
        """A ready spare that is still alive, out of the set; else one forked now from the zygote (stale
        or not: recovery loads what it lacks); else None (fill() starts another)."""
        with self._lock:
            while self._ready:
                spare = self._ready.pop(0)
                if spare.proc.alive:
                    return spare
        return self._forked(build=False) if self.mode == "fork" and not self._closed else None

    def fill_after(self, busy: list[Future[Any]], at_most: float, idle: Callable[[], bool] | None = None) -> None:
        """fill() once the futures are done and ``idle()`` has held for a moment (at most ``at_most``
        seconds from now): a spare starting takes the CPU that a recovered worker's replayed calls need,
        and the calls made on it right after (a paused stream resumed there). A fork from a current zygote
        takes next to nothing: it starts at once."""
        if self.mode == "fork" and self._is_current(self._zygote):
            self.fill()
            return

        def run() -> None:
            deadline = time.monotonic() + at_most
            wait(busy, timeout=at_most)
            quiet_since: float | None = None
            while idle is not None and time.monotonic() < deadline:
                now = time.monotonic()
                quiet_since = (quiet_since or now) if idle() else None
                if quiet_since is not None and now - quiet_since >= IDLE_BEFORE_FILL:
                    break
                time.sleep(0.02)
            self.fill()

        threading.Thread(target=run, daemon=True, name="lloyal-spare-fill").start()

    def close(self) -> None:
        """No more spares start; the pool closes the workers (they are among its processes, the zygote
        too)."""
        with self._lock:
            self._closed = True
            self._ready.clear()


__all__ = ["Spare", "Spares", "Zygote", "model_key"]
