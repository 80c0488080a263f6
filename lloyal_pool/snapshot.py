"""Snapshots: an instance prepared once (models loaded, contexts created and prefilled), then forked into
ready instances in milliseconds (go-llama's Snapshot/Fork, with processes).

    snap = pool.snapshot(prepare)      prepare(instance) runs once, in a fresh worker: the zygote
    inst = snap.fork()                 a new worker with the same models, contexts and KV cache
    inst.prepared["chat"]              the handles prepare() returned, by name, bound to the fork

On Linux the zygote forks copy-on-write children: a fork shares the model's pages and the prepared KV
cache with the zygote until it writes, and its handles are the zygote's. See worker/zygote.py for how
threads are handled (the zygote computes on one thread; its forks on the threads their contexts were
created with).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

from . import protocol as p
from ._process import WorkerProcess
from .context import Context
from .errors import SnapshotError
from .instance import Instance
from .lora import LoraAdapter, LoraOwner
from .model import Model

Handle = Model | Context | LoraAdapter
Prepare = Callable[[Instance], "Mapping[str, Handle] | None"]


class Snapshot:
    """A prepared instance that forks into ready ones (Pool.snapshot). ``fork()`` returns a new Instance
    holding what prepare() left; ``names`` are the handles prepare() returned by name. ``mode`` says how:
    "fork" (Linux, CPU variant: the prepared worker is a zygote that forks copy-on-write children) or
    "replay" (elsewhere, e.g. a GPU variant or AMX kernels: each fork is a fresh worker that loads the same
    models and the saved state of each named context). Close it with close() (or a ``with`` block; the pool's
    close() closes it too); forks live on after it."""

    def __init__(self, prepare: Prepare, *, spawn: Callable[..., WorkerProcess],
                 release: Callable[[WorkerProcess], None], closed: Callable[[], bool], why_no_fork: str | None,
                 fork: bool | None = None) -> None:
        """``spawn(zygote=..., fork_from=...)`` starts a worker of the pool's (not ready yet), ``release``
        ends one, ``closed()`` says whether the pool is; ``why_no_fork``: what keeps its workers from
        forking (variants.fork_obstacle), or None."""
        if fork and why_no_fork:
            raise SnapshotError(f"this snapshot cannot fork: {why_no_fork}; use fork=False (replay)")
        #: "fork" or "replay".
        self.mode = "replay" if why_no_fork or fork is False else "fork"
        self._spawn, self._release, self._pool_closed = spawn, release, closed
        self._closed = False
        self._states: dict[int, bytes] = {}
        proc = spawn(zygote=self.mode == "fork")
        try:
            proc.wait_ready()
            instance = Instance(proc)
            named = prepare(instance) or {}
            self._handles = _check_handles(named, instance)
            if self.mode == "fork":
                self._frozen = proc.call(p.Freeze()).result()
            else:
                self._states = {id(h): h.save_state() for h in self._handles.values() if isinstance(h, Context)}
        except BaseException:
            release(proc)
            raise
        self._zygote: WorkerProcess | None = proc if self.mode == "fork" else None
        if self._zygote is None:
            release(proc)  # replay needs only what was saved from it

    @property
    def names(self) -> list[str]:
        """The names of the handles prepare() returned, in its order."""
        return list(self._handles)

    @property
    def closed(self) -> bool:
        """Whether close() was called (or the pool closed); fork() then raises SnapshotError."""
        return self._closed or self._pool_closed()

    def fork(self) -> Instance:
        """A new Instance with what prepare() made, ready: the same models, contexts (their KV cache,
        history and last logits) and LoRA adapters; ``instance.prepared`` maps prepare()'s names to its
        handles. Each fork is an independent worker: a crash or a generate in one leaves the others and
        the snapshot untouched. SnapshotError once the snapshot is closed, or its worker has died."""
        if self.closed:
            raise SnapshotError("the snapshot is closed")
        zygote = self._zygote
        if zygote is not None and not zygote.alive:
            raise SnapshotError(f"the snapshot's worker is gone ({zygote._dead})")
        proc = self._spawn(fork_from=zygote)
        try:
            proc.wait_ready()
            instance = Instance(proc)
            if zygote is not None:
                instance._prepared = _rebind(self._handles, instance)
            else:
                instance._prepared = _replay(self._handles, self._states, instance)
        except BaseException:
            self._release(proc)
            raise
        return instance

    def close(self) -> None:
        """Ends the zygote (or drops the saved state). Forks already made keep running. Idempotent."""
        self._closed = True
        self._states = {}
        if self._zygote is not None:
            self._release(self._zygote)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.mode
        return f"<Snapshot {state} names={self.names}>"


def _check_handles(named: Mapping[str, Any], instance: Instance) -> dict[str, Handle]:
    if not isinstance(named, Mapping):
        raise SnapshotError(f"prepare() returns a mapping of names to handles, or None; got {type(named).__name__}")
    out: dict[str, Handle] = {}
    for name, handle in named.items():
        if not isinstance(name, str):
            raise SnapshotError(f"prepare() returned a handle under {name!r}: names are strings")
        if not isinstance(handle, (Model, Context, LoraAdapter)):
            raise SnapshotError(f"prepare() returned {type(handle).__name__} as {name!r}: a snapshot carries "
                                "Model, Context and LoraAdapter handles by name")
        owner = handle.model.instance if isinstance(handle, LoraAdapter) else handle.instance
        closed = handle._closed if isinstance(handle, Model) else handle.closed
        if owner is not instance or closed:
            raise SnapshotError(f"{name!r} is not a live handle of the instance prepare() was given")
        out[name] = handle
    return out


def _rebind(handles: Mapping[str, Handle], instance: Instance) -> dict[str, Handle]:
    """The fork's own handle objects: the same handle numbers (the fork inherited the zygote's engine),
    bound to the fork's worker."""
    def model(old: Model) -> Model:
        return Model(instance, old._handle, old.info, old.path, old._load, old._source)

    def adapter(old: LoraAdapter, owner: Model) -> LoraAdapter:
        new = LoraAdapter(owner, old._handle, old.path, old.alpha, old.meta)
        owner._loras.add(new)
        return new

    def context(old: Context, owner: Model, lora: list[tuple[LoraAdapter, float]]) -> Context:
        new = Context(owner, old._desc, old._params)
        new._link.state.lora = lora
        return new

    return _carry(handles, model, adapter, context)


def _replay(handles: Mapping[str, Handle], states: Mapping[int, bytes], instance: Instance) -> dict[str, Handle]:
    """Makes in a fresh worker what the named handles are: each model loaded as it was, each adapter
    loaded, each context created with its parameters, its adapters applied and its saved state loaded."""
    def model(old: Model) -> Model:
        loaded = old._load_into(instance._proc).result()
        return Model(instance, loaded.model, loaded.info, old.path, old._load, old._source)

    def adapter(old: LoraAdapter, owner: Model) -> LoraAdapter:
        return owner.load_lora(old.path)

    def context(old: Context, owner: Model, lora: list[tuple[LoraAdapter, float]]) -> Context:
        new = owner.new_context(old._params)
        if lora:
            new.set_lora(lora)
        new.load_state(states[id(old)])
        return new

    return _carry(handles, model, adapter, context)


def _carry(handles: Mapping[str, Handle], make_model: Callable[[Model], Model],
           make_adapter: Callable[[LoraAdapter, Model], LoraAdapter],
           make_context: Callable[[Context, Model, list[tuple[LoraAdapter, float]]], Context]) -> dict[str, Handle]:
    """The named handles made anew by the make_* functions, each model and adapter once however many
    handles share it, a context's model and adapters before the context."""
    models: dict[int, Model] = {}
    adapters: dict[int, LoraAdapter] = {}

    def model(old: Model | LoraOwner) -> Model:
        if id(old) not in models:
            # A context's or an adapter's model is the Model that made it, named by a Protocol only
            # because their modules are below model.py.
            models[id(old)] = make_model(cast(Model, old))
        return models[id(old)]

    def adapter(old: LoraAdapter) -> LoraAdapter:
        if id(old) not in adapters:
            adapters[id(old)] = make_adapter(old, model(old.model))
        return adapters[id(old)]

    out: dict[str, Handle] = {}
    for name, handle in handles.items():
        if isinstance(handle, Model):
            out[name] = model(handle)
        elif isinstance(handle, LoraAdapter):
            out[name] = adapter(handle)
        else:
            out[name] = make_context(handle, model(handle.model), [(adapter(a), s) for a, s in handle._lora])
    return out


__all__ = ["Snapshot"]
