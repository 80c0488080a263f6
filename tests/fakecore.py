"""A fake worker and a fake driver for the pure lifecycle machine (lloyal_pool._machine.CoreMachine): no
process, no thread, no model. The worker keeps a toy state per context (its tokens, a paused generation)
and runs requests one at a time, a generation one token per step; the driver carries the machine's
actions out as _core.WorkerCore does, its jobs (transfers, page-outs and -ins, recoveries) as directives
the worker runs in pipe order. tests/unit/test_machine.py drives both with random interleavings."""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec

from lloyal_pool import protocol as p
from lloyal_pool._generation import Generation
from lloyal_pool._journal import PendingState
from lloyal_pool._machine import (
    CallRec,
    ClosePage,
    ContextState,
    CoreMachine,
    Deliver,
    Interrupt,
    Kind,
    Notify,
    RunJob,
    Settle,
    Status,
)
from lloyal_pool.errors import ContextError, WorkerCrashedError
from lloyal_pool.params import MAX_SEED, EvalResult, Result, StopReason

_ids = itertools.count(1)
DROPPED: set[int] = set()
"""The origins of paused generations that another call on their context dropped (in any fake worker): a
Resume of one is refused, rightly."""


def next_token(tokens: list[int]) -> int:
    """What the toy model generates after ``tokens``: a function of them (greedy, or a fixed seed)."""
    return 100 + (sum(tokens) * 7 + len(tokens)) % 50


@dataclass
class FakeContext:
    tokens: list[int] = field(default_factory=list)
    suspended: dict[str, Any] | None = None  # a paused generation: {"left", "done", "text", "origin", "random"}


@dataclass
class Page:
    """A page file's stand-in: the state it holds."""

    state: tuple[int, ...]
    closed: bool = False

    @property
    def size(self) -> int:
        return len(self.state)

    def close(self) -> None:
        self.closed = True


@dataclass
class Running:
    call: CallRec
    req_id: int
    ctx: FakeContext
    slot: int
    left: int
    done: int
    text: str
    origin: int
    random: bool
    n_prompt: int


class FakeWorker:
    """One worker's toy engine (module docstring). ``queue`` holds what the pipe holds, in order: requests
    (call, request, id) and the driver's job directives (callables run in turn)."""

    def __init__(self, rng: random.Random) -> None:
        self.alive = True
        self.contexts: dict[int, FakeContext] = {}
        self.slots: dict[int, int] = {}
        self.words: dict[int, int] = {}
        self.queue: deque[Any] = deque()
        self.running: Running | None = None
        self._handles = itertools.count(1)
        self.rng = rng

    def new_context(self, tokens: tuple[int, ...] = ()) -> p.ContextCreated:
        handle = next(self._handles)
        self.contexts[handle] = FakeContext(list(tokens))
        self.slots[handle] = handle % 512
        return p.ContextCreated(context=handle, interrupt_slot=handle % 512, logits_offset=0, n_vocab=200, n_ctx=4096,
                                n_batch=512, n_ubatch=512, n_seq_max=1, n_threads=1)

    @property
    def idle(self) -> bool:
        return self.running is None and not self.queue

    def step(self) -> list[tuple[Any, ...]]:
        """One unit of work: a token of the generation running, or the next request; what came of it
        (("event", call, payload), ("reply", call, result, error), ("job", directive))."""
        if not self.alive:
            return []
        if self.running is not None:
            return self._token(self.running)
        if not self.queue:
            return []
        item = self.queue.popleft()
        if callable(item):
            return [("job", item)]
        call, req, req_id = item
        try:
            return self._handle(call, req, req_id)
        except Exception as exc:
            return [("reply", call, None, exc)]

    def _ctx(self, req: p.Request[Any]) -> FakeContext:
        assert isinstance(req, p.ContextRequest)
        ctx = self.contexts.get(req.context)
        if ctx is None:
            raise ContextError(f"no context {req.context}")
        return ctx

    def _handle(self, call: CallRec, req: p.Request[Any], req_id: int) -> list[tuple[Any, ...]]:
        if isinstance(req, p.ContextRequest) and type(req) not in p.READS_ONLY and not isinstance(
                req, (p.Resume, p.AdoptGeneration)):
            ctx = self.contexts.get(req.context)
            if ctx is not None and ctx.suspended is not None:
                DROPPED.add(int(ctx.suspended["origin"]))
                ctx.suspended = None  # another call drops a paused generation
        if isinstance(req, p.Generate):
            ctx = self._ctx(req)
            prompt = list(req.prompt) if isinstance(req.prompt, list) else []
            ctx.tokens = (ctx.tokens if req.append else []) + prompt
            random_seed = int(req.params.get("seed", 0)) == MAX_SEED and float(req.params.get("temperature", 0)) > 0
            self.running = Running(call, req_id, ctx, req.context % 512, int(req.params.get("n_predict", 4)), 0, "",
                                   req_id, random_seed, len(prompt))
            return self._token(self.running) if self.running.left == 0 else []
        if isinstance(req, p.Resume):
            ctx = self._ctx(req)
            s = ctx.suspended
            if s is None:
                raise ContextError("nothing is paused on the context")
            ctx.suspended = None
            self.running = Running(call, req_id, ctx, req.context % 512, s["left"], s["done"], s["text"], s["origin"],
                                   s["random"], 0)
            return self._token(self.running) if self.running.left == 0 else []
        if isinstance(req, p.AdoptGeneration):
            ctx = self._ctx(req)
            s = dict(req.suspension)
            if "n_predict" in req.params:  # the budget the journal capped it at
                s["left"] = int(req.params["n_predict"]) - int(s["done"])
            ctx.suspended = {**s, "origin": req.origin}
            return [("reply", call, None, None)]
        if isinstance(req, p.Eval):
            ctx = self._ctx(req)
            if self.words.get(req.context % 512) == req_id:
                return [("reply", call, EvalResult(0, len(ctx.tokens), True, 0.0), None)]
            ctx.tokens += list(req.tokens or [])
            return [("reply", call, EvalResult(len(req.tokens or []), len(ctx.tokens), False, 0.0), None)]
        if isinstance(req, p.Reset):
            self._ctx(req).tokens = []
            return [("reply", call, None, None)]
        if isinstance(req, p.Tokens):
            return [("reply", call, list(self._ctx(req).tokens), None)]
        if isinstance(req, p.NPast):
            return [("reply", call, len(self._ctx(req).tokens), None)]
        if isinstance(req, p.FreeContext):
            self.contexts.pop(req.context, None)
            return [("reply", call, None, None)]
        if isinstance(req, p.SaveState):
            ctx = self._ctx(req)
            if not ctx.tokens:
                raise ContextError("save_state: the context holds nothing to save")
            call.data_saved = tuple(ctx.tokens)  # type: ignore[attr-defined]
            return [("reply", call, len(ctx.tokens), None)]
        if isinstance(req, p.LoadState):
            ctx = self._ctx(req)
            ctx.tokens = list(bytes(call.data))
            return [("reply", call, len(ctx.tokens), None)]
        raise ValueError(f"the fake worker does not serve {type(req).__name__}")

    def _token(self, run: Running) -> list[tuple[Any, ...]]:
        word = self.words.get(run.slot)
        if word == run.req_id:
            self.running = None
            return [("reply", run.call, self._result(run, StopReason.INTERRUPTED), None)]
        if word == run.req_id | p.PAUSE_BIT and run.done > 0:
            self.running = None
            run.ctx.suspended = {"left": run.left, "done": run.done, "text": run.text, "origin": run.origin,
                                 "random": run.random}
            suspension = {"left": run.left, "done": run.done, "text": run.text, "random": run.random}
            return [("event", run.call, {"paused": suspension}),
                    ("reply", run.call, self._result(run, StopReason.PAUSED), None)]
        if run.left <= 0:
            self.running = None
            return [("reply", run.call, self._result(run, StopReason.LENGTH), None)]
        token = self.rng.randrange(150, 200) if run.random else next_token(run.ctx.tokens)
        run.ctx.tokens.append(token)
        run.left -= 1
        run.done += 1
        piece = chr(token)
        run.text += piece
        out: list[tuple[Any, ...]] = [("event", run.call, {"piece": piece})]
        if run.left == 0:
            self.running = None
            out.append(("reply", run.call, self._result(run, StopReason.LENGTH), None))
        return out

    def _result(self, run: Running, reason: StopReason) -> Result:
        return Result(text=run.text, tokens=[], n_prompt=run.n_prompt, n_decoded=run.done, n_cached=0,
                      stop_reason=reason, prompt_ms=0.0, decode_ms=0.0)


def replay(checkpoint: Any, entries: list[p.Request[Any]]) -> list[int]:
    """The tokens a context rebuilt from a journal holds: its checkpoint, then its entries replayed."""
    if isinstance(checkpoint, PendingState):
        assert checkpoint.settled, "a recovery ran before its checkpoint was read"
        checkpoint = checkpoint.data
    state: tuple[int, ...] = () if checkpoint is None or checkpoint == b"" else (
        checkpoint.state if isinstance(checkpoint, Page) else tuple(checkpoint))
    worker = FakeWorker(random.Random(0))
    desc = worker.new_context(state)
    for req in entries:
        req = msgspec.structs.replace(req, context=desc.context)
        call = CallRec(req, None)
        for out in worker._handle(call, req, next(_ids)):
            if out[0] == "reply" and out[3] is not None:
                raise AssertionError(f"{req} replayed with {out[3]!r}")
        while worker.running is not None:
            worker._token(worker.running)
    return worker.contexts[desc.context].tokens


class FakeCore:
    """The machine's driver against a FakeWorker (as _core.WorkerCore is against a WorkerProcess): actions
    carried out, the outbox written in order, jobs run in turn, one at a time."""

    def __init__(self, machine: CoreMachine, rng: random.Random) -> None:
        self.machine = machine
        self.rng = rng
        self.worker = FakeWorker(rng)
        self.jobs: deque[RunJob] = deque()
        self.blocked: tuple[str, Any] | None = None  # the job that waits on the worker: (kind, call or context)
        self.settled: dict[Future[Any], int] = {}  # how many times a Settle named each future
        self.delivered: dict[object, list[str]] = {}  # a call's or generation's pieces its caller got

    # -- actions --------------------------------------------------------------------------------------
    def do(self, actions: list[Any], flush: bool = True) -> None:
        for action in actions:
            if isinstance(action, Settle):
                self.settled[action.future] = self.settled.get(action.future, 0) + 1
                if not action.future.done():
                    if action.error is not None:
                        action.future.set_exception(action.error)
                    else:
                        action.future.set_result(action.result)
            elif isinstance(action, Deliver):
                action.fn(action.event)
            elif isinstance(action, Interrupt):
                if self.worker.alive:
                    self.worker.words[action.slot] = action.value
            elif isinstance(action, RunJob):
                self.jobs.append(action)
            elif isinstance(action, ClosePage):
                action.page.close()
            else:
                assert isinstance(action, Notify)
        if flush:
            self.flush()

    def flush(self) -> None:
        m = self.machine
        while m.outbox:
            call = m.outbox.popleft()
            self._write(call, self._wire(call))

    def _wire(self, call: CallRec) -> p.Request[Any]:
        req = call.req
        if call.ctx is not None and isinstance(req, p.ContextRequest) and req.context != call.ctx.handle:
            req = msgspec.structs.replace(req, context=call.ctx.handle)
        return req

    def _write(self, call: CallRec, req: p.Request[Any]) -> None:
        if not self.worker.alive:
            return  # the pipe is gone: died() decides for the call
        req_id = next(_ids)
        self.do(self.machine.sent(call, req_id), flush=False)  # inside a write: the frames keep their order
        self.worker.queue.append((call, req, req_id))

    # -- the worker ---------------------------------------------------------------------------------------
    def step_worker(self) -> None:
        for out in self.worker.step():
            if out[0] == "event":
                self.do(self.machine.event(out[1], out[2]))
            elif out[0] == "reply":
                call, result, error = out[1], out[2], out[3]
                self.do(self.machine.reply(call, result, error))
                if self.blocked == ("transfer", call):
                    self._transferred(call, error)
            else:
                out[1]()

    def _transferred(self, call: CallRec, error: BaseException | None) -> None:
        """The transfer job's end (after its reply): its state read out, and the loop free again."""
        self.blocked = None
        if call.kind is Kind.LOAD:
            return
        saved = tuple(getattr(call, "data_saved", ()) or ())
        data: Any
        if error is not None:
            data = b"" if call.internal and "holds nothing" in str(error) else None
        else:
            data = bytes(saved) if call.kind is Kind.SAVE else Page(saved)
        self.do(self.machine.state_read(call, data))

    def kill(self) -> None:
        """SIGKILL: the worker and what its pipe held are gone; the machine hears of it first (the reader's
        EOF), then the job that waited on the worker sees its call fail and goes on."""
        if not self.worker.alive:
            return  # dead already: its replacement is not there yet
        self.worker.alive = False
        crash = WorkerCrashedError("worker 0 killed by SIGKILL (-9)", returncode=-9)
        self.do(self.machine.died(crash))
        blocked, self.blocked = self.blocked, None
        if blocked is None:
            return
        kind, what = blocked
        if kind == "transfer" and what.kind is not Kind.LOAD:
            self.do(self.machine.state_read(what, None))
        elif kind == "page_out":
            self.do(self.machine.page_out_failed(what))
        elif kind == "page_in":
            self.do(self.machine.page_in_failed(what, crash))

    def quiet(self) -> bool:
        return self.worker.idle and not self.jobs and self.blocked is None and not self.machine.outbox

    # -- jobs (the driver's loop) ---------------------------------------------------------------------
    def run_job(self) -> bool:
        """Runs the next job, unless one waits on the worker; whether one ran."""
        if self.blocked is not None or not self.jobs:
            return False
        job = self.jobs.popleft()
        m = self.machine
        if job.kind == "transfer":
            call = job.call
            assert call is not None
            if call.state != "sending" or call.epoch != m.epoch or not self.worker.alive:
                return True  # its worker died before it went out: the machine has dealt with it
            self.blocked = ("transfer", call)
            handle = call.ctx.handle if call.ctx else 0
            req: p.Request[Any] = (p.LoadState(context=handle, path="") if call.kind is Kind.LOAD
                                   else p.SaveState(context=handle, path="", in_place=True))
            req_id = next(_ids)
            self.do(m.sent(call, req_id), flush=False)
            self.worker.queue.append((call, req, req_id))
        elif job.kind == "page_out":
            ctx = job.ctx
            assert ctx is not None
            if ctx.status is not Status.PAGING_OUT or not self.worker.alive:
                self.do(m.page_out_failed(ctx))
                return True
            self.blocked = ("page_out", ctx)
            worker = self.worker

            def page_out() -> None:
                self.blocked = None
                fake = worker.contexts.pop(ctx.handle, None) if ctx.status is Status.PAGING_OUT else None
                if fake is None or not worker.alive:
                    self.do(m.page_out_failed(ctx))
                    return
                self.do(m.paged_out(ctx, Page(tuple(fake.tokens)) if fake.tokens else None))

            worker.queue.append(page_out)
        elif job.kind == "page_in":
            ctx = job.ctx
            assert ctx is not None
            if ctx.status is not Status.LOADING:
                return True
            if not self.worker.alive:  # the real job's NewContext fails at once
                self.do(m.page_in_failed(ctx, WorkerCrashedError("the worker died", returncode=-9)))
                return True
            self.blocked = ("page_in", ctx)
            worker = self.worker

            def page_in() -> None:
                self.blocked = None
                if ctx.status is not Status.LOADING:
                    return
                page = ctx.page
                desc = worker.new_context(page.state if page is not None else ())
                ok, actions = m.paged_in(ctx, desc)
                self.do(actions)
                if not ok:
                    worker.contexts.pop(desc.context, None)

            worker.queue.append(page_in)
        elif job.kind in ("recover", "rebuild"):
            if job.kind == "recover":
                self.worker = FakeWorker(self.rng)
                contexts = m.to_rebuild()
            else:
                assert job.ctx is not None
                contexts = [job.ctx]
            for ctx in contexts:
                self._rebuild(ctx, alone=job.kind == "rebuild")
            if job.kind == "recover":
                self.do(m.recovered())
        return True

    def _rebuild(self, ctx: ContextState, alone: bool) -> None:
        m = self.machine
        if ctx.status is not Status.RECOVERING:
            return
        journal = ctx.journal
        lost = "no journal" if journal is None else journal.lost
        tokens: list[int] = []
        if lost is None:
            assert journal is not None
            tokens = replay(journal.checkpoint, list(journal.entries))
        desc = self.worker.new_context(tuple(tokens))
        ok, actions = m.restored(ctx, desc, lost, alone=alone)
        self.do(actions)
        if not ok:
            self.worker.contexts.pop(desc.context, None)

    # -- what callers do ------------------------------------------------------------------------------
    def new_context(self) -> ContextState:
        desc = self.worker.new_context()
        state = ContextState(desc.context, desc.interrupt_slot, None, {}, desc=desc)
        self.do(self.machine.admit(state))
        return state

    def call(self, ctx: ContextState | None, req: p.Request[Any], *, kind: Kind = Kind.USER,
             data: Any = None) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_running_or_notify_cancel()
        rec = CallRec(req, ctx, future=fut, kind=kind, data=data)
        pieces: list[str] = []
        self.delivered[rec] = pieces
        rec.on_event = lambda e: pieces.append(e["piece"]) if "piece" in e else None
        self.do(self.machine.submit(rec))
        return fut

    def generation(self, ctx: ContextState, req: p.Generate, checkpoint_tokens: int | None) -> Generation:
        pieces: list[str] = []

        def deliver(event: dict[str, Any]) -> None:
            if "piece" in event:
                pieces.append(event["piece"])

        gen = Generation(req, deliver, checkpoint_tokens)
        self.delivered[gen] = pieces
        self.do(self.machine.start_generation(ctx, gen))
        return gen

    def on(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            value, actions = out
            self.do(actions)
            return value
        self.do(out)
        return None


__all__ = ["FakeCore", "FakeWorker", "Page", "next_token", "replay"]
