"""Hot spares (Pool(spares=N)): workers started ahead of need, with the models the pool's workers hold
already loaded, so that crash recovery takes one instead of starting a worker and loading its models
while the caller waits.

    a model loads in a pool worker ─▶ Spares.sync (a thread): every ready spare loads it too
    a worker dies (recover=True) ─▶ _recovery.recover: Spares.take ─▶ the spare's loaded models stand in
                                    for the dead worker's (what it lacks is loaded then) ─▶ a new spare
                                    starts in the background
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

IDLE_BEFORE_FILL = 0.25
"""Seconds a recovered worker stays without calls in flight before a new spare starts."""

if TYPE_CHECKING:
    from ._process import WorkerProcess
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


class Spares:
    """The pool's ready spares; ``spawn`` starts a worker of the pool's (ready or raising), ``models``
    lists the models the pool's workers hold now."""

    def __init__(self, wanted: int, spawn: Callable[[], WorkerProcess], models: Callable[[], list[Model]]) -> None:
        self.wanted = wanted
        self._spawn = spawn
        self._models = models
        self._lock = threading.Lock()
        self._ready: list[Spare] = []
        self._starting = 0
        self._closed = False

    @property
    def ready(self) -> int:
        """How many spares are ready now."""
        with self._lock:
            return len(self._ready)

    def fill(self) -> None:
        """Starts, in the background, as many spares as are missing."""
        with self._lock:
            missing = 0 if self._closed else self.wanted - len(self._ready) - self._starting
            self._starting += max(0, missing)
        for _ in range(max(0, missing)):
            threading.Thread(target=self._start_one, daemon=True, name="lloyal-spare").start()

    def _start_one(self) -> None:
        try:
            spare = Spare(self._spawn())
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
                return
        spare.proc.close(1.0)

    def _load_missing(self, spare: Spare) -> None:
        """Loads into the spare every model the pool's workers hold that it has not loaded (once per
        model_key: a recovery claims the spare's load for the first Model of a file, loads the others)."""
        with spare.lock:
            for model in self._models():
                key = model_key(model)
                if spare.loaded.get(key) or not spare.proc.alive:
                    continue
                spare.loaded.setdefault(key, []).append(model._load_into(spare.proc).result())

    def sync(self) -> None:
        """A model was loaded in a pool worker: the ready spares load it too (on a thread of its own)."""
        def run() -> None:
            with self._lock:
                ready = list(self._ready)
            for spare in ready:
                try:
                    self._load_missing(spare)
                except BaseException as exc:
                    log.error("[spares] spare worker %d could not load a model: %s", spare.proc.worker_id, exc)

        threading.Thread(target=run, daemon=True, name="lloyal-spare-sync").start()

    def take(self) -> Spare | None:
        """A ready spare that is still alive, out of the set, or None (fill() starts another)."""
        with self._lock:
            while self._ready:
                spare = self._ready.pop(0)
                if spare.proc.alive:
                    break
            else:
                spare = None
        return spare

    def fill_after(self, busy: list[Future[Any]], at_most: float, idle: Callable[[], bool] | None = None) -> None:
        """fill() once the futures are done and ``idle()`` has held for a moment (at most ``at_most``
        seconds from now): a spare starting takes the CPU that a recovered worker's replayed calls need,
        and the calls made on it right after (a paused stream resumed there)."""
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
        """No more spares start; the pool closes the workers (they are among its processes)."""
        with self._lock:
            self._closed = True
            self._ready.clear()


__all__ = ["Spare", "Spares", "model_key"]
