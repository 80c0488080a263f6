"""Continuous batching: many independent generations on one context, one llama_decode per step for all.

    instance.generate(...) ─┐
    instance.stream(...)  ──┼─▶ Batcher (one per model, on a client thread)
    pool.generate(...)    ──┘      │  admit: a free slot (its KV sequence), the cached prefix kept
                                   │  sample: every generating request, one token each (no decode)
                                   └─ decode: those tokens and a chunk of new prompts, one llama_decode

Each request gets a *slot*: one of the context's n_seq_max KV sequences, held between requests as a
detached sequence, so a request whose prompt starts like what a slot last held reuses that prefix
when it is ``AFFINITY_TOKENS`` (16, routing.py) or more (the slot chosen is the free one sharing the
longest prefix). New prompts go in ``chunk`` tokens a step, in the same decode as the running requests'
tokens, while more requests generate than wait for their prompt; all at once otherwise. In its slot a request is a root
branch (branches.py): its own sampler chain, seed, grammar and logit bias. The loop drives the branches
with the batched calls the Branch API already has (produce, then prefill with commits) over the
context's link, one round trip each, which costs well under a millisecond against a decode of tens of
milliseconds.

When the worker dies, its requests go to the model's next batcher (a live worker's with the same model,
or the replacement's with Pool(recover=True)): from the start, the text its caller had not given again;
those that had produced tokens only where they sample deterministically (greedy, or a fixed seed); the
others fail with WorkerCrashedError.

A request's text is made in the worker by the code generate uses (native/text_assembly.hpp), on its
branch: control tokens and markers are left out unless render_special, stop strings are matched across
tokens on the bytes, and text that could still become a stop string or is an incomplete UTF-8 sequence
is held back from the stream until it is known. So a request's Result is what Context.generate returns
for the same prompt and params (at greedy the same tokens, within the batch invariance docs/BRANCHES.md
describes), except that repetition penalties see only the generated tokens, not the prompt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from ._futures import running
from ._journal import MAX_ATTEMPTS, deterministic
from .branches import Branch
from .context import ContextOwner
from .errors import (
    ContextOverflowError,
    InvalidArgumentError,
    LloyalError,
    LoraError,
    PoolClosedError,
    StaleHandleError,
    WorkerCrashedError,
    WorkerError,
)
from .params import (
    MAX_SEED,
    ContextParams,
    GenerateParams,
    Result,
    SamplerParams,
    StopReason,
    TokenLogprob,
    whole,
    wire_prompt,
)
from .routing import AFFINITY_TOKENS
from .scheduler import Decode, Job, Placement, Scheduler

if TYPE_CHECKING:
    from .context import Context
    from .lora import LoraAdapter

_log = logging.getLogger("lloyal_pool.batching")
T = TypeVar("T")
_SAMPLER_FIELDS = tuple(f.name for f in fields(SamplerParams))
#: Seconds an idle batcher waits after the first request arrives before admitting, so that a burst is
#: admitted as one: a fraction of one prompt's prefill.
ADMIT_WINDOW = 0.005
# Errors that mean the batcher's context is gone (its worker died, its model or the pool was closed): the
# batcher stops and every request it holds gets the error. Any other error is one request's own.
_GONE = (WorkerError, StaleHandleError, PoolClosedError)


class _Output:
    """One request's text as its branch makes it in the worker, as generate makes it (native
    text_assembly: stop strings, UTF-8 hold-back, control tokens): what became final goes to on_piece at
    once; what is held back is final only when the request ends there. ``given``: what the caller was
    given already (by an attempt on a worker that died): made again, not given again; ``diverged`` once
    the text made again differs from it (a near-tie that another batch broke the other way)."""

    def __init__(self, on_piece: Callable[[str], None] | None, given: bytes = b"") -> None:
        self._on_piece = on_piece
        self.text = bytearray()
        self.held = b""
        self.tokens: list[int] = []
        self.callback_error: BaseException | None = None
        self._given = given
        self.diverged = False

    def push(self, token: int, final: bytes, held: bytes) -> None:
        """A sampled token (committed, or the one that completed a stop string), with its text."""
        self.tokens.append(token)
        self._emit(final)
        self.held = held

    def _emit(self, chunk: bytes) -> None:
        if not chunk:
            return
        at = len(self.text)
        self.text += chunk
        if at < len(self._given):  # given before: not again, but it must be what was given
            cut = min(len(self._given) - at, len(chunk))
            if chunk[:cut] != self._given[at:at + cut]:
                self.diverged = True
            chunk = chunk[cut:]
            if not chunk:
                return
        if self._on_piece is not None and self.callback_error is None:
            try:
                self._on_piece(chunk.decode("utf-8", "replace"))
            except BaseException as exc:  # the caller's, when the request ends
                self.callback_error = exc

    def finish(self) -> str:
        self._emit(self.held)
        self.held = b""
        return self.text.decode("utf-8", "replace")


@dataclass(eq=False, kw_only=True)
class _Request(Job):
    """A job and what the loop keeps for it: its parameters, text, future and branch."""

    params: GenerateParams
    output: _Output
    future: Future[Result]
    branch: Branch | None = None
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    wake: threading.Event | None = None  # the loop of the batcher that holds it
    logprobs: list[TokenLogprob] | None = None  # params.logprobs: one per token handed out
    lora: list[tuple[LoraAdapter, float]] | None = None  # params.lora resolved; None: no adapter
    again: _Request | None = None  # the request that goes on with it on another batcher (its worker died)
    attempts: int = 1

    def cancel(self) -> None:
        self.cancelled = True
        if self.wake is not None:
            self.wake.set()
        if self.again is not None:
            self.again.cancel()

    def handle(self) -> BatchRequest:
        # The list only grows, on the loop's thread; a copy read on another thread is a prefix of it.
        return BatchRequest(self.future, self.cancel, lambda: list(self._latest().logprobs or ()))

    def _latest(self) -> _Request:
        req = self
        while req.again is not None:
            req = req.again
        return req


class BatchRequest:
    """A handle on one independent request (in a Batcher, or on a RayPool's actor): its ``future`` (of
    the Result) and ``interrupt()``."""

    def __init__(self, future: Future[Result], interrupt: Callable[[], None],
                 logprobs: Callable[[], list[TokenLogprob]] | None = None) -> None:
        self.future = future
        self._interrupt = interrupt
        self._logprobs = logprobs

    def logprobs_so_far(self) -> list[TokenLogprob]:
        """While it runs, the log-probabilities (GenerateParams.logprobs) of the tokens whose pieces were
        handed out so far, each before its piece reaches ``on_piece`` (a streaming server sends them with
        the pieces); [] when it asked for none, or where they arrive only with the Result (a RayPool)."""
        return [] if self._logprobs is None else self._logprobs()

    def interrupt(self) -> None:
        """Ends the request at the next step (its Result says ``interrupted``); a no-op once it ended.
        Any thread may call."""
        self._interrupt()


class BatcherOwner(ContextOwner, Protocol):
    """The model a batcher runs on (a Model, which makes it: Model.batcher): the context it batches on, the
    batcher that takes its requests when its worker dies, and what a user reaches through ``batcher.model``."""

    def _new_context(self, params: ContextParams, *, pageable: bool) -> Context: ...
    def _successor_batcher(self, dead: Batcher) -> Batcher | None: ...
    def batcher(self, *, slots: int | None = None, n_ctx_slot: int | None = None, chunk: int | None = None,
                n_threads: int | None = None, deterministic: bool | None = None,
                preempt_slots: int | None = None) -> Batcher: ...


class Batcher:
    """Continuous batching of independent generations on one context of ``slots`` sequences of a model
    (see the module's docstring). ``n_ctx_slot`` tokens are each request's room (prompt and generated
    tokens: the context has slots x n_ctx_slot cells); ``chunk`` is the most prompt tokens one
    iteration prefills, all new requests together, between two steps of the running ones.

    ``deterministic=True`` makes a request's result independent of the other requests in the batch: its
    context is batch-invariant (ContextParams.batch_invariant: ggml's reference CPU kernels, flash
    attention), so a greedy request gives the tokens it gives alone on such a batcher, bit for bit. It
    needs a model loaded with ``repack=False`` on a CPU worker (ContextError otherwise) and costs
    throughput (bench/bench_deterministic.py).

    ``preempt_slots``: that many slots more, for preemption. A request that finds every slot busy takes
    one when it outranks a running request (a lower GenerateParams.priority, or an equal one that came
    first), and the lowest-ranked running request pauses: it keeps its slot, KV cache, sampler and text,
    is neither sampled nor decoded, and goes on exactly where it stopped once a request ends (at most
    ``slots`` requests run at once; ``paused`` counts the others). 0 (default): a request waits for a
    slot. Each costs a slot's cells (n_ctx_slot) of memory.

    Made by Model.batcher(); Instance.generate/stream and Pool.generate/stream use the default one."""

    def __init__(self, model: BatcherOwner, *, slots: int = 8, n_ctx_slot: int = 2048, chunk: int = 128,
                 n_threads: int | None = None, deterministic: bool = False, preempt_slots: int = 0) -> None:
        slots = whole(slots, "slots")
        n_ctx_slot = whole(n_ctx_slot, "n_ctx_slot")
        chunk = whole(chunk, "chunk")
        preempt_slots = whole(preempt_slots, "preempt_slots")
        if slots < 1 or n_ctx_slot < 8 or chunk < 1 or preempt_slots < 0:
            raise InvalidArgumentError(f"a batcher needs slots >= 1, n_ctx_slot >= 8, chunk >= 1 and "
                                       f"preempt_slots >= 0, got slots={slots}, n_ctx_slot={n_ctx_slot}, "
                                       f"chunk={chunk}, preempt_slots={preempt_slots}")
        self.model = model
        self.n_threads = n_threads
        self.slots = slots
        self.preempt_slots = preempt_slots
        self.n_ctx_slot = n_ctx_slot
        self.chunk = chunk
        self._eog = list(model.info.eog_tokens)
        self.deterministic = bool(deterministic)
        seqs = slots + preempt_slots
        self.context: Context = model._new_context(ContextParams(
            n_ctx=seqs * n_ctx_slot, n_seq_max=seqs, n_batch=max(512, chunk, seqs), n_threads=n_threads,
            batch_invariant=self.deterministic), pageable=False)
        self._incarnation = self.context._link.incarnation  # a crash makes its context again, branches gone
        # A deterministic context keeps each slot in a cache stream of its own: nothing to copy between them.
        self._plan = Scheduler([self.context.branches.create().detach() for _ in range(seqs)], n_ctx_slot, chunk,
                               share=not self.deterministic, lanes=slots)
        self._lock = threading.Lock()  # the scheduler's queue and slots, which callers' threads read
        self._wake = threading.Event()
        self._closed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lloyal-batcher", daemon=True)
        self._thread.start()

    @property
    def options(self) -> dict[str, Any]:
        """The options it was made with (Model.batcher's keywords)."""
        return {"slots": self.slots, "n_ctx_slot": self.n_ctx_slot, "chunk": self.chunk, "n_threads": self.n_threads,
                "deterministic": self.deterministic, "preempt_slots": self.preempt_slots}

    def __repr__(self) -> str:
        return f"<Batcher slots={self.slots} n_ctx_slot={self.n_ctx_slot} model={self.model!r}>"

    # -- the caller's side -------------------------------------------------------------------------------
    def tokens(self, prompt: str | Sequence[int]) -> list[int]:
        """prompt as the token ids a request decodes: text gets the model's BOS, as generate's does."""
        wire = wire_prompt(prompt, self.model.n_vocab)
        if not wire:
            raise ValueError("empty prompt: a batched request starts from a prompt of its own")
        if not isinstance(wire, str):
            return wire
        tokens = self.model.tokenize(wire, add_special=True, parse_special=True)
        bos = self.model.info.bos
        if len(tokens) >= 2 and bos >= 0 and tokens[0] == tokens[1] == bos:
            tokens = tokens[1:]  # a template that writes the BOS itself: one, not two
        return tokens

    def submit(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               on_piece: Callable[[str], None] | None = None, **overrides: Any) -> BatchRequest:
        """Queues a generation; it starts when a slot is free. ``prompt`` is text (the model's BOS is
        added, as generate does) or token ids."""
        gen = GenerateParams.of(params, overrides)
        req = self._request(self.tokens(prompt), gen, on_piece)
        self._enqueue([req])
        return req.handle()

    def submit_many(self, prompt: str | Sequence[int], params: GenerateParams | None = None, n: int = 1, *,
                    on_piece: Callable[[int, str], None] | None = None, **overrides: Any) -> list[BatchRequest]:
        """``n`` choices of one prompt (OpenAI's ``n``), queued together: the prompt is decoded once and
        its cells shared with the other choices' slots (Scheduler.admit). Choice i draws with the seed
        choice_params gives it, so choices differ at temperature > 0 and the same call replays them.
        ``on_piece(i, piece)`` gets choice i's pieces. InvalidArgumentError when n is not in [1, slots]."""
        gen = GenerateParams.of(params, overrides)
        n = whole(n, "n")
        if not 1 <= n <= self.slots:
            raise InvalidArgumentError(f"n={n} choices need as many slots; this batcher has {self.slots}")
        if on_piece is not None and not callable(on_piece):
            raise InvalidArgumentError(f"on_piece must be callable, got {type(on_piece).__name__}")
        tokens = self.tokens(prompt)
        reqs = [self._request(list(tokens), choice_params(gen, i),
                              None if on_piece is None else _choice_pieces(on_piece, i)) for i in range(n)]
        self._enqueue(reqs)
        return [r.handle() for r in reqs]

    def _request(self, tokens: list[int], gen: GenerateParams, on_piece: Callable[[str], None] | None, *,
                 given: bytes = b"") -> _Request:
        if len(tokens) >= self.n_ctx_slot:
            raise ContextOverflowError(f"the prompt has {len(tokens)} tokens; a batched request has room for "
                                       f"{self.n_ctx_slot} (n_ctx_slot), generated tokens included")
        if on_piece is not None and not callable(on_piece):
            raise InvalidArgumentError(f"on_piece must be callable, got {type(on_piece).__name__}")
        lora = [(self.model.lora(name), float(scale)) for name, scale in gen.lora.items() if scale != 0] or None
        # Requests under one configuration share decodes and cells: their group is that configuration.
        group = () if lora is None else tuple(sorted((a._handle, s) for a, s in lora))
        return _Request(tokens, gen.n_predict, priority=gen.priority, group=group, params=gen,
                        output=_Output(on_piece, given), future=running(), lora=lora)

    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 on_piece: Callable[[str], None] | None = None, **overrides: Any) -> Result:
        """submit() and wait for the Result."""
        return self.submit(prompt, params, on_piece=on_piece, **overrides).future.result()

    def close(self, error: LloyalError | None = None, *, wait: bool = True) -> None:
        """Stops the loop and closes the context; requests not ended yet raise ``error`` (default:
        StaleHandleError saying the batcher was closed). ``wait``: until the loop has ended. Idempotent."""
        with self._lock:
            if self._closed is None:
                self._closed = error or StaleHandleError("the batcher was closed")
        self._wake.set()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def closed(self) -> bool:
        """Whether the batcher stopped (closed, or its worker died) or its context is gone (crash
        recovery does not restore a batcher's context): a model's next batcher() makes a new one."""
        return (self._closed is not None or self.context.closed
                or self.context._link.incarnation != self._incarnation)

    def affinity(self, prompt: Sequence[int]) -> int:
        """The longest prefix of prompt a free slot holds (0 when no slot is free): what a request would
        not have to decode again here."""
        return self._plan.affinity(prompt)

    @property
    def load(self) -> int:
        """Requests in slots or waiting for one (what the router balances)."""
        return self.active + self.queued

    @property
    def active(self) -> int:
        """Requests in slots now."""
        return len(self._plan.running())

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._plan.waiting)

    @property
    def paused(self) -> int:
        """Requests in slots paused for higher-ranked ones (preempt_slots)."""
        return len(self._plan.paused())

    def _closed_error(self) -> BaseException:
        err = self._closed
        assert err is not None
        return err if isinstance(err, LloyalError) else StaleHandleError(f"the batcher stopped: {err!r}")

    # -- the loop ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.wait()
                # Woken from idle: requests that arrive together (a burst of clients) are admitted
                # together, so their prompts share one prefill instead of the first going alone.
                time.sleep(ADMIT_WINDOW)
                self._wake.clear()
                if self._closed is not None:
                    break
                self._iterate_while_busy()
        except BaseException as exc:  # the worker died, or a bug: every request learns why
            _log.debug("batcher loop ended: %r", exc)
            with self._lock:
                if self._closed is None:
                    self._closed = exc
        if isinstance(self._closed, WorkerError):
            self._hand_over()
        self._fail_all(self._closed_error())
        try:
            if not self.context.closed:
                self.context.close()
        except LloyalError:
            pass

    def _iterate_while_busy(self) -> None:
        while self._closed is None:
            self._admit()
            step = self._plan.step()
            for req in step.interrupted:
                self._finish(_req(req), StopReason.INTERRUPTED)
            if step.idle:
                return
            # Sample (no decode) and hand the pieces out first: a token reaches its client a decode
            # sooner than if it were sent after its own decode, and a request that ends on it spends no
            # decode on it. Then ONE decode takes the tokens of the requests that go on and the next part
            # of the new prompts, as llama-server's batches do: a running request waits one decode per
            # token whether or not a prompt is coming in.
            going = self._sample([_req(j) for j in step.sample]) if step.sample else []
            decode = self._plan.decode(step, going)
            if decode is not None:
                self._decode(decode)

    def _admit(self) -> None:
        with self._lock:
            for req in self._plan.withdraw_cancelled():  # interrupted before it had a slot
                _req(req).future.set_result(self._result(_req(req), StopReason.INTERRUPTED, ""))
            placements = self._plan.admit()
        for placement in placements:
            req = _req(placement.job)
            try:
                self._place(req, placement)
            except LloyalError as exc:  # this request's own fault (its grammar, say): the others go on
                if isinstance(exc, _GONE):
                    raise
                self._release(req)
                req.future.set_exception(exc)

    def _place(self, req: _Request, placement: Placement) -> None:
        ctx, seq, keep, source = self.context, placement.slot.seq, placement.keep, placement.source
        if source is not None:
            ctx.kv.remove(seq, 0, -1)
            ctx.kv.copy(source.seq, seq, 0, keep)
        elif keep < len(placement.slot.tokens) and not ctx.kv.remove(seq, keep, -1):
            keep = 0
            ctx.kv.remove(seq, 0, -1)
        self._plan.placed(placement, keep)
        gen = req.params
        sampler = SamplerParams(**{name: getattr(gen, name) for name in _SAMPLER_FIELDS})
        branch = ctx.branches.adopt(seq, sampler, grammar=gen.grammar or None)
        req.branch = branch
        branch._set_text(gen.stop, gen.render_special, gen.logprobs)
        req.logprobs = None if gen.logprobs is None else []
        bias = dict(gen.logit_bias)
        if gen.ignore_eos:
            bias.update({t: float("-inf") for t in self._eog})
        if bias:
            branch.set_logit_bias(bias)

    def _batched(self, reqs: Sequence[_Request], call: Callable[[], T]) -> T | None:
        """call(), one request to the worker on behalf of reqs. An error of theirs (a decode that
        failed) fails them and gives None; one that means the context is gone goes on to the loop."""
        try:
            return call()
        except LloyalError as exc:
            if isinstance(exc, _GONE):
                raise
            for req in reqs:
                self._fail(req, exc)
            return None

    def _decode(self, decode: Decode) -> None:
        """One prefill call: the going requests' tokens committed in its first decode, beside the next
        parts of the prompts still to prefill."""
        reqs = [_req(j) for j in decode.jobs]
        closed = [a for a, _ in reqs[0].lora or () if a.closed]
        if closed:  # the group's own fault: its requests fail, the batcher goes on
            for req in reqs:
                self._fail(req, LoraError(f"the LoRA adapter {closed[0].path} was closed while the request ran"))
            return
        ms = self._batched(reqs, lambda: self.context.branches.prefill(
            [(b, part) for j, part in decode.parts if (b := _req(j).branch) is not None],
            commits=[(b, token) for j, token in decode.commits if (b := _req(j).branch) is not None],
            lora=reqs[0].lora))  # one group: one configuration
        if ms is None:
            return
        self._plan.decoded(decode)
        for job, _ in decode.parts:
            _req(job).prompt_ms += ms
        for job, _ in decode.commits:
            _req(job).decode_ms += ms

    def _sample(self, reqs: list[_Request]) -> list[tuple[Job, int]]:
        """Samples every generating request and hands its piece out; the requests that go on, with
        their tokens (to commit). A request that ends here is finished."""
        produced = self._batched(reqs, lambda: self.context.branches._produce_text(
            [r.branch for r in reqs if r.branch is not None]))
        if produced is None:
            return []
        going: list[tuple[Job, int]] = []
        for req, (token, is_stop, final, held, stop_string, logprobs) in zip(reqs, produced, strict=True):
            if not is_stop:
                if req.logprobs is not None and logprobs is not None:  # before its piece: logprobs_so_far
                    req.logprobs.append(msgspec.convert(logprobs, TokenLogprob))
                req.output.push(token, final, held)
            reason = self._plan.sampled(req, token, eog=is_stop,
                                        stop=stop_string or req.output.callback_error is not None
                                        or req.output.diverged)
            if req.output.diverged:
                self._fail(req, WorkerCrashedError(
                    f"the request's worker died, and sent again here it wrote other text than its caller had "
                    f"been given (a near-tie this batch broke the other way, after {len(req.output.tokens)} "
                    "tokens): ended here rather than streamed on inconsistently"))
            elif reason is None:
                going.append((req, token))
            else:
                self._finish(req, reason)
        return going

    # -- ending a request --------------------------------------------------------------------------------
    def _result(self, req: _Request, reason: StopReason, text: str) -> Result:
        return Result(text=text, tokens=list(req.output.tokens), n_prompt=len(req.prompt), n_decoded=req.n_decoded,
                      n_cached=req.n_cached, stop_reason=reason, prompt_ms=req.prompt_ms, decode_ms=req.decode_ms,
                      logprobs=None if req.logprobs is None else list(req.logprobs))

    def _finish(self, req: _Request, reason: StopReason) -> None:
        text = req.output.finish()
        self._release(req)
        if req.output.callback_error is not None:
            req.future.set_exception(req.output.callback_error)
        else:
            req.future.set_result(self._result(req, reason, text))

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._release(req)
        if not req.future.done():
            req.future.set_exception(exc)

    def _release(self, req: _Request) -> None:
        branch, req.branch = req.branch, None
        kept = True
        try:
            if req.slot is not None and branch is not None and branch.alive:
                branch.detach()  # the sequence keeps its cells: the next prompt may start the same way
        except LloyalError:
            kept = False
        with self._lock:
            self._plan.release(req, cells_kept=kept)

    def _hand_over(self) -> None:
        """The worker died: every request goes on in the model's next batcher (a live worker's with the
        same model, or crash recovery's replacement): one that had not produced a token from the start;
        one that had, and samples deterministically (greedy, or a fixed seed), from the start too, its
        caller given only the text beyond what it had (within batch invariance: the tokens a batch of
        other requests gives). The others fail with the death, as they do without a successor."""
        with self._lock:
            gone = [_req(j) for j in self._plan.take_all()]
        gone = [r for r in gone if not r.future.done()]
        if not gone:
            return
        try:
            successor = self.model._successor_batcher(self)
        except LloyalError:
            successor = None
        for req in gone:
            replayable = req.n_decoded == 0 or (deterministic(req.params.to_wire()) and req.attempts < MAX_ATTEMPTS)
            if successor is None or successor is self or not replayable or req.cancelled:
                req.future.set_exception(self._closed_error())
                continue
            try:
                again = successor._request(list(req.prompt), req.params, req.output._on_piece,
                                           given=bytes(req.output.text))
            except LloyalError as exc:
                req.future.set_exception(exc)
                continue
            again.future, again.attempts = req.future, req.attempts + 1
            req.again, req.branch = again, None
            try:
                successor._enqueue([again])
            except LloyalError as exc:
                req.future.set_exception(exc)

    def _enqueue(self, reqs: Sequence[_Request]) -> None:
        # Under one lock: choices of one prompt reach the queue together, so the first one's prefill is
        # what the others copy.
        with self._lock:
            if self._closed is not None:
                raise self._closed_error()
            for req in reqs:
                req.wake = self._wake
                self._plan.submit(req)
        self._wake.set()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            gone = [_req(j) for j in self._plan.take_all()]
        for req in gone:
            if not req.future.done():
                req.future.set_exception(exc)
            req.branch = None


def choice_params(gen: GenerateParams, i: int) -> GenerateParams:
    """The params of choice ``i`` of a request for several (n, best_of): seed + i, wrapping past MAX_SEED."""
    return gen if i == 0 else replace(gen, seed=(gen.seed + i) % (MAX_SEED + 1))


def _choice_pieces(on_piece: Callable[[int, str], None], i: int) -> Callable[[str], None]:
    return lambda piece: on_piece(i, piece)


def ranked_params(gen: GenerateParams) -> GenerateParams:
    """gen as best_of's candidates run: with their tokens' log-probabilities, which best_choices ranks by."""
    return gen if gen.logprobs is not None else replace(gen, logprobs=0)


def best_choices(results: Sequence[Result], n: int, *, keep_logprobs: bool = True) -> list[Result]:
    """The ``n`` results whose tokens have the highest mean log-probability (OpenAI's ``best_of``: "the
    highest log probability per token"), best first. Each needs its logprobs (GenerateParams.logprobs=0
    or more: ranked_params); one without tokens ranks last. ``keep_logprobs`` False: returned without
    them (the caller did not ask for them)."""
    def mean(r: Result) -> float:
        if r.logprobs is None:
            raise InvalidArgumentError("best_choices ranks by log-probability: generate with logprobs=0 or more")
        return sum(t.logprob for t in r.logprobs) / len(r.logprobs) if r.logprobs else float("-inf")

    best = sorted(results, key=mean, reverse=True)[:n]
    return best if keep_logprobs else [msgspec.structs.replace(r, logprobs=None) for r in best]


def _req(job: Job) -> _Request:
    """A scheduler's job back as the request the batcher gave it (every job it holds is one)."""
    assert isinstance(job, _Request)
    return job


__all__ = ["AFFINITY_TOKENS", "BatchRequest", "Batcher", "best_choices", "choice_params",
           "ranked_params"]
