"""The public client: a Pool of worker processes, and handles that mirror the native objects inside them.

    Pool ──▶ Instance (one worker process = one isolated engine)
                └─▶ Model (a loaded GGUF)  ──▶ Context (a KV cache + generation)
                                           ──▶ LoraAdapter (applied per context: Context.set_lora)

This process never loads llama.cpp. Every handle method is a request to its worker (_process.py) and
returns when the reply arrives; ``*_async`` variants return the concurrent.futures.Future underneath.
Any thread may call; calls on one worker run in the order they were made. A worker that dies fails its
waiting calls with WorkerCrashedError and leaves its handles stale (StaleHandleError); the others keep
serving, and Pool.replace() starts a fresh one in its place.

Each class lives in a module of its own (pool.py, instance.py, model.py, context.py, lora.py, stream.py,
lifecycle.py); this module gathers them under the name they have always been imported by.
"""

from __future__ import annotations

from .context import Context
from .instance import Instance
from .lifecycle import Subscribers, WorkerEvent
from .lora import LoraAdapter
from .model import Model
from .pool import Pool
from .stream import Stream

# ProgressCallback is importable from here too; instance.py documents it.
__all__ = ["Context", "Instance", "LoraAdapter", "Model", "Pool", "Stream", "Subscribers", "WorkerEvent"]
