"""Context: a KV cache in one worker, and everything that runs on one: generate, stream, eval, logits,
interrupt, speculative decoding, scoring, embeddings and rerank, LoRA configuration, whole-context state,
and the two ways to grow on it (branches: ``branches``/``kv``; a conversation: ``chat``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from . import protocol as p
from ._aio import AsyncStream, twin
from ._core import ContextCore, WorkerCore
from ._files import beneath
from ._futures import PromptProgress, check_timeout, events, spread_progress
from ._machine import ContextState, Status
from ._owners import InstanceLike
from ._pieces import PieceStream
from .branches import KV, Branch, BranchStore, GrammarLike
from .errors import (
    BadRequestError,
    InvalidArgumentError,
    StaleHandleError,
    StateError,
)
from .lora import LoraAdapter, LoraOwner, lora_pairs, lora_wire
from .params import (
    RERANK_PROMPT,
    BufferMemory,
    ContextParams,
    EvalResult,
    GenerateParams,
    Grammar,
    Result,
    SamplerParams,
    Score,
    token_ids,
    whole,
    wire_prompt,
)
from .sampler import Sampler
from .session import ChatModel, Session
from .stream import Stream

if TYPE_CHECKING:
    import weakref

    from ._generation import Generation
    from ._process import WorkerProcess

S = TypeVar("S", bound=PieceStream)


@runtime_checkable
class MoveTarget(Protocol):
    """Where a context moves to (an Instance, which checks it can take it: migration.py moves it)."""

    def _take_context(self, ctx: Context) -> None: ...


class ContextInstance(InstanceLike, MoveTarget, Protocol):
    """The worker a context lives in (an Instance): what a user reaches through ``ctx.instance``: a target
    to move another context to, and more models in the same worker (a draft model's, say)."""

    def load_model(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                   vocab_only: bool = False, repack: bool = True, progress: Callable[[float], None] | None = None,
                   timeout: float | None = None) -> ContextOwner: ...
    def drain_contexts(self) -> list[Context]: ...


class ContextOwner(LoraOwner, ChatModel, Protocol):
    """The model a context runs on (a Model, which makes it): what a context and the adapters and sessions
    on it use of it, and what a user reaches through ``ctx.model``: the tokenizer, templates, adapters,
    and more contexts of the same model."""

    @property
    def instance(self) -> ContextInstance: ...
    @property
    def _contexts(self) -> weakref.WeakSet[Context]: ...
    def new_context(self, params: ContextParams | None = None, **overrides: Any) -> Context: ...


class Context:
    """A context (KV cache) in one worker: generate, stream, evaluate, read logits, interrupt; embed and
    rerank in an embedding context; branches (``branches``, a BranchStore) and raw KV sequences (``kv``,
    a KV). ``n_ctx``, ``n_batch``, ``n_ubatch``, ``n_seq_max`` and ``n_threads`` are the values it was
    created with. Calls on one context run in the order they were made; a blocking method returns when
    its request has been served. Once it is closed (or its model is), or its worker died, its methods
    raise StaleHandleError (PoolClosedError once the pool is closed)."""

    def __init__(self, model: ContextOwner, desc: p.ContextCreated, params: ContextParams | None = None, *,
                 pageable: bool = True) -> None:
        self.model = model
        self._params = params or ContextParams()  # what it was created with: it is made so again
        self.n_ctx = desc.n_ctx
        self.n_batch = desc.n_batch
        self.n_ubatch = desc.n_ubatch
        self.n_seq_max = desc.n_seq_max
        self.n_threads = desc.n_threads
        #: An embedding context's pooling ("none", "mean", "cls", "last", "rank"); None: a generation context.
        self.pooling = desc.pooling
        # embed() and rerank() reuse one block of the region per context: a call frees the previous
        # call's rows, so each call holds this from its request until its rows are copied out.
        self._embed_lock = threading.Lock()
        core: WorkerCore = model.instance._core
        state = ContextState(desc.context, desc.interrupt_slot, model, self._params.to_wire(),
                             pageable=pageable and not self._params.embeddings, desc=desc)
        self._link = ContextCore(core, state)
        self.branches = BranchStore(self._link, model.n_vocab)
        self.kv = KV(self._link, self.branches)
        self._logits_reads = 0  # logits() calls: a view shows the row as the one that made it wrote it
        model._contexts.add(self)
        core.step(core.machine.admit, state)

    @property
    def instance(self) -> ContextInstance:
        """The worker the context lives in now (a move changes it)."""
        return self.model.instance

    @property
    def _desc(self) -> p.ContextCreated:
        """What its worker said when it made the context as it is now (a snapshot's fork rebuilds from it)."""
        desc = self._link.state.desc
        assert isinstance(desc, p.ContextCreated)
        return desc

    @property
    def _proc(self) -> WorkerProcess:
        return self._link.proc

    @property
    def _lora(self) -> list[tuple[LoraAdapter, float]]:
        return list(self._link.state.lora)

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
        generation is interrupted and CallTimeoutError raised, its ``result`` the partial Result.

        With Pool(recover=True, checkpoint_tokens=N) it is checkpointed as it goes, as a stream is
        (docs/RELIABILITY.md), and a move_to() meanwhile takes it along to the other worker."""
        check_timeout(timeout)
        return self._link.wait(self.generate_async(prompt, params, append=append, on_piece=on_piece,
                                                   progress=progress, **overrides), timeout, "generate")

    def generate_async(self, /, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                       append: bool = False, on_piece: Callable[[str], None] | None = None,
                       progress: PromptProgress | None = None, **overrides: Any) -> Future[Result]:
        """generate() without waiting: a Future of the Result."""
        params = GenerateParams.of(params, overrides)
        on_event = events(piece=on_piece, prompt_progress=spread_progress(progress))
        if self._checkpoint_every() is None:
            req = self._generate_request(prompt, params, stream=on_piece is not None, append=append,
                                         progress=progress is not None)
            return self._link.call(req, on_event)
        # Checkpointed as a stream is (and paused for a move as a stream is): a Generation, whose
        # segments a timeout or a cancelled agenerate() stops through its stop.
        return self._pausable(prompt, params, append, on_event, progress is not None).future

    def _checkpoint_every(self) -> int | None:
        journal = self._link.journal
        return None if journal is None else journal.checkpoint_tokens

    def _pausable(self, prompt: str | Sequence[int], params: GenerateParams, append: bool,
                  on_event: Callable[[dict[str, Any]], None] | None, progress: bool) -> Generation:
        """A generation that can pause, move and be checkpointed: its pieces come as events, and its
        prompt's progress where it is wanted or checkpoints are taken (which follow it)."""
        every = self._checkpoint_every()
        req = self._generate_request(prompt, params, stream=True, append=append,
                                     progress=progress or every is not None)
        return self._link.generation(req, on_event)

    def stream(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               append: bool = False, progress: PromptProgress | None = None, timeout: float | None = None,
               **overrides: Any) -> Stream:
        """Like generate, but returns at once with a Stream: iterate it for the pieces, then read its
        ``result``. Close it (or use ``with``) to stop early; ``pause()`` and ``resume()`` it from any
        thread, and it goes on in the worker its context moves to (move_to). ``timeout``: seconds the
        whole generation may take (paused time included); past it the stream is interrupted and
        iterating it (or reading ``result``) raises CallTimeoutError."""
        return self._start_stream(Stream(self._link.interrupt_future, timeout), prompt,
                                  GenerateParams.of(params, overrides), append=append, progress=progress)

    def _start_stream(self, s: S, prompt: str | Sequence[int], params: GenerateParams, *, append: bool,
                      progress: PromptProgress | None) -> S:
        on_event = events(piece=s._q.put, prompt_progress=spread_progress(progress))
        if isinstance(s, Stream):  # a blocking stream (a chat turn's too) pauses and moves
            s._start_run(self._link, lambda: self._pausable(prompt, params, append, on_event, progress is not None))
        else:
            req = self._generate_request(prompt, params, stream=True, append=append, progress=progress is not None)
            s._attach(self._link.call(req, on_event))
        return s

    agenerate = twin(generate_async, """generate() for asyncio: the same request, awaited. Cancelling the awaiting task
        (or an ``asyncio.timeout`` around it) interrupts the generation in the worker. ``on_piece`` and
        ``progress`` run on a client thread, as with generate(); astream() hands pieces to the loop.""")

    def astream(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                append: bool = False, progress: PromptProgress | None = None, **overrides: Any) -> AsyncStream:
        """stream() for asyncio (call it inside a running event loop): ``async for piece in
        ctx.astream(...)``, then ``await stream.result()``. Leaving early, ``aclose()`` or cancelling the
        iterating task interrupts the generation."""
        return self._start_stream(AsyncStream(self._link.interrupt_future), prompt,
                                  GenerateParams.of(params, overrides), append=append, progress=progress)

    def chat(self, system: str | None = None, *, template: str | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str = "auto",
             params: GenerateParams | None = None, **defaults: Any) -> Session[Context]:
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

    def generate_with_draft_async(self, /, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                                  draft: str | Context = "ngram", n_draft: int = 8, ngram_min: int = 2,
                                  ngram_max: int = 4, append: bool = False,
                                  on_piece: Callable[[str], None] | None = None,
                                  progress: PromptProgress | None = None, **overrides: Any) -> Future[Result]:
        """generate_with_draft() without waiting: a Future of the Result."""
        if not isinstance(draft, Context) and draft != "ngram":
            raise InvalidArgumentError(f'draft must be "ngram" or a Context, got {draft!r}')
        gen = GenerateParams.of(params, overrides).to_wire()
        on_event = events(piece=on_piece, prompt_progress=spread_progress(progress))

        def request(wire_draft: str | int) -> p.GenerateWithDraft:
            return p.GenerateWithDraft(context=self.handle, prompt=wire_prompt(prompt, self.model.n_vocab), params=gen,
                                       draft=wire_draft, n_draft=whole(n_draft, "n_draft"),
                                       ngram_min=whole(ngram_min, "ngram_min"), ngram_max=whole(ngram_max, "ngram_max"),
                                       stream=on_piece is not None, append=bool(append), progress=progress is not None)

        if not isinstance(draft, Context):
            return self._link.call(request(draft), on_event)
        if draft.closed:
            raise StaleHandleError(f"draft context handle {draft.handle} was closed")
        # The draft stays resident (and in this worker) until the call ends: its own link sees no call.
        draft._link.pin(+1)
        try:
            if draft._link.core is not self._link.core:
                raise InvalidArgumentError("the draft context must live in the same worker (Instance) as the target")
            draft._resident()
            fut = self._link.call(request(draft.handle), on_event, data=draft._link.state)
        except BaseException:
            draft._link.pin(-1)
            raise
        fut.add_done_callback(lambda _: draft._link.pin(-1))
        return fut

    agenerate_with_draft = twin(generate_with_draft_async,
                                """generate_with_draft() for asyncio; cancelling the awaiting task interrupts it.""")

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

    aeval = twin(eval_async, """eval() for asyncio; cancelling the awaiting task interrupts it.""")

    def interrupt(self) -> None:
        """Stops the generation or prompt evaluation running on this context, from any thread, without a
        round trip: it writes the request's id into the context's word in shared memory, which the
        worker checks every token and inside each decode step. A no-op when nothing is running."""
        self._link.interrupt()

    def logits(self, *, copy: bool = False) -> np.ndarray:
        """Logits (n_vocab float32) of the last decoded position. Without copy, a read-only view of the
        context's row in the worker's shared memory, which the next logits() call writes again: the view
        is valid until then (or until the context closes or its worker dies), and reading it afterwards
        raises StaleHandleError instead of showing other logits. Keep a copy (copy=True) to hold on."""
        self._link.pin(+1)  # no page-out frees the row before it is read
        try:
            at = self._link.call(p.Logits(context=self.handle)).result()
            self._logits_reads += 1
            region, incarnation = self._link.region, self._link.incarnation
            if copy:
                row: np.ndarray = region.floats(at.offset, at.count).copy()
                return row
        finally:
            self._link.pin(-1)
        read, link = self._logits_reads, self._link

        def stale() -> str:
            if self._logits_reads != read:
                return "the context's logits() was called again since"
            if link.closed or link.region is not region or not link.proc.alive:
                return "its context was closed, or its worker died"
            if link.incarnation != incarnation:
                return "its context was paged out (Pool(max_resident_contexts=...)) or moved since"
            return ""

        return region.floats(at.offset, at.count, guard=stale)

    # -- lloyal.node's low-level loop: decode at a position, sample, grammar handles ---------------------
    def decode(self, tokens: Sequence[int], pos: int, seq: int = 0) -> float:
        """Decodes tokens at positions pos, pos + 1, ... of KV sequence ``seq`` (lloyal.node's
        ``decode(tokens, pos, seqId)``); the last token's logits become logits() and what sample() draws
        from. ``seq`` is a raw sequence of ``kv``: a free one is leased (as a detached sequence; kv.free
        gives it back), and each call continues it: ``pos`` must be one past its last position
        (InvalidArgumentError otherwise; kv.remove drops positions to decode again). BranchError for a
        branch's sequence; ContextError while the context holds an eval/generate history (reset() it).
        All or nothing: an error or an interrupt leaves the sequence as it was. Returns the ms decoding."""
        return self._link.call(p.RawDecode(context=self.handle, tokens=token_ids(tokens, self.model.n_vocab),
                                           pos=whole(pos, "pos"), seq=whole(seq, "seq"))).result()

    def sample(self, params: SamplerParams | None = None, *, sampler: Sampler | None = None,
               **overrides: Any) -> int:
        """A token drawn from the context's last logits (a decode()'s, else eval's or generate's) by a
        sampler chain of ``params`` (keyword overrides are SamplerParams fields; greedy by default) that
        the context keeps while the params stay the same: its PRNG and penalty windows go on from call
        to call, and each token sampled is accepted into it. ``sampler``: a grammar handle applied first,
        which then accepts the token. GrammarError when no token is allowed."""
        handle = 0
        if sampler is not None:
            if sampler._link is not self._link:
                raise InvalidArgumentError("sampler belongs to another context")
            handle = sampler._live()
        return self._link.call(p.Sample(context=self.handle, params=SamplerParams.of(params, overrides).to_wire(),
                                        grammar=handle)).result()

    def sampler(self, grammar: str | Grammar) -> Sampler:
        """A grammar handle in this context (lloyal.node's createSampler): GBNF text or a Grammar (a JSON
        schema too). GrammarError for a grammar that does not parse."""
        if not isinstance(grammar, (str, Grammar)):
            raise InvalidArgumentError(f"sampler() needs GBNF text or a Grammar, got {type(grammar).__name__}")
        spec = Grammar(gbnf=grammar) if isinstance(grammar, str) else grammar
        h = self._link.call(p.GrammarNew(context=self.handle, grammar=spec.to_wire())).result()
        return Sampler(self._link, h, self.model.n_vocab)

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
        with self._embed_lock, self._pinned():
            at = self._link.call(p.Embed(context=self.handle, inputs=wire, normalize=bool(normalize))).result()
            flat = self._link.region.floats(at.offset, sum(at.rows) * at.width).copy()
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
        pairs = lora_pairs(adapters, self._link.core, "set_lora")
        return self._link.call(p.SetLora(context=self.handle, adapters=lora_wire(pairs)), data=pairs).result()

    @property
    def lora(self) -> list[tuple[LoraAdapter, float]]:
        """The configuration the last successful set_lora gave (``[]`` at first)."""
        return self._lora

    # -- whole-context state ---------------------------------------------------------------------------
    def save_state(self) -> bytes:
        """The context's whole state (KV cache, token history, logits of the last position) as bytes that
        load_state() takes in any context of the same model, in any worker or process. The bytes travel
        through a temporary shared-memory file, never through the pipe. ContextError for a context that
        holds branches or nothing."""
        return self._link.save_state()

    def load_state(self, data: bytes | bytearray | memoryview) -> int:
        """Replaces what the context holds with a saved state; returns its n_past. StateError for bytes
        that are not a state (garbage, truncated, corrupted) or one of another model,
        ContextOverflowError for a state longer than n_ctx: then the context is left as it was. With
        Pool(recover=True) the state is also the context's checkpoint."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadRequestError(f"a state is bytes (from save_state), got {type(data).__name__}")
        return self._link.load_state(bytes(data))

    def checkpoint(self) -> int:
        """With Pool(recover=True): saves the context's state in this process, so that crash recovery
        restores it from here instead of replaying every call since the last one (docs/RELIABILITY.md);
        returns its size in bytes. A checkpoint also makes a context recoverable again after a call that
        cannot be replayed (an interrupted generation, a random seed). ContextError without recover."""
        return self._link.checkpoint()

    def save_state_file(self, path: str | os.PathLike[str]) -> int:
        """save_state() straight into a file, written by the worker (replaced whole: a reader sees the old
        file or the new one); returns its size in bytes. StateError for a path outside the pool's
        ``writable_dirs`` where the worker's sandbox confines its writes (Instance.sandbox)."""
        abspath = os.path.abspath(os.fspath(path))
        proc = self._link.proc
        if self.instance.sandbox.get("writes_scoped"):
            dirs = proc.options.writable_dirs
            # The private directory of whichever worker holds the context when the call runs.
            if not beneath(os.path.dirname(abspath), (*dirs, os.path.realpath(proc.private_dir))):
                raise StateError(f"{abspath} is outside the pool's writable_dirs {list(dirs)}: the worker may "
                                 "not write there (Pool(writable_dirs=...))")
        return self._link.call(p.SaveState(context=self.handle, path=abspath)).result()

    def load_state_file(self, path: str | os.PathLike[str]) -> int:
        """load_state() from a file the worker reads (StateError also for a missing file)."""
        return self._link.call(p.LoadState(context=self.handle, path=os.path.abspath(os.fspath(path)))).result()

    # -- live migration --------------------------------------------------------------------------------
    def move_to(self, instance: MoveTarget) -> None:
        """Moves the context to another worker: its tokens, KV cache, last logits and LoRA configuration
        (the target must have loaded the same model file, and the adapters), and a stream running or
        paused on it, which goes on in the target token for token as if it had not moved (its iterator
        sees a gap of one move; a paused one stays paused). This handle, its streams and ``chat``
        sessions stay valid; ``instance`` and ``model`` name the target afterwards. Calls other threads
        make meanwhile wait and then run in the target. The state travels through shared memory
        (Instance transfer files), never through a pipe.

        InvalidArgumentError for the worker it lives in, or one without its model or adapters;
        PoolClosedError for a closed or dead worker; ContextError for a context with branches or a
        stream sampling with mirostat; StaleHandleError for a closed context. MigrationError when the
        target fails on the way: the context then stays in its worker, whole and serving. If its own
        worker dies before its state is read out, the crash's error is raised (Pool(recover=True)
        restores the context there as for any crash)."""
        if not isinstance(instance, MoveTarget):
            raise BadRequestError(f"a context moves to an Instance, got {type(instance).__name__}")
        instance._take_context(self)

    # -- scoring ---------------------------------------------------------------------------------------
    def score(self, text: str | Sequence[int], *, logprobs: int | None = None, timeout: float | None = None) -> Score:
        """Teacher-forced score of a whole text (text gets the model's BOS; token ids are taken as they
        are): every token after the first is scored against the logits of the tokens before it, so
        n_scored = n_tokens - 1. ``logprobs=N`` (0 to MAX_LOGPROBS) adds Score.logprobs: each scored
        token's log-probability and its N most likely alternatives (a prompt's log-probabilities, as a
        completion's ``echo`` shows them). Like a generate prompt, the text replaces what the context held
        and stays in it afterwards. ValueError for fewer than two tokens, ContextOverflowError past n_ctx."""
        check_timeout(timeout)
        return self._link.wait(self.score_async(text, logprobs=logprobs), timeout, "score")

    def score_async(self, text: str | Sequence[int], *, logprobs: int | None = None) -> Future[Score]:
        """score() without waiting: a Future of the Score."""
        wire = wire_prompt(text, self.model.n_vocab)
        if logprobs is not None:
            GenerateParams(logprobs=logprobs)  # the same bounds and refusal as a generation's
        return self._link.call(p.ScoreText(context=self.handle, text=wire, logprobs=logprobs))

    ascore = twin(score_async, """score() for asyncio; cancelling the awaiting task interrupts it.""")

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

    ascore_choices = twin(score_choices_async,
                          """score_choices() for asyncio; cancelling the awaiting task interrupts it.""")

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

    def _resident(self) -> None:
        """Pages the context in, if it is out (a draft, which its target's call uses without a call of its
        own, pinned meanwhile)."""
        if self._link.state.status is not Status.RESIDENT:
            self._link.call(p.NPast(context=self.handle)).result()

    @contextmanager
    def _pinned(self) -> Iterator[None]:
        """Kept resident for the block: a reply's rows are read from shared memory before a page-out
        could free them."""
        self._link.pin(+1)
        try:
            yield
        finally:
            self._link.pin(-1)

    @property
    def paged(self) -> bool:
        """Whether the context is paged out now (Pool(max_resident_contexts=...)): its state is in a file
        of this process, not in its worker, until its next call pages it in."""
        return self._link.paged

    def _forget(self) -> None:
        """Its model's close freed it in the worker: the handle goes stale here too."""
        self._link.close(freed=True)
        self.branches._forget_all()

    def close(self) -> None:
        """Frees the context's KV cache in the worker; every branch is released and the handle goes
        stale. Blocks until the worker has freed it (after the calls queued before it). Idempotent; a
        dead worker has nothing to free. A stream paused on it ends (interrupted)."""
        if self._link.closed:
            return
        self._link.close()
        self.branches._forget_all()


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

