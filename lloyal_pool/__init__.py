"""lloyal_pool: forkable, crash-isolated llama.cpp inference. Every engine runs in its own worker process;
this process never loads llama.cpp."""

from __future__ import annotations

from . import metrics
from .branches import KV, Branch, BranchInfo, BranchStore, KVPressure, Produced
from .client import Context, Instance, Model, Pool, Stream
from .errors import (
    BranchError,
    ContextError,
    ContextOverflowError,
    DecodeError,
    GrammarError,
    InterruptedByClient,
    InvalidTokenError,
    LloyalError,
    ModelLoadError,
    PoolClosedError,
    ProtocolError,
    RemoteError,
    StaleHandleError,
    StateError,
    WorkerCrashedError,
    WorkerError,
    WorkerStartupError,
)
from .models import default_model_path
from .params import (
    ContextParams,
    EvalResult,
    GenerateParams,
    Grammar,
    ModelInfo,
    Result,
    SamplerParams,
    Score,
    StopReason,
)

__version__ = "0.1.0"

__all__ = [
    "KV",
    "Branch",
    "BranchError",
    "BranchInfo",
    "BranchStore",
    "Context",
    "ContextError",
    "ContextOverflowError",
    "ContextParams",
    "DecodeError",
    "EvalResult",
    "GenerateParams",
    "Grammar",
    "GrammarError",
    "Instance",
    "InterruptedByClient",
    "InvalidTokenError",
    "KVPressure",
    "LloyalError",
    "Model",
    "ModelInfo",
    "ModelLoadError",
    "Pool",
    "PoolClosedError",
    "Produced",
    "ProtocolError",
    "RemoteError",
    "Result",
    "SamplerParams",
    "Score",
    "StaleHandleError",
    "StateError",
    "StopReason",
    "Stream",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerStartupError",
    "default_model_path",
    "metrics",
]


def __dir__() -> list[str]:
    return __all__
