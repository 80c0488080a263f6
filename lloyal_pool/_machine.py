"""The lifecycle of one worker's contexts as a pure machine: every call, reply, event, pause, checkpoint,
page-out, move and death is a message; each returns the actions it leads to. No thread, no lock, no I/O:
its driver (_core.WorkerCore) holds a lock around each message and carries the actions out, and its
tests (tests/unit/test_machine.py) drive it against a fake worker.

    caller ─submit(call)─▶ ┌──────────────┐ ─outbox (calls to write, in order)─▶ driver ─▶ pipe
    reader ─reply/event──▶ │  CoreMachine │ ─Settle / Deliver / Interrupt / RunJob / ClosePage─▶ driver
    reader ─died(error)──▶ │  (per worker)│      a job (the driver's loop thread) ─paged_in / restored ...─▶
    jobs ─paged_out...───▶ └──────────────┘

A context's status says where it is and what becomes of a call made on it:

    status       the context                                 a call made now
    RESIDENT     lives in the worker under ``handle``        is sent (queued while ``hold`` is set)
    PAGING_OUT   is being saved into a page file, then freed queued; paged in again after
    PAGED        lives in its page file only                 queued; starts a page-in
    LOADING      is being made in the worker (a page-in)     queued
    MOVING       its state was read out for a move           queued; sent in the target once it commits
    RECOVERING   its worker died; a replacement rebuilds it  queued; sent once the recovery ends
    DEAD         its worker died, no recovery                fails with DeadWorkerError
    CLOSED       was closed                                  fails with StaleHandleError

``hold`` is who has a resident context to itself: a generation paused for its own checkpoint (from its
pause to its resume), or a move (from its pauses to its state read out). Each message says, in every
status, what becomes of the calls and holds it touches, so that no transition waits on a dead worker:
a death is a message like any other.
"""

from __future__ import annotations

import enum
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from . import protocol as p
from ._generation import Generation, Phase, Why
from .errors import (
    ContextError,
    ContextLostError,
    DeadWorkerError,
    PoolClosedError,
    StaleHandleError,
    WorkerCrashedError,
    copy_error,
)
from .journal import MAX_ATTEMPTS, STATELESS, Journal, Ledger, PendingState, replayable, starts_afresh
from .residency import victims


class Status(enum.Enum):
    RESIDENT = "resident"
    PAGING_OUT = "paging out"
    PAGED = "paged"
    LOADING = "loading"
    MOVING = "moving"
    RECOVERING = "recovering"
    DEAD = "dead"
    CLOSED = "closed"


class Hold(enum.Enum):
    CHECKPOINT = "checkpoint"  # a generation paused for its own checkpoint, until it resumes
    MOVE = "move"  # a move, from its pauses until its state is read out


class Kind(enum.Enum):
    """What a call is for. USER, SEGMENT (a generation's Generate, Resume or AdoptGeneration) and FREE are
    written as they are; SAVE, LOAD and MOVE_SAVE go through the worker's transfer file, so once sent they
    are a job of the driver's (which writes the file, the frame, and reads the file)."""

    USER = "user"
    SEGMENT = "segment"
    FREE = "free"
    SAVE = "save"  # a SaveState: a checkpoint (``pending`` set) or save_state()
    LOAD = "load"  # load_state() of bytes: a checkpoint too
    MOVE_SAVE = "move save"  # a move's SaveState: the state it carries


TRANSFERS = frozenset({Kind.SAVE, Kind.LOAD, Kind.MOVE_SAVE})


@dataclass(eq=False)
class CallRec:
    """One call: its request, where its outcome goes, and where it is (new, queued, sending, sent, done)."""

    req: p.Request[Any]
    ctx: ContextState | None = None  # None: a worker-level call (models, tokenizer, ping)
    future: Future[Any] | None = None  # settled with the outcome (None: a generation's segment)
    on_event: Callable[[dict[str, Any]], None] | None = None
    kind: Kind = Kind.USER
    model: Any = None  # what names the model a worker-level request carries (``.handle``, renumbered)
    gen: Generation | None = None  # the generation a segment is of
    state: str = "new"
    req_id: int = 0
    epoch: int = -1  # the worker incarnation it was sent to
    cancelled: bool = False  # interrupted before it ran
    ledger: Ledger | None = None  # under recovery: what its caller has been given of its events
    callback_error: BaseException | None = None
    pending: PendingState | None = None  # a checkpoint's state, filled by the job that reads it
    data: Any = None  # a LOAD's bytes; a SetLora's pairs
    prompt_paused: bool = False  # a Generate that paused inside its prompt: not journaled
    error: BaseException | None = None  # a SAVE's or MOVE_SAVE's failed reply: its caller's once the job ends
    internal: bool = False  # sent by the machine itself (its SaveStates): never replayed

    @property
    def decodes(self) -> bool:
        return type(self.req).decodes


@dataclass(eq=False)
class ContextState:
    """One context's lifecycle state (module docstring)."""

    handle: int
    slot: int
    model: Any  # what made it (``._handle`` names the model in the worker)
    params: dict[str, Any]  # its ContextParams on the wire, to make it again
    pageable: bool = True
    status: Status = Status.RESIDENT
    hold: Hold | None = None
    hold_gen: Generation | None = None
    inflight: list[CallRec] = field(default_factory=list)
    queued: deque[CallRec] = field(default_factory=deque)
    journal: Journal | None = None
    gens: list[Generation] = field(default_factory=list)  # its generations that have not ended
    pins: int = 0  # calls that read it without a call of its own (a draft's use, rows being read): kept in
    # What holds state of it in the worker that does not travel (its BranchStore, grammar Samplers): while
    # one ``holds()`` it neither pages out nor is checkpointed.
    holders: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    notice: str | None = None  # lost to a crash, made again empty: the first call that needs the history says so
    death: BaseException | None = None  # DEAD: the crash
    page: Any = None  # its page file (PAGED; and its journal's checkpoint after a page-in, under recovery)
    lora: list[Any] = field(default_factory=list)  # its LoRA configuration: applied first when it is made again
    checkpointing: bool = False  # a checkpoint of the machine's own is queued or in flight
    incarnation: int = 0  # bumped whenever it is made anew in a worker (views, branches, samplers go stale)
    deferred: list[Callable[[CoreMachine], None]] = field(default_factory=list)  # what waits for it to settle
    move_token: object = None  # the move under way (begin_move)
    desc: Any = None  # its ContextCreated in the worker now (the logits row's offset)

    @property
    def counted(self) -> bool:
        """Whether the residency budget counts it: pageable and in the worker (or on its way in or out)."""
        return self.pageable and self.status in (Status.RESIDENT, Status.PAGING_OUT, Status.LOADING)

    @property
    def settled(self) -> bool:
        """Resident and held by nobody, paged, or ended: what a move and a close wait for."""
        return ((self.status is Status.RESIDENT and self.hold is None)
                or self.status in (Status.PAGED, Status.CLOSED, Status.DEAD))

    def idle(self) -> bool:
        """What may page out: resident, held by nobody, nothing in flight or waiting, no generation
        running or paused (a paused one lives in the worker), no branches or grammar handles."""
        return (self.status is Status.RESIDENT and self.hold is None and not self.inflight and not self.queued
                and not self.gens and self.pins == 0 and self.pageable and not self.checkpointing
                and not self.worker_bound())

    def worker_bound(self) -> bool:
        """Whether state of it lives only in the worker (branches, grammar handles): it cannot be saved."""
        return any(h.holds() for h in list(self.holders))


# -- actions: what the driver carries out ----------------------------------------------------------------
@dataclass
class Settle:
    future: Future[Any]
    result: Any = None
    error: BaseException | None = None


@dataclass
class Deliver:
    call: CallRec
    fn: Callable[[dict[str, Any]], None]
    event: dict[str, Any]


@dataclass
class Interrupt:
    slot: int
    value: int


@dataclass
class RunJob:
    kind: str  # "transfer", "page_out", "page_in", "recover", "rebuild" (and the driver's own: "flush", "call")
    ctx: ContextState | None = None
    call: CallRec | None = None
    data: Any = None


@dataclass
class ClosePage:
    page: Any


@dataclass
class Notify:
    """Something a caller may wait for changed (a pause landed, a recovery ended, the pager settled)."""


Action = Settle | Deliver | Interrupt | RunJob | ClosePage | Notify


class CoreMachine:
    """The contexts of one worker slot (module docstring). ``recover``: Pool(recover=True), which keeps a
    journal per context and rebuilds them in a replacement; ``checkpoint_tokens``: Pool(checkpoint_tokens);
    ``budget``: Pool(max_resident_contexts)."""

    def __init__(self, *, recover: bool = False, checkpoint_tokens: int | None = None,
                 budget: int | None = None) -> None:
        self.recover = recover
        self.checkpoint_tokens = checkpoint_tokens
        self.budget = budget
        self.epoch = 0  # bumped by each replacement worker
        self.phase = "alive"  # "recovering", "dead", "closed"
        self.death: BaseException | None = None
        self.contexts: OrderedDict[ContextState, None] = OrderedDict()  # least recently used first
        self.outbox: deque[CallRec] = deque()  # decided, to be written in this order
        self.inflight: dict[CallRec, None] = {}  # every call sending or sent, in decision order
        self.queued: deque[CallRec] = deque()  # worker-level calls waiting for a recovery
        self.salvaged: list[CallRec] = []  # calls in flight at a crash, to send again after it
        self.paging_out: ContextState | None = None
        self.page_outs = 0
        self.page_ins = 0
        self._out: list[Action] = []

    def _take(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    # -- calls ------------------------------------------------------------------------------------------
    def submit(self, call: CallRec) -> list[Action]:
        """A call made by a caller."""
        ctx = call.ctx
        if ctx is None:
            self._submit_worker_call(call)
        else:
            self._submit(ctx, call)
        return self._take()

    def _submit_worker_call(self, call: CallRec) -> None:
        if call.ledger is None and self.recover:
            call.ledger = Ledger()
        if self.phase == "alive":
            self._send(call)
        elif self.phase == "recovering":
            call.state = "queued"
            self.queued.append(call)
        else:
            self._fail(call, self._stale_error())

    def _submit(self, ctx: ContextState, call: CallRec) -> None:
        if call.ledger is None and self.recover and not call.internal:
            call.ledger = Ledger()  # what its caller has been given, should a crash send it again
        if ctx.status is Status.CLOSED and call.kind is not Kind.FREE:
            self._fail(call, StaleHandleError(f"context handle {ctx.handle} was closed"))
            return
        if ctx.status is Status.DEAD:
            self._fail(call, self._dead_context_error(ctx))
            return
        if ctx.notice is not None and call.kind in (Kind.USER, Kind.SEGMENT, Kind.LOAD):
            why, ctx.notice = ctx.notice, None
            if not (starts_afresh(call.req) or isinstance(call.req, (p.Reset, p.LoadState, p.SetLora))
                    or call.kind is Kind.LOAD):
                self._fail(call, self._lost_error(ctx, why))
                return
        if ctx in self.contexts:
            self.contexts.move_to_end(ctx)
        if ctx.status is Status.RESIDENT and (ctx.hold is None or self._passes_hold(ctx, call)):
            self._send(call)
        else:
            call.state = "queued"
            ctx.queued.append(call)
            if ctx.status is Status.PAGED and ctx.move_token is None:
                ctx.status = Status.LOADING
                self._out.append(RunJob("page_in", ctx))
        self._police()

    def _passes_hold(self, ctx: ContextState, call: CallRec) -> bool:
        """Whether a call goes on while the context is held: the holder's own (a move's SaveState, a
        checkpoint's, the held generation's segments), and calls that only read it."""
        if call.internal or (call.gen is not None and call.gen is ctx.hold_gen):
            return True
        return type(call.req) in p.READS_ONLY and call.kind is not Kind.LOAD

    def _send(self, call: CallRec) -> None:
        call.state, call.epoch = "sending", self.epoch
        self.inflight[call] = None
        if call.ctx is not None:
            call.ctx.inflight.append(call)
        if call.kind in TRANSFERS:
            self._out.append(RunJob("transfer", call.ctx, call))  # the job writes its frame
        else:
            self.outbox.append(call)

    def sent(self, call: CallRec, req_id: int) -> list[Action]:
        """The driver wrote the call's frame: the worker runs it under req_id."""
        if call.state != "sending" or call.epoch != self.epoch:
            return []
        call.state, call.req_id = "sent", req_id
        ctx = call.ctx
        if ctx is not None and call.decodes:
            gen = call.gen
            if gen is not None and gen.stop_wanted:
                self._out.append(Interrupt(ctx.slot, req_id))
            elif gen is not None and gen.phase is Phase.PAUSING:
                self._out.append(Interrupt(ctx.slot, req_id | p.PAUSE_BIT))
            elif call.cancelled and self._head(ctx) is call:
                self._out.append(Interrupt(ctx.slot, req_id))
        return self._take()

    def unsent(self, call: CallRec, error: BaseException) -> list[Action]:
        """The driver could not write the call (its request did not encode, the thread was interrupted; not
        the worker's death, which died() is told of and decides for every call in flight)."""
        if call.state == "sending" and call.epoch == self.epoch and not isinstance(error, WorkerCrashedError):
            self._forget(call)
            self._end(call, None, error)
        return self._take()

    def _head(self, ctx: ContextState) -> CallRec | None:
        """The decoding call of ctx the worker runs now or next (the oldest in flight)."""
        return next((c for c in ctx.inflight if c.decodes), None)

    def _forget(self, call: CallRec) -> None:
        call.state = "done"
        self.inflight.pop(call, None)
        ctx = call.ctx
        if ctx is not None and call in ctx.inflight:
            was_head = self._head(ctx) is call
            ctx.inflight.remove(call)
            head = self._head(ctx)
            # The worker starts the next request now: if it was cancelled while queued, its id goes into
            # the word, which the worker checks between tokens and steps.
            if was_head and head is not None and head.state == "sent" and (
                    head.cancelled or (head.gen is not None and head.gen.stop_wanted)):
                self._out.append(Interrupt(ctx.slot, head.req_id))

    # -- replies and events -----------------------------------------------------------------------------
    def event(self, call: CallRec, payload: dict[str, Any]) -> list[Action]:
        """An event of a call in flight (a piece, prompt progress, a pause's portable form)."""
        if call.state not in ("sending", "sent") or call.epoch != self.epoch or call.callback_error is not None:
            return []
        event: dict[str, Any] | None = payload
        if call.ledger is not None and "paused" not in payload:
            event = call.ledger.admit(payload)
        gen = call.gen
        if event is not None and gen is not None:
            event, due = gen.on_event(event)
            if "paused" in payload and gen.in_prompt:
                call.prompt_paused = True
            if due and call.ctx is not None:
                self._checkpoint_pause(call.ctx, gen)
        fn = gen.deliver if gen is not None else call.on_event
        if event is not None and fn is not None:
            self._out.append(Deliver(call, fn, event))
        return self._take()

    def callback_failed(self, call: CallRec, error: BaseException) -> list[Action]:
        """A callback of the call raised: the call ends with that error, and stops decoding for nobody."""
        if call.state in ("sending", "sent") and call.callback_error is None:
            call.callback_error = error
            if call.gen is not None and call.ctx is not None:
                self._stop_gen(call.ctx, call.gen)
            elif call.decodes:
                self._interrupt_call(call)
        return self._take()

    def reply(self, call: CallRec, result: Any, error: BaseException | None) -> list[Action]:
        """The worker answered the call (or its write failed)."""
        if call.state not in ("sending", "sent") or call.epoch != self.epoch:
            return []
        self._forget(call)
        if call.callback_error is not None:
            error, result = call.callback_error, None
        ctx = call.ctx
        if ctx is not None:
            self._replied(ctx, call, result, error)
        self._end(call, result, error)
        if ctx is not None:
            self._after(ctx)
        self._police()
        return self._take()

    def _replied(self, ctx: ContextState, call: CallRec, result: Any, error: BaseException | None) -> None:
        """What the reply makes of the context: its journal (in reply order), its LoRA configuration."""
        req = call.req
        if isinstance(req, p.ContextRequest) and req.context != ctx.handle:
            req = _renamed(req, ctx.handle)
        if error is None and isinstance(req, p.SetLora):
            ctx.lora = list(call.data or [])
        journal = ctx.journal
        if journal is None or ctx.status is Status.CLOSED:
            return
        if call.kind in (Kind.SAVE, Kind.MOVE_SAVE) and call.pending is not None:
            if error is None or (call.internal and holds_nothing(error)):
                # The history is the state now: what the worker answers after it replays on top.
                first = [a for g in ctx.gens if (a := g.adoption(ctx.handle)) is not None]
                self._restart(ctx, call.pending, first)
            return
        if call.kind is Kind.LOAD:
            if error is None:
                self._restart(ctx, bytes(call.data), ())
            return
        if call.prompt_paused:
            return  # the same request, sent again on resume, decodes the rest after what the cache holds
        was_lost = journal.lost
        journal.record(req, result, error)
        if journal.lost is not None and was_lost is None:
            self._checkpoint(ctx)  # replay cannot reach past this: the state itself is saved instead

    def _restart(self, ctx: ContextState, state: Any, first: Any) -> None:
        journal = ctx.journal
        assert journal is not None
        old = journal.checkpoint
        journal.restart(state, first)
        if old is not None and old is not state and old is ctx.page and ctx.status is not Status.PAGED:
            ctx.page = None
            self._out.append(ClosePage(old))

    def _end(self, call: CallRec, result: Any, error: BaseException | None) -> None:
        """The call's outcome goes to its caller (a generation's segment: to the generation)."""
        gen = call.gen
        if gen is not None:
            if not isinstance(call.req, p.AdoptGeneration):
                self._segment_ended(call, gen, result, error)
            elif error is not None:
                gen.adopting = error
            return
        if call.kind in (Kind.SAVE, Kind.MOVE_SAVE) and not isinstance(error, WorkerCrashedError):
            call.error = error  # its caller hears once the job that reads the state ends (state_read)
            return
        if call.future is not None:
            self._out.append(Settle(call.future, result, error))

    def _fail(self, call: CallRec, error: BaseException) -> None:
        """The call ends with ``error`` before it was sent (or, at a death, instead of its reply)."""
        call.state = "done"
        if call.kind in TRANSFERS and call.gen is None:
            if call.future is not None:  # no job ever runs for it
                self._out.append(Settle(call.future, error=error))
            return
        self._end(call, None, error)

    # -- generations ------------------------------------------------------------------------------------
    def start_generation(self, ctx: ContextState, gen: Generation) -> list[Action]:
        """A pausable generation's first segment."""
        ctx.gens.append(gen)
        self._segment(ctx, gen, [gen.request])
        return self._take()

    def _segment(self, ctx: ContextState, gen: Generation, reqs: list[p.Request[Any]]) -> None:
        for req in reqs:
            call = CallRec(req, ctx, kind=Kind.SEGMENT, gen=gen)
            if isinstance(req, p.AdoptGeneration):
                gen.adopting = None
            else:
                gen.segment = call
            self._submit(ctx, call)

    def _segment_ended(self, call: CallRec, gen: Generation, result: Any, error: BaseException | None) -> None:
        ctx = call.ctx
        assert ctx is not None
        if gen.done:
            return
        if error is not None and isinstance(gen.adopting, BaseException):
            error = gen.adopting  # the Resume failed because the take-over did: say why
        paused = error is None and result.stop_reason == "paused"
        if paused:
            gen.paused_at(result, call.req_id, (self, self.epoch))
            why = gen.why
            if gen.stop_wanted:  # stopped while its pause landed
                gen.stopped_while_paused()
                self._gen_gone(ctx, gen)
            elif why is Why.CHECKPOINT:
                self._checkpoint(ctx, gen)
            elif why is Why.MOVE and ctx.move_token is None:
                self._go_on(ctx, gen)  # the move it paused for is over (it failed): on here
            self._out.append(Notify())
            return
        gen.ended(result, error)
        self._gen_gone(ctx, gen)
        self._out.append(Notify())

    def _gen_gone(self, ctx: ContextState, gen: Generation) -> None:
        if gen in ctx.gens:
            ctx.gens.remove(gen)
        if ctx.hold_gen is gen:
            self._release(ctx)

    def _checkpoint_pause(self, ctx: ContextState, gen: Generation) -> None:
        """A checkpoint's pause of gen, where nothing but it is under way on the context (else none now:
        the next is due after as many tokens again). The context is held from here to the resume."""
        if (gen.phase is not Phase.RUNNING or ctx.hold is not None or ctx.queued or ctx.status is not Status.RESIDENT
                or ctx.journal is None or ctx.checkpointing):
            return
        if any(c is not gen.segment and (c.decodes or type(c.req) not in p.READS_ONLY) for c in ctx.inflight):
            return
        ctx.hold, ctx.hold_gen = Hold.CHECKPOINT, gen
        self._pause(ctx, gen, Why.CHECKPOINT)

    def _pause(self, ctx: ContextState, gen: Generation, why: Why) -> None:
        gen.phase, gen.why = Phase.PAUSING, why
        seg = gen.segment
        if seg is not None and seg.state == "sent":
            self._out.append(Interrupt(ctx.slot, seg.req_id | p.PAUSE_BIT))
        # sending: sent() asks it; queued: the pause lands once it is sent

    def pause(self, ctx: ContextState, gen: Generation) -> list[Action]:
        """The caller pauses the generation (Stream.pause)."""
        if gen.phase is Phase.RUNNING:
            self._pause(ctx, gen, Why.CALLER)
        elif gen.phase in (Phase.PAUSING, Phase.PAUSED) and gen.why in (Why.CHECKPOINT, Why.MOVE, Why.CRASH):
            gen.why = Why.CALLER  # a checkpoint's, a move's or a crash's pause under way is the caller's now
        return self._take()

    def resume(self, ctx: ContextState, gen: Generation) -> tuple[bool, list[Action]]:
        """The caller goes on with a generation it paused: False when it is not paused (running, pausing
        for something else, ended). ContextError for one that would have to move and cannot."""
        if gen.phase is not Phase.PAUSED or gen.why is not Why.CALLER:
            return False, self._take()
        self._go_on(ctx, gen)
        return True, self._take()

    def _go_on(self, ctx: ContextState, gen: Generation) -> None:
        try:
            reqs = gen.next_segment(ctx.handle, (self, self.epoch))
        except ValueError:
            gen.ended(None, ContextError("the paused generation cannot go on in another worker: a mirostat "
                                         "sampler's state does not travel"))
            self._gen_gone(ctx, gen)
            return
        self._segment(ctx, gen, reqs)
        self._out.append(Notify())

    def stop(self, ctx: ContextState, gen: Generation) -> list[Action]:
        """Ends the generation: a running one at its next token, a paused one at once."""
        self._stop_gen(ctx, gen)
        return self._take()

    def _stop_gen(self, ctx: ContextState, gen: Generation) -> None:
        if gen.phase is Phase.PAUSED:
            gen.stopped_while_paused()
            self._gen_gone(ctx, gen)
            self._after(ctx)
            self._out.append(Notify())
            return
        if gen.done:
            return
        gen.stop_wanted = True
        seg: CallRec | None = gen.segment
        if seg is not None and seg.state == "sent" and self._head(ctx) is seg:
            self._out.append(Interrupt(ctx.slot, seg.req_id))
        # queued, sending, or behind another call: sent() or the call before it ending asks it

    # -- interrupts ------------------------------------------------------------------------------------
    def interrupt(self, ctx: ContextState) -> list[Action]:
        """Context.interrupt(): stops the decoding call the worker runs (or runs next) on ctx; ends a
        generation paused, or about to resume, for a checkpoint (nothing of it runs then)."""
        head = self._head(ctx)
        if head is not None and head.state == "sent":
            self._out.append(Interrupt(ctx.slot, head.req_id))
        elif head is not None:
            head.cancelled = True
        for gen in list(ctx.gens):
            if gen.why is Why.CHECKPOINT and gen.phase is Phase.PAUSED:
                self._stop_gen(ctx, gen)
        return self._take()

    def interrupt_call(self, call: CallRec) -> list[Action]:
        self._interrupt_call(call)
        return self._take()

    def _interrupt_call(self, call: CallRec) -> None:
        ctx = call.ctx
        if call.state == "queued":
            call.cancelled = True
            return
        if ctx is None or call.state not in ("sending", "sent"):
            return
        call.cancelled = True
        if call.state == "sent" and self._head(ctx) is call:
            self._out.append(Interrupt(ctx.slot, call.req_id))

    # -- checkpoints ------------------------------------------------------------------------------------
    def _checkpoint(self, ctx: ContextState, gen: Generation | None = None) -> None:
        """A SaveState of the machine's own: the journal restarts at its reply, with the hand-over of
        every generation the state holds suspended (a held generation's own: then it resumes)."""
        if ctx.journal is None or ctx.status is not Status.RESIDENT or (gen is None and ctx.checkpointing):
            if gen is not None:  # nothing to save it for: it goes on
                self._resume_held(ctx, gen)
            return
        if ctx.worker_bound() and gen is None:
            return  # branches or grammar handles: a state with them does not save
        ctx.checkpointing = True
        call = CallRec(p.SaveState(context=ctx.handle, path="", in_place=True), ctx, kind=Kind.SAVE,
                       pending=PendingState(), internal=True, gen=None)
        call.data = gen  # the held generation to resume once the state is read
        self._submit(ctx, call)

    def checkpoint(self, ctx: ContextState, future: Future[Any]) -> list[Action]:
        """Context.checkpoint(): the state, saved after every call made before, becomes the journal's
        checkpoint; the future gets its size."""
        call = CallRec(p.SaveState(context=ctx.handle, path="", in_place=True), ctx, future=future,
                       kind=Kind.SAVE, pending=PendingState(), internal=True)
        self._submit(ctx, call)
        return self._take()

    def state_read(self, call: CallRec, data: Any) -> list[Action]:
        """The job behind a SAVE or MOVE_SAVE ended, its state read out (None: it failed, or the SaveState
        did): a checkpoint has its bytes, save_state() its result, a move its image (or, failing, the
        context its streams back)."""
        ctx = call.ctx
        assert ctx is not None
        if call.pending is not None:
            call.pending.set(data)
            if data is None and ctx.journal is not None and ctx.journal.checkpoint is call.pending:
                ctx.journal.lost = "its last checkpoint could not be read"
        fut = call.future
        if fut is not None and not fut.done():
            if data is None:
                error = call.error or ContextError("the context's state could not be read out of its worker")
                self._out.append(Settle(fut, error=error))
            elif call.kind is Kind.MOVE_SAVE:
                if ctx.hold is Hold.MOVE and ctx.status is Status.RESIDENT:
                    ctx.status = Status.MOVING  # the image's until the move commits or aborts
                self._out.append(Settle(fut, ("state", data)))
            elif call.pending is not None:
                self._out.append(Settle(fut, len(data) if isinstance(data, bytes) else data.size))
            else:
                self._out.append(Settle(fut, data))
        if call.kind is Kind.MOVE_SAVE and data is None:
            self._abort_move(ctx)  # the mover hears why; the context goes on here
        if call.internal and call.kind is Kind.SAVE:
            if call.future is None:  # the machine's own (Context.checkpoint() is the caller's)
                ctx.checkpointing = False
            gen = call.data
            if isinstance(gen, Generation):
                self._resume_held(ctx, gen)
            self._after(ctx)
            self._police()
        return self._take()

    def _resume_held(self, ctx: ContextState, gen: Generation) -> None:
        """A checkpoint's pause ends: the generation goes on, unless its caller paused (or stopped) it
        meanwhile; then the context is free for the calls that waited, which queue behind its Resume."""
        if gen.phase is Phase.PAUSED and gen.why is Why.CHECKPOINT and ctx.status is Status.RESIDENT:
            self._go_on(ctx, gen)
        if ctx.hold_gen is gen:
            self._release(ctx)

    def _release(self, ctx: ContextState) -> None:
        ctx.hold, ctx.hold_gen = None, None
        self._flush_queued(ctx)
        self._run_deferred(ctx)

    def _flush_queued(self, ctx: ContextState) -> None:
        # A call cancelled while it waited is sent all the same: its interrupt ends it at its start (sent()),
        # and its result says so.
        while ctx.queued and ctx.status is Status.RESIDENT and (
                ctx.hold is None or self._passes_hold(ctx, ctx.queued[0])):
            self._send(ctx.queued.popleft())

    def _after(self, ctx: ContextState) -> None:
        """Whatever the context's new state allows now: a background checkpoint, what waited for it."""
        journal = ctx.journal
        if (journal is not None and journal.wants_checkpoint() and not ctx.checkpointing and ctx.hold is None
                and ctx.status is Status.RESIDENT and not ctx.worker_bound()):
            self._checkpoint(ctx)
        if ctx.settled:
            self._run_deferred(ctx)

    def _run_deferred(self, ctx: ContextState) -> None:
        while ctx.deferred and ctx.settled:
            ctx.deferred.pop(0)(self)

    # -- residency (Pool(max_resident_contexts)) --------------------------------------------------------
    def admit(self, ctx: ContextState) -> list[Action]:
        """A context made in this worker (new_context, a snapshot's fork): others page out to make room."""
        self.contexts[ctx] = None
        if self.recover and ctx.journal is None:
            ctx.journal = Journal(self.checkpoint_tokens)
        self._police(keep=ctx)
        return self._take()

    def pin(self, ctx: ContextState, delta: int) -> list[Action]:
        ctx.pins += delta
        if ctx.pins == 0:
            self._after(ctx)
            self._police()
        return self._take()

    def _police(self, keep: ContextState | None = None) -> None:
        """Pages out the least recently used idle context (but ``keep``) while more than the budget are
        resident, one at a time (residency.victims)."""
        if self.budget is None or self.paging_out is not None or self.phase != "alive":
            if self.budget is not None and self.paging_out is None:
                self._out.append(Notify())
            return
        chosen = victims(self.contexts, self.budget, keep)
        if not chosen:
            self._out.append(Notify())
            return
        victim = chosen[0]
        assert isinstance(victim, ContextState)
        victim.status, self.paging_out = Status.PAGING_OUT, victim
        self._out.append(RunJob("page_out", victim))

    @property
    def settled_paging(self) -> bool:
        return self.paging_out is None

    def paged_out(self, ctx: ContextState, page: Any) -> list[Action]:
        """The page-out job saved ctx into ``page`` (None: it held nothing) and freed it in the worker."""
        if self.paging_out is ctx:
            self.paging_out = None
        if ctx.status is not Status.PAGING_OUT:  # its worker died meanwhile: recovery has it
            if page is not None and page is not ctx.page:
                self._out.append(ClosePage(page))
            return self._take()
        self.page_outs += 1
        old = ctx.page
        ctx.page, ctx.status = page, Status.PAGED
        ctx.incarnation += 1
        if ctx.journal is not None:  # what crash recovery restores it from from now on
            self._restart(ctx, page if page is not None else b"", ())
        if old is not None and old is not page:
            self._out.append(ClosePage(old))
        if ctx.queued:  # a call came meanwhile: in again
            ctx.status = Status.LOADING
            self._out.append(RunJob("page_in", ctx))
        self._run_deferred(ctx)
        self._police()
        return self._take()

    def page_out_failed(self, ctx: ContextState) -> list[Action]:
        """It stays resident (it may not have been idle after all, or its worker died: then recovery has it)."""
        if self.paging_out is ctx:
            self.paging_out = None
        if ctx.status is Status.PAGING_OUT:
            ctx.status = Status.RESIDENT
            self._flush_queued(ctx)
            self._run_deferred(ctx)
        self._out.append(Notify())
        return self._take()

    def paged_in(self, ctx: ContextState, desc: Any) -> tuple[bool, list[Action]]:
        """The page-in job made ctx again in the worker (``desc``: its ContextCreated); False when the
        context no longer wants it (the job frees it)."""
        if ctx.status is not Status.LOADING:
            return False, self._take()
        self.page_ins += 1
        self._made(ctx, desc)
        ctx.status = Status.RESIDENT
        ctx.incarnation += 1
        if ctx.journal is None and ctx.page is not None:  # no checkpoint needs the file any more
            self._out.append(ClosePage(ctx.page))
            ctx.page = None
        self.contexts.move_to_end(ctx)
        self._flush_queued(ctx)
        self._run_deferred(ctx)
        self._police()
        return True, self._take()

    def _made(self, ctx: ContextState, desc: Any) -> None:
        ctx.desc, ctx.handle, ctx.slot = desc, desc.context, desc.interrupt_slot
        ctx.incarnation += 1

    def page_in_failed(self, ctx: ContextState, error: BaseException) -> list[Action]:
        """The page-in failed (the worker is out of memory, say): the calls that needed it get the error;
        the context stays paged out. A death meanwhile leaves it paged, its calls queued for the
        replacement."""
        if ctx.status is not Status.LOADING:
            return self._take()
        ctx.status = Status.PAGED
        if not isinstance(error, WorkerCrashedError):
            while ctx.queued:
                self._fail(ctx.queued.popleft(), copy_error(error))
        self._run_deferred(ctx)
        return self._take()

    # -- close ------------------------------------------------------------------------------------------
    def close(self, ctx: ContextState, future: Future[None], *, freed: bool = False) -> list[Action]:
        """Context.close() (``freed``: its model's close freed it in the worker already): its calls not sent
        fail, its generations end, the worker frees it after the calls sent before."""
        if ctx.status is Status.CLOSED:
            self._out.append(Settle(future))
            return self._take()
        if not ctx.settled and not freed and ctx.status not in (Status.DEAD, Status.RECOVERING):
            ctx.deferred.append(lambda m: m._close(ctx, future, freed))
        else:
            self._close(ctx, future, freed)
        return self._take()

    def _close(self, ctx: ContextState, future: Future[None], freed: bool) -> None:
        status = ctx.status
        if status is Status.CLOSED:
            self._out.append(Settle(future))
            return
        ctx.status = Status.CLOSED
        ctx.incarnation += 1
        while ctx.queued:
            self._fail(ctx.queued.popleft(), StaleHandleError(f"context handle {ctx.handle} was closed"))
        for gen in list(ctx.gens):
            self._stop_gen(ctx, gen)  # a paused one ends (interrupted) instead of waiting for a resume that cannot come
        if ctx.page is not None:
            self._out.append(ClosePage(ctx.page))
            ctx.page = None
        self.contexts.pop(ctx, None)
        if status is Status.RESIDENT and not freed and self.phase == "alive":
            self._send(CallRec(p.FreeContext(context=ctx.handle), ctx, future=future, kind=Kind.FREE))
        else:
            self._out.append(Settle(future))
        self._run_deferred(ctx)  # a close or a move that waited for it: closed now
        self._police()

    # -- moves (migration.py orchestrates: begin here, build in the target, commit or abort) -----------
    def begin_move(self, ctx: ContextState, token: object, future: Future[Any]) -> list[Action]:
        """Holds ctx for a move: pauses its running generations and, after every call sent before, saves its
        state (a MOVE_SAVE, whose job reads it out: the future gets ("state", file)); a paged-out one moves
        as its page file (("paged", page)). A context in transition settles first."""
        if ctx.status is Status.CLOSED:
            self._out.append(Settle(future, error=StaleHandleError(f"context handle {ctx.handle} was closed")))
        elif ctx.status is Status.DEAD:
            self._out.append(Settle(future, error=self._dead_context_error(ctx)))
        elif not ctx.settled:
            ctx.deferred.append(lambda m: m._begin_move(ctx, token, future))
        else:
            self._begin_move(ctx, token, future)
        return self._take()

    def _begin_move(self, ctx: ContextState, token: object, future: Future[Any]) -> None:
        if ctx.status is Status.CLOSED:
            self._out.append(Settle(future, error=StaleHandleError(f"context handle {ctx.handle} was closed")))
            return
        ctx.move_token = token
        if ctx.status is Status.PAGED:
            ctx.status = Status.MOVING
            self._out.append(Settle(future, ("paged", ctx.page)))
            return
        ctx.hold = Hold.MOVE
        for gen in ctx.gens:
            if gen.phase is Phase.RUNNING:
                self._pause(ctx, gen, Why.MOVE)
        self._submit(ctx, CallRec(p.SaveState(context=ctx.handle, path="", in_place=True), ctx, future=future,
                                  kind=Kind.MOVE_SAVE, internal=True,
                                  pending=PendingState() if ctx.journal is not None else None))

    def abort_move(self, ctx: ContextState) -> list[Action]:
        """The target failed (or the state could not be read): the context goes on here, the generations
        the move paused resumed; rebuilt from its journal where its worker died meanwhile."""
        self._abort_move(ctx)
        return self._take()

    def _abort_move(self, ctx: ContextState) -> None:
        if ctx.move_token is None:
            return
        ctx.move_token = None
        resident = ctx.hold is Hold.MOVE
        ctx.hold = None
        if ctx.status is Status.MOVING:
            if not resident:  # a paged one: still paged
                ctx.status = Status.PAGED
                if ctx.queued:
                    ctx.status = Status.LOADING
                    self._out.append(RunJob("page_in", ctx))
            elif ctx.death is None and self.phase == "alive":
                ctx.status = Status.RESIDENT
            elif self.recover and ctx.journal is not None and self.phase != "closed":
                ctx.status = Status.RECOVERING  # its worker died after its state was read: made again here
                self._out.append(RunJob("rebuild", ctx))
            else:
                self._kill(ctx, ctx.death or self.death)
        if ctx.status is Status.RESIDENT:
            for gen in list(ctx.gens):
                if gen.why is Why.MOVE and gen.phase is Phase.PAUSED:
                    self._go_on(ctx, gen)  # one still pausing goes on once its pause lands (_segment_ended)
            self._flush_queued(ctx)
        self._run_deferred(ctx)

    def release_moved(self, ctx: ContextState) -> tuple[list[CallRec], list[Action]]:
        """The move committed: ctx leaves this worker, whose copy is freed; returns the calls queued on it,
        which go with it."""
        if ctx.hold is Hold.MOVE and self.phase == "alive" and ctx.death is None:
            self._send(CallRec(p.FreeContext(context=ctx.handle), None, kind=Kind.FREE))
        self.contexts.pop(ctx, None)
        queued = list(ctx.queued)
        ctx.queued.clear()
        ctx.move_token, ctx.hold, ctx.hold_gen, ctx.death = None, None, None, None
        self._police()
        return queued, self._take()

    def take_moved(self, ctx: ContextState, desc: Any, queued: list[CallRec], state: Any) -> list[Action]:
        """The moved context arrives: made here under ``handle`` from ``state`` (its journal's checkpoint,
        under recovery), with the generations it carries handed over; or paged (``handle`` None), its page
        file the image. The generations the move paused go on here, then the calls that waited."""
        self.contexts[ctx] = None
        handle = None if desc is None else desc.context
        if desc is None:
            ctx.status = Status.PAGED
            ctx.incarnation += 1
        else:
            self._made(ctx, desc)
            ctx.status = Status.RESIDENT
        for gen in ctx.gens:
            if gen.phase is Phase.PAUSED:
                gen.handed_over((self, self.epoch))
        if not self.recover:
            ctx.journal = None
        elif handle is not None or ctx.journal is None:
            ctx.journal = Journal(self.checkpoint_tokens)
            first = [g.adoption_at(handle) for g in ctx.gens if g.phase is Phase.PAUSED and not g.in_prompt
                     and g.suspension is not None] if handle is not None else []
            ctx.journal.restart(state if handle is not None else ctx.page, first)
        for call in queued:
            call.state = "queued"
            ctx.queued.append(call)
        if ctx.status is Status.RESIDENT:
            for gen in list(ctx.gens):
                if gen.phase is Phase.PAUSED and gen.why is Why.MOVE:
                    self._go_on(ctx, gen)
            self._flush_queued(ctx)
        elif ctx.queued:
            ctx.status = Status.LOADING
            self._out.append(RunJob("page_in", ctx))
        self._run_deferred(ctx)  # a close that waited for the move
        self._police()
        return self._take()

    # -- death and recovery ----------------------------------------------------------------------------
    def died(self, error: BaseException) -> list[Action]:
        """The worker died (or was closed: ``error`` a PoolClosedError). The calls in flight that can be
        replayed are kept for the replacement (recover=True), the others fail; every context it held is
        rebuilt there, or is dead; paged-out ones lose nothing."""
        if self.phase in ("dead", "closed"):
            return []
        recovering = self.recover and isinstance(error, WorkerCrashedError) and self.phase != "closing"
        self.death = error
        if not isinstance(error, WorkerCrashedError) or self.phase == "closing":
            self.phase = "closed"
        else:
            self.phase = "recovering" if recovering else "dead"
        inflight, self.inflight = list(self.inflight), {}
        self.outbox.clear()
        self.paging_out = None
        for ctx in self.contexts:
            ctx.inflight.clear()
        for call in inflight:
            call.state = "done"
            if recovering and self._salvage(call):
                continue
            if call.kind is Kind.FREE:
                self._end(call, None, None)  # what it frees went with the worker
            elif call.gen is not None:
                self._segment_died(call, call.gen, error, recovering)
            else:
                self._end(call, None, copy_error(error))
        for ctx in list(self.contexts):
            self._context_died(ctx, error, recovering)
        if recovering:
            self._out.append(RunJob("recover"))
        else:
            while self.queued:
                self._fail(self.queued.popleft(), self._stale_error())
        self._out.append(Notify())
        return self._take()

    def _salvage(self, call: CallRec) -> bool:
        """Keeps a call in flight at a crash to send again, where that gives its caller what the first
        worker would have (journal.replayable)."""
        if call.internal or call.ledger is None or call.ledger.attempts >= MAX_ATTEMPTS:
            return False
        if call.kind in TRANSFERS or isinstance(call.req, (p.Resume, p.AdoptGeneration)):
            return False
        # One stopped meanwhile goes again too: its interrupt ends it there at once (sent()), and its
        # caller gets the stopped result it asked for instead of the crash.
        ctx = call.ctx
        if ctx is None:
            ok = type(call.req) in STATELESS
        else:
            journal = ctx.journal
            ok = replayable(call.req, lambda: journal is not None and journal.lost is None)
        if ok:
            call.state = "salvaged"
            self.salvaged.append(call)
        return ok

    def _segment_died(self, call: CallRec, gen: Generation, error: BaseException, recovering: bool) -> None:
        ctx = call.ctx
        assert ctx is not None
        if isinstance(call.req, p.AdoptGeneration) or gen.done:
            return
        if recovering and gen.resuming and gen.suspension is not None and ctx.journal is not None \
                and not gen.stop_wanted:
            # The journal rebuilds the history up to the pause, and the generation goes on from its
            # portable form, the pieces delivered since the pause not delivered twice; a pause its caller
            # asked for meanwhile stays the caller's.
            caller = gen.phase is Phase.PAUSING and gen.why is Why.CALLER
            gen.crashed_under_resume(None)
            if caller:
                gen.why = Why.CALLER
            return
        gen.ended(None, copy_error(error))
        self._gen_gone(ctx, gen)

    def _context_died(self, ctx: ContextState, error: BaseException, recovering: bool) -> None:
        if ctx.status in (Status.CLOSED, Status.DEAD):
            return
        if ctx.status is Status.LOADING:
            ctx.status = Status.PAGED  # its page file is whole: the replacement pages it in
            return
        if ctx.status is Status.PAGED:
            return
        if ctx.status is Status.MOVING:
            ctx.death = error  # its state was read out: the move commits or aborts (then it is rebuilt)
            return
        held = ctx.hold_gen
        ctx.hold, ctx.hold_gen, ctx.move_token = None, None, None
        ctx.checkpointing = False
        ctx.incarnation += 1
        for gen in ctx.gens:
            if gen.why in (Why.CHECKPOINT, Why.MOVE):
                if gen.phase is Phase.PAUSED:
                    gen.why = Why.CRASH  # it goes on in the replacement
                elif gen.phase is Phase.PAUSING:  # its segment is sent again: no pause asked of it any more
                    gen.phase, gen.why = Phase.RUNNING, None
        del held
        if recovering and ctx.journal is not None:
            ctx.status = Status.RECOVERING
        else:
            self._kill(ctx, error)

    def _kill(self, ctx: ContextState, error: BaseException | None) -> None:
        ctx.status, ctx.death = Status.DEAD, error
        while ctx.queued:
            self._fail(ctx.queued.popleft(), self._dead_context_error(ctx))
        for gen in list(ctx.gens):
            gen.ended(None, self._dead_context_error(ctx))
            self._gen_gone(ctx, gen)

    def to_rebuild(self) -> list[ContextState]:
        """What the recovery job makes again in the replacement: every context the dead worker held."""
        return [c for c in self.contexts if c.status is Status.RECOVERING]

    def restored(self, ctx: ContextState, desc: Any, lost: str | None = None, *,
                 alone: bool = False) -> tuple[bool, list[Action]]:
        """A job made ctx again in the replacement (``lost``: empty, its history not rebuilt, why); False
        when it no longer wants it (closed meanwhile: the job frees it). ``alone``: a context rebuilt by
        itself (a move that aborted after its worker died), which serves at once."""
        if ctx.status is not Status.RECOVERING:
            return False, self._take()
        self._made(ctx, desc)
        ctx.status = Status.RESIDENT
        if lost is not None:
            ctx.notice = lost
            if ctx.journal is not None:
                ctx.journal.restart(None)
            for gen in list(ctx.gens):
                if gen.phase is Phase.PAUSED:  # what it goes on from is gone (one sent again from its
                    gen.ended(None, self._lost_error(ctx, lost))  # whole prompt goes on: recovered())
                    self._gen_gone(ctx, gen)
        if alone:
            self._serve(ctx)
            self._police()
        return True, self._take()

    def unrestorable(self, ctx: ContextState, why: str) -> list[Action]:
        """Not even an empty context could be made again for ctx: it is dead."""
        if ctx.status is Status.RECOVERING:
            self._kill(ctx, DeadWorkerError(f"context handle {ctx.handle}: its worker died and {why}"))
        return self._take()

    def recovered(self) -> list[Action]:
        """The replacement serves: the calls kept at the crash are sent again in their order, then what
        waited meanwhile; generations a crash or a checkpoint left paused go on."""
        if self.phase != "recovering":
            return self._take()
        self.epoch += 1
        self.phase, self.death = "alive", None
        for ctx in self.to_rebuild():  # the job did not get to it
            self._kill(ctx, DeadWorkerError(f"context handle {ctx.handle}: its recovery did not complete"))
        salvaged, self.salvaged = self.salvaged, []
        for call in salvaged:
            assert call.ledger is not None
            call.ledger.again()
            call.state = "new"
            if call.ctx is None:
                self._send(call)
            else:
                self._submit(call.ctx, call)  # a lost context's first call that needs its history says so
        for ctx in list(self.contexts):
            if ctx.status is Status.RESIDENT:
                self._serve(ctx)
            elif ctx.status is Status.PAGED and ctx.queued:
                ctx.status = Status.LOADING
                self._out.append(RunJob("page_in", ctx))
        while self.queued:
            self._send(self.queued.popleft())
        self._police()
        self._out.append(Notify())
        return self._take()

    def _serve(self, ctx: ContextState) -> None:
        """A context made again goes on: the generations a crash left paused, then the calls that waited."""
        for gen in list(ctx.gens):
            if gen.phase is Phase.PAUSED and gen.why is Why.CRASH:
                self._go_on(ctx, gen)
        self._flush_queued(ctx)
        self._run_deferred(ctx)

    def closing(self) -> list[Action]:
        """The pool closes: what runs is interrupted (so that the worker ends at once); a death from here on
        is a close, not a crash."""
        for ctx in self.contexts:
            head = self._head(ctx)
            if head is not None and head.state == "sent":
                self._out.append(Interrupt(ctx.slot, head.req_id))
        if self.phase == "alive":
            self.phase = "closing"
        return self._take()

    def close_all(self, error: BaseException, *, phase: str = "closed") -> list[Action]:
        """The pool closed (or, ``phase`` "dead", a recovery found no replacement): whatever still waits
        fails with ``error``; the page files go."""
        self.phase, self.death = phase, error
        for ctx in list(self.contexts):
            while ctx.queued:
                self._fail(ctx.queued.popleft(), copy_error(error))
            for gen in list(ctx.gens):
                if gen.phase is Phase.PAUSED:
                    gen.ended(None, copy_error(error))
                    self._gen_gone(ctx, gen)
            if ctx.page is not None:
                self._out.append(ClosePage(ctx.page))
                ctx.page = None
            if ctx.status is not Status.CLOSED:
                ctx.status, ctx.death = Status.DEAD, error
        while self.queued:
            self._fail(self.queued.popleft(), copy_error(error))
        for call in self.salvaged:
            self._end(call, None, copy_error(error))
        self.salvaged = []
        self._out.append(Notify())
        return self._take()

    # -- errors -----------------------------------------------------------------------------------------
    def _stale_error(self) -> BaseException:
        dead = self.death
        if isinstance(dead, PoolClosedError) or dead is None:
            return PoolClosedError("the pool is closed")
        first = str(dead).split("\n--- worker stderr")[0]
        err = DeadWorkerError(f"{first}; its models and contexts are gone. Start a replacement with Pool.replace().",
                              returncode=getattr(dead, "returncode", None), worker_id=getattr(dead, "worker_id", None),
                              pid=getattr(dead, "pid", None), stderr_tail=getattr(dead, "stderr_tail", ""))
        err.__cause__ = dead
        return err

    def _dead_context_error(self, ctx: ContextState) -> BaseException:
        dead = ctx.death if ctx.death is not None else self.death
        if isinstance(dead, PoolClosedError):
            return PoolClosedError("the pool is closed")
        if isinstance(dead, DeadWorkerError):
            return copy_error(dead)
        first = str(dead).split("\n--- worker stderr")[0] if dead is not None else "its worker died"
        err = DeadWorkerError(f"context handle {ctx.handle}: {first}; its models and contexts are gone. Start a "
                              "replacement with Pool.replace().", returncode=getattr(dead, "returncode", None),
                              worker_id=getattr(dead, "worker_id", None), pid=getattr(dead, "pid", None))
        err.__cause__ = dead
        return err

    def _lost_error(self, ctx: ContextState, why: str) -> ContextLostError:
        return ContextLostError(f"context handle {ctx.handle}: its worker died and crash recovery could not rebuild "
                                f"its history ({why}); it was made again empty, and serves from here")


def holds_nothing(error: BaseException) -> bool:
    """Whether a SaveState failed only because its context is empty (its state is then b"")."""
    return isinstance(error, ContextError) and "holds nothing" in str(error)


def _renamed(req: p.ContextRequest[Any], handle: int) -> p.ContextRequest[Any]:
    import msgspec

    return msgspec.structs.replace(req, context=handle)


__all__ = ["Action", "CallRec", "ClosePage", "ContextState", "CoreMachine", "Deliver", "Hold", "Interrupt", "Kind",
           "Notify", "RunJob", "Settle", "Status"]
