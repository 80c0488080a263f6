"""What the HTTP app needs of whatever serves the model: a Pool on this machine (``PoolBackend``) or a
RayPool across a cluster (lloyal_pool.ray). Every method blocks (the app calls them on a thread), and
every worker behind a backend holds the same one model (and, on a Pool, the LoRA adapters the server
serves: PoolBackend.serve_loras)."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .. import protocol as p
from .._embedder import Embedder, Scorer
from ..batching import BatchRequest
from ..chat import ChatMessage
from ..errors import LloyalError, LoraError
from ..lifecycle import WorkerEvent
from ..model import Model
from ..params import GenerateParams, TokenLogprob, token_ids
from ..pool import Pool
from .schemas import APIError, Echo, ServedLora

_log = logging.getLogger("lloyal_pool.serve")

LoraPath = str | os.PathLike[str]
#: create_app's ``lora``: adapter paths (each named by its file's stem) or (name, path) pairs, in the order
#: their ids number them; or a mapping of names to paths.
LoraSpec = Sequence[LoraPath | tuple[str, LoraPath]] | Mapping[str, LoraPath]


def served_loras(spec: LoraSpec | None) -> list[ServedLora]:
    """The adapters create_app's ``lora`` names, in order (a request's ``lora`` ids index them): each a
    path (named by its file's stem) or a (name, path) pair; a mapping is name -> path. ValueError for
    anything else, two adapters of one name, or one file given twice."""
    if spec is None:
        return []
    if isinstance(spec, (str, bytes, os.PathLike)):
        raise ValueError(f"lora is a list of adapter paths or (name, path) pairs; got the single path {spec!r}: "
                         f"write [{spec!r}]")
    items = list(spec.items()) if isinstance(spec, Mapping) else list(spec)
    out: list[ServedLora] = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, where = item
        else:
            name, where = None, item
        if isinstance(where, bytes) or not isinstance(where, (str, os.PathLike)):
            raise ValueError(f"lora: each adapter is a path or a (name, path) pair, got {item!r}")
        path = os.path.abspath(os.fspath(where))
        if name is None:
            name = os.path.splitext(os.path.basename(path))[0]
        if not name:
            raise ValueError(f"lora: the adapter {path} needs a name")
        for other in out:
            if other.path == path:
                raise ValueError(f"the LoRA adapter {path} is given twice (as {other.name!r} and {name!r})")
            if other.name == name:
                raise ValueError(f"two LoRA adapters are named {name!r} ({other.path} and {path}): name them "
                                 f"apart (NAME=PATH)")
        out.append(ServedLora(len(out), name, path))
    return out


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
    core = model._core
    sent = [core.call(p.TokenToPiece(model=model._handle, token=t, special=True), model=model) for t in ids]
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

    def echo(self, prompt: str | list[int], logprobs: int | None) -> Echo:
        """A completion prompt as ``echo`` shows it, its tokens scored when ``logprobs`` is not None."""
        ...

    def served_model(self) -> tuple[ServedModel, int]:
        """The model as one live worker serves it, and the slots of all live workers together."""
        ...


class PoolBackend:
    """A Pool on this machine: requests routed by pool.submit, questions asked of any live worker."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._embedders: dict[int, Embedder] = {}  # one per worker's model, made at its first request
        self._scorers: dict[int, Scorer] = {}  # the same, for echo's prompt log-probabilities
        self._lock = threading.Lock()
        self._loras: list[ServedLora] = []
        # The served models that have loaded every adapter in _loras (or failed to and were logged).
        self._ready: weakref.WeakSet[Model] = weakref.WeakSet()
        self._lora_lock = threading.Lock()

    def serve_loras(self, adapters: Sequence[ServedLora]) -> None:
        """Has the model of every live worker load ``adapters`` now (those it has not loaded already),
        LoraError naming the adapter and the worker for one that cannot be loaded; and the model of any
        worker that comes later (Pool.replace started it and the application loaded the model there)
        before the next request is routed. Crash recovery (Pool(recover=True)) loads a model's adapters
        again itself; one it could not is loaded here at the next request."""
        self._loras = list(adapters)
        if self._loras:
            self._prepare(strict=True)
            self.pool.subscribe(self._on_event)

    def _on_event(self, event: WorkerEvent) -> None:
        if event.kind == "recovered" and event.instance is not None:
            for model in event.instance.models:  # an adapter may have failed to load again: check at the next request
                self._ready.discard(model)

    def _served_models(self) -> list[Model]:
        out = []
        for inst in self.pool:
            if inst.alive:
                models = inst.models
                if len(models) == 1:  # a worker the server routes to (pool.submit names no model)
                    out.append(models[0])
        return out

    def _prepare(self, *, strict: bool = False) -> None:
        """Loads the served adapters for every served model that has not loaded them yet. ``strict``: a
        failure raises (at start); otherwise it is logged, and that model takes no request naming the
        adapter (the pool routes such requests to a worker that has it)."""
        if not self._loras:
            return
        models = self._served_models()
        if all(m in self._ready for m in models):
            return
        with self._lora_lock:  # one load per adapter and model: two of one path would make its name ambiguous
            for model in models:
                if model in self._ready:
                    continue
                try:
                    self._load_loras(model)
                except LloyalError as exc:
                    if strict:
                        raise
                    _log.error("%s", exc)
                self._ready.add(model)

    def _load_loras(self, model: Model) -> None:
        loaded = {a.path for a in model.loras}
        for lora in self._loras:
            if lora.path in loaded:
                continue
            try:
                model.load_lora(lora.path)
            except LloyalError as exc:
                raise LoraError(f"the LoRA adapter {lora.name!r} ({lora.path}) cannot be loaded for "
                                f"{os.path.basename(model.path)} in worker {model.instance.worker_id}: {exc}") from exc

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
        self._prepare()
        return self.pool.submit(prompt, gen, on_piece=on_piece)

    def submit_many(self, prompt: str | list[int], gen: GenerateParams, n: int,
                    on_piece: Callable[[int, str], None] | None) -> list[BatchRequest]:
        self._prepare()
        return self.pool.submit_many(prompt, gen, n, on_piece=on_piece)  # one batcher: the prompt decoded once

    def format_chat(self, messages: Sequence[Mapping[str, Any]], *, template: str | None,
                    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str) -> p.ChatPrompt:
        return self.any_model()._format_chat(messages, template=template, tools=tools, tool_choice=tool_choice)

    def parse_chat(self, text: str, *, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
                   messages: Sequence[Mapping[str, Any]], tool_choice: str, partial: bool) -> ChatMessage:
        return self.any_model()._parse_chat(text, template=template, tools=tools, messages=messages,
                                            tool_choice=tool_choice, partial=partial)

    def echo(self, prompt: str | list[int], logprobs: int | None) -> Echo:
        model = self.any_model()
        batcher = model.batcher()
        tokens = batcher.tokens(prompt)  # as the request's own prompt: text gets the BOS
        entries: list[TokenLogprob | None] = [None] * len(tokens)
        if logprobs is not None and len(tokens) >= 2:
            with self._lock:
                scorer = self._scorers.get(id(model))
                if scorer is None or scorer.model is not model:
                    scorer = self._scorers[id(model)] = Scorer(model, batcher.n_ctx_slot)
            entries[1:] = scorer.score(tokens, logprobs)
        # A scored token carries its piece; only the others are asked for.
        asked = iter(token_pieces(model, [t for t, lp in zip(tokens, entries, strict=True) if lp is None]))
        n_prompt, pieces = len(tokens), [next(asked) if lp is None else lp.piece for lp in entries]
        if model.info.bos >= 0 and tokens[0] == model.info.bos:  # not part of the text the reply echoes
            tokens, pieces, entries = tokens[1:], pieces[1:], entries[1:]
        text = prompt if isinstance(prompt, str) else model.detokenize(tokens)
        return Echo(text, pieces, entries, n_prompt)

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
