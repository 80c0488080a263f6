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
from ..params import GenerateParams, token_ids
from ..pool import Pool
from .schemas import APIError


@dataclass(frozen=True)
class WorkerGauge:
    """One worker as /health and /metrics show it."""

    worker: str
    alive: bool
    active: int = 0  # requests generating in its slots
    queued: int = 0  # requests waiting for a slot
    kv_used: int | None = None  # KV cells its slots' sequences hold (cached prefixes included); None: unknown
    kv_total: int | None = None  # ... of slots x n_ctx_slot


@dataclass(frozen=True)
class ServedModel:
    """What /props tells of the model a worker serves."""

    path: str
    slots: int  # this worker's
    n_ctx_slot: int
    chat_template: str | None  # the model's own (Jinja source); None: it has none
    bos_token: str | None  # the text of its BOS and EOS tokens; None: it has none
    eos_token: str | None
    build: dict[str, Any]  # Instance.build_info


def served_model(model: Model) -> ServedModel:
    """The ServedModel of ``model`` (its batcher made now if the first request has not made it yet)."""
    batcher = model.batcher()

    def text(token: int) -> str | None:
        return model.token_to_piece(token).decode("utf-8", "replace") if token >= 0 else None

    return ServedModel(model.path, batcher.slots, batcher.n_ctx_slot, model.info.chat_template,
                       text(model.info.bos), text(model.info.eos), model.instance.build_info)


def detokenize(model: Model, tokens: Sequence[int]) -> str:
    """The text of ``tokens``, control tokens written out (as llama-server's /detokenize writes them)."""
    return model.detokenize(tokens, unparse_special=True) if tokens else ""


def token_pieces(model: Model, tokens: Sequence[int]) -> list[bytes]:
    """Each token's bytes (control tokens written out), asked of the worker all at once."""
    ids = token_ids(tokens, model.n_vocab)
    proc = model._proc
    sent = [proc.call(p.TokenToPiece(model=model._handle, token=t, special=True)) for t in ids]
    return [f.result() for f in sent]


class Backend(Protocol):
    def model_path(self) -> str: ...

    def submit(self, prompt: str | list[int], gen: GenerateParams,
               on_piece: Callable[[str], None] | None) -> BatchRequest: ...

    def submit_many(self, prompt: str | list[int], gen: GenerateParams, n: int,
                    on_piece: Callable[[int, str], None] | None) -> list[BatchRequest]:
        """``n`` choices of one prompt (OpenAI's ``n``), choice i drawing with the seed
        batching.choice_params gives it; ``on_piece(i, piece)`` gets choice i's pieces."""
        ...

    def format_chat(self, messages: Sequence[Mapping[str, Any]], *, template: str | None,
                    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str) -> p.ChatPrompt: ...

    def parse_chat(self, text: str, *, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
                   messages: Sequence[Mapping[str, Any]], tool_choice: str, partial: bool) -> ChatMessage: ...

    def embed(self, inputs: Sequence[str | list[int]]) -> tuple[list[np.ndarray], int]:
        """The vectors, and the number of tokens the inputs hold."""
        ...

    def gauges(self) -> list[WorkerGauge]: ...

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def token_pieces(self, tokens: Sequence[int]) -> list[bytes]: ...

    def served_model(self) -> tuple[ServedModel, int]:
        """The model as one live worker serves it, and the slots of all live workers together."""
        ...


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

    def submit_many(self, prompt: str | list[int], gen: GenerateParams, n: int,
                    on_piece: Callable[[int, str], None] | None) -> list[BatchRequest]:
        return self.pool.submit_many(prompt, gen, n, on_piece=on_piece)  # one batcher: the prompt decoded once

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
            active = queued = kv_used = kv_total = 0
            for model in inst.models if inst.alive else []:
                b = model._batcher
                if b is not None and not b.closed:
                    active, queued = active + b.active, queued + b.queued
                    kv_used += sum(len(slot.tokens) for slot in list(b._plan.slots))
                    kv_total += b.slots * b.n_ctx_slot
            out.append(WorkerGauge(str(inst.worker_id), inst.alive, active, queued, kv_used, kv_total))
        return out

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.any_model().tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return detokenize(self.any_model(), tokens)

    def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        return token_pieces(self.any_model(), tokens)

    def served_model(self) -> tuple[ServedModel, int]:
        first = served_model(self.any_model())
        slots = sum(model.batcher().slots for inst in self.pool if inst.alive for model in inst.models)
        return first, slots


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
