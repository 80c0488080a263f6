"""The engine of one worker: models and contexts over the native module, addressed by integer handles.

It knows nothing of pipes or frames (worker/loop.py does), so it runs the same in-process, which is how
the tests exercise the request logic without a subprocess. Each method handles one request struct of
protocol.py and returns its declared reply; ``@handles`` registers it, and Engine.handle() dispatches by
the request's type. Bulk results are written into the shared-memory region and returned as descriptors.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np

from .. import protocol as p
from .._files import not_regular
from ..chat import ChatMessage, ToolCall, template_source
from ..errors import (
    BadRequestError,
    ContextError,
    InvalidArgumentError,
    LloyalError,
    LoraError,
    ModelLoadError,
    SnapshotError,
    StaleHandleError,
    StateError,
)
from ..params import BranchInfo, BufferMemory, Device, EvalResult, KVPressure, ModelInfo, Result, Score
from ..protocol import MAX_FRAME, Request
from ..shm import (
    BULK_OFFSET,
    HEARTBEAT_OFFSET,
    INTERRUPT_OFFSET,
    INTERRUPT_SLOTS,
    PAGE,
    Region,
    row_bytes,
    shm_bytes_for,
)
from .grammar_trie import factor_literal_alternations

if TYPE_CHECKING:  # the stub is the native module's contract: mypy checks the engine's calls against it
    from . import _native as native_api

EventSink = Callable[[dict[str, Any]], None]
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Call:
    """What a handler knows about the request it serves besides its fields."""

    request_id: int = 0  # the id the interrupt word is compared with (0: never interrupted)
    emit: EventSink | None = None  # EVENT frames for this request

    def prompt_progress(self, wanted: bool) -> Callable[[int, int], None] | None:
        """The native on_progress for a request that asked for prompt_progress events (else None)."""
        emit = self.emit
        if not wanted or emit is None:
            return None

        def on_progress(done: int, total: int) -> None:
            emit({"prompt_progress": (done, total)})

        return on_progress


Q = TypeVar("Q", bound=Request[Any])
Handler = Callable[["Engine", Any, Call], Any]
HANDLERS: dict[type[Request[Any]], Handler] = {}
# What an embedding context (embeddings=True) takes; every other context request is refused there.
_EMBEDDING_OPS: frozenset[type[Request[Any]]] = frozenset(
    {p.FreeContext, p.Embed, p.Rerank, p.Reset, p.Tokens, p.NPast, p.KvPressureRequest, p.SetLora,
     p.MemoryBreakdown})
# What a frozen zygote still serves (Fork itself is the loop's: worker/zygote.py).
_FROZEN_OPS: frozenset[type[Request[Any]]] = frozenset({p.Ping, p.Reap, p.Fault})
# Work that llama.cpp does with no interrupt check (no heartbeat from the native loops) but that ends on its
# own: reading a file, building a vocabulary, allocating a cache. The worker keeps its heartbeat going
# while these run, so that a large model or state is not taken for a hang (a stopped worker still is).
_UNCHECKED_OPS: frozenset[type[Request[Any]]] = frozenset(
    {p.LoadModel, p.FreeModel, p.LoadLora, p.NewContext, p.FreeContext, p.SaveState, p.LoadState,
     p.StateSeqGet, p.StateSeqSet, p.StateSeqSaveFile, p.StateSeqLoadFile, p.Tokenize, p.Detokenize})
_PLACEHOLDER = re.compile(r"\{query\}|\{document\}")


def handles(request: type[Q]) -> Callable[[Callable[[Engine, Q, Call], Any]], Callable[[Engine, Q, Call], Any]]:
    """Registers the decorated method as the handler of one request struct."""

    def register(fn: Callable[[Engine, Q, Call], Any]) -> Callable[[Engine, Q, Call], Any]:
        if request in HANDLERS:
            raise TypeError(f"two handlers for {request.__name__}")
        HANDLERS[request] = fn
        return fn

    return register


@dataclass
class _ModelEntry:
    native: native_api.Model
    path: str
    n_vocab: int
    contexts: set[int]


@dataclass
class _ContextEntry:
    native: native_api.Context
    model_id: int
    slot: int  # interrupt word index
    loras: frozenset[int] = frozenset()  # the adapters its configuration holds


@dataclass
class _LoraEntry:
    native: native_api.Lora
    model_id: int


class Engine:
    def __init__(self, native: ModuleType, region: Region, default_threads: int | None = None,
                 single_threaded: bool = False) -> None:
        self.native = native
        self.region = region
        self.default_threads = default_threads
        # A snapshot's zygote (worker/zygote.py): its contexts compute on one thread until a fork thaws
        # them, and once frozen it serves nothing but forks.
        self.single_threaded = single_threaded
        self.frozen = False
        self.zygote: object = None
        # The region's bulk area, handed out by the native side: a block per context (its logits row)
        # and per branch (its snapshot), each freed natively with its owner.
        self.arena = native.Arena(region.view, BULK_OFFSET, PAGE)
        # The native loops advance it at every interrupt check; handle() at every request.
        native.set_heartbeat_word(region.view, HEARTBEAT_OFFSET // 8)
        self._models: dict[int, _ModelEntry] = {}
        self._contexts: dict[int, _ContextEntry] = {}
        self._loras: dict[int, _LoraEntry] = {}
        self._free_slots = list(range(INTERRUPT_SLOTS - 1, -1, -1))
        self._next_id = 1

    def handle(self, req: Request[Any], request_id: int = 0, emit: EventSink | None = None) -> Any:
        """Runs one request through its registered handler."""
        self.region.beat()
        if self.frozen and type(req) not in _FROZEN_OPS:
            raise SnapshotError(f"{req.op.value}: this worker is a frozen snapshot; it serves only forks "
                                "(Snapshot.fork())")
        if isinstance(req, p.ContextRequest) and type(req) not in _EMBEDDING_OPS:
            entry = self._contexts.get(req.context)
            if entry is not None and entry.native.embeddings:
                raise ContextError(f"{req.op.value} needs a generation context; this one was created with "
                                   "embeddings=True (it can embed, and rerank with pooling='rank')")
        try:
            if type(req) in _UNCHECKED_OPS:
                with _keepalive(self.region):
                    return HANDLERS[type(req)](self, req, Call(request_id, emit))
            return HANDLERS[type(req)](self, req, Call(request_id, emit))
        except (ValueError, TypeError) as exc:
            # The native checks (and a few here) raise the plain built-ins for a value out of range or of
            # the wrong type; the client gets a LloyalError that is still that built-in.
            if type(exc) is ValueError:
                raise InvalidArgumentError(str(exc)) from exc
            if type(exc) is TypeError:
                raise BadRequestError(str(exc)) from exc
            raise

    def thaw(self) -> None:
        """In a zygote's forked child: every context computes with the threads it was created with."""
        self.frozen = self.single_threaded = False
        self.zygote = None
        for entry in self._contexts.values():
            entry.native.set_threads(entry.native.n_threads, entry.native.n_threads_batch)

    def _new_id(self) -> int:
        handle = self._next_id
        self._next_id += 1
        return handle

    def _model(self, model_id: int) -> _ModelEntry:
        try:
            return self._models[model_id]
        except KeyError:
            raise StaleHandleError(f"model handle {model_id} is not loaded in this worker") from None

    def _context(self, context_id: int) -> _ContextEntry:
        try:
            return self._contexts[context_id]
        except KeyError:
            raise StaleHandleError(f"context handle {context_id} does not exist in this worker") from None

    def _lora(self, lora_id: int) -> _LoraEntry:
        try:
            return self._loras[lora_id]
        except KeyError:
            raise StaleHandleError(f"LoRA adapter handle {lora_id} is not loaded in this worker (closed, or "
                                   f"freed with its model)") from None

    # -- models ---------------------------------------------------------------------------------------
    @handles(p.Ping)
    def ping(self, req: p.Ping, call: Call) -> p.Pong:
        return p.Pong(pid=os.getpid())

    @handles(p.LoadModel)
    def load_model(self, req: p.LoadModel, call: Call) -> p.ModelLoaded:
        _check_gguf_file(req.path)
        last = [-1.0]
        emit = call.emit

        def progress(fraction: float) -> bool:
            # llama.cpp reports hundreds of steps; a percent is enough for a progress bar.
            if emit is not None and (fraction - last[0] >= 0.01 or fraction >= 1.0):
                last[0] = fraction
                emit({"progress": fraction})
            return True

        try:
            native = self.native.Model(req.path, n_gpu_layers=req.n_gpu_layers, use_mmap=req.use_mmap,
                                       vocab_only=req.vocab_only, repack=req.repack, progress=progress)
        except (ModelLoadError, MemoryError) as exc:
            raise _name_memory_limit_load(exc) from None
        model_id = self._new_id()
        self._models[model_id] = _ModelEntry(native, req.path, int(native.n_vocab), set())
        return p.ModelLoaded(model=model_id, info=msgspec.convert(native.info(), ModelInfo))

    @handles(p.FreeModel)
    def free_model(self, req: p.FreeModel, call: Call) -> None:
        entry = self._model(req.model)
        for ctx in list(entry.contexts):
            self._free_context(ctx)
        for lora in [k for k, v in self._loras.items() if v.model_id == req.model]:
            del self._loras[lora]
        del self._models[req.model]

    def _tokenize(self, model: int, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return list(self._model(model).native.tokenize(text, add_special, parse_special))

    @handles(p.Tokenize)
    def tokenize(self, req: p.Tokenize, call: Call) -> list[int]:
        return self._tokenize(req.model, req.text, req.add_special, req.parse_special)

    @handles(p.Detokenize)
    def detokenize(self, req: p.Detokenize, call: Call) -> str:
        return str(self._model(req.model).native.detokenize(req.tokens, req.remove_special, req.unparse_special))

    @handles(p.TokenToPiece)
    def token_to_piece(self, req: p.TokenToPiece, call: Call) -> bytes:
        return bytes(self._model(req.model).native.token_to_piece(req.token, req.special))

    @handles(p.ApplyChatTemplate)
    def apply_chat_template(self, req: p.ApplyChatTemplate, call: Call) -> str:
        native = self._model(req.model).native
        return str(native.apply_chat_template(req.messages, template_source(req.template), req.add_generation_prompt,
                                              req.tools))

    @handles(p.ChatFormat)
    def chat_format(self, req: p.ChatFormat, call: Call) -> p.ChatPrompt:
        native = self._model(req.model).native
        d = native.format_chat(req.messages, template_source(req.template), req.add_generation_prompt, req.tools,
                               req.tool_choice)
        return msgspec.convert(d, p.ChatPrompt)

    @handles(p.ParseChatOutput)
    def parse_chat_output(self, req: p.ParseChatOutput, call: Call) -> ChatMessage:
        native = self._model(req.model).native
        # The parser expects what follows the generation prompt, which a conversation ending in a user turn
        # yields: one stands in when the caller gives none.
        messages = req.messages or '[{"role": "user", "content": "?"}]'
        content, reasoning, calls = native.parse_chat(messages, template_source(req.template), req.tools,
                                                      req.tool_choice, req.text, req.partial)
        return ChatMessage(content=content, reasoning=reasoning,
                           tool_calls=[ToolCall(name=n, arguments=a, id=i) for n, a, i in calls])

    @handles(p.JsonSchemaToGrammar)
    def json_schema_to_grammar(self, req: p.JsonSchemaToGrammar, call: Call) -> str:
        return str(self.native.json_schema_to_grammar(req.schema))

    # -- LoRA adapters --------------------------------------------------------------------------------
    @handles(p.LoadLora)
    def load_lora(self, req: p.LoadLora, call: Call) -> p.LoraLoaded:
        model = self._model(req.model)
        _check_gguf_file(req.path, LoraError, "LoRA adapter")
        native = self.native.Lora(model.native, req.path)
        lora_id = self._new_id()
        self._loras[lora_id] = _LoraEntry(native, req.model)
        return p.LoraLoaded(lora=lora_id, alpha=float(native.alpha), meta=dict(native.meta()))

    @handles(p.FreeLora)
    def free_lora(self, req: p.FreeLora, call: Call) -> None:
        self._lora(req.lora)
        users = sorted(c for c, e in self._contexts.items() if req.lora in e.loras)
        if users:
            # The native adapter would live on inside those contexts: a closed adapter still in effect.
            raise LoraError(f"LoRA adapter {req.lora} is applied by context(s) {users}: set_lora([]) there "
                            f"(or close them) before closing it")
        del self._loras[req.lora]

    @handles(p.SetLora)
    def set_lora(self, req: p.SetLora, call: Call) -> bool:
        entry = self._context(req.context)
        weights = [(self._lora(lora).native, float(scale)) for lora, scale in req.adapters]
        # The native side checks the model, the scales and duplicates, and refuses a change under branches.
        changed = bool(entry.native.set_lora(weights))
        entry.loras = frozenset(lora for lora, scale in req.adapters if scale != 0.0)
        return changed

    # -- contexts -------------------------------------------------------------------------------------
    @handles(p.NewContext)
    def new_context(self, req: p.NewContext, call: Call) -> p.ContextCreated:
        entry = self._model(req.model)
        if not self._free_slots:
            raise ContextError(f"a worker holds at most {INTERRUPT_SLOTS} contexts")
        params = req.params
        if self.default_threads and params.get("n_threads") is None:
            params = {**params, "n_threads": self.default_threads}
        cap = _memory_cap()
        if cap is not None and self.native.gpu_device_count() == 0:
            # On the CPU every buffer of the context is heap the cap counts (a GPU build's are not).
            _refuse_over_cap(cap, _context_lower_bound(entry.native.info(), params), "needs at least")
        try:
            native = self.native.Context(entry.native, params, self.arena)
        except self.native.RegionFullError:
            raise self._region_full(entry) from None
        except (ContextError, MemoryError) as exc:
            raise _name_memory_limit(exc) from None
        if self.single_threaded:
            native.set_threads(1, 1)
        if cap is not None:
            # The buffers fitted, but the threads llama.cpp starts at the first decode need their stacks
            # under the same cap (past it libgomp exits the worker): refuse now, the context freed.
            _refuse_over_cap(cap, _thread_headroom(max(native.n_threads, native.n_threads_batch)),
                             "leaves too little for its compute threads, which need")
        slot = self._free_slots.pop()
        self.region.set_interrupt(slot, 0)
        # The native side indexes u64 words from the start of the region.
        native.set_interrupt_word(self.region.view, INTERRUPT_OFFSET // 8 + slot)
        context_id = self._new_id()
        self._contexts[context_id] = _ContextEntry(native, req.model, slot)
        entry.contexts.add(context_id)
        return p.ContextCreated(
            context=context_id, interrupt_slot=slot, logits_offset=native.logits_offset, n_vocab=entry.n_vocab,
            n_ctx=native.n_ctx, n_batch=native.n_batch, n_ubatch=native.n_ubatch, n_seq_max=native.n_seq_max,
            n_threads=native.n_threads, pooling=native.pooling)

    def _region_full(self, entry: _ModelEntry) -> ContextError:
        """No room in the region for a context's logits row: say how much larger shm_bytes must be."""
        row = row_bytes(entry.n_vocab)
        size = self.region.size
        free = int(self.arena.free_bytes)
        # Enough for one more even when the free bytes are scattered; and the size that holds twice as
        # many rows as now, for an application that keeps adding contexts.
        held = (size - BULK_OFFSET) // row
        return ContextError(
            f"no room for another context in this worker's shared-memory region: each context of this model "
            f"keeps its logits row there ({row} bytes: n_vocab {entry.n_vocab} x 4, rounded up to a page), and "
            f"{free} of its {size} bytes are free ({len(self._contexts)} context(s) here, and branch "
            f"snapshots and embedding results take rows too). Create the Pool with a larger shm_bytes: "
            f"{size + row} holds one more, {shm_bytes_for(entry.n_vocab, 2 * max(held, 1))} about twice as "
            f"many (lloyal_pool.shm_bytes_for(n_vocab, rows))")

    @handles(p.FreeContext)
    def free_context(self, req: p.FreeContext, call: Call) -> None:
        self._free_context(req.context)

    def _free_context(self, context: int) -> None:
        entry = self._context(context)
        del self._contexts[context]
        self._models[entry.model_id].contexts.discard(context)
        self._free_slots.append(entry.slot)

    @handles(p.Eval)
    def eval(self, req: p.Eval, call: Call) -> EvalResult:
        entry = self._context(req.context)
        tokens = req.tokens or []
        if req.text is not None:
            add_special = entry.native.n_past() == 0 if req.add_special is None else req.add_special
            tokens = self._tokenize(entry.model_id, req.text, add_special, req.parse_special)
        # Token ids are checked (InvalidTokenError) by the native side, before anything is decoded.
        return msgspec.convert(entry.native.eval(tokens, call.request_id, call.prompt_progress(req.progress)),
                               EvalResult)

    @handles(p.Generate)
    def generate(self, req: p.Generate, call: Call) -> Result:
        entry = self._context(req.context)
        on_piece = self._on_piece(call) if req.stream else None
        return self._generated(entry, call, entry.native.generate(
            req.prompt, self._gen_params(req.params), call.request_id, on_piece, req.append,
            call.prompt_progress(req.progress)))

    @handles(p.Resume)
    def resume(self, req: p.Resume, call: Call) -> Result:
        entry = self._context(req.context)
        on_piece = self._on_piece(call) if req.stream else None
        return self._generated(entry, call, entry.native.resume(call.request_id, on_piece, req.origin))

    @handles(p.AdoptGeneration)
    def adopt_generation(self, req: p.AdoptGeneration, call: Call) -> None:
        self._context(req.context).native.adopt(self._gen_params(req.params), req.suspension, req.origin)

    def _generated(self, entry: _ContextEntry, call: Call, result: dict[str, Any]) -> Result:
        if result["stop_reason"] == "paused" and call.emit is not None:
            # Its portable form travels with the pause, so that the client can go on with it elsewhere
            # (a move, or this worker's crash); a mirostat generation has none. One paused inside its
            # prompt holds nothing: the same request sent again goes on.
            suspension: dict[str, Any] | None = {"prompt": True}
            if entry.native.paused():
                try:
                    suspension = entry.native.suspension()
                except ContextError:
                    suspension = None
            call.emit({"paused": suspension})
        return msgspec.convert(result, Result)

    @handles(p.GenerateWithDraft)
    def generate_with_draft(self, req: p.GenerateWithDraft, call: Call) -> Result:
        entry = self._context(req.context)
        draft: str | Any = req.draft
        if isinstance(req.draft, int):
            if req.draft == req.context:
                raise ValueError("the draft context must be another context than the target")
            draft = self._context(req.draft).native
            if draft.embeddings:
                raise ContextError("the draft context is an embedding context: drafting needs a generation context")
        on_piece = self._on_piece(call) if req.stream else None
        return msgspec.convert(entry.native.generate_with_draft(
            req.prompt, self._gen_params(req.params), draft, req.n_draft, req.ngram_min, req.ngram_max,
            call.request_id, on_piece, req.append, call.prompt_progress(req.progress)), Result)

    def _gen_params(self, params: dict[str, Any]) -> dict[str, Any]:
        grammar = params.get("grammar")
        if isinstance(grammar, dict):
            return {**params, "grammar": self._grammar(grammar)}
        if isinstance(grammar, str) and grammar:
            return {**params, "grammar": factor_literal_alternations(grammar)}
        return params

    @staticmethod
    def _on_piece(call: Call) -> Callable[[str], None] | None:
        emit = call.emit
        if emit is None:
            return None

        def on_piece(piece: str) -> None:
            emit({"piece": piece})

        return on_piece

    @handles(p.Logits)
    def logits(self, req: p.Logits, call: Call) -> p.LogitsAt:
        entry = self._context(req.context)
        entry.native.write_logits()
        return p.LogitsAt(offset=entry.native.logits_offset, count=self._models[entry.model_id].n_vocab)

    @handles(p.Reset)
    def reset(self, req: p.Reset, call: Call) -> None:
        self._context(req.context).native.reset()  # drops every branch and detached sequence too

    @handles(p.Tokens)
    def tokens(self, req: p.Tokens, call: Call) -> list[int]:
        return list(self._context(req.context).native.tokens())

    @handles(p.NPast)
    def n_past(self, req: p.NPast, call: Call) -> int:
        return int(self._context(req.context).native.n_past())

    @handles(p.MemoryBreakdown)
    def memory_breakdown(self, req: p.MemoryBreakdown, call: Call) -> list[BufferMemory]:
        return [BufferMemory(**row) for row in self._context(req.context).native.memory_breakdown()]

    # -- devices --------------------------------------------------------------------------------------
    @handles(p.Devices)
    def devices(self, req: p.Devices, call: Call) -> list[Device]:
        return [Device(**row) for row in self.native.devices()]

    # -- embeddings and rerank ------------------------------------------------------------------------
    @handles(p.Embed)
    def embed(self, req: p.Embed, call: Call) -> p.Embedded:
        entry = self._context(req.context)
        if entry.native.pooling == "rank":
            raise ContextError("a pooling='rank' context scores (query, document) pairs: use rerank()")
        # Texts are data: special-token text in them stays text.
        inputs = [self._tokenize(entry.model_id, x, True, False) if isinstance(x, str) else x for x in req.inputs]
        r = entry.native.embed(inputs, req.normalize, call.request_id)
        return p.Embedded(offset=int(r["offset"]), rows=[int(n) for n in r["rows"]], width=int(r["width"]))

    @handles(p.Rerank)
    def rerank(self, req: p.Rerank, call: Call) -> list[float]:
        entry = self._context(req.context)
        native = entry.native
        if native.embeddings and native.pooling != "rank":
            raise ContextError(f"rerank in an embedding context needs pooling='rank' (a reranker model), this one "
                               f"pools with {native.pooling!r}; a causal LM reranks in a generation context")
        if not req.documents:
            return []
        if native.embeddings:
            info = self._model(entry.model_id).native.info()
            pairs = [self._rank_pair(entry.model_id, info, req.query, d) for d in req.documents]
            r = native.embed(pairs, False, call.request_id)
            width = int(r["width"])
            # The classifier's first output is the score (a reranker's "relevant" class).
            scores = self.region.floats(int(r["offset"]), len(pairs) * width)[::width]
            return [float(x) for x in scores]
        if not req.query.strip():
            raise ValueError("the query is empty")
        template = req.prompt.rstrip()
        if not template.endswith("{query}") or "{document}" not in template:
            raise ValueError("the rerank prompt must contain {document} and end with {query}")
        before = template[:-len("{query}")]
        prompts: list[list[int]] = []
        n_tail: list[int] = []
        for doc in req.documents:
            head = _fill(before, req.query, doc)
            full = self._tokenize(entry.model_id, head + req.query, True, False)
            # The query's tokens: what follows the longest common prefix with the prompt alone (a
            # space before the query may merge into its first token).
            alone = self._tokenize(entry.model_id, head.rstrip(), True, False)
            k = _common_prefix(alone, full)
            if k == len(full):
                raise ValueError("the query has no tokens")
            prompts.append(full)
            n_tail.append(len(full) - k)
        return [float(x) for x in native.score_tails(prompts, n_tail, call.request_id)]

    def _rank_pair(self, model: int, info: dict[str, Any], query: str, document: str) -> list[int]:
        """A (query, document) pair as a reranker takes it: the model's rerank template when its GGUF has
        one (special tokens parsed, as its author wrote them), else the BERT-style convention
        [BOS] query [EOS] [SEP] document [EOS], each marker where the vocabulary asks for it."""
        template = info.get("rerank_template")
        if template:
            return self._tokenize(model, _fill(template, query, document), False, True)
        eos = info["eos"] if info["eos"] >= 0 else info["sep"]
        out: list[int] = [info["bos"]] if info["add_bos"] and info["bos"] >= 0 else []
        out += self._tokenize(model, query, False, False)
        if info["add_eos"] and eos >= 0:
            out.append(eos)
        if info["add_sep"] and info["sep"] >= 0:
            out.append(info["sep"])
        out += self._tokenize(model, document, False, False)
        if info["add_eos"] and eos >= 0:
            out.append(eos)
        return out

    # -- whole-context state and scoring ------------------------------------------------------------------
    @handles(p.SaveState)
    def save_state(self, req: p.SaveState, call: Call) -> int:
        native = self._context(req.context).native
        _check_state_path(req.path, reading=False)
        if req.in_place:
            return int(native.save_state(req.path))
        # A file that is there is either the old state or the new one, never half of the new one.
        tmp = f"{req.path}.{os.getpid()}.tmp"
        try:
            n = int(native.save_state(tmp))
            os.replace(tmp, req.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return n

    @handles(p.LoadState)
    def load_state(self, req: p.LoadState, call: Call) -> int:
        entry = self._context(req.context)
        _check_state_path(req.path, reading=True)
        return int(entry.native.load_state(req.path))

    @handles(p.ScoreText)
    def score(self, req: p.ScoreText, call: Call) -> Score:
        entry = self._context(req.context)
        tokens = self._prompt_tokens(entry, req.text, bos=True)
        n_logprobs = -1 if req.logprobs is None else req.logprobs
        return msgspec.convert(entry.native.score(tokens, call.request_id, n_logprobs), Score)

    @handles(p.ScoreChoices)
    def score_choices(self, req: p.ScoreChoices, call: Call) -> list[Score]:
        entry = self._context(req.context)
        choices = [self._prompt_tokens(entry, c, bos=False) for c in req.choices]
        return msgspec.convert(entry.native.score_choices(choices, call.request_id), list[Score])

    # -- branches -------------------------------------------------------------------------------------
    # A branch's logits snapshot is a block of the shared region that the native side owns: written on
    # every commit, read in place by the client, freed with the branch.
    @staticmethod
    def _state(entry: _ContextEntry, handle: int, info: dict[str, Any] | None = None) -> p.BranchState:
        d = entry.native.branch_info(handle) if info is None else info
        return p.BranchState(branch=handle, position=d["position"], n_accepted=d["n_accepted"],
                             perplexity=d["perplexity"], sampling_perplexity=d["sampling_perplexity"])

    def _created(self, entry: _ContextEntry, created: tuple[int, int]) -> p.BranchCreated:
        handle, offset = created
        info = entry.native.branch_info(handle)
        return p.BranchCreated(logits_offset=offset, state=self._state(entry, handle, info), parent=info["parent"])

    def _grammar(self, grammar: dict[str, Any] | None) -> dict[str, Any] | None:
        if grammar is None:
            return None
        grammar = dict(grammar)
        schema = grammar.pop("json_schema", None)
        if schema is not None:
            grammar["gbnf"] = str(self.native.json_schema_to_grammar(schema))
        if isinstance(grammar.get("gbnf"), str):
            grammar["gbnf"] = factor_literal_alternations(grammar["gbnf"])
        return grammar

    def _prompt_tokens(self, entry: _ContextEntry, prompt: str | Sequence[int], bos: bool) -> list[int]:
        """Token ids, or text tokenized with special tokens parsed (BOS only for a root's prompt)."""
        if isinstance(prompt, str):
            return self._tokenize(entry.model_id, prompt, bos, True)
        return list(prompt)

    @handles(p.BranchCreate)
    def branch_create(self, req: p.BranchCreate, call: Call) -> p.BranchCreated:
        entry = self._context(req.context)
        spec = self._grammar(req.grammar)
        tokens = self._prompt_tokens(entry, req.prompt, bos=True)
        created = entry.native.branch_create(req.params, spec, call.request_id)
        if tokens:
            try:
                entry.native.prefill([(created[0], tokens)], call.request_id, call.prompt_progress(req.progress))
            except BaseException:
                entry.native.branch_prune(created[0], True)
                raise
        return self._created(entry, created)

    @handles(p.BranchFork)
    def branch_fork(self, req: p.BranchFork, call: Call) -> p.BranchCreated:
        entry = self._context(req.context)
        return self._created(entry, entry.native.branch_fork(req.branch))

    @handles(p.BranchAdopt)
    def branch_adopt(self, req: p.BranchAdopt, call: Call) -> p.BranchCreated:
        entry = self._context(req.context)
        spec = self._grammar(req.grammar)
        return self._created(entry, entry.native.branch_adopt(req.seq, req.params, spec, call.request_id))

    @handles(p.BranchPrune)
    def branch_prune(self, req: p.BranchPrune, call: Call) -> list[int]:
        return self._context(req.context).native.branch_prune(req.branch, req.subtree)

    @handles(p.BranchRetainOnly)
    def branch_retain_only(self, req: p.BranchRetainOnly, call: Call) -> list[int]:
        return self._context(req.context).native.branch_retain_only(req.branch)

    @handles(p.BranchDetach)
    def branch_detach(self, req: p.BranchDetach, call: Call) -> int:
        return self._context(req.context).native.branch_detach(req.branch)

    @handles(p.BranchInfoRequest)
    def branch_info(self, req: p.BranchInfoRequest, call: Call) -> BranchInfo:
        return msgspec.convert(self._context(req.context).native.branch_info(req.branch), BranchInfo)

    @handles(p.BranchSetParams)
    def branch_set_params(self, req: p.BranchSetParams, call: Call) -> None:
        self._context(req.context).native.branch_set_params(req.branch, req.params)

    @handles(p.BranchSetGrammar)
    def branch_set_grammar(self, req: p.BranchSetGrammar, call: Call) -> None:
        self._context(req.context).native.branch_set_grammar(req.branch, self._grammar(req.grammar), call.request_id)

    @handles(p.BranchSetLogitBias)
    def branch_set_logit_bias(self, req: p.BranchSetLogitBias, call: Call) -> None:
        self._context(req.context).native.branch_set_logit_bias(req.branch, req.bias)

    @handles(p.BranchReseed)
    def branch_reseed(self, req: p.BranchReseed, call: Call) -> None:
        self._context(req.context).native.branch_reseed(req.branch, req.seed)

    @handles(p.BranchSetLogits)
    def branch_set_logits(self, req: p.BranchSetLogits, call: Call) -> None:
        entry = self._context(req.context)
        # The client checks too; a request that skipped it must not put NaNs into the sampler.
        row = np.frombuffer(req.logits, dtype=np.float32)
        if np.isnan(row).any() or (row == np.inf).any():
            raise InvalidArgumentError("logits must be finite, or -inf to ban a token; got NaN or +inf")
        entry.native.branch_set_logits(req.branch, req.logits)

    @handles(p.BranchMergeLogits)
    def branch_merge_logits(self, req: p.BranchMergeLogits, call: Call) -> None:
        self._context(req.context).native.branch_merge_logits(req.branch, req.experts, req.alpha)

    @handles(p.Produce)
    def produce(self, req: p.Produce, call: Call) -> list[p.Produced]:
        return list(self._context(req.context).native.produce(req.branches, call.request_id))

    @handles(p.BranchSetLogprobs)
    def branch_set_logprobs(self, req: p.BranchSetLogprobs, call: Call) -> None:
        self._context(req.context).native.branch_set_logprobs(req.branch, req.logprobs)

    @handles(p.BranchSetText)
    def branch_set_text(self, req: p.BranchSetText, call: Call) -> None:
        self._context(req.context).native.branch_set_text(req.branch, req.stop, req.render_special, req.logprobs)

    @handles(p.ProduceText)
    def produce_text(self, req: p.ProduceText, call: Call) -> list[p.TextProduced]:
        return list(self._context(req.context).native.produce_text(req.branches, call.request_id))

    # The decoding calls report the time spent inside llama_decode, so a caller can tell its overhead,
    # and the state of every branch they changed, which the client's handles cache.
    def _decoded(self, entry: _ContextEntry, handles: Sequence[int]) -> p.Decoded:
        return p.Decoded(decode_ms=entry.native.last_decode_ms, states=[self._state(entry, h) for h in handles])

    @handles(p.Commit)
    def commit(self, req: p.Commit, call: Call) -> p.Decoded:
        entry = self._context(req.context)
        entry.native.commit(req.pairs, call.request_id)
        return self._decoded(entry, [h for h, _ in req.pairs])

    @handles(p.Prefill)
    def prefill(self, req: p.Prefill, call: Call) -> p.Decoded:
        entry = self._context(req.context)
        loras = None
        if req.loras is not None:
            # A request's own adapter that was closed meanwhile fails that request (LoraError), not the
            # context as a stale handle would say.
            missing = [h for h, _ in req.loras if h not in self._loras]
            if missing:
                raise LoraError(f"LoRA adapter handle(s) {missing} are not loaded in this worker (closed, or freed "
                                f"with their model)")
            loras = [(self._loras[h].native, float(scale)) for h, scale in req.loras]
        entry.native.prefill([(h, self._prompt_tokens(entry, toks, bos=False)) for h, toks in req.items],
                             call.request_id, call.prompt_progress(req.progress), req.commits, loras)
        return self._decoded(entry, [h for h, _ in req.items] + [h for h, _ in req.commits])

    @handles(p.Step)
    def step(self, req: p.Step, call: Call) -> p.Stepped:
        entry = self._context(req.context)
        produced = list(entry.native.step(req.branches, call.request_id))
        committed = [h for h, (_, _, stop, _) in zip(req.branches, produced, strict=True) if not stop]
        done = self._decoded(entry, committed)
        return p.Stepped(decode_ms=done.decode_ms, states=done.states, produced=produced)

    @handles(p.ClearAndReseed)
    def clear_and_reseed(self, req: p.ClearAndReseed, call: Call) -> p.Decoded:
        entry = self._context(req.context)
        entry.native.clear_and_reseed(req.sinks, req.tail, call.request_id)
        return self._decoded(entry, entry.native.branches())

    # -- raw KV sequences -----------------------------------------------------------------------------
    @handles(p.KvCopy)
    def kv_copy(self, req: p.KvCopy, call: Call) -> None:
        self._context(req.context).native.kv_seq_cp(req.src, req.dst, req.p0, req.p1)

    @handles(p.KvKeep)
    def kv_keep(self, req: p.KvKeep, call: Call) -> None:
        self._context(req.context).native.kv_seq_keep(req.seq)

    @handles(p.KvRemove)
    def kv_remove(self, req: p.KvRemove, call: Call) -> bool:
        return bool(self._context(req.context).native.kv_seq_rm(req.seq, req.p0, req.p1))

    @handles(p.KvPosMin)
    def kv_pos_min(self, req: p.KvPosMin, call: Call) -> int:
        return int(self._context(req.context).native.kv_seq_pos_min(req.seq))

    @handles(p.KvPosMax)
    def kv_pos_max(self, req: p.KvPosMax, call: Call) -> int:
        return int(self._context(req.context).native.kv_seq_pos_max(req.seq))

    @handles(p.KvFree)
    def kv_free(self, req: p.KvFree, call: Call) -> None:
        self._context(req.context).native.free_seq(req.seq)

    @handles(p.KvPressureRequest)
    def kv_pressure(self, req: p.KvPressureRequest, call: Call) -> KVPressure:
        return msgspec.convert(self._context(req.context).native.kv_pressure(), KVPressure)

    # -- lloyal.node's low-level loop and grammar handles ---------------------------------------------
    @handles(p.RawDecode)
    def raw_decode(self, req: p.RawDecode, call: Call) -> float:
        return float(self._context(req.context).native.decode(req.tokens, req.pos, req.seq, call.request_id))

    @handles(p.Sample)
    def sample(self, req: p.Sample, call: Call) -> int:
        native = self._context(req.context).native
        return int(native.sample(req.params, req.grammar or None, call.request_id))

    @handles(p.GrammarNew)
    def grammar_new(self, req: p.GrammarNew, call: Call) -> int:
        entry = self._context(req.context)
        return int(entry.native.grammar_new(self._grammar(req.grammar), call.request_id))

    @handles(p.GrammarClone)
    def grammar_clone(self, req: p.GrammarClone, call: Call) -> int:
        return int(self._context(req.context).native.grammar_clone(req.handle))

    @handles(p.GrammarMask)
    def grammar_mask(self, req: p.GrammarMask, call: Call) -> int:
        return int(self._context(req.context).native.grammar_mask(req.handle, call.request_id))

    @handles(p.GrammarAccept)
    def grammar_accept(self, req: p.GrammarAccept, call: Call) -> None:
        self._context(req.context).native.grammar_accept(req.handle, req.token, call.request_id)

    @handles(p.GrammarFree)
    def grammar_free(self, req: p.GrammarFree, call: Call) -> None:
        self._context(req.context).native.grammar_free(req.handle)

    @handles(p.StateSeqSize)
    def state_seq_size(self, req: p.StateSeqSize, call: Call) -> int:
        return int(self._context(req.context).native.state_seq_size(req.seq))

    @handles(p.StateSeqGet)
    def state_seq_get(self, req: p.StateSeqGet, call: Call) -> bytes:
        data = bytes(self._context(req.context).native.state_seq_get(req.seq))
        if len(data) > MAX_FRAME - 4096:
            raise ContextError(f"the state of sequence {req.seq} is {len(data)} bytes, more than one protocol frame "
                               f"carries ({MAX_FRAME}): save it to a file with kv.save_file instead")
        return data

    def _loaded(self, entry: _ContextEntry, seq: int, tokens: list[int], n_bytes: int) -> p.StateLoaded:
        # A load into a branch's (empty) sequence moves that branch: its handle's cache needs the news.
        owners = [h for h in entry.native.branches() if entry.native.branch_info(h)["seq"] == seq]
        return p.StateLoaded(tokens=tokens, n_bytes=n_bytes, states=[self._state(entry, h) for h in owners])

    @handles(p.StateSeqSet)
    def state_seq_set(self, req: p.StateSeqSet, call: Call) -> p.StateLoaded:
        entry = self._context(req.context)
        n = int(entry.native.state_seq_set(req.seq, req.data))
        return self._loaded(entry, req.seq, [], n)

    @handles(p.StateSeqSaveFile)
    def state_seq_save_file(self, req: p.StateSeqSaveFile, call: Call) -> int:
        entry = self._context(req.context)
        _check_state_path(req.path, reading=False)
        return int(entry.native.state_seq_save_file(req.seq, req.path, req.tokens))

    @handles(p.StateSeqLoadFile)
    def state_seq_load_file(self, req: p.StateSeqLoadFile, call: Call) -> p.StateLoaded:
        entry = self._context(req.context)
        _check_state_path(req.path, reading=True)
        tokens, n = entry.native.state_seq_load_file(req.seq, req.path)
        return self._loaded(entry, req.seq, [int(t) for t in tokens], int(n))

    def close(self) -> None:
        for model in list(self._models):
            self.free_model(p.FreeModel(model=model), Call())
        self.native.set_heartbeat_word(None)



@contextlib.contextmanager
def _keepalive(region: Region) -> Iterator[None]:
    """Beats the heartbeat from a thread while the body runs (the native call releases the GIL). A thread
    per call, not a standing one: a snapshot's zygote must hold no thread but its main one when it forks."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(0.05):
            region.beat()

    thread = threading.Thread(target=beat, daemon=True, name="lloyal-keepalive")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _common_prefix(x: Sequence[int], y: Sequence[int]) -> int:
    n = min(len(x), len(y))
    return next((i for i in range(n) if x[i] != y[i]), n)


def _fill(template: str, query: str, document: str) -> str:
    """template with {query} and {document} replaced in one pass (a query holding "{document}" stays text)."""
    return _PLACEHOLDER.sub(lambda m: query if m.group(0) == "{query}" else document, template)


def _check_gguf_file(path: str, error: type[Exception] = ModelLoadError, what: str = "model") -> None:
    """The cheap checks llama.cpp would otherwise report only as a log line and a null model, and what it
    would never report: a FIFO or a device (links followed) would block or never end its read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise error(f"cannot read {what} file {path}: {exc}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what} path is a directory: {path}")
    kind = not_regular(st.st_mode)
    if kind is not None:
        raise error(f"{what} path is {kind}, not a regular file: {path}")
    try:
        # O_NONBLOCK: a FIFO swapped in since the stat does not wait for a writer, and fstat refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise error(f"cannot read {what} file {path}: {exc}") from exc
    try:
        kind = not_regular(os.fstat(fd).st_mode)
        if kind is not None:
            raise error(f"{what} path is {kind}, not a regular file: {path}")
        magic = os.pread(fd, 4, 0)
    except OSError as exc:
        raise error(f"cannot read {what} file {path}: {exc}") from exc
    finally:
        os.close(fd)
    if magic != _GGUF_MAGIC:
        raise error(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {path}")


def _check_state_path(path: str, reading: bool) -> None:
    """A state file is read or written by native code that would block on a FIFO (or never end on a
    device): only a regular file, or for a write a path that does not exist yet."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: the native side says which
    kind = not_regular(mode)
    if kind is not None:
        raise StateError(f"cannot {'read a state from' if reading else 'write a state to'} {path}: it is {kind}, "
                         "not a regular file")


# context_core.cpp's message when llama.cpp returns no context (its buffers could not be allocated).
_NO_CONTEXT = "failed to create the llama context"


def _memory_cap() -> int | None:
    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    return None if limit == resource.RLIM_INFINITY else int(limit)


def _under_memory_cap(exc: BaseException, error: type[LloyalError], failed_allocation: bool, what: str,
                      advice: str) -> BaseException:
    """A failed allocation as ``error``: under a memory cap, saying which option to raise. Anything else
    (a refused parameter, a bad or missing file) is returned as it is."""
    if not failed_allocation:
        return exc
    message = str(exc) or "out of memory"
    limit = _memory_cap()
    if limit is None:
        return exc if isinstance(exc, error) else error(f"{what}: {message}")
    return error(f"{advice.format(limit=limit)} ({message})")


def _data_in_use() -> int:
    """What RLIMIT_DATA counts now (VmData: heap and private writable mappings), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _context_lower_bound(info: dict[str, Any], params: dict[str, Any]) -> int:
    """Bytes a context surely allocates: the logits of one micro-batch in its compute buffer, its output
    rows and its KV cache at one byte an element (llama.cpp's own buffers are larger)."""
    n_vocab = int(info.get("n_vocab", 0))
    n_ctx = int(params.get("n_ctx") or info.get("n_ctx_train") or 0)
    n_ubatch = min(int(params.get("n_ubatch") or 512), int(params.get("n_batch") or 2048), max(n_ctx, 1))
    n_seq = int(params.get("n_seq_max") or 1)
    n_head = max(int(info.get("n_head", 0)), 1)
    head_dim = int(info.get("n_embd", 0)) // n_head
    kv = n_ctx * int(info.get("n_layer", 0)) * int(info.get("n_head_kv", 0)) * head_dim * 2
    logits = 0 if params.get("embeddings") else n_vocab * 4 * (n_ubatch + n_seq)
    return logits + kv


def _thread_headroom(n_threads: int) -> int:
    """A stack for each compute thread besides the calling one (glibc maps RLIMIT_STACK's size for each,
    and RLIMIT_DATA counts it), and a little room for a decode's own small allocations."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    if stack == resource.RLIM_INFINITY or stack <= 0:
        stack = 8 << 20
    return (max(n_threads, 1) - 1) * int(stack) + (2 << 20)


def _refuse_over_cap(cap: int, need: int, what: str) -> None:
    """ContextError naming the cap when `need` bytes do not fit in what the cap leaves."""
    left = cap - _data_in_use()
    if need > left:
        raise ContextError(
            f"the context does not fit under this worker's memory cap, Pool(memory_limit={cap}) bytes: it {what} "
            f"about {need / (1 << 20):.0f} MiB and {max(left, 0) / (1 << 20):.0f} MiB are left: raise memory_limit "
            f"or lower n_ctx")


def _name_memory_limit(exc: ContextError | MemoryError) -> BaseException:
    """A context that did not fit: under a memory cap, the error says which option to raise."""
    return _under_memory_cap(
        exc, ContextError, not isinstance(exc, ContextError) or _NO_CONTEXT in str(exc), "creating the context",
        "the context does not fit under this worker's memory cap, Pool(memory_limit={limit}) bytes: raise "
        "memory_limit or lower n_ctx")


def _name_memory_limit_load(exc: ModelLoadError | MemoryError) -> BaseException:
    """A model whose buffers could not be allocated under a memory cap says which option to raise."""
    allocation = _memory_cap() is not None and "alloc" in (str(exc) or "out of memory")
    return _under_memory_cap(
        exc, ModelLoadError, not isinstance(exc, ModelLoadError) or allocation,
        "loading the model", "the model does not fit under this worker's memory cap, "
        "Pool(memory_limit={limit}) bytes: raise memory_limit, or keep use_mmap=True")


__all__ = ["HANDLERS", "Call", "Engine", "EventSink", "handles"]
