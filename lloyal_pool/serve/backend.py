"""What the HTTP app needs of whatever serves the model: a Pool on this machine (``PoolBackend``) or a
RayPool across a cluster (lloyal_pool.ray). Every method blocks (the app calls them on a thread), and
every worker behind a backend holds the same one model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .. import protocol as p
from .._embedder import Embedder
from ..batching import BatchRequest
from ..chat import ChatMessage
from ..model import Model
from ..params import GenerateParams
from ..pool import Pool
from .schemas import APIError


@dataclass(frozen=True)
class WorkerGauge:
    """One worker as /health and /metrics show it."""

    worker: str
    alive: bool
    active: int = 0  # requests generating in its slots
    queued: int = 0  # requests waiting for a slot


class Backend(Protocol):
    def model_path(self) -> str: ...

    def submit(self, prompt: str | list[int], gen: GenerateParams,
               on_piece: Callable[[str], None] | None) -> BatchRequest: ...

    def format_chat(self, messages: Sequence[Mapping[str, Any]], *, template: str | None,
                    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str) -> p.ChatPrompt: ...

    def parse_chat(self, text: str, *, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
                   messages: Sequence[Mapping[str, Any]], tool_choice: str, partial: bool) -> ChatMessage: ...

    def embed(self, inputs: Sequence[str | list[int]]) -> tuple[list[np.ndarray], int]:
        """The vectors, and the number of tokens the inputs hold."""
        ...

    def gauges(self) -> list[WorkerGauge]: ...


class PoolBackend:
    """A Pool on this machine: requests routed by pool.submit, questions asked of any live worker."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._embedders: dict[int, Embedder] = {}  # one per worker's model, made at its first request
        self._lock = threading.Lock()

    def any_model(self) -> Model:
        for inst in self.pool:
            if inst.alive:
                models = inst.models
                if len(models) == 1:
                    return models[0]
        raise APIError(503, "no live worker holds a model", "server_error")

    def model_path(self) -> str:
        return self.any_model().path

    def submit(self, prompt: str | list[int], gen: GenerateParams,
               on_piece: Callable[[str], None] | None) -> BatchRequest:
        return self.pool.submit(prompt, gen, on_piece=on_piece)

    def format_chat(self, messages: Sequence[Mapping[str, Any]], *, template: str | None,
                    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str) -> p.ChatPrompt:
        return self.any_model()._format_chat(messages, template=template, tools=tools, tool_choice=tool_choice)

    def parse_chat(self, text: str, *, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
                   messages: Sequence[Mapping[str, Any]], tool_choice: str, partial: bool) -> ChatMessage:
        return self.any_model()._parse_chat(text, template=template, tools=tools, messages=messages,
                                            tool_choice=tool_choice, partial=partial)

    def embed(self, inputs: Sequence[str | list[int]]) -> tuple[list[np.ndarray], int]:
        model = self.any_model()
        with self._lock:
            embedder = self._embedders.get(id(model))
            if embedder is None or embedder.model is not model:
                embedder = self._embedders[id(model)] = Embedder(model)
        return embedder.embed(inputs)

    def gauges(self) -> list[WorkerGauge]:
        out = []
        for inst in self.pool:
            active = queued = 0
            for model in inst.models if inst.alive else []:
                b = model._batcher
                if b is not None and not b.closed:
                    active, queued = active + b.active, queued + b.queued
            out.append(WorkerGauge(str(inst.worker_id), inst.alive, active, queued))
        return out


def backend_of(pool: Any) -> Backend:
    """The backend for what create_app was given: a Pool, or anything with a ``serving_backend()``
    (RayPool)."""
    if isinstance(pool, Pool):
        return PoolBackend(pool)
    make = getattr(pool, "serving_backend", None)
    if make is None:
        raise TypeError(f"create_app serves a Pool or a RayPool, not {type(pool).__name__}")
    backend: Backend = make()
    return backend
