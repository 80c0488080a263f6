"""The public client: a Pool of worker processes, and handles that mirror the native objects inside them.

    Pool ──▶ Instance (one worker process = one isolated engine)
                └─▶ Model (a loaded GGUF)  ──▶ Context (a KV cache + generation)
                                           ──▶ LoraAdapter (applied per context: Context.set_lora)

This process never loads llama.cpp. Every handle method is a request to its worker (_process.py) and
returns when the reply arrives; ``*_async`` variants return the concurrent.futures.Future underneath.
Any thread may call; calls on one worker run in the order they were made. A worker that dies fails its
waiting calls with WorkerCrashedError and leaves its handles stale (StaleHandleError); the others keep
serving, and Pool.replace() starts a fresh one in its place.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec
import numpy as np

from . import protocol as p
from . import variants
from ._aio import AsyncStream, awaited, closed_in_thread, settle
from ._files import irregular_path
from ._futures import mapped
from ._link import ContextLink, PromptProgress, check_timeout, events, spread_progress, wait
from ._pieces import PieceStream
from ._process import LOG_LEVELS, HangWatch, TempRoot, WorkerOptions, WorkerProcess
from ._recovery import PoolRecovery
from .batching import BatchedCalls, Batcher
from .branches import KV, Branch, BranchStore, GrammarLike
from .chat import ChatMessage
from .errors import (
    BadRequestError,
    CallTimeoutError,
    InvalidArgumentError,
    LloyalError,
    LoraError,
    ModelLoadError,
    PoolClosedError,
    StaleHandleError,
    WorkerCrashedError,
)
from .params import (
    RERANK_PROMPT,
    BufferMemory,
    ContextParams,
    Device,
    EvalResult,
    GenerateParams,
    ModelInfo,
    Result,
    SamplerParams,
    Score,
    token_id,
    token_ids,
    whole,
    wire_prompt,
)
from .protocol import Request
from .routing import ROUTER
from .shm import DEFAULT_SIZE, check_size

if TYPE_CHECKING:
    from .session import Session
    from .snapshot import Snapshot

_log = logging.getLogger("lloyal_pool")
_model_serials = itertools.count()
#: The most threads a context takes (ggml's GGML_MAX_N_THREADS).
MAX_THREADS = 512
ProgressCallback = Callable[[float], None]
"""Model loading progress: the fraction loaded, 0.0 to 1.0."""
R = TypeVar("R")
S = TypeVar("S", bound=PieceStream)


class Instance(BatchedCalls):
    """One worker process: an isolated engine that may hold several models and many contexts.
    ``generate``/``stream``/``submit`` (and ``agenerate``/``astream``) run independent requests on a
    model's Batcher: continuous batching in this worker."""

    def __init__(self, proc: WorkerProcess) -> None:
        self._proc = proc
        self._prepared: dict[str, Model | Context | LoraAdapter] = {}
        # The models loaded and not closed (a Model dropped without close() is still loaded): what crash
        # recovery loads again, and what a batched request may name.
        self._models: set[Model] = set()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"<Instance worker={self.worker_id} pid={self.pid} variant={self.variant} {state}>"

    @property
    def worker_id(self) -> int:
        """The worker's number in its pool, unique per Pool (a replacement gets a new one)."""
        return int(self._proc.worker_id)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return int(self._proc.pid)

    @property
    def alive(self) -> bool:
        """False once the worker has died or its pool was closed; then its handles are stale."""
        return self._proc.alive

    @property
    def variant(self) -> str:
        """The GPU backend the worker runs on ("cuda", "vulkan"), or "cpu": the one asked for, or "cpu"
        when that one could not load and the pool is not strict."""
        return str(self._proc.hello.get("variant"))

    @property
    def cpu_kernels(self) -> str:
        """The level of ggml's CPU kernels the worker runs ("haswell", "sapphirerapids", ...): the best
        this CPU runs, or the one the pool's ``cpu`` named. ``build_info["cpu"]`` says why, and which
        instruction sets they use."""
        return str(self.build_info.get("cpu", {}).get("kernels", ""))

    @property
    def threads(self) -> int:
        """The n_threads a context in this worker gets unless it asks for another number."""
        return int(self._proc.hello.get("threads", 0))

    @property
    def build_info(self) -> dict[str, Any]:
        """What the handshake reported: llama.cpp build, system info, default threads, and ``cpu``: the CPU
        kernels (``kernels``, the level; ``requested``; ``reason``; ``features``, the instruction sets)."""
        return dict(self._proc.hello.get("build", {}))

    @property
    def sandbox(self) -> dict[str, Any]:
        """What confines the worker, as it reported after applying it: ``landlock`` (the kernel's Landlock
        ABI, 0 where it has none), ``writes_scoped`` (writes only beneath its private directory and the
        pool's ``writable_dirs``), ``reads_scoped`` (reads only beneath ``allowed_dirs`` and the system's
        directories), ``tcp_blocked`` (TCP bind/connect refused), ``scoped`` (abstract Unix sockets and
        signals kept inside), ``ip_sockets_blocked`` (a seccomp filter: no IPv4/IPv6 socket at all, UDP
        included), ``network`` (what the pool asked for)."""
        return {k: v for k, v in self._proc.hello.get("sandbox", {}).items() if k != "transfer_fd"}

    @property
    def prepared(self) -> dict[str, Model | Context | LoraAdapter]:
        """In an instance forked from a Snapshot: the handles its prepare() returned, by name, bound to
        this instance (empty otherwise)."""
        return dict(self._prepared)

    @property
    def models(self) -> list[Model]:
        """The models loaded in this worker and not closed, in the order they were loaded."""
        return sorted((m for m in list(self._models) if not m._closed), key=lambda m: m._serial)

    def _model(self, model: Model | str | None) -> Model:
        """The loaded model a batched request names: a Model of this worker, a name (path, file name or
        stem), or None for the only one."""
        loaded = self.models
        if isinstance(model, Model):
            if model.instance is not self:
                raise InvalidArgumentError(f"{model!r} is loaded in another worker")
            return model
        if model is None:
            if len(loaded) != 1:
                raise InvalidArgumentError(f"worker {self.worker_id} holds {len(loaded)} models: name one (model=)")
            return loaded[0]
        if not isinstance(model, str):
            raise BadRequestError(f"model is a Model, a name or None, got {type(model).__name__}")
        for m in loaded:
            name = os.path.basename(m.path)
            if model in (m.path, name, os.path.splitext(name)[0]):
                return m
        raise InvalidArgumentError(f"no model named {model!r} is loaded in worker {self.worker_id}")

    def _route(self, model: Model | str | None, prompt: str | Sequence[int]) -> tuple[Batcher, list[int]]:
        batcher = self._model(model).batcher()
        return batcher, batcher.tokens(prompt)

    def _live(self) -> WorkerProcess:
        # A worker that crash recovery is replacing: wait for the replacement (Pool(recover=True)).
        if not self._proc.alive:
            self._proc.await_recovery()
        return self._proc

    def close(self, timeout: float = 5.0) -> None:
        """Ends this worker (shutdown, then kill after ``timeout``); its handles go stale. For a forked
        instance this is how it ends before its pool does; a pool's own instance can be started again
        with Pool.replace(). Idempotent."""
        self._stop_batchers(PoolClosedError(f"worker {self.worker_id} was closed while the request ran"))
        self._proc.close(timeout)

    def _stop_batchers(self, error: LloyalError) -> None:
        """Ends the loops of this worker's batchers (without waiting: a loop ends at its next call, which
        fails once the worker is closed), so that no idle loop thread outlives the worker."""
        for model in list(self._models):
            if model._batcher is not None:
                model._batcher.close(error, wait=False)

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time in seconds; CallTimeoutError when there is no answer within ``timeout``."""
        check_timeout(timeout)
        t0 = time.perf_counter()
        wait(self._live().call(p.Ping()), timeout, what="ping")
        return time.perf_counter() - t0

    def load_model(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                   vocab_only: bool = False, progress: ProgressCallback | None = None,
                   timeout: float | None = None) -> Model:
        """Loads a GGUF model into this worker and returns its handle; blocks until it is loaded.
        ``n_gpu_layers`` layers go to the GPU (GPU variants only), ``use_mmap`` maps the file instead of
        reading it, ``vocab_only`` loads the vocabulary alone (tokenize, templates; no contexts).
        ``progress(fraction)`` is called on a client thread as the load proceeds; an exception it raises
        is raised here once the load ends (the model is freed again). ModelLoadError for a
        missing, unreadable or invalid file, or one outside the pool's ``allowed_dirs``; the worker keeps
        serving. ``timeout``: seconds to wait at most (CallTimeoutError; the load goes on in the worker)."""
        check_timeout(timeout)
        return wait(self.load_model_async(path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap,
                                          vocab_only=vocab_only, progress=progress), timeout, what="load_model")

    def load_model_async(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                         vocab_only: bool = False, progress: ProgressCallback | None = None) -> Future[Model]:
        """load_model() without waiting: a Future of the Model."""
        abspath = os.path.abspath(os.fspath(path))
        why = irregular_path(abspath)
        if why is not None:  # the worker refuses it too; here it costs no round trip
            raise ModelLoadError(f"cannot load a model: {why}")
        allowed = self._proc.options.allowed_dirs
        if allowed is not None and self._proc.options.sandbox and not _beneath(abspath, allowed):
            raise ModelLoadError(f"{abspath} is outside the pool's allowed_dirs {list(allowed)}: the worker "
                                 "may not read it (Pool(allowed_dirs=...))")
        req = p.LoadModel(path=abspath, n_gpu_layers=whole(n_gpu_layers, "n_gpu_layers"), use_mmap=bool(use_mmap),
                          vocab_only=bool(vocab_only))
        if progress is not None and not callable(progress):
            raise BadRequestError(f"the progress callback must be callable, got {type(progress).__name__}")
        failed: list[BaseException] = []

        def guarded(fraction: float) -> None:
            if progress is not None and not failed:
                try:
                    progress(fraction)
                except BaseException as exc:
                    failed.append(exc)

        def loaded(r: p.ModelLoaded) -> Model:
            model = Model(self, self._proc, r.model, r.info, abspath, req)
            if failed:
                # The worker loaded it all the same: free it, from a thread of its own (this runs on the
                # reader thread, which must not wait for a reply), and fail the call with the error.
                threading.Thread(target=_close_quietly, args=(model,), daemon=True,
                                 name="lloyal-free-model").start()
                raise failed[0]
            return model

        fut = self._live().call(req, events(progress=None if progress is None else guarded))
        return mapped(fut, loaded)

    async def aload_model(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                          vocab_only: bool = False, progress: ProgressCallback | None = None) -> Model:
        """load_model() for asyncio. A load cannot be interrupted: cancelling the awaiting task lets it
        finish in the worker, which then frees the model again."""
        fut = self.load_model_async(path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, vocab_only=vocab_only,
                                    progress=progress)

        def free_when_loaded() -> None:
            def free(f: Future[Model]) -> None:
                if f.exception() is None:
                    threading.Thread(target=_close_quietly, args=(f.result(),), daemon=True,
                                     name="lloyal-free-model").start()
            fut.add_done_callback(free)

        return await settle(fut, free_when_loaded)

    def json_schema_to_grammar(self, schema: str | Mapping[str, Any]) -> str:
        """llama.cpp's own JSON schema -> GBNF converter."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return self._live().call(p.JsonSchemaToGrammar(schema=text)).result()

    def devices(self) -> list[Device]:
        """The devices the worker's ggml backends registered, in their order: the CPU in every variant,
        and in a GPU variant each GPU it sees (the variant only loads when it sees one)."""
        return self._live().call(p.Devices()).result()

    def stats(self) -> dict[str, Any]:
        """RSS, CPU, threads and state of the worker process (psutil)."""
        return self._proc.stats()

    def kill(self) -> None:
        """SIGKILL the worker now (its waiting calls raise WorkerCrashedError)."""
        self._proc.kill()

    def fault(self, kind: str, **args: Any) -> Future[Any]:
        """Test-only: ask the worker to crash in a given way (needs LLOYAL_POOL_TEST_FAULTS=1)."""
        return self._proc.call(p.Fault(kind=kind, **args))


def _close_quietly(model: Model) -> None:
    try:
        model.close()
    except LloyalError:
        pass  # the worker or the pool went away meanwhile: nothing is left to free


def _beneath(path: str, dirs: Sequence[str]) -> bool:
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, d]) == d for d in dirs)


class Model:
    """A model loaded in one worker (Instance.load_model). Contexts created from it share its weights.
    ``info`` is its ModelInfo, ``path`` the absolute path it was loaded from, ``instance`` its worker.
    Its methods that ask the worker block until it replies; once the model is closed, or its worker died,
    they raise StaleHandleError (PoolClosedError once the pool is closed)."""

    def __init__(self, instance: Instance, proc: WorkerProcess, handle: int, info: ModelInfo, path: str,
                 load: p.LoadModel | None = None) -> None:
        self.instance = instance
        self._proc = proc
        self._handle = handle
        self._load = load or p.LoadModel(path=path)  # how it was loaded: a replayed snapshot loads it so
        self._closed = False
        self.info = info
        self.path = path
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()  # freed with the model
        # ... and their links, which outlive a collected Context as long as one of its Branches lives:
        # such a branch must go stale with the model too (its logits block is freed).
        self._links: weakref.WeakSet[ContextLink] = weakref.WeakSet()
        self._loras: weakref.WeakSet[LoraAdapter] = weakref.WeakSet()  # freed with the model too
        self._batcher: Batcher | None = None
        self._serial = next(_model_serials)
        self._batcher_lock = threading.Lock()
        instance._models.add(self)

    def _rebind(self, proc: WorkerProcess, handle: int) -> None:
        """Crash recovery loaded the model again in a replacement worker."""
        self._proc, self._handle = proc, handle

    def __repr__(self) -> str:
        return f"<Model {self.info.desc!r} worker={self.instance.worker_id} handle={self._handle}>"

    def _call(self, req: Request[R]) -> R:
        if self._closed:
            raise StaleHandleError(f"Model handle {self._handle} was closed")
        if not self._proc.alive:
            self._proc.await_recovery()  # rebinds this model when it succeeds
            if getattr(req, "model", self._handle) != self._handle:
                req = msgspec.structs.replace(req, model=self._handle)
        return self._proc.call(req).result()

    @property
    def n_vocab(self) -> int:
        """The vocabulary size: token ids are in [0, n_vocab)."""
        return self.info.n_vocab

    @property
    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token of the vocabulary (eos, eot, ...)."""
        return list(self.info.eog_tokens)

    def is_eog(self, token: int) -> bool:
        """Whether token ends a generation (no round trip: the ids came with the model's info)."""
        return int(token) in self.info.eog_tokens

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of text, by the model's tokenizer. ``add_special`` adds BOS/EOS as the model asks;
        ``parse_special`` reads control-token text such as ``<start_of_turn>`` as those tokens instead of
        as plain text."""
        return self._call(p.Tokenize(model=self._handle, text=text, add_special=add_special,
                                     parse_special=parse_special))

    def detokenize(self, tokens: Sequence[int], *, remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        """The text of tokens. ``remove_special`` drops a leading BOS and a trailing EOS (where the model
        adds them);
        ``unparse_special`` renders control tokens as their text instead of leaving them out. Bytes
        that are not valid UTF-8 become U+FFFD. InvalidTokenError for an id outside [0, n_vocab)."""
        return self._call(p.Detokenize(model=self._handle, tokens=token_ids(tokens, self.n_vocab),
                                       remove_special=remove_special, unparse_special=unparse_special))

    def token_to_piece(self, token: int, *, special: bool = True) -> bytes:
        """Raw bytes: one token may be part of a multi-byte UTF-8 character."""
        return self._call(p.TokenToPiece(model=self._handle, token=token_id(token, self.n_vocab), special=special))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, template: str | None = None,
                            add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Formats ``messages`` (``{"role": ..., "content": ...}`` mappings) as a prompt, through llama.cpp's
        own Jinja engine and chat formats, with the model's chat template, or ``template``: a format name
        from ``lloyal_pool.chat.CHAT_FORMATS`` ("gemma", "chatml", "llama3") or Jinja source.
        ``add_generation_prompt`` ends it with the start of an assistant turn; ``tools`` (OpenAI-style tool
        definitions) are rendered where the template places them. TemplateError when the model has no
        template and none is given, or the template does not parse or render; ValueError for an unknown
        format name."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise BadRequestError(f"messages is a list of {{'role': ..., 'content': ...}} mappings, got "
                                  f"{type(messages).__name__}")
        if not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages):
            raise BadRequestError("each message is a mapping with a str 'role' and a str 'content'")
        pairs = [(m["role"], m["content"]) for m in messages]
        return self._call(p.ApplyChatTemplate(model=self._handle, messages=pairs, template=template,
                                              add_generation_prompt=add_generation_prompt,
                                              tools=json.dumps(list(tools)) if tools else ""))

    def parse_chat_output(self, text: str, *, template: str | None = None,
                          tools: Sequence[Mapping[str, Any]] | None = None) -> ChatMessage:
        """Parses ``text``, an assistant turn the model generated, with llama.cpp's parser for the format
        that the template (as for apply_chat_template) yields: a ChatMessage with the ``content``, the
        ``reasoning`` (a ``<think>`` block, where the format has one) and the ``tool_calls`` (name,
        arguments as JSON text, id) when ``tools`` were offered. TemplateError for text that the format
        cannot parse, or a template that cannot be used."""
        return self._parse_chat(text, template=template, tools=tools)

    def _parse_chat(self, text: str, *, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
                    messages: Sequence[Mapping[str, Any]] | None = None, tool_choice: str = "auto",
                    partial: bool = False) -> ChatMessage:
        return self._call(p.ParseChatOutput(model=self._handle, text=text,
                                            messages=json.dumps(list(messages)) if messages else "",
                                            template=template, tools=json.dumps(list(tools)) if tools else "",
                                            tool_choice=tool_choice, partial=partial))

    def _format_chat(self, messages: Sequence[Mapping[str, Any]], *, template: str | None,
                     tools: Sequence[Mapping[str, Any]] | None, tool_choice: str = "auto") -> p.ChatPrompt:
        return self._call(p.ChatFormat(model=self._handle, messages=json.dumps(list(messages)), template=template,
                                       tools=json.dumps(list(tools)) if tools else "",
                                       tool_choice=tool_choice))

    def batcher(self, *, slots: int | None = None, n_ctx_slot: int | None = None, chunk: int | None = None,
                n_threads: int | None = None) -> Batcher:
        """The model's Batcher (batching.py): continuous batching of independent generations on one
        context of ``slots`` sequences (default 8) with ``n_ctx_slot`` tokens of room each (default 2048).
        The first call makes it with the options given; Instance.generate and Pool.generate use it. A
        later call with other options raises InvalidArgumentError (close the model to start over). When
        its worker died and crash recovery replaced it, the next call makes a new one with the same
        options."""
        asked = {k: v for k, v in {"slots": slots, "n_ctx_slot": n_ctx_slot, "chunk": chunk,
                                   "n_threads": n_threads}.items() if v is not None}
        with self._batcher_lock:
            if self._closed:
                raise StaleHandleError(f"Model handle {self._handle} was closed")
            if self._batcher is None or self._batcher.closed:
                if self._batcher is not None:  # its context is gone: end its loop (which may be the caller)
                    self._batcher.close(wait=False)
                    # A batcher made again (after a crash) keeps the options the first was made with.
                    asked = {**self._batcher.options, **asked}
                self._batcher = Batcher(self, **asked)
            elif any(getattr(self._batcher, k) != v for k, v in asked.items()):
                raise InvalidArgumentError(f"this model's batcher already runs with other options: {self._batcher!r}")
            return self._batcher

    def new_context(self, params: ContextParams | None = None, **overrides: Any) -> Context:
        """Creates a context (its own KV cache) of this model in the same worker; keyword overrides are
        ContextParams fields (``model.new_context(n_ctx=2048)``; BadRequestError for a name that is not
        one). ContextError for invalid parameters, a context llama.cpp cannot create, a worker that
        already holds 512 contexts, or a shared-memory region with no room for the context's logits row
        (n_vocab * 4 bytes: the message names the shm_bytes that holds one more; see shm_bytes_for). Free
        it with Context.close(); the model's close() frees it too."""
        if params is not None and not isinstance(params, ContextParams):
            raise BadRequestError(f"params is a ContextParams, got {type(params).__name__}")
        if overrides:
            from dataclasses import fields, replace

            unknown = set(overrides) - {f.name for f in fields(ContextParams)}
            if unknown:
                raise BadRequestError(f"unknown ContextParams field(s): {', '.join(sorted(unknown))}")
            params = replace(params or ContextParams(), **overrides)
        params = params or ContextParams()
        ctx = Context(self, self._call(p.NewContext(model=self._handle, params=params.to_wire())))
        ctx._params = params
        self._contexts.add(ctx)
        return ctx

    def load_lora(self, path: str | os.PathLike[str]) -> LoraAdapter:
        """Loads a LoRA adapter GGUF for this model. It does nothing until a context applies it
        (Context.set_lora); it is freed by close() or with the model. LoraError for a missing file, a file
        that is not a LoRA adapter GGUF, or an adapter for another architecture or other tensor shapes."""
        abspath = os.path.abspath(os.fspath(path))
        why = irregular_path(abspath)
        if why is not None:
            raise LoraError(f"cannot load a LoRA adapter: {why}")
        loaded = self._call(p.LoadLora(model=self._handle, path=abspath))
        adapter = LoraAdapter(self, loaded.lora, abspath, loaded.alpha, loaded.meta)
        self._loras.add(adapter)
        return adapter

    def close(self) -> None:
        """Frees the model, every context created from it and every LoRA adapter loaded for it.
        Idempotent; a dead worker has nothing to free."""
        if self._closed:
            return
        if self._batcher is not None:
            self._batcher.close(StaleHandleError(f"its model (handle {self._handle}) was closed"))
        self._closed = True
        self.instance._models.discard(self)
        for ctx in list(self._contexts):
            ctx._forget()  # the worker frees them with the model: their handles go stale here too
        for link in list(self._links):
            link.closed = True
        for adapter in list(self._loras):
            adapter._closed = True
        if self._proc.alive:
            self._proc.call(p.FreeModel(model=self._handle)).result()


class LoraAdapter:
    """A LoRA adapter loaded in one worker for one model (Model.load_lora). Apply it to contexts of that
    model with Context.set_lora; each context has its own configuration."""

    def __init__(self, model: Model, handle: int, path: str, alpha: float, meta: Mapping[str, str]) -> None:
        self.model = model
        self._handle = handle
        self._closed = False
        self.path = path
        self.alpha = alpha  # adapter.lora.alpha (0.0: the file has none)
        self.meta = dict(meta)  # the adapter GGUF's scalar metadata, as strings

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<LoraAdapter {os.path.basename(self.path)!r} handle={self._handle}{state}>"

    @property
    def closed(self) -> bool:
        """Whether the adapter was freed (by close() or with its model)."""
        return self._closed or self.model._closed

    def close(self) -> None:
        """Frees the adapter. LoraError while a context still applies it (set_lora([]) there first).
        Idempotent; the model's close frees it too."""
        if self.closed:
            return
        if self.model._proc.alive:
            self.model._proc.call(p.FreeLora(lora=self._handle)).result()
        self._closed = True


class Stream(PieceStream):
    """Text pieces as they are decoded: iterate, then read ``result``. The pieces always join to
    ``result.text`` (text that could be the start of a stop string is held back until it is not).

    Leaving early stops the generation: ``close()`` (or the end of a ``with`` block, or the stream being
    garbage-collected while it runs) interrupts the request, so the context is free again at once
    instead of generating on for nobody:

        with ctx.stream("Once upon a time", n_predict=400) as stream:
            for piece in stream:
                if "dragon" in piece:
                    break          # the worker stops generating here
    """

    def __init__(self, interrupt: Callable[[int], None], timeout: float | None = None) -> None:
        super().__init__(interrupt)
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        check_timeout(timeout)
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._timed_out: CallTimeoutError | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._timed_out is not None:
            raise self._timed_out
        try:
            item = self._q.get(timeout=self._left())
        except queue.Empty:
            self._wait_result()  # raises CallTimeoutError, unless the generation ended just now
            item = self._q.get()
        if item is self._END:
            self._q.put(self._END)  # stay exhausted
            self.future.result()  # raises the call's error, if any
            raise StopIteration
        assert isinstance(item, str)
        return item

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _wait_result(self) -> Result:
        if self._timed_out is not None:
            raise self._timed_out
        try:
            return wait(self.future, self._left(), self.interrupt, f"stream (timeout={self._timeout:g}s)"
                        if self._timeout is not None else "stream")
        except CallTimeoutError as exc:
            self._timed_out = exc
            raise

    @property
    def result(self) -> Result:
        """The whole generation's Result. Blocks until the generation ends (read it after iterating, or
        instead of iterating); raises the call's error, if it failed, and CallTimeoutError once the
        stream's timeout has passed."""
        return self._wait_result()

    def close(self) -> None:
        """Stops the generation unless it has ended; the pieces already received stay readable. Does not
        wait: ``result`` does."""
        if not self.future.done():
            self.interrupt()


class Context:
    """A context (KV cache) in one worker: generate, stream, evaluate, read logits, interrupt; embed and
    rerank in an embedding context; branches (``branches``, a BranchStore) and raw KV sequences (``kv``,
    a KV). ``n_ctx``, ``n_batch``, ``n_ubatch``, ``n_seq_max`` and ``n_threads`` are the values it was
    created with. Calls on one context run in the order they were made; a blocking method returns when
    its request has been served. Once it is closed (or its model is), or its worker died, its methods
    raise StaleHandleError (PoolClosedError once the pool is closed)."""

    def __init__(self, model: Model, desc: p.ContextCreated) -> None:
        self.model = model
        self.instance = model.instance
        self._desc = desc  # a snapshot's fork rebuilds this handle from it
        self._params = ContextParams()  # what it was created with (Model.new_context sets it)
        self.n_ctx = desc.n_ctx
        self.n_batch = desc.n_batch
        self.n_ubatch = desc.n_ubatch
        self.n_seq_max = desc.n_seq_max
        self.n_threads = desc.n_threads
        #: An embedding context's pooling ("none", "mean", "cls", "last", "rank"); None: a generation context.
        self.pooling = desc.pooling
        self._proc = model._proc
        # embed() and rerank() reuse one block of the region per context: a call frees the previous
        # call's rows, so each call holds this from its request until its rows are copied out.
        self._embed_lock = threading.Lock()
        self._logits_offset = desc.logits_offset
        self._link = ContextLink(self._proc, desc.context, desc.interrupt_slot)
        model._links.add(self._link)
        self.branches = BranchStore(self._link, model.n_vocab)
        self.kv = KV(self._link, self.branches)
        self._lora: list[tuple[LoraAdapter, float]] = []

    def _rebind(self, proc: WorkerProcess, desc: p.ContextCreated) -> None:
        """Crash recovery created the context again in a replacement worker."""
        self._proc, self._desc, self._logits_offset = proc, desc, desc.logits_offset
        self._link.rebind(proc, desc.context, desc.interrupt_slot)
    @property
    def handle(self) -> int:
        """The context's id in its worker (for logs and repr; handles are numbered per worker)."""
        return self._link.handle

    def __repr__(self) -> str:
        return f"<Context n_ctx={self.n_ctx} worker={self.instance.worker_id} handle={self.handle}>"

    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 append: bool = False, on_piece: Callable[[str], None] | None = None,
                 progress: PromptProgress | None = None, timeout: float | None = None, **overrides: Any) -> Result:
        """Generates a continuation of ``prompt`` (text, or token ids) and returns it when it ends.

        ``prompt`` is the whole input, as in llama-server: what the context held before is replaced.
        With ``cache_prompt`` (the default) the part of the cache that matches the prompt's start is
        reused and only the rest is decoded (``Result.n_cached`` says how many tokens). ``append=True``
        instead adds the prompt to what the context holds (text then gets no BOS), and
        ``generate("", append=True)`` continues where the last call ended.

        ``on_piece`` is called, on a client thread, with each piece of final text; ``progress(done,
        total)`` with the prompt tokens decoded so far. An exception either callback raises stops the
        generation and is raised here (the context keeps what was decoded). Keyword overrides are GenerateParams fields
        (``n_predict``, ``temperature``, ``stop``, ...). Raises ContextOverflowError when the prompt does
        not fit, GrammarError, InvalidTokenError, ValueError for an empty prompt without append.

        ``timeout``: seconds to wait at most (this and every other blocking call that takes it): then the
        generation is interrupted and CallTimeoutError raised, its ``result`` the partial Result."""
        check_timeout(timeout)
        return self._link.wait(self.generate_async(prompt, params, append=append, on_piece=on_piece,
                                                   progress=progress, **overrides), timeout, "generate")

    def generate_async(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                       append: bool = False, on_piece: Callable[[str], None] | None = None,
                       progress: PromptProgress | None = None, **overrides: Any) -> Future[Result]:
        """generate() without waiting: a Future of the Result."""
        req = self._generate_request(prompt, GenerateParams.of(params, overrides), stream=on_piece is not None,
                                     append=append, progress=progress is not None)
        return self._link.call(req, events(piece=on_piece, prompt_progress=spread_progress(progress)))

    def stream(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               append: bool = False, progress: PromptProgress | None = None, timeout: float | None = None,
               **overrides: Any) -> Stream:
        """Like generate, but returns at once with a Stream: iterate it for the pieces, then read its
        ``result``. Close it (or use ``with``) to stop early. ``timeout``: seconds the whole generation
        may take; past it the stream is interrupted and iterating it (or reading ``result``) raises
        CallTimeoutError."""
        return self._start_stream(Stream(self._link.interrupt_request, timeout), prompt,
                                  GenerateParams.of(params, overrides), append=append, progress=progress)

    def _start_stream(self, s: S, prompt: str | Sequence[int], params: GenerateParams, *, append: bool,
                      progress: PromptProgress | None) -> S:
        req = self._generate_request(prompt, params, stream=True, append=append, progress=progress is not None)
        s._attach(self._link.call(req, events(piece=s._q.put, prompt_progress=spread_progress(progress)),
                                  on_id=s._set_id))
        return s

    async def agenerate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                        append: bool = False, on_piece: Callable[[str], None] | None = None,
                        progress: PromptProgress | None = None, **overrides: Any) -> Result:
        """generate() for asyncio: the same request, awaited. Cancelling the awaiting task (or an
        ``asyncio.timeout`` around it) interrupts the generation in the worker. ``on_piece`` and
        ``progress`` run on a client thread, as with generate(); astream() hands pieces to the loop."""
        return await awaited(self._link, lambda: self.generate_async(prompt, params, append=append,
                                                                     on_piece=on_piece, progress=progress,
                                                                     **overrides))

    def astream(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                append: bool = False, progress: PromptProgress | None = None, **overrides: Any) -> AsyncStream:
        """stream() for asyncio (call it inside a running event loop): ``async for piece in
        ctx.astream(...)``, then ``await stream.result()``. Leaving early, ``aclose()`` or cancelling the
        iterating task interrupts the generation."""
        return self._start_stream(AsyncStream(self._link.interrupt_request), prompt,
                                  GenerateParams.of(params, overrides), append=append, progress=progress)

    def chat(self, system: str | None = None, *, template: str | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str = "auto",
             params: GenerateParams | None = None, **defaults: Any) -> Session:
        """A multi-turn conversation on this context (a Session): ``send(text)`` adds a user turn and
        generates the assistant's reply, ``stream(text)`` does it piece by piece. Every turn formats the
        whole conversation with the template (the model's, or a format name or Jinja source as for
        Model.apply_chat_template) and generates with the prompt cache, so only the new turn's tokens are
        decoded. ``system`` starts it with a system message. ``tools`` (OpenAI-style definitions) are
        rendered by the template, and where its format has tool calls a grammar from llama.cpp constrains
        them: lazily, once the model writes the format's call marker, with ``tool_choice="auto"``; from
        the first token with "required" (a grammar that is not lazy); not at all with "none". ``params``
        and keyword ``defaults`` (GenerateParams fields) apply to every turn. ValueError for an unknown
        tool_choice, TypeError for an unknown GenerateParams field."""
        from .session import Session

        return Session(self, system, template=template, tools=tools, tool_choice=tool_choice, params=params,
                       **defaults)

    def generate_with_draft(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                            draft: str | Context = "ngram", n_draft: int = 8, ngram_min: int = 2, ngram_max: int = 4,
                            append: bool = False, on_piece: Callable[[str], None] | None = None,
                            progress: PromptProgress | None = None, timeout: float | None = None,
                            **overrides: Any) -> Result:
        """generate() with speculative decoding (go-llama's GenerateWithDraft): a drafter proposes up to
        ``n_draft`` tokens, this context decodes them in one batch, and its own sampler keeps them for as
        long as it chooses the same tokens. Every token is this context's sampler's choice, so greedy
        output is generate()'s and sampled output has its distribution; the drafter only decides how many
        tokens one decode yields (``Result.n_drafted``, ``n_accepted``, ``acceptance_rate``).

        ``draft``: ``"ngram"`` (prompt lookup: the latest earlier occurrence of the last ``ngram_max``
        down to ``ngram_min`` tokens, and what followed it; no second model), or a Context of a smaller
        model with the same vocabulary in the same worker (its greedy continuation; it must not be in use
        meanwhile). Needs swa_full=True on sliding-window models (the default)."""
        check_timeout(timeout)
        fut = self.generate_with_draft_async(prompt, params, draft=draft, n_draft=n_draft, ngram_min=ngram_min,
                                             ngram_max=ngram_max, append=append, on_piece=on_piece,
                                             progress=progress, **overrides)
        return self._link.wait(fut, timeout, "generate_with_draft")

    def generate_with_draft_async(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                                  draft: str | Context = "ngram", n_draft: int = 8, ngram_min: int = 2,
                                  ngram_max: int = 4, append: bool = False,
                                  on_piece: Callable[[str], None] | None = None,
                                  progress: PromptProgress | None = None, **overrides: Any) -> Future[Result]:
        """generate_with_draft() without waiting: a Future of the Result."""
        wire_draft: str | int
        if isinstance(draft, Context):
            if draft._proc is not self._proc:
                raise InvalidArgumentError("the draft context must live in the same worker (Instance) as the target")
            if draft.closed:
                raise StaleHandleError(f"draft context handle {draft.handle} was closed")
            wire_draft = draft.handle
        elif draft == "ngram":
            wire_draft = draft
        else:
            raise InvalidArgumentError(f'draft must be "ngram" or a Context, got {draft!r}')
        req = p.GenerateWithDraft(context=self.handle, prompt=wire_prompt(prompt, self.model.n_vocab),
                                  params=GenerateParams.of(params, overrides).to_wire(), draft=wire_draft,
                                  n_draft=whole(n_draft, "n_draft"),
                                  ngram_min=whole(ngram_min, "ngram_min"), ngram_max=whole(ngram_max, "ngram_max"),
                                  stream=on_piece is not None, append=bool(append), progress=progress is not None)
        return self._link.call(req, events(piece=on_piece, prompt_progress=spread_progress(progress)))

    async def agenerate_with_draft(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                                   draft: str | Context = "ngram", n_draft: int = 8, ngram_min: int = 2,
                                   ngram_max: int = 4, append: bool = False,
                                   on_piece: Callable[[str], None] | None = None,
                                   progress: PromptProgress | None = None, **overrides: Any) -> Result:
        """generate_with_draft() for asyncio; cancelling the awaiting task interrupts it."""
        return await awaited(self._link, lambda: self.generate_with_draft_async(
            prompt, params, draft=draft, n_draft=n_draft, ngram_min=ngram_min, ngram_max=ngram_max,
            append=append, on_piece=on_piece, progress=progress, **overrides))

    def _generate_request(self, prompt: str | Sequence[int], params: GenerateParams, stream: bool, append: bool,
                          progress: bool) -> p.Generate:
        return p.Generate(context=self.handle, prompt=wire_prompt(prompt, self.model.n_vocab), params=params.to_wire(),
                          stream=stream,
                          append=bool(append), progress=progress)

    def eval(self, prompt: str | Sequence[int], *, add_special: bool | None = None,
             parse_special: bool = True, progress: PromptProgress | None = None,
             timeout: float | None = None) -> EvalResult:
        """Decodes prompt into the KV cache after what it holds, without sampling (prefill). Text gets
        the model's BOS only when the context is empty, unless add_special says otherwise.
        ``progress(done, total)`` is called with the tokens decoded so far."""
        check_timeout(timeout)
        return self._link.wait(self.eval_async(prompt, add_special=add_special, parse_special=parse_special,
                                               progress=progress), timeout, "eval")

    def eval_async(self, prompt: str | Sequence[int], *, add_special: bool | None = None,
                   parse_special: bool = True, progress: PromptProgress | None = None) -> Future[EvalResult]:
        """eval() without waiting: a Future of the EvalResult."""
        wire = wire_prompt(prompt, self.model.n_vocab)
        if isinstance(wire, str):
            req = p.Eval(context=self.handle, text=wire, add_special=add_special, parse_special=parse_special,
                         progress=progress is not None)
        else:
            req = p.Eval(context=self.handle, tokens=wire, progress=progress is not None)
        return self._link.call(req, events(prompt_progress=spread_progress(progress)))

    async def aeval(self, prompt: str | Sequence[int], *, add_special: bool | None = None,
                    parse_special: bool = True, progress: PromptProgress | None = None) -> EvalResult:
        """eval() for asyncio; cancelling the awaiting task interrupts it."""
        return await awaited(self._link, lambda: self.eval_async(prompt, add_special=add_special,
                                                                 parse_special=parse_special, progress=progress))

    def interrupt(self) -> None:
        """Stops the generation or prompt evaluation running on this context, from any thread, without a
        round trip: it writes the request's id into the context's word in shared memory, which the
        worker checks every token and inside each decode step. A no-op when nothing is running."""
        self._link.interrupt()

    def logits(self, *, copy: bool = False) -> np.ndarray:
        """Logits (n_vocab float32) of the last decoded position. Without copy, a read-only view of the
        worker's shared memory: valid until the next logits() call on this context."""
        at = self._link.call(p.Logits(context=self.handle)).result()
        arr = self._proc.region.floats(at.offset, at.count)
        return arr.copy() if copy else arr

    # -- embeddings and rerank ------------------------------------------------------------------------
    @property
    def embeddings(self) -> bool:
        """Whether this is an embedding context (created with embeddings=True)."""
        return self.pooling is not None

    def embed(self, texts: str | Sequence[int] | Sequence[str | Sequence[int]], *,
              normalize: bool = True) -> np.ndarray | list[np.ndarray]:
        """Embeddings (float32) of one text or of several, in an embedding context. A text may also be
        given as token ids. Several texts are decoded side by side, one sequence each, n_seq_max of them
        and at most n_ubatch tokens per decode; no text may be longer than that (ContextOverflowError).

        One text: a 1-D array (n_embd,), or with pooling "none" a 2-D array (n_tokens, n_embd) of its
        per-token vectors. A list of texts: a 2-D array (n_texts, n_embd), or with pooling "none" a list
        of 2-D arrays. normalize scales every vector to L2 norm 1. The arrays are copies: nothing refers
        to the worker's shared memory afterwards. ResultTooLargeError when the vectors of one call do not
        fit the worker's shared memory (nothing is computed): embed fewer texts at a time."""
        if isinstance(texts, (bytes, bytearray, memoryview)) or not isinstance(texts, (Sequence, np.ndarray)):
            raise BadRequestError(f"embed takes a text, token ids or a list of them, got {type(texts).__name__}")
        single = isinstance(texts, str) or (len(texts) > 0 and all(_is_int(t) for t in texts))
        items = [cast("str | Sequence[int]", texts)] if single else list(cast("Sequence[str | Sequence[int]]", texts))
        if not items:
            raise InvalidArgumentError("embed needs at least one text")
        wire = [wire_prompt(t, self.model.n_vocab) for t in items]
        with self._embed_lock:
            at = self._link.call(p.Embed(context=self.handle, inputs=wire, normalize=bool(normalize))).result()
            flat = self._proc.region.floats(at.offset, sum(at.rows) * at.width).copy()
        if self.pooling == "none":
            bounds = np.cumsum(at.rows)[:-1]
            per_text: list[np.ndarray] = [a.reshape(-1, at.width) for a in np.split(flat, bounds * at.width)]
            return per_text[0] if single else per_text
        rows = flat.reshape(len(items), at.width)
        first: np.ndarray = rows[0]
        return first if single else rows

    def rerank(self, query: str, documents: Sequence[str], *, prompt: str = RERANK_PROMPT) -> list[float]:
        """A relevance score per document for query, higher is more relevant; all documents are decoded
        side by side, one sequence each (n_seq_max per decode).

        In an embedding context with pooling="rank" (a reranker model with a classifier head): the
        classifier's first output for the pair, formatted by the model's rerank template, or as
        [BOS] query [EOS] [SEP] document [EOS] when it has none. In a generation context (a causal LM,
        which must hold nothing: reset() it first): the mean log-probability of the query's tokens after
        ``prompt`` with its {document} filled in (the prompt ends with {query}), which is <= 0: how well
        the document predicts the query."""
        if isinstance(documents, str):
            raise BadRequestError("documents must be a list of str, not a str")
        req = p.Rerank(context=self.handle, query=query, documents=list(documents), prompt=prompt)
        with self._embed_lock:
            return self._link.call(req).result()

    def n_past(self) -> int:
        """How many tokens the context's history holds (sequence mode; 0 with branches)."""
        return self._link.call(p.NPast(context=self.handle)).result()

    def memory_breakdown(self) -> list[BufferMemory]:
        """Where this context's memory and its model's weights sit: bytes per ggml buffer type (llama.cpp's
        memory breakdown). The weights a GPU variant offloaded (Instance.load_model's ``n_gpu_layers``)
        show as ``model`` bytes on a buffer type of the GPU device; on the CPU variant every row is the
        CPU's."""
        return self._link.call(p.MemoryBreakdown(context=self.handle)).result()

    def tokens(self) -> list[int]:
        """The tokens in the KV cache, in order."""
        return self._link.call(p.Tokens(context=self.handle)).result()

    def reset(self) -> None:
        """Clears the KV cache: the next generation starts from nothing. Every branch is released."""
        self._link.call(p.Reset(context=self.handle)).result()
        self.branches._forget_all()

    def set_lora(self, adapters: Sequence[tuple[LoraAdapter, float]]) -> bool:
        """Replaces the context's whole LoRA configuration with (adapter, scale) pairs; ``[]`` removes
        every adapter. Scale 0 is the same as leaving the adapter out. The same configuration again (in
        any order) keeps the KV cache and returns False. A different one empties the context's history
        and KV cache, since what they hold was computed under the old adapters, and returns True; with
        branches or detached sequences present it raises LoraError instead and changes nothing (prune
        them or reset() first). LoraError for an adapter of another model, a non-finite scale or one
        adapter twice; StaleHandleError for a closed adapter."""
        pairs: list[tuple[LoraAdapter, float]] = []
        for item in adapters:
            adapter, scale = item
            if not isinstance(adapter, LoraAdapter):
                raise BadRequestError(f"set_lora takes (LoraAdapter, scale) pairs, got {type(adapter).__name__}")
            if adapter.closed:
                raise StaleHandleError(f"{adapter!r} was closed")
            if adapter.model._proc is not self._proc:
                # Handles are numbered per worker: another worker's would name something else here.
                raise LoraError(f"{adapter!r} was loaded in another worker, for another model: load it with "
                                f"this context's model")
            pairs.append((adapter, float(scale)))
        changed = self._link.call(p.SetLora(context=self.handle, adapters=[
            (a._handle, s) for a, s in pairs])).result()
        self._lora = pairs
        return changed

    @property
    def lora(self) -> list[tuple[LoraAdapter, float]]:
        """The configuration the last successful set_lora gave (``[]`` at first)."""
        return list(self._lora)

    # -- whole-context state ---------------------------------------------------------------------------
    def save_state(self) -> bytes:
        """The context's whole state (KV cache, token history, logits of the last position) as bytes that
        load_state() takes in any context of the same model, in any worker or process. The bytes travel
        through a temporary shared-memory file, never through the pipe. ContextError for a context that
        holds branches or nothing."""
        with self._proc.transfer() as f:
            self._link.call(p.SaveState(context=self.handle, path=f.path, in_place=True)).result()
            return f.read()

    def load_state(self, data: bytes | bytearray | memoryview) -> int:
        """Replaces what the context holds with a saved state; returns its n_past. StateError for bytes
        that are not a state (garbage, truncated, corrupted) or one of another model,
        ContextOverflowError for a state longer than n_ctx: then the context is left as it was. With
        Pool(recover=True) the state is also the context's checkpoint."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadRequestError(f"a state is bytes (from save_state), got {type(data).__name__}")
        marks: list[int] = []
        journal = self._link.journal
        with self._proc.transfer() as f:
            f.write(data)
            n = self._link.call(p.LoadState(context=self.handle, path=f.path),
                                after=None if journal is None else lambda _: marks.append(journal.mark())).result()
        if journal is not None:
            journal.restart(bytes(data), marks[0])
        return n

    def checkpoint(self) -> int:
        """With Pool(recover=True): saves the context's state in this process, so that crash recovery
        restores it from here instead of replaying every call since the last one (docs/RELIABILITY.md);
        returns its size in bytes. A checkpoint also makes a context recoverable again after a call that
        cannot be replayed (an interrupted generation, a random seed). ContextError without recover."""
        journal = self._link.journal
        if journal is None:
            from .errors import ContextError

            raise ContextError("checkpoint() is for crash recovery: create the pool with Pool(recover=True)")
        marks: list[int] = []
        with self._proc.transfer() as f:
            self._link.call(p.SaveState(context=self.handle, path=f.path, in_place=True),
                            after=lambda _: marks.append(journal.mark())).result()
            data = f.read()
        journal.restart(data, marks[0])
        return len(data)

    def save_state_file(self, path: str | os.PathLike[str]) -> int:
        """save_state() straight into a file, written by the worker (replaced whole: a reader sees the old
        file or the new one); returns its size in bytes."""
        return self._link.call(p.SaveState(context=self.handle, path=os.path.abspath(os.fspath(path)))).result()

    def load_state_file(self, path: str | os.PathLike[str]) -> int:
        """load_state() from a file the worker reads (StateError also for a missing file)."""
        return self._link.call(p.LoadState(context=self.handle, path=os.path.abspath(os.fspath(path)))).result()

    # -- scoring ---------------------------------------------------------------------------------------
    def score(self, text: str | Sequence[int], *, timeout: float | None = None) -> Score:
        """Teacher-forced score of a whole text (text gets the model's BOS; token ids are taken as they
        are): every token after the first is scored against the logits of the tokens before it, so
        n_scored = n_tokens - 1. Like a generate prompt, the text replaces what the context held and stays
        in it afterwards. ValueError for fewer than two tokens, ContextOverflowError past n_ctx."""
        check_timeout(timeout)
        return self._link.wait(self.score_async(text), timeout, "score")

    def score_async(self, text: str | Sequence[int]) -> Future[Score]:
        """score() without waiting: a Future of the Score."""
        wire = wire_prompt(text, self.model.n_vocab)
        return self._link.call(p.ScoreText(context=self.handle, text=wire))

    async def ascore(self, text: str | Sequence[int]) -> Score:
        """score() for asyncio; cancelling the awaiting task interrupts it."""
        return await awaited(self._link, lambda: self.score_async(text))

    def score_choices(self, choices: Sequence[str | Sequence[int]], *,
                      timeout: float | None = None) -> list[Score]:
        """Scores each choice (text without BOS, or token ids) as the continuation of what the context
        holds; every token of a choice is scored (n_scored = n_tokens). The context is left as it was:
        its cache is rolled back and its last logits kept. With n_seq_max > 1 the choices are decoded
        together, one sequence each (as many at once as there are sequences); with n_seq_max 1 one
        after another."""
        check_timeout(timeout)
        return self._link.wait(self.score_choices_async(choices), timeout, "score_choices")

    def score_choices_async(self, choices: Sequence[str | Sequence[int]]) -> Future[list[Score]]:
        """score_choices() without waiting: a Future of the list of Scores."""
        if isinstance(choices, str):
            raise BadRequestError("choices must be a list of texts or token lists, not one str")
        wire = [wire_prompt(c, self.model.n_vocab) for c in choices]
        return self._link.call(p.ScoreChoices(context=self.handle, choices=wire))

    async def ascore_choices(self, choices: Sequence[str | Sequence[int]]) -> list[Score]:
        """score_choices() for asyncio; cancelling the awaiting task interrupts it."""
        return await awaited(self._link, lambda: self.score_choices_async(choices))

    # -- branches -------------------------------------------------------------------------------------
    def branch(self, prompt: Sequence[int] | str | None = None, params: SamplerParams | None = None, *,
               grammar: GrammarLike = None, progress: PromptProgress | None = None, **overrides: Any) -> Branch:
        """A root branch at position 0 with its own sampler (keyword overrides are SamplerParams fields)
        and grammar, prompt prefilled (text gets the model's BOS; ``progress(done, total)`` follows it).
        Needs a context without a plain eval/generate history; forks need n_seq_max > 1."""
        return self.branches.create(prompt, params, grammar=grammar, progress=progress, **overrides)

    def clear_and_reseed(self, sinks: Sequence[int], tail: Sequence[int]) -> float:
        """Infinite context for a single branch (BlinkKV): clears the whole KV cache and decodes sinks at
        position 0, then tail, into the context's only branch, which keeps its handle, sampler, grammar
        and perplexity; its position becomes len(sinks) + len(tail). Returns the ms spent decoding."""
        return self.branches._decoded(self._link.call(p.ClearAndReseed(
            context=self.handle, sinks=token_ids(sinks, self.model.n_vocab, "sinks"),
            tail=token_ids(tail, self.model.n_vocab, "tail"))).result())

    @property
    def closed(self) -> bool:
        """Whether the context was freed (close(), or its model's close()); its methods then raise
        StaleHandleError. A context whose worker died is not closed, but stale all the same."""
        return self._link.closed

    def _forget(self) -> None:
        self._link.closed = True
        self.branches._forget_all()

    def close(self) -> None:
        """Frees the context's KV cache in the worker; every branch is released and the handle goes
        stale. Blocks until the worker has freed it (after the calls queued before it). Idempotent; a
        dead worker has nothing to free."""
        if self._link.closed:
            return
        self._forget()
        if self._proc.alive:
            self._proc.call(p.FreeContext(context=self.handle)).result()


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_options(size: int, shm_bytes: object, shm_backend: object, threads_per_worker: object,
                   memory_limit: object, start_timeout: object, native_log_level: object,
                   choices: Mapping[str, object], flags: Mapping[str, object]) -> None:
    """Pool options that would otherwise be taken silently (a negative thread count, an unknown log level,
    the string "no" for a flag), fail later as a bare TypeError, or bring on the OOM killer (a region
    larger than the machine holds). ``choices``: the options that name something (variant, cpu): a str
    or None each, resolved by variants.py."""
    if threads_per_worker is not None and (isinstance(threads_per_worker, bool) or not isinstance(
            threads_per_worker, int) or not 1 <= threads_per_worker <= MAX_THREADS):
        raise InvalidArgumentError(f"threads_per_worker must be an int in [1, {MAX_THREADS}] or None (the CPUs "
                                   f"shared among the workers), got {threads_per_worker!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, int)
                                     or memory_limit <= 0):
        raise InvalidArgumentError(f"memory_limit is a positive int of bytes or None, got {memory_limit!r}")
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not start_timeout > 0:
        raise InvalidArgumentError(f"start_timeout is a number of seconds > 0, got {start_timeout!r}")
    if native_log_level not in LOG_LEVELS:
        raise InvalidArgumentError(f"native_log_level is one of {', '.join(LOG_LEVELS)}; got {native_log_level!r}")
    for name, value in choices.items():
        if value is not None and not isinstance(value, str):
            raise InvalidArgumentError(f"{name} is a str or None, got {value!r}")
    for name, value in flags.items():
        if not isinstance(value, bool) and not (name == "strict_variant" and value is None):
            raise InvalidArgumentError(f"{name} is True or False, got {value!r}")
    if shm_backend not in ("auto", "memfd", "posix"):
        raise InvalidArgumentError(f"shm_backend is 'auto', 'memfd' or 'posix', got {shm_backend!r}")
    check_size(shm_bytes, shm_backend, size)


def _dirs(name: str, dirs: object) -> tuple[str, ...]:
    """Directories as real paths. A lone path is refused rather than taken as a sequence of its
    characters, which would have made "/" (the first one) allowed."""
    if isinstance(dirs, (str, bytes, os.PathLike)):
        raise InvalidArgumentError(f"{name} is a list of directories; got the single path {dirs!r}: "
                                   f"write [{dirs!r}]")
    try:
        items = list(dirs)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(f"{name} is a list of directories, got {dirs!r}") from None
    for d in items:
        if not isinstance(d, (str, os.PathLike)):
            raise InvalidArgumentError(f"{name}: {d!r} is not a path")
    return tuple(os.path.realpath(os.fspath(d)) for d in items)


def _close_procs(procs: list[WorkerProcess], timeout: float, watch: HangWatch | None = None,
                 temp: TempRoot | None = None) -> None:
    # Module-level and holding no reference to the Pool, so weakref.finalize can run it after the Pool is
    # collected or at interpreter exit.
    if watch is not None:
        watch.stop()
    threads = [threading.Thread(target=p.close, args=(timeout,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    procs.clear()
    if temp is not None:
        temp.close()


@dataclass(frozen=True)
class WorkerEvent:
    """What Pool.subscribe() callbacks receive. ``kind``: "died" (the worker crashed, was killed or hung;
    ``error`` says how: WorkerCrashedError, WorkerHungError) or "replaced" (Pool.replace() started
    ``instance`` in its place, at ``index``). Not sent for workers that close() ended."""

    kind: str
    worker_id: int
    pid: int
    error: WorkerCrashedError | None = None
    instance: Instance | None = None
    index: int | None = None


class Subscribers:
    """subscribe() and the events it delivers: what Pool and lloyal_pool.ray.RayPool share. A subclass
    sets ``_subscribers`` (a list) and ``_subscribers_lock`` in its constructor."""

    _subscribers: list[Callable[[WorkerEvent], None]]
    _subscribers_lock: threading.Lock

    def subscribe(self, callback: Callable[[WorkerEvent], None]) -> Callable[[], None]:
        """Calls ``callback(event)`` (a WorkerEvent) when a worker of this pool dies (crash, kill, hang;
        also a snapshot's fork) and when replace() has started a replacement, so an application need not
        poll ``alive``. It runs on a lloyal_pool thread (the dead worker's reader, or the thread that
        replaces it) and must return promptly; what it raises is logged, never propagated. Returns a
        function that unsubscribes it."""
        with self._subscribers_lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._subscribers_lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _emit(self, event: WorkerEvent) -> None:
        with self._subscribers_lock:
            callbacks = list(self._subscribers)
        for callback in callbacks:
            try:
                callback(event)
            except Exception:  # a subscriber's bug must not stop the pool's bookkeeping
                _log.exception("a subscribe() callback raised on %s", event.kind)


def _death_relay(pool_ref: weakref.ref[Pool]) -> Callable[[WorkerProcess, WorkerCrashedError], None]:
    # A weak reference: a worker's reader thread must not keep its pool alive.
    def on_death(proc: WorkerProcess, error: WorkerCrashedError) -> None:
        pool = pool_ref()
        if pool is not None:
            pool._emit(WorkerEvent("died", proc.worker_id, proc.pid, error=error))

    return on_death


class Pool(BatchedCalls, Subscribers):
    """N worker processes, each an isolated engine instance. The constructor starts ``size`` workers and
    blocks until every one has completed its handshake (WorkerStartupError otherwise, after the others
    are stopped). ``pool[i]`` is the i-th Instance. ``generate``/``stream``/``submit`` (and their asyncio
    twins) route independent requests to the live workers that hold the model, batched in each.

    ``variant``: the GPU backend ("cuda", "vulkan", "auto"; default LLOYAL_POOL_VARIANT, else "cpu"),
    falling back to the CPU unless ``strict_variant``. ``cpu``: the level of ggml's CPU kernels ("auto",
    the best this CPU runs, or a level this install holds such as "haswell"; default LLOYAL_POOL_CPU,
    else "auto"). ``shm_bytes``: each worker's shared-memory
    region for logits and embeddings (``shm_backend``: "memfd", "posix" or "auto"), a row of n_vocab * 4
    bytes per context and per branch (lloyal_pool.shm_bytes_for), allocated up front: at least 12 KiB,
    and for all workers together no more than the machine has available (InvalidArgumentError). ``memory_limit``: a
    cap in bytes on a worker's data (RLIMIT_DATA), so that it fails an allocation instead of growing (a
    context that does not fit raises ContextError naming memory_limit). ``start_timeout``: seconds a
    worker has for its handshake. ``env``: a worker's whole environment, empty by default (the interpreter
    needs none of ours); a value of None passes our value of that variable through, if we have one
    (e.g. ``env={"CUDA_VISIBLE_DEVICES": None}``). ``native_log_level``:
    the llama.cpp messages forwarded to the ``lloyal_pool.worker.<id>`` loggers ("debug" ... "none").
    ``threads_per_worker``: a context's default n_threads, 1 to 512 (default: the CPUs shared among the
    workers).
    ``hang_timeout``: seconds a worker with calls waiting may show no sign of life (its heartbeat, which
    it advances at every interrupt check of its decode and sampling loops and at every request) before
    the pool kills it and fails its calls with WorkerHungError; None turns the watch off. A single native
    step with no interrupt check (tokenizing hundreds of megabytes, a state of many gigabytes, a GPU
    kernel compile) must fit in it. ``subscribe()`` tells an application of deaths and replacements.

    Sandbox (Linux Landlock; ``Instance.sandbox`` says what a worker's kernel enforces): a worker writes
    only beneath its private temporary directory and ``writable_dirs`` (where save_state_file may write),
    and cannot bind or connect TCP sockets, nor create any IPv4/IPv6 socket (seccomp), unless ``network``.
    ``allowed_dirs``: the only directories (besides the Python installation and system libraries) it may
    read, models included; None (default) lets it read anywhere. ``sandbox=False`` turns all of it off.

    >>> with Pool(2) as pool:
    ...     model = pool[0].load_model("model.gguf")
    ...     ctx = model.new_context(n_ctx=2048)
    ...     print(ctx.generate("Once upon a time", n_predict=32).text)
    """

    def __init__(self, size: int = 1, *, variant: str | None = None, strict_variant: bool | None = None,
                 cpu: str | None = None, shm_bytes: int = DEFAULT_SIZE, shm_backend: str = "auto",
                 memory_limit: int | None = None,
                 start_timeout: float = 60.0, env: Mapping[str, str | None] | None = None,
                 native_log_level: str = "warning", threads_per_worker: int | None = None,
                 allowed_dirs: Sequence[str | os.PathLike[str]] | None = None,
                 writable_dirs: Sequence[str | os.PathLike[str]] = (), network: bool = False,
                 sandbox: bool = True, hang_timeout: float | None = 30.0, recover: bool = False) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgumentError(f"a Pool needs an int of at least one worker, got size={size!r}")
        if hang_timeout is not None and (isinstance(hang_timeout, bool) or not isinstance(
                hang_timeout, (int, float)) or not hang_timeout > 0):
            raise InvalidArgumentError(f"hang_timeout is a number of seconds > 0 or None, got {hang_timeout!r}")
        for name, value in (env or {}).items():
            if not isinstance(name, str) or not name or "=" in name or "\0" in name:
                raise InvalidArgumentError(f"env: {name!r} is not an environment variable name")
            if value is not None and (not isinstance(value, str) or "\0" in value):
                raise InvalidArgumentError(f"env[{name!r}] must be a str, or None to pass ours through; got {value!r}")
        _check_options(size, shm_bytes, shm_backend, threads_per_worker, memory_limit, start_timeout,
                       native_log_level, {"variant": variant, "cpu": cpu},
                       {"strict_variant": strict_variant, "network": network, "sandbox": sandbox, "recover": recover})
        if threads_per_worker is None:
            # Workers that together ask for more threads than there are CPUs make llama.cpp's spinning
            # thread barriers stall each other (10x slower on a loaded 2-core machine): share the CPUs.
            threads_per_worker = max(1, len(os.sched_getaffinity(0)) // size) if hasattr(
                os, "sched_getaffinity") else None
        self._options = WorkerOptions(variant=variants.requested(variant),
                                      strict_variant=variants.strict_requested(strict_variant),
                                      cpu=variants.requested_cpu(cpu), shm_bytes=shm_bytes,
                                      shm_backend=shm_backend, memory_limit=memory_limit,
                                      start_timeout=start_timeout, env=dict(env or {}),
                                      native_log_level=native_log_level, threads=threads_per_worker,
                                      allowed_dirs=None if allowed_dirs is None else _dirs("allowed_dirs",
                                                                                           allowed_dirs),
                                      writable_dirs=_dirs("writable_dirs", writable_dirs),
                                      network=network, sandbox=sandbox)
        self._lock = threading.Lock()
        self._all_procs: list[WorkerProcess] = []  # everything started, for the finalizer
        self._instances: list[Instance] = []
        self._closed = False
        self._next_worker_id = 0
        self._subscribers: list[Callable[[WorkerEvent], None]] = []
        self._subscribers_lock = threading.Lock()
        self._temp = TempRoot()
        self._options = dataclasses.replace(self._options, temp_root=self._temp.path)
        self.hang_timeout = hang_timeout
        #: Whether crash recovery is on (Pool(recover=True)).
        self.recover = bool(recover)
        self._watch = None if hang_timeout is None else HangWatch(self._all_procs, float(hang_timeout))
        self._finalizer = weakref.finalize(self, _close_procs, self._all_procs, 5.0, self._watch, self._temp)
        try:
            procs = [self._spawn(recoverable=True) for _ in range(size)]  # start all, then wait: start-ups overlap
            for proc in procs:
                proc.wait_ready()
        except BaseException:
            self.close()
            raise
        self._instances = [Instance(p) for p in procs]

    def _spawn(self, *, zygote: bool = False, fork_from: WorkerProcess | None = None,
               recoverable: bool = False) -> WorkerProcess:
        with self._lock:
            if self._closed:
                raise PoolClosedError("the pool is closed")
            worker_id = self._next_worker_id
            self._next_worker_id += 1
        proc = WorkerProcess(worker_id, self._options, zygote=zygote, fork_from=fork_from)
        proc.on_death = _death_relay(weakref.ref(self))
        if recoverable and self.recover:
            proc.recovery = PoolRecovery(weakref.ref(self))
        with self._lock:
            self._all_procs.append(proc)
        return proc

    # -- crash recovery (_recovery.py) ----------------------------------------------------------------
    def _adopt(self, instance: Instance, dead: WorkerProcess, proc: WorkerProcess) -> None:
        """Recovery's replacement takes the dead worker's place, under the same Instance."""
        dead.close(timeout=1.0)
        with self._lock:
            instance._proc = proc
            if dead in self._all_procs:
                self._all_procs.remove(dead)

    def _index_of(self, instance: Instance) -> int | None:
        return next((i for i, x in enumerate(self._instances) if x is instance), None)

    def _release(self, proc: WorkerProcess, timeout: float = 5.0) -> None:
        proc.close(timeout)
        with self._lock:
            if proc in self._all_procs:
                self._all_procs.remove(proc)

    def snapshot(self, prepare: Callable[[Instance], Mapping[str, Model | Context | LoraAdapter] | None], *,
                 fork: bool | None = None) -> Snapshot:
        """Runs ``prepare(instance)`` once in a fresh worker of this pool's options (load models, create
        contexts, prefill a long system prompt) and keeps it as a Snapshot, whose ``fork()`` returns new
        instances that hold the same models and contexts, ready. prepare() may return a mapping of names
        to the Model, Context and LoraAdapter handles it made: a fork's ``instance.prepared`` holds them
        by name. The snapshot and its forks belong to this pool (its close() ends them) but not to its
        list of instances.

        ``fork``: None (default) forks the prepared worker where it can (Linux, CPU variant, CPU kernels
        without AMX), else replays; True insists on forking (SnapshotError where it cannot); False replays:
        each fork is a fresh worker that loads the models and the named contexts' saved state. When forking, whatever
        prepare() decodes runs on one thread (docs/SNAPSHOTS.md says why). SnapshotError when prepare()
        returns anything else; prepare()'s own exceptions propagate; either way the worker is closed."""
        from .snapshot import Snapshot

        if self._closed:
            raise PoolClosedError("the pool is closed")
        return Snapshot(self, prepare, fork)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._instances)

    def __getitem__(self, index: int) -> Instance:
        return self._instances[index]

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._instances))

    @property
    def instances(self) -> list[Instance]:
        """The workers, in index order (a copy: replace() changes the pool, not this list)."""
        return list(self._instances)

    def replace(self, instance: Instance | int) -> Instance:
        """Starts a fresh worker in the place of ``instance`` (dead or alive; a live one is closed).
        Handles from the old worker stay stale; models must be loaded again."""
        if self._closed:
            raise PoolClosedError("the pool is closed")
        index = instance if isinstance(instance, int) else self._instances.index(instance)
        old = self._instances[index]._proc
        old.close(timeout=2.0)
        proc = self._spawn(recoverable=True)
        proc.wait_ready()
        fresh = Instance(proc)
        with self._lock:
            self._instances[index] = fresh
            self._all_procs.remove(old)
        self._emit(WorkerEvent("replaced", proc.worker_id, proc.pid, instance=fresh, index=index))
        return fresh

    def _route(self, model: Model | str | None, prompt: str | Sequence[int]) -> tuple[Batcher, list[int]]:
        if self._closed:
            raise PoolClosedError("the pool is closed")
        if isinstance(model, Model):
            return model.instance._route(model, prompt)
        batchers: list[Batcher] = []
        reasons: list[str] = []
        for inst in self._instances:
            if not inst.alive:
                reasons.append(f"worker {inst.worker_id} is dead")
                continue
            try:
                batchers.append(inst._model(model).batcher())
            except LloyalError as exc:
                reasons.append(str(exc))
        if not batchers:
            raise InvalidArgumentError("no live worker can take the request: " + "; ".join(reasons))
        tokens = batchers[0].tokens(prompt)
        return ROUTER.pick(batchers, tokens), tokens

    def stats(self) -> list[dict[str, Any]]:
        """Instance.stats() of every worker, in index order."""
        return [inst.stats() for inst in self._instances]

    def close(self, timeout: float = 5.0) -> None:
        """Ends every worker (shutdown, then kill after timeout), reaps every process and frees every
        shared-memory region. Idempotent; also runs at interpreter exit."""
        self._closed = True
        for inst in list(self._instances):
            inst._stop_batchers(PoolClosedError("the pool was closed while the request ran"))
        _close_procs(self._all_procs, timeout, self._watch, self._temp)
        self._finalizer.detach()

    async def aclose(self, timeout: float = 5.0) -> None:
        """close() for asyncio: workers end on a thread of the loop's executor while other tasks go on."""
        await closed_in_thread(self.close, timeout)

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """Whether close() was called; calls on the pool's handles then raise PoolClosedError."""
        return self._closed

    @property
    def temp_dir(self) -> str:
        """The pool's temporary directory, which holds each worker's private one (its working directory,
        the only place it may write besides ``writable_dirs``). close() removes it, and should this
        process die without closing the pool, a janitor process (a shell waiting on a pipe) does."""
        return self._temp.path

