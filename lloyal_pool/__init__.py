"""lloyal_pool: forkable, crash-isolated llama.cpp inference. Every engine runs in its own worker process;
this process never loads llama.cpp.

A Pool starts the worker processes; ``pool[i].load_model(path)`` loads a Model into one of them, and
``model.new_context()`` gives a Context to generate, stream, evaluate or embed with, to grow a tree of
forkable branches on (Context.branch, Branch, BranchStore, KV), or to chat on (Context.chat, Session).
Every handle method is a request to its worker and blocks until the reply arrives (``*_async`` variants
return a Future). Parameters and results are in ``lloyal_pool.params``, the errors in
``lloyal_pool.errors`` (all derive from LloyalError), entropy and surprisal over logits in
``lloyal_pool.metrics``.

The callback types:

- ``PromptProgress``: ``Callable[[int, int], None]``, called as ``progress(done, total)`` after each
  micro-batch of a prompt (Context.generate, stream, eval, branch; Branch.prefill) with the prompt tokens
  decoded so far and the number to decode.
- ``ProgressCallback``: ``Callable[[float], None]``, called as ``progress(fraction)`` while a model loads
  (Instance.load_model), with the fraction loaded, 0.0 to 1.0.

Callbacks run on a client thread, the one that reads that worker's replies: a slow callback delays them.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import metrics
    from ._aio import AsyncStream
    from ._futures import PromptProgress
    from .branches import KV, Branch, BranchInfo, BranchStore, KVPressure, Produced
    from .chat import ChatMessage, ToolCall
    from .context import Context
    from .errors import (
        BranchError,
        CallTimeoutError,
        ContextError,
        ContextLostError,
        ContextOverflowError,
        DeadWorkerError,
        DecodeError,
        GrammarError,
        InterruptedByClient,
        InvalidArgumentError,
        InvalidTokenError,
        LloyalError,
        LoraError,
        MigrationError,
        ModelLoadError,
        PoolClosedError,
        ProtocolError,
        RemoteError,
        ResultTooLargeError,
        SnapshotError,
        StaleHandleError,
        StateError,
        TemplateError,
        WorkerCrashedError,
        WorkerError,
        WorkerHungError,
        WorkerStartupError,
    )
    from .instance import Instance, ProgressCallback
    from .lifecycle import WorkerEvent
    from .lora import LoraAdapter
    from .model import Model
    from .models import default_model_path
    from .params import (
        BufferMemory,
        ContextParams,
        Device,
        EvalResult,
        GenerateParams,
        Grammar,
        ModelInfo,
        Result,
        SamplerParams,
        Score,
        StopReason,
    )
    from .pool import Pool
    from .sampler import Sampler
    from .session import ChatReply, ChatStream, Session
    from .shm import shm_bytes_for
    from .snapshot import Snapshot
    from .stream import Stream

__version__ = "0.2.0"  # the one place: pyproject.toml reads it (tool.scikit-build.metadata.version)

# A library logs; the application decides what is shown. Without this, Python's last-resort handler would
# print every llama.cpp warning a worker forwards ("lloyal_pool.worker.<id>") on stderr.
logging.getLogger("lloyal_pool").addHandler(logging.NullHandler())

__all__ = [
    "KV",
    "AsyncStream",
    "Branch",
    "BranchError",
    "BranchInfo",
    "BranchStore",
    "BufferMemory",
    "CallTimeoutError",
    "ChatMessage",
    "ChatReply",
    "ChatStream",
    "Context",
    "ContextError",
    "ContextLostError",
    "ContextOverflowError",
    "ContextParams",
    "DeadWorkerError",
    "DecodeError",
    "Device",
    "EvalResult",
    "GenerateParams",
    "Grammar",
    "GrammarError",
    "Instance",
    "InterruptedByClient",
    "InvalidArgumentError",
    "InvalidTokenError",
    "KVPressure",
    "LloyalError",
    "LoraAdapter",
    "LoraError",
    "MigrationError",
    "Model",
    "ModelInfo",
    "ModelLoadError",
    "Pool",
    "PoolClosedError",
    "Produced",
    "ProgressCallback",
    "PromptProgress",
    "ProtocolError",
    "RemoteError",
    "Result",
    "ResultTooLargeError",
    "Sampler",
    "SamplerParams",
    "Score",
    "Session",
    "Snapshot",
    "SnapshotError",
    "StaleHandleError",
    "StateError",
    "StopReason",
    "Stream",
    "TemplateError",
    "ToolCall",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerEvent",
    "WorkerHungError",
    "WorkerStartupError",
    "default_model_path",
    "metrics",
    "shm_bytes_for",
]


# Where each public name is defined. They load on first use (PEP 562): a worker imports this package on
# its way to lloyal_pool.worker and must not load the client with it (tests/unit/test_layers.py).
_SOURCES: dict[str, tuple[str, ...]] = {
    "_aio": ("AsyncStream",),
    "_futures": ("PromptProgress",),
    "branches": ("KV", "Branch", "BranchInfo", "BranchStore", "KVPressure", "Produced"),
    "chat": ("ChatMessage", "ToolCall"),
    "context": ("Context",),
    "instance": ("Instance", "ProgressCallback"),
    "lifecycle": ("WorkerEvent",),
    "lora": ("LoraAdapter",),
    "model": ("Model",),
    "pool": ("Pool",),
    "sampler": ("Sampler",),
    "stream": ("Stream",),
    "errors": ("BranchError", "CallTimeoutError", "ContextError", "ContextLostError", "ContextOverflowError",
               "DeadWorkerError",
               "DecodeError", "GrammarError", "InterruptedByClient", "InvalidArgumentError", "InvalidTokenError",
               "LloyalError", "LoraError", "MigrationError", "ModelLoadError", "PoolClosedError", "ProtocolError",
               "RemoteError", "ResultTooLargeError", "SnapshotError", "StaleHandleError", "StateError", "TemplateError",
               "WorkerCrashedError", "WorkerError", "WorkerHungError", "WorkerStartupError"),
    "models": ("default_model_path",),
    "params": ("BufferMemory", "ContextParams", "Device", "EvalResult", "GenerateParams", "Grammar", "ModelInfo",
               "Result", "SamplerParams", "Score", "StopReason"),
    "session": ("ChatReply", "ChatStream", "Session"),
    "shm": ("shm_bytes_for",),
    "snapshot": ("Snapshot",),
}
_WHERE = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name == "metrics":
        return importlib.import_module(".metrics", __name__)
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return __all__
