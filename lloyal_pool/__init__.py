"""lloyal_pool: forkable, crash-isolated llama.cpp inference. Every engine runs in its own worker process;
this process never loads llama.cpp."""

from __future__ import annotations

from .client import Context, Instance, Model, Pool, Stream
from .errors import (
    ContextError,
    ContextOverflowError,
    DecodeError,
    GrammarError,
    InvalidTokenError,
    LloyalError,
    ModelLoadError,
    PoolClosedError,
    ProtocolError,
    RemoteError,
    StaleHandleError,
    WorkerCrashedError,
    WorkerError,
    WorkerStartupError,
)
from .models import default_model_path
from .params import ContextParams, EvalResult, GenerateParams, ModelInfo, Result, StopReason

__version__ = "0.1.0"

__all__ = [
    "Context", "ContextError", "ContextOverflowError", "ContextParams", "DecodeError", "EvalResult",
    "GenerateParams", "GrammarError", "Instance", "InvalidTokenError", "LloyalError", "Model", "ModelInfo",
    "ModelLoadError", "Pool", "PoolClosedError", "ProtocolError", "RemoteError", "Result", "StaleHandleError",
    "StopReason", "Stream", "WorkerCrashedError", "WorkerError", "WorkerStartupError", "default_model_path",
]


def __dir__() -> list[str]:
    return __all__
