"""lloyal_pool: forkable, crash-isolated llama.cpp inference. Every engine runs in its own worker process;
this process never loads llama.cpp."""

from __future__ import annotations

import logging

from . import metrics
from ._link import PromptProgress
from .branches import KV, Branch, BranchInfo, BranchStore, KVPressure, Produced
from .client import Context, Instance, LoraAdapter, Model, Pool, ProgressCallback, Stream
from .errors import (
    BranchError,
    ContextError,
    ContextOverflowError,
    DecodeError,
    GrammarError,
    InterruptedByClient,
    InvalidTokenError,
    LloyalError,
    LoraError,
    ModelLoadError,
    PoolClosedError,
    ProtocolError,
    RemoteError,
    ResultTooLargeError,
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

# A library logs; the application decides what is shown. Without this, Python's last-resort handler would
# print every llama.cpp warning a worker forwards ("lloyal_pool.worker.<id>") on stderr.
logging.getLogger("lloyal_pool").addHandler(logging.NullHandler())

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
    "LoraAdapter",
    "LoraError",
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
