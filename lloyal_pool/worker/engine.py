"""The engine of one worker: models and contexts over the native module, addressed by integer handles.

It knows nothing of pipes or frames (worker/loop.py does), so it runs the same in-process, which is how
the tests exercise the request logic without a subprocess. Each handler serves one request struct of
protocol.py and returns its declared reply; ``@handles`` (worker/registry.py) registers it, and
Engine.handle() dispatches by the request's type. Bulk results are written into the shared-memory region
and returned as descriptors.

The handlers live one concern to a module, each module a base class of Engine over the same tables
(registry.Registry): model_handlers (models, their vocabulary and chat templates, LoRA adapters),
context_handlers (a context itself, its raw KV sequences and low-level loop), generation_handlers,
scoring_handlers (scores, embeddings, rerank), branch_handlers and state_handlers. What is left here is
what concerns every request: which ones a worker serves in its present state, and the heartbeat.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from .. import protocol as p
from ..errors import BadRequestError, ContextError, InvalidArgumentError, SnapshotError
from ..params import Device
from ..protocol import Request
from ..shm import Region
from .branch_handlers import BranchHandlers
from .context_handlers import ContextHandlers
from .generation_handlers import GenerationHandlers
from .model_handlers import ModelHandlers
from .registry import HANDLERS, Call, EventSink, handles
from .scoring_handlers import ScoringHandlers
from .state_handlers import StateHandlers

# What an embedding context (embeddings=True) takes; every other context request is refused there.
_EMBEDDING_OPS: frozenset[type[Request[Any]]] = frozenset(
    {p.FreeContext, p.Embed, p.Rerank, p.Reset, p.Tokens, p.NPast, p.KvPressureRequest, p.SetLora,
     p.MemoryBreakdown})
# What a frozen zygote still serves (Fork itself is the loop's: worker/zygote.py).
_FROZEN_OPS: frozenset[type[Request[Any]]] = frozenset({p.Ping, p.Reap, p.Fault})
# Work that llama.cpp does with no interrupt check (no heartbeat from the native loops) but that ends on its
# own: reading a file, building a vocabulary, allocating a cache. The worker keeps its heartbeat going
# while these run, so that a large model or state is not taken for a hang (a stopped worker still is).
_UNCHECKED_OPS: frozenset[type[Request[Any]]] = frozenset(
    {p.LoadModel, p.FreeModel, p.LoadLora, p.NewContext, p.FreeContext, p.SaveState, p.LoadState,
     p.StateSeqGet, p.StateSeqSet, p.StateSeqSaveFile, p.StateSeqLoadFile, p.Tokenize, p.Detokenize})


class Engine(ModelHandlers, ContextHandlers, GenerationHandlers, ScoringHandlers, BranchHandlers, StateHandlers):
    def __init__(self, native: ModuleType, region: Region, default_threads: int | None = None,
                 single_threaded: bool = False) -> None:
        super().__init__(native, region, default_threads, single_threaded)
        # Once a snapshot's zygote is frozen it serves nothing but forks.
        self.frozen = False
        self.zygote: object = None

    def handle(self, req: Request[Any], request_id: int = 0, emit: EventSink | None = None) -> Any:
        """Runs one request through its registered handler."""
        self.region.beat()
        if self.frozen and type(req) not in _FROZEN_OPS:
            raise SnapshotError(f"{req.op.value}: this worker is a frozen snapshot; it serves only forks "
                                "(Snapshot.fork())")
        if isinstance(req, p.ContextRequest) and type(req) not in _EMBEDDING_OPS:
            entry = self._contexts.get(req.context)
            if entry is not None and entry.native.embeddings:
                raise ContextError(f"{req.op.value} needs a generation context; this one was created with "
                                   "embeddings=True (it can embed, and rerank with pooling='rank')")
        try:
            if type(req) in _UNCHECKED_OPS:
                with _keepalive(self.region):
                    return HANDLERS[type(req)](self, req, Call(request_id, emit))
            return HANDLERS[type(req)](self, req, Call(request_id, emit))
        except (ValueError, TypeError) as exc:
            # The native checks (and a few here) raise the plain built-ins for a value out of range or of
            # the wrong type; the client gets a LloyalError that is still that built-in.
            if type(exc) is ValueError:
                raise InvalidArgumentError(str(exc)) from exc
            if type(exc) is TypeError:
                raise BadRequestError(str(exc)) from exc
            raise

    def thaw(self) -> None:
        """In a zygote's forked child: every context computes with the threads it was created with."""
        self.frozen = self.single_threaded = False
        self.zygote = None
        for entry in self._contexts.values():
            entry.native.set_threads(entry.native.n_threads, entry.native.n_threads_batch)

    # -- the worker itself ----------------------------------------------------------------------------
    @handles(p.Ping)
    def ping(self, req: p.Ping, call: Call) -> p.Pong:
        return p.Pong(pid=os.getpid())

    @handles(p.Devices)
    def devices(self, req: p.Devices, call: Call) -> list[Device]:
        return [Device(**row) for row in self.native.devices()]

    def close(self) -> None:
        for model in list(self._models):
            self.free_model(p.FreeModel(model=model), Call())
        self.native.set_heartbeat_word(None)


@contextlib.contextmanager
def _keepalive(region: Region) -> Iterator[None]:
    """Beats the heartbeat from a thread while the body runs (the native call releases the GIL). A thread
    per call, not a standing one: a snapshot's zygote must hold no thread but its main one when it forks."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(0.05):
            region.beat()

    thread = threading.Thread(target=beat, daemon=True, name="lloyal-keepalive")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# Call, EventSink, HANDLERS and handles live in registry.py; loop.py and zygote.py take them from here.
__all__ = ["HANDLERS", "Call", "Engine", "EventSink", "handles"]
