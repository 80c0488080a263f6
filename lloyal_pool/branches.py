"""Branches: forkable generation state on one context, and the context's raw KV sequences.

    ctx = model.new_context(n_ctx=4096, n_seq_max=8)
    root = ctx.branch(prompt_tokens, SamplerParams(temperature=0.8, seed=1))
    kids = [root.fork(reseed=i) for i in range(1, 5)]
    for _ in range(32):
        ctx.branches.step(kids)           # produce for each, then ONE batched decode for all

A Branch is a handle; its state (a KV sequence, sampler chain, grammar, logit bias, perplexity) lives in
the worker. Its logits snapshot lives in the worker's shared memory, so ``branch.logits`` is a numpy view
read with no copy and no round trip. Everything here is a request to the worker except reading logits
and the metrics computed from them (metrics.py).
"""

from __future__ import annotations

import codecs
import os
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import msgspec
import numpy as np

from . import metrics
from . import protocol as p
from ._aio import twin
from ._core import ContextCore
from ._futures import PromptProgress, events, mapped, running, spread_progress
from .errors import BadRequestError, BranchError, InvalidArgumentError, LloyalError, StaleHandleError
from .lora import LoraAdapter, lora_pairs, lora_wire
from .params import (
    MAX_SEED,
    BranchInfo,
    GenerateParams,
    Grammar,
    KVPressure,
    SamplerParams,
    TokenLogprob,
    logit_bias_pairs,
    token_id,
    token_ids,
    whole,
    wire_prompt,
)

GrammarLike = str | Grammar | None


class Produced(NamedTuple):
    """One sampled token. ``text`` is its piece (bytes of a character split across tokens show as
    U+FFFD here; Branch.iterate() joins them properly). ``is_stop``: an end-of-generation token, or -1
    when the grammar or logit bias allow no token at all; a stop token's ``text`` and ``piece`` are empty,
    since it ends the output and is no part of it (as in generate's text). ``piece``: the token's raw
    bytes, control tokens rendered (what ``text`` decodes). ``logprobs``: after Branch.set_logprobs, the
    token's TokenLogprob (None otherwise, and for a stop)."""

    token: int
    text: str
    is_stop: bool
    piece: bytes = b""  # the raw bytes of the token
    # Branch.set_logprobs: its log-probability and alternatives in the row it was sampled from; None
    # otherwise and for a stop
    logprobs: TokenLogprob | None = None


class StepResult(list[Produced]):
    """What a step produced, one entry per branch, and ``decode_ms``: the time the worker spent inside
    llama_decode (the rest of the call's wall time is sampling, bookkeeping and the round trip)."""

    decode_ms: float = 0.0


def _grammar_wire(grammar: GrammarLike) -> dict[str, object] | None:
    if grammar is None:
        return None
    if isinstance(grammar, str):
        grammar = Grammar(gbnf=grammar)
    return grammar.to_wire()


def _produced(rows: Sequence[p.Produced]) -> list[Produced]:
    # A stop token ends the output and is no part of it, as in generate's text: no text, no piece.
    return [Produced(t, "", True, b"") if stop else
            Produced(t, piece.decode("utf-8", "replace"), False, piece,
                     None if lp is None else msgspec.convert(lp, TokenLogprob))
            for t, piece, stop, lp in rows]


def _prune_quietly(branch: Branch) -> None:
    try:
        branch.prune_subtree()
    except LloyalError:
        pass  # the context or its worker went away meanwhile: nothing is left to free


class Branch:
    """One branch of a generation tree. Create roots with Context.branch(), children with fork().

    ``position``, ``perplexity``, ``sampling_perplexity``, ``n_accepted``, ``parent`` and ``children`` are
    read locally: the worker sends a branch's new state with the reply of every call that changes it.
    ``info()`` asks the worker for everything at once."""

    def __init__(self, store: BranchStore, created: p.BranchCreated) -> None:
        self.store = store
        self.handle = created.state.branch
        self._logits_offset = created.logits_offset
        self._state = created.state
        self._parent = store._get(created.parent)
        self._alive = True
        self._incarnation = store._link.incarnation  # the context made again (a crash): the branch is gone

    def __repr__(self) -> str:
        state = "" if self._alive else " released"
        return f"<Branch {self.handle} context={self.store._link.handle}{state}>"

    # -- plumbing ---------------------------------------------------------------------------------------
    def _live(self) -> int:
        if not self._alive:
            raise StaleHandleError(f"branch {self.handle} was pruned, retained away or detached")
        link = self.store._link
        if link.closed or link.incarnation != self._incarnation or not link.proc.alive:
            raise StaleHandleError(f"branch {self.handle}'s context was closed or its worker is gone")
        return self.handle

    def _call(self, req: p.Request[p.R]) -> p.R:
        return self.store._link.call(req).result()

    @property
    def _ctx(self) -> int:
        return self.store._link.handle

    @property
    def alive(self) -> bool:
        """False once the branch was pruned, detached or dropped by retain_only, or its context was reset
        or closed; then its methods raise StaleHandleError, as they do once its worker died. Does not ask
        the worker."""
        return self._alive and self._incarnation == self.store._link.incarnation

    # -- tree ---------------------------------------------------------------------------------------------
    def fork(self, *, reseed: int | None = None) -> Branch:
        """A child at this branch's position that shares its KV prefix (no tensor copy) and starts with a
        copy of its sampler (PRNG and penalty history), grammar state, logit bias, logits and perplexity.
        Unreseeded siblings sample identical tokens: pass ``reseed`` to make them diverge."""
        child = self.store._register(self._call(p.BranchFork(context=self._ctx, branch=self._live())))
        if reseed is not None:
            child.reseed_sampler(reseed)
        return child

    def prune(self) -> None:
        """Frees this branch and its KV sequence. A branch with live children raises BranchError (use
        prune_subtree)."""
        freed = self._call(p.BranchPrune(context=self._ctx, branch=self._live()))
        self.store._released(freed)

    def prune_subtree(self) -> None:
        """Frees this branch and every descendant."""
        freed = self._call(p.BranchPrune(context=self._ctx, branch=self._live(), subtree=True))
        self.store._released(freed)

    def detach(self) -> int:
        """Releases the handle but keeps its KV sequence, whose id is returned for raw use through
        Context.kv; Context.kv.free(seq) gives it back. Children become roots."""
        seq = self._call(p.BranchDetach(context=self._ctx, branch=self._live()))
        self.store._released([self.handle])
        return seq

    def info(self) -> BranchInfo:
        """Everything the worker knows about this branch (one round trip)."""
        return self._call(p.BranchInfoRequest(context=self._ctx, branch=self._live()))

    @property
    def position(self) -> int:
        """Tokens in the branch's sequence: the next token goes here."""
        self._live()
        return self._state.position

    @property
    def n_accepted(self) -> int:
        """Tokens committed to this branch (a fork starts with its parent's count); prefilled tokens are
        context, not choices, and do not count."""
        self._live()
        return self._state.n_accepted

    @property
    def parent(self) -> Branch | None:
        """The branch this one was forked from, or None for a root (or once the parent is gone)."""
        self._live()
        return self._parent if self._parent is not None and self._parent._alive else None

    @property
    def children(self) -> list[Branch]:
        """Live children, oldest first."""
        self._live()
        return [b for b in self.store if b._parent is self]

    @property
    def is_leaf(self) -> bool:
        """Whether the branch has no live children."""
        return not self.children

    @property
    def perplexity(self) -> float:
        """exp(mean model surprisal) of the committed tokens, each under the logits before it was decoded."""
        self._live()
        return self._state.perplexity

    @property
    def sampling_perplexity(self) -> float:
        """The same over the distribution the sampler drew from (after grammar, bias and truncation)."""
        self._live()
        return self._state.sampling_perplexity

    # -- sampling and decoding ------------------------------------------------------------------------
    def produce(self) -> Produced:
        """Samples the next token from this branch's logits; changes no KV, grammar or perplexity."""
        return self.store.produce([self])[0]

    def commit(self, token: int) -> float:
        """Accepts token (grammar, penalties, perplexity) and decodes it; the logits become the new row.
        Returns the ms spent inside llama_decode."""
        return self.store.commit([(self, token)])

    def prefill(self, tokens: Sequence[int] | str, *, progress: PromptProgress | None = None) -> float:
        """Decodes tokens (or text, no BOS added) into this branch, accepting nothing: context, not choices.
        ``progress(done, total)`` follows a long prefill. Returns the ms spent inside llama_decode."""
        return self.store.prefill([(self, tokens)], progress=progress)

    def step(self) -> Produced:
        """produce(), then commit() unless the token is a stop: one round trip."""
        return self.store.step([self])[0]

    async def acommit(self, token: int) -> float:
        """commit() for asyncio; cancelling the awaiting task interrupts the decode (all or nothing)."""
        return await self.store.acommit([(self, token)])

    async def aprefill(self, tokens: Sequence[int] | str, *, progress: PromptProgress | None = None) -> float:
        """prefill() for asyncio; cancelling the awaiting task interrupts it (all or nothing)."""
        return await self.store.aprefill([(self, tokens)], progress=progress)

    async def astep(self) -> Produced:
        """step() for asyncio; cancelling the awaiting task interrupts its decode (all or nothing)."""
        return (await self.store.astep([self]))[0]

    def iterate(self, max_tokens: int | None = None) -> Iterator[Produced]:
        """produce -> commit -> yield, until a stop token (not committed) or max_tokens. Stop at any point
        (break) and fork: everything yielded is committed. ``text`` joins multi-byte characters."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        n = 0
        while max_tokens is None or n < max_tokens:
            produced = self.step()
            if produced.is_stop:
                return
            n += 1
            yield produced._replace(text=decoder.decode(produced.piece))

    def __iter__(self) -> Iterator[Produced]:
        return self.iterate()

    async def aiterate(self, max_tokens: int | None = None) -> AsyncIterator[Produced]:
        """iterate() for asyncio: ``async for produced in branch.aiterate()``."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        n = 0
        while max_tokens is None or n < max_tokens:
            produced = await self.astep()
            if produced.is_stop:
                return
            n += 1
            yield produced._replace(text=decoder.decode(produced.piece))

    # -- sampler, grammar, bias -----------------------------------------------------------------------
    def set_sampler_params(self, params: SamplerParams | None = None, **overrides: object) -> None:
        """A new sampler chain: its PRNG restarts from params.seed; penalty windows keep their tokens."""
        wire = SamplerParams.of(params, overrides).to_wire()
        self._call(p.BranchSetParams(context=self._ctx, branch=self._live(), params=wire))

    def reseed_sampler(self, seed: int) -> None:
        """Reseeds the final draw (greedy chains have none and are left alone). InvalidArgumentError for a
        seed outside [0, MAX_SEED], as SamplerParams.seed."""
        seed = whole(seed, "seed")
        if not 0 <= seed <= MAX_SEED:
            raise InvalidArgumentError(f"seed must be in [0, {MAX_SEED}], got {seed}")
        self._call(p.BranchReseed(context=self._ctx, branch=self._live(), seed=seed))

    def set_grammar(self, grammar: GrammarLike) -> None:
        """GBNF text, a Grammar (JSON schema, lazy triggers), or None to remove. Invalid grammars raise
        GrammarError now. Forks inherit the grammar and its state. Interruptible (a grammar of thousands
        of alternatives takes seconds to set up): InterruptedByClient, and the branch keeps its grammar."""
        self._call(p.BranchSetGrammar(context=self._ctx, branch=self._live(), grammar=_grammar_wire(grammar)))

    def set_logit_bias(self, bias: Mapping[int, float] | None) -> None:
        """Added to the logits before sampling (-inf bans a token); None or {} clears it."""
        pairs = None if bias is None else logit_bias_pairs(bias, self.store.n_vocab) or None
        self._call(p.BranchSetLogitBias(context=self._ctx, branch=self._live(), bias=pairs))

    def set_logprobs(self, logprobs: int | None) -> None:
        """From now on ``produce``/``step``/``iterate`` report each token's ``Produced.logprobs``: its
        log-probability and the ``logprobs`` (0 to 20) most likely alternatives, the raw model
        distribution as GenerateParams.logprobs reports it; None stops. Forks inherit it."""
        n = -1 if logprobs is None else GenerateParams(logprobs=logprobs).logprobs
        assert n is not None
        self._call(p.BranchSetLogprobs(context=self._ctx, branch=self._live(), logprobs=n))

    def _set_text(self, stop: Sequence[str], render_special: bool, logprobs: int | None = None) -> None:
        # The batcher's: from now on the branch makes its text (and logprobs) in the worker
        # (BranchStore._produce_text).
        self._call(p.BranchSetText(context=self._ctx, branch=self._live(), stop=list(stop),
                                   render_special=bool(render_special), logprobs=-1 if logprobs is None else logprobs))

    def clear_logit_bias(self) -> None:
        """Removes the logit bias: set_logit_bias(None)."""
        self.set_logit_bias(None)

    # -- logits and metrics ---------------------------------------------------------------------------
    @property
    def logits(self) -> np.ndarray:
        """The logits the next token is sampled from (n_vocab float32): a read-only view of shared memory,
        no copy and no round trip. It follows the branch (each commit rewrites it) and is valid while the
        branch lives; copy it to keep it. StaleHandleError once the branch, its context or its model is
        released or its worker gone; a view taken before cannot be revoked and may then show another
        branch's logits, so it must not be read after the release."""
        self._live()
        return self.store._link.region.floats(self._logits_offset, self.store.n_vocab)

    def logits_at(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """The logits of the given token ids (a float32 copy), read locally like ``logits``.
        InvalidTokenError for an id outside [0, n_vocab) (a negative one would count from the end)."""
        return np.array(self.logits[token_ids(tokens, self.store.n_vocab)], dtype=np.float32)

    def set_logits(self, logits: np.ndarray | Sequence[float]) -> None:
        """Replaces the logits the next token is sampled from with ``logits`` (n_vocab floats): steer
        sampling with logits computed here. -inf bans a token (as a grammar or a logit bias of -inf
        does); NaN and +inf, which would turn the distribution into NaNs, raise InvalidArgumentError, as
        does another shape, and the branch keeps its logits."""
        try:
            with np.errstate(over="ignore"):  # a float64 past float32's range becomes inf: refused below
                arr = np.ascontiguousarray(logits, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise BadRequestError(f"logits must be n_vocab floats: {exc}") from None
        if arr.shape != (self.store.n_vocab,):
            raise InvalidArgumentError(f"logits must have shape ({self.store.n_vocab},), got {arr.shape}")
        _check_logits(arr)
        self._call(p.BranchSetLogits(context=self._ctx, branch=self._live(), logits=arr.tobytes()))

    def merge_logits(self, experts: Sequence[Branch], alpha: float) -> None:
        """self.logits += alpha * sum(expert.logits), in the worker (contrastive / DExperts decoding).
        A token that this branch or an expert bans (-inf) stays banned, whatever alpha; a sum that
        overflows float32 is clamped to its largest value. InvalidArgumentError for an alpha that is not
        finite."""
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)):
            raise BadRequestError(f"alpha must be a number, got {type(alpha).__name__}")
        if not np.isfinite(alpha):
            raise InvalidArgumentError(f"alpha must be finite, got {alpha}")
        self._call(p.BranchMergeLogits(context=self._ctx, branch=self._live(),
                                       experts=[self.store._own(e) for e in experts], alpha=float(alpha)))

    def model_entropy(self, base: str = "nats") -> float:
        """metrics.entropy of this branch's logits (in "nats" or "bits"), computed here with no round
        trip: how uncertain the model is about the next token."""
        return metrics.entropy(self.logits, base)

    def model_surprisal(self, token: int, base: str = "nats", logits: np.ndarray | None = None) -> float:
        """metrics.surprisal of token under this branch's logits (or the ``logits`` given, e.g. a copy
        taken before a commit), computed here with no round trip."""
        return metrics.surprisal(self.logits if logits is None else logits, token, base)


def _check_logits(arr: np.ndarray) -> None:
    """NaN or +inf anywhere in a logits row would make the sampler's distribution NaN."""
    if not np.isfinite(arr).all():
        bad = arr[np.isnan(arr) | (arr == np.inf)]
        if bad.size:
            raise InvalidArgumentError(f"logits must be finite, or -inf to ban a token; got {bad.size} value(s) "
                                       f"that are NaN or +inf")


class BranchStore:
    """The branches of one context (``context.branches``) and the operations over many of them."""

    def __init__(self, link: ContextCore, n_vocab: int) -> None:
        self._link = link
        self.n_vocab = n_vocab
        self._branches: dict[int, Branch] = {}  # live handles, creation order
        link.state.holders.add(self)  # while it holds branches the context stays in its worker

    def __iter__(self) -> Iterator[Branch]:
        self._forget_stale()
        return iter(list(self._branches.values()))

    def __len__(self) -> int:
        self._forget_stale()
        return len(self._branches)

    def holds(self) -> bool:
        """Whether it keeps its context in its worker (residency: a branch's state is the worker's)."""
        return any(b._incarnation == self._link.incarnation for b in list(self._branches.values()))

    def _forget_stale(self) -> None:
        """The branches of a worker that is gone (a crash made the context again): released here too."""
        now = self._link.incarnation
        stale = [h for h, b in self._branches.items() if b._incarnation != now]
        if stale:
            self._released(stale)

    # -- registry: what the handles know without asking ------------------------------------------------
    def _register(self, created: p.BranchCreated) -> Branch:
        branch = Branch(self, created)
        self._branches[branch.handle] = branch
        return branch

    def _released(self, handles: Iterable[int]) -> None:
        for h in handles:
            branch = self._branches.pop(int(h), None)
            if branch is not None:
                branch._alive = False

    def _forget_all(self) -> None:
        self._released(list(self._branches))

    def _update(self, states: Iterable[p.BranchState]) -> None:
        for s in states:
            branch = self._branches.get(s.branch)
            if branch is not None:
                branch._state = s

    def _decoded(self, reply: p.Decoded) -> float:
        self._update(reply.states)
        return reply.decode_ms

    def _get(self, handle: int) -> Branch | None:
        return self._branches.get(handle)

    def _own(self, branch: Branch) -> int:
        if not isinstance(branch, Branch):
            raise BadRequestError(f"expected a Branch, got {type(branch).__name__}")
        if branch.store is not self:
            raise BranchError(f"{branch!r} belongs to another context")
        return branch._live()

    # -- creation -------------------------------------------------------------------------------------
    def create(self, prompt: Sequence[int] | str | None = None, params: SamplerParams | None = None, *,
               grammar: GrammarLike = None, progress: PromptProgress | None = None, **overrides: object) -> Branch:
        """A root branch at position 0 with its own sampler (keyword overrides are SamplerParams fields)
        and grammar, prompt prefilled (text gets the model's BOS; ``progress(done, total)`` follows it)."""
        return self.create_async(prompt, params, grammar=grammar, progress=progress, **overrides).result()

    def create_async(self, /, prompt: Sequence[int] | str | None = None, params: SamplerParams | None = None, *,
                     grammar: GrammarLike = None, progress: PromptProgress | None = None,
                     **overrides: object) -> Future[Branch]:
        """create() without waiting: a Future of the Branch."""
        req = p.BranchCreate(context=self._link.handle, params=SamplerParams.of(params, overrides).to_wire(),
                             grammar=_grammar_wire(grammar), prompt=self._wire_prompt(prompt),
                             progress=progress is not None)
        if progress is None:
            return mapped(self._link.call(req), self._register)
        # A progress callback that raises stops the prefill and fails the call with its error. The branch
        # may be made all the same (the prefill ended before the interrupt landed): then it is pruned.
        failed: list[BaseException] = []
        sent: list[Future[p.BranchCreated]] = []

        def guarded(done: int, total: int) -> None:
            if not failed:
                try:
                    progress(done, total)
                except BaseException as exc:
                    failed.append(exc)
                    if sent:
                        self._link.interrupt_future(sent[0])

        out: Future[Branch] = running()

        def created(fut: Future[p.BranchCreated]) -> None:
            exc = fut.exception()
            if failed:
                if exc is None:
                    # Not on this thread (the reader's), which must not wait for a reply.
                    threading.Thread(target=_prune_quietly, args=(self._register(fut.result()),),
                                     daemon=True, name="lloyal-prune-branch").start()
                out.set_exception(failed[0])
            elif exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(self._register(fut.result()))

        sent.append(self._link.call(req, events(prompt_progress=spread_progress(guarded))))
        sent[0].add_done_callback(created)
        return out

    def adopt(self, seq: int, params: SamplerParams | None = None, *, grammar: GrammarLike = None,
              **overrides: object) -> Branch:
        """A root branch over an existing sequence (a detached branch's, or one loaded with kv.load): it
        continues at pos_max + 1. It has no logits until its next prefill or commit."""
        req = p.BranchAdopt(context=self._link.handle, seq=whole(seq, "seq"),
                            params=SamplerParams.of(params, overrides).to_wire(), grammar=_grammar_wire(grammar))
        return self._register(self._link.call(req).result())

    def _wire_prompt(self, prompt: Sequence[int] | str | None) -> str | list[int]:
        # Text is tokenized by the worker, in the same request: no extra round trip.
        if prompt is None:
            return []
        return wire_prompt(prompt, self.n_vocab)

    # -- batched operations ---------------------------------------------------------------------------
    def produce(self, branches: Sequence[Branch]) -> list[Produced]:
        """Samples every branch (one round trip)."""
        req = p.Produce(context=self._link.handle, branches=[self._own(b) for b in branches])
        return _produced(self._link.call(req).result())

    def _produce_text(self, branches: Sequence[Branch]) -> list[p.TextProduced]:
        # The batcher's produce: (token, is_stop, text that became final, text held back, stop string
        # completed, logprobs or None) per branch, of branches that make text (Branch._set_text).
        req = p.ProduceText(context=self._link.handle, branches=[self._own(b) for b in branches])
        return self._link.call(req).result()

    def commit(self, pairs: Iterable[tuple[Branch, int]]) -> float:
        """Commits one token per branch in ONE llama_decode. All or nothing: if the decode fails (KV full:
        DecodeError; interrupt: InterruptedByClient) every branch is exactly as before. Returns the ms
        spent inside llama_decode."""
        return self.commit_async(pairs).result()

    def commit_async(self, pairs: Iterable[tuple[Branch, int]]) -> Future[float]:
        """commit() without waiting: a Future of the ms spent decoding."""
        req = p.Commit(context=self._link.handle, pairs=[(self._own(b), token_id(t, self.n_vocab)) for b, t in pairs])
        return mapped(self._link.call(req), self._decoded)

    def prefill(self, items: Iterable[tuple[Branch, Sequence[int] | str]], *,
                commits: Iterable[tuple[Branch, int]] = (), progress: PromptProgress | None = None,
                lora: Sequence[tuple[LoraAdapter, float]] | None = None) -> float:
        """Decodes a token run into each branch, packed into n_batch chunks. All or nothing.
        ``commits``: (branch, token) pairs committed as commit() does, in the first decode beside the
        items (a running generation's next token and a new prompt in one llama_decode); at most n_batch,
        and a branch appears once in the whole call. ``progress(done, total)`` is called after each
        chunk. ``lora``: (adapter, scale) pairs these decodes run under instead of the context's
        configuration (Context.set_lora's checks; LoraError), so that branches on different adapters
        share one context, decoded in groups; a branch's cells must all come from one configuration,
        which is the caller's to keep. Returns the ms spent inside llama_decode."""
        return self.prefill_async(items, commits=commits, progress=progress, lora=lora).result()

    def prefill_async(self, items: Iterable[tuple[Branch, Sequence[int] | str]], *,
                      commits: Iterable[tuple[Branch, int]] = (), progress: PromptProgress | None = None,
                      lora: Sequence[tuple[LoraAdapter, float]] | None = None) -> Future[float]:
        """prefill() without waiting: a Future of the ms spent decoding."""
        req = p.Prefill(context=self._link.handle, items=[(self._own(b), self._wire_prompt(t)) for b, t in items],
                        progress=progress is not None,
                        commits=[(self._own(b), token_id(t, self.n_vocab)) for b, t in commits],
                        loras=None if lora is None else lora_wire(lora_pairs(lora, self._link.core, "prefill")))
        return mapped(self._link.call(req, events(prompt_progress=spread_progress(progress))), self._decoded)

    def step(self, branches: Sequence[Branch]) -> StepResult:
        """produce for every branch, then one batched commit of those whose token is not a stop."""
        return self.step_async(branches).result()

    def step_async(self, branches: Sequence[Branch]) -> Future[StepResult]:
        """step() without waiting: a Future of the StepResult."""
        req = p.Step(context=self._link.handle, branches=[self._own(b) for b in branches])

        def done(reply: p.Stepped) -> StepResult:
            out = StepResult(_produced(reply.produced))
            out.decode_ms = self._decoded(reply)
            return out

        return mapped(self._link.call(req), done)

    # -- asyncio: the same requests, awaited; cancelling the task interrupts the decode --------------
    acreate = twin(create_async, "create() for asyncio; cancelling the awaiting task interrupts the prompt's prefill.")
    acommit = twin(commit_async, """commit() for asyncio.""")
    aprefill = twin(prefill_async, """prefill() for asyncio.""")
    astep = twin(step_async, """step() for asyncio: every branch advances in one batched decode.""")

    def retain_only(self, winner: Branch) -> None:
        """Keeps winner's KV sequence (one llama_memory_seq_keep) and drops every other branch and
        detached sequence; winner becomes a root."""
        self._released(self._link.call(p.BranchRetainOnly(context=self._link.handle,
                                                          branch=self._own(winner))).result())

    def available(self) -> int:
        """Sequence ids free to lease (to create or fork a branch): one round trip."""
        return self._link.call(p.KvPressureRequest(context=self._link.handle)).result().seqs_free


class KV:
    """Raw operations on the context's KV-cache sequences (``context.kv``). Sequences owned by a branch
    can be read but not written (BranchError): detach the branch first."""

    def __init__(self, link: ContextCore, branches: BranchStore) -> None:
        self._link = link
        self._branches = branches

    def _call(self, req: p.Request[p.R]) -> p.R:
        return self._link.call(req).result()

    @property
    def _ctx(self) -> int:
        return self._link.handle

    def copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """dst gets src's cells in [p0, p1) (p1 -1: to the end); shared, not copied."""
        self._call(p.KvCopy(context=self._ctx, src=whole(src, "src"), dst=whole(dst, "dst"), p0=whole(p0, "p0"),
                            p1=whole(p1, "p1")))

    def keep(self, seq: int) -> None:
        """Removes every sequence but seq from the cache (llama_memory_seq_keep). BranchError while
        branches live (BranchStore.retain_only keeps one branch)."""
        self._call(p.KvKeep(context=self._ctx, seq=whole(seq, "seq")))

    def remove(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        """Removes seq's cells in [p0, p1) (p1 -1: to the end). False when the cache cannot remove that
        part of a sequence (llama_memory_seq_rm), else True."""
        return self._call(p.KvRemove(context=self._ctx, seq=whole(seq, "seq"), p0=whole(p0, "p0"), p1=whole(p1, "p1")))

    def pos_min(self, seq: int) -> int:
        """First position in seq, -1 when it is empty."""
        return self._call(p.KvPosMin(context=self._ctx, seq=whole(seq, "seq")))

    def pos_max(self, seq: int) -> int:
        """Last position in seq, -1 when it is empty."""
        return self._call(p.KvPosMax(context=self._ctx, seq=whole(seq, "seq")))

    def free(self, seq: int) -> None:
        """Removes a detached sequence's cells and returns its id to the lease pool."""
        self._call(p.KvFree(context=self._ctx, seq=whole(seq, "seq")))

    def clear(self) -> None:
        """Empties the whole cache (every branch is released), like Context.reset()."""
        self._call(p.Reset(context=self._ctx))
        self._branches._forget_all()

    def pressure(self) -> KVPressure:
        """How full the cache is: cells used and remaining, sequences leased and free."""
        return self._call(p.KvPressureRequest(context=self._ctx))

    def state_size(self, seq: int) -> int:
        """Bytes that save(seq) would return (llama_state_seq_get_size)."""
        return self._call(p.StateSeqSize(context=self._ctx, seq=whole(seq, "seq")))

    def save(self, seq: int) -> bytes:
        """seq's KV state (llama_state_seq_get_data): that sequence only, never the whole context.
        ContextError for an empty sequence, or a state larger than one protocol frame (use save_file)."""
        return self._call(p.StateSeqGet(context=self._ctx, seq=whole(seq, "seq")))

    def load(self, seq: int, data: bytes) -> int:
        """Loads a state from save() into seq, which must be a detached sequence or the empty sequence of a
        new branch (that branch then continues after it; BranchError otherwise). Returns the bytes read.
        ContextError for a state of another model or one that does not fit."""
        loaded = self._call(p.StateSeqSet(context=self._ctx, seq=whole(seq, "seq"), data=bytes(data)))
        self._branches._update(loaded.states)
        return loaded.n_bytes

    def save_file(self, seq: int, path: str | os.PathLike[str], tokens: Sequence[int] = ()) -> int:
        """Writes seq's KV state to a file on the worker's machine, with ``tokens`` (e.g. the ones it
        holds) stored beside it for load_file to return. Returns the bytes written. ContextError for an
        empty sequence or a file that cannot be written. Unlike save(), not limited by the frame size."""
        return self._call(p.StateSeqSaveFile(context=self._ctx, seq=whole(seq, "seq"),
                                             path=os.path.abspath(os.fspath(path)), tokens=token_ids(tokens)))

    def load_file(self, seq: int, path: str | os.PathLike[str]) -> list[int]:
        """Loads seq from a file written by save_file and returns the tokens saved with it."""
        loaded = self._call(p.StateSeqLoadFile(context=self._ctx, seq=whole(seq, "seq"),
                                               path=os.path.abspath(os.fspath(path))))
        self._branches._update(loaded.states)
        return loaded.tokens


__all__ = ["KV", "Branch", "BranchInfo", "BranchStore", "KVPressure", "Produced", "StepResult"]
