"""Model: a GGUF loaded in one worker, with its tokenizer and chat templates; it makes the contexts, LoRA
adapters and the batcher that run on it."""

from __future__ import annotations

import itertools
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeVar, overload

import msgspec

from . import protocol as p
from ._files import irregular_path
from .batching import Batcher, BatchRequest
from .chat import ChatMessage
from .context import Context, ContextInstance
from .errors import (
    BadRequestError,
    DeadWorkerError,
    InvalidArgumentError,
    LoraError,
    ModelLoadError,
    PoolClosedError,
    StaleHandleError,
)
from .lora import LoraAdapter
from .params import ContextParams, GenerateParams, ModelInfo, Result, token_id, token_ids
from .protocol import Request
from .stream import Stream

if TYPE_CHECKING:
    from ._core import WorkerCore
    from ._process import WorkerProcess

_model_serials = itertools.count()
R = TypeVar("R")
ModelBytes = bytes | bytearray | memoryview | int | IO[bytes]
"""A GGUF in memory: its bytes, or an open descriptor (or binary file object) that reads it from the start."""
GGUF_MAGIC = b"GGUF"


class MemorySource:
    """A model given in memory (go-llama's in-memory filesystem): kept by reference (a descriptor is
    duplicated) so that a recovered worker or a snapshot's replay loads it again. Each load copies it into
    a transfer memfd the worker reads as a file (shm.TransferFile): the bytes never ride in a frame."""

    def __init__(self, data: ModelBytes) -> None:
        self._view: memoryview | None = None
        self._fd = -1
        if isinstance(data, bool):
            raise BadRequestError("a model in memory is bytes, a memoryview, a descriptor or a binary file")
        if isinstance(data, int) or hasattr(data, "fileno"):
            fd = data if isinstance(data, int) else data.fileno()
            try:
                self._fd = os.dup(fd)
            except OSError as exc:
                raise ModelLoadError(f"cannot read the model's descriptor {fd}: {exc}") from exc
            # Closed once no model (a snapshot's forks share one source) holds it any more.
            weakref.finalize(self, os.close, self._fd)
            try:
                head = os.pread(self._fd, 4, 0)
                self.size = os.fstat(self._fd).st_size
            except OSError as exc:  # a pipe or a socket: a model is read at offsets
                raise ModelLoadError(f"cannot read the model from descriptor {fd} at offsets: {exc}") from exc
        elif isinstance(data, (bytes, bytearray, memoryview)):
            self._view = memoryview(data).cast("B")
            head = bytes(self._view[:4])
            self.size = len(self._view)
        else:
            raise BadRequestError(f"a model in memory is bytes, a memoryview, a descriptor or a binary file, not "
                                  f"{type(data).__name__}")
        if head != GGUF_MAGIC:
            raise ModelLoadError(f"the model in memory is not a GGUF file (it starts with {head!r}, not "
                                 f"{GGUF_MAGIC!r})")

    def load(self, proc: WorkerProcess, req: p.LoadModel,
             on_event: Callable[[dict[str, Any]], None] | None = None) -> Future[p.ModelLoaded]:
        """req with the path of a transfer file that holds the model, sent to proc; the file goes once
        the worker replied. A mapping survives that only where the file is the worker's alone to keep
        (a sealed memfd, or an unlinked file): the worker's reused memfd is emptied after each transfer,
        so the model is read into memory instead."""
        from .shm import TransferFile

        transfer = proc.transfer()
        transfer.__enter__()
        try:
            transfer.write(self._view if self._view is not None else self._fd)
            keeps = isinstance(transfer, TransferFile)
            sent = msgspec.structs.replace(req, path=transfer.path, use_mmap=req.use_mmap and keeps)
            fut = proc.call(sent, on_event)
        except BaseException:
            transfer.__exit__(None, None, None)
            raise
        fut.add_done_callback(lambda _: transfer.__exit__(None, None, None))
        return fut


class ModelOwner(ContextInstance, Protocol):
    """The worker a model is loaded in (an Instance, which makes it: Instance.load_model): the models it
    holds and where their batched requests go, and what a user reaches through ``model.instance``: more
    models in the same worker, and batched requests on them."""

    @property
    def _models(self) -> set[Model]: ...
    @property
    def _reroute(self) -> Callable[[Model], Batcher | None] | None: ...
    def _route(self, model: Model | str | None, prompt: str | Sequence[int],
               lora: Iterable[str] = ()) -> tuple[Batcher, list[int]]: ...
    @property
    def models(self) -> list[Model]: ...
    def load_model(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                   vocab_only: bool = False, repack: bool = True, progress: Callable[[float], None] | None = None,
                   timeout: float | None = None) -> Model: ...
    def load_model_from_memory(self, data: ModelBytes, *, n_gpu_layers: int = 0, use_mmap: bool = True,
                               vocab_only: bool = False, repack: bool = True,
                               progress: Callable[[float], None] | None = None,
                               timeout: float | None = None) -> Model: ...
    def submit(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               model: Model | str | None = None, on_piece: Callable[[str], None] | None = None,
               **overrides: Any) -> BatchRequest: ...
    @overload
    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 model: Model | str | None = None, on_piece: Callable[[str], None] | None = None,
                 timeout: float | None = None, n: None = None, best_of: None = None, **overrides: Any) -> Result: ...
    @overload
    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 model: Model | str | None = None, on_piece: Callable[[int, str], None] | None = None,
                 timeout: float | None = None, n: int, best_of: int | None = None,
                 **overrides: Any) -> list[Result]: ...
    def stream(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               model: Model | str | None = None, timeout: float | None = None, **overrides: Any) -> Stream: ...


class Model:
    """A model loaded in one worker (Instance.load_model). Contexts created from it share its weights.
    ``info`` is its ModelInfo, ``path`` the absolute path it was loaded from, ``instance`` its worker.
    Its methods that ask the worker block until it replies; once the model is closed, or its worker died,
    they raise StaleHandleError (PoolClosedError once the pool is closed)."""

    def __init__(self, instance: ModelOwner, handle: int, info: ModelInfo, path: str,
                 load: p.LoadModel | None = None, source: MemorySource | None = None) -> None:
        self.instance = instance
        self._handle = handle  # its number in the worker: a recovery renumbers it (WorkerCore._load_models)
        self._load = load or p.LoadModel(path=path)  # how it was loaded: a replayed snapshot loads it so
        self._source = source  # a model loaded from memory: what loads it again
        self._closed = False
        self.info = info
        self.path = path
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()  # freed with the model
        # Held until closed (a request names one by its name: Model.lora), and freed with the model too.
        self._loras: set[LoraAdapter] = set()
        self._batcher: Batcher | None = None
        self._serial = next(_model_serials)
        self._batcher_lock = threading.Lock()
        instance._models.add(self)
        instance._core.models.add(self)

    @property
    def _core(self) -> WorkerCore:
        return self.instance._core

    @property
    def _proc(self) -> WorkerProcess:
        return self.instance._core.proc

    def _load_into(self, proc: WorkerProcess) -> Future[p.ModelLoaded]:
        """Loads this model again, as it was loaded, in another worker (recovery, a snapshot's replay)."""
        return self._source.load(proc, self._load) if self._source is not None else proc.call(self._load)

    def _adapters(self) -> list[LoraAdapter]:
        return list(self._loras)

    def __repr__(self) -> str:
        return f"<Model {self.info.desc!r} worker={self.instance.worker_id} handle={self._handle}>"

    def _call(self, req: Request[R]) -> R:
        if self._closed:
            raise StaleHandleError(f"Model handle {self._handle} was closed")
        # Through the worker's core: during a crash recovery it waits for the replacement, and goes there
        # under the model's new handle.
        return self._core.call(req, model=self).result()

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
                n_threads: int | None = None, deterministic: bool | None = None,
                preempt_slots: int | None = None) -> Batcher:
        """The model's Batcher (batching.py): continuous batching of independent generations on one
        context of ``slots`` sequences (default 8) with ``n_ctx_slot`` tokens of room each (default 2048).
        The first call makes it with the options given; Instance.generate and Pool.generate use it. A
        later call with other options raises InvalidArgumentError (close the model to start over). When
        its worker died and crash recovery replaced it, the next call makes a new one with the same
        options. ``deterministic=True``: a request's tokens do not depend on what else is batched
        (Batcher's docstring). ``preempt_slots``: slots where a request outranked by a higher-priority one
        waits, paused (Batcher's docstring; default 0)."""
        asked: dict[str, Any] = {k: v for k, v in {"slots": slots, "n_ctx_slot": n_ctx_slot, "chunk": chunk,
                                   "n_threads": n_threads, "deterministic": deterministic,
                                   "preempt_slots": preempt_slots}.items() if v is not None}
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

    def _successor_batcher(self, dead: Batcher) -> Batcher | None:
        """Where the requests of ``dead`` (its worker died) go on: a live worker's batcher of the same model
        (the pool's choice), else this model's next batcher (crash recovery's replacement serves it; a
        batcher made meanwhile waits for it)."""
        reroute = self.instance._reroute
        if reroute is not None:
            found = reroute(self)
            if found is not None:
                return found
        return self.batcher(**dead.options)

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
        return self._new_context(params or ContextParams(), pageable=True)

    def _new_context(self, params: ContextParams, *, pageable: bool) -> Context:
        """``pageable``: under the pool's max_resident_contexts (not a batcher's or an embedder's own): the
        least recently used idle contexts beyond it page out before this returns."""
        ctx = Context(self, self._call(p.NewContext(model=self._handle, params=params.to_wire())), params,
                      pageable=pageable)
        if pageable and self._core.machine.budget is not None:
            self._core.settle()
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

    @property
    def loras(self) -> list[LoraAdapter]:
        """The LoRA adapters loaded for this model and not closed, by path."""
        return sorted((a for a in list(self._loras) if not a.closed), key=lambda a: a.path)

    def lora(self, name: str) -> LoraAdapter:
        """The loaded adapter ``name`` names: its path, file name or stem (what GenerateParams.lora and the
        server's ``lora`` field name). InvalidArgumentError when none or several match."""
        found = [a for a in self.loras
                 if name in (a.path, os.path.basename(a.path), os.path.splitext(os.path.basename(a.path))[0])]
        if len(found) != 1:
            held = ", ".join(os.path.basename(a.path) for a in self.loras) or "none"
            raise InvalidArgumentError(f"{'no' if not found else 'more than one'} LoRA adapter named {name!r} is "
                                       f"loaded for {os.path.basename(self.path)} (loaded: {held})")
        return found[0]

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
        for state in self._core.contexts_of(self):  # those whose Context was dropped (a Branch holds them)
            self._core.forget(state)
        for adapter in list(self._loras):
            adapter._closed = True
        if self.instance.alive:
            try:
                self._core.call(p.FreeModel(model=self._handle), model=self).result()
            except (PoolClosedError, DeadWorkerError):
                pass  # its worker went meanwhile: nothing is left to free

