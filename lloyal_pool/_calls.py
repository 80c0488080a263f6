"""The lifecycle machine's calls (the first half of _machine.CoreMachine): what becomes of a call made on a
context in each of its states, its reply and events (the journal written in reply order), a context's
generations (pause, resume, stop, a checkpoint's pause), interrupts, checkpoints, residency and close.
Pure: every method returns the actions it leads to (_states.py)."""

from __future__ import annotations

from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any

from . import protocol as p
from ._generation import Generation, Phase, Why
from ._journal import Journal, Ledger, PendingState, starts_afresh
from ._residency import victims
from ._states import (
    TRANSFERS,
    Action,
    CallRec,
    ClosePage,
    ContextState,
    Deliver,
    Hold,
    Interrupt,
    Kind,
    Notify,
    RunJob,
    Settle,
    Status,
    _renamed,
    holds_nothing,
)
from .errors import (
    ContextError,
    ContextLostError,
    DeadWorkerError,
    PoolClosedError,
    StaleHandleError,
    WorkerCrashedError,
    copy_error,
)


class CallMachine:
    """The contexts of one worker slot (_machine.py's docstring). ``recover``: Pool(recover=True), which keeps a
    journal per context and rebuilds them in a replacement; ``checkpoint_tokens``: Pool(checkpoint_tokens);
    ``budget``: Pool(max_resident_contexts)."""

    def __init__(self, *, recover: bool = False, checkpoint_tokens: int | None = None,
                 budget: int | None = None) -> None:
        self.recover = recover
        self.checkpoint_tokens = checkpoint_tokens
        self.budget = budget
        self.epoch = 0  # the worker incarnation: bumped at each death (what a replacement serves)
        self.phase = "alive"  # "recovering", "dead", "closed"
        self.death: BaseException | None = None
        self.contexts: OrderedDict[ContextState, None] = OrderedDict()  # least recently used first
        self.outbox: deque[CallRec] = deque()  # decided, to be written in this order
        self.inflight: dict[CallRec, None] = {}  # every call sending or sent, in decision order
        self.queued: deque[CallRec] = deque()  # worker-level calls waiting for a recovery
        self.salvaged: list[CallRec] = []  # calls in flight at a crash, to send again after it
        self.paging_out: ContextState | None = None
        self.accepting = True  # contexts may move in (not while the worker is drained)
        self.deaths = 0  # of the workers that served the slot: a job that began before the latest is stale
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
        if self.phase in ("closing", "closed", "dead") and call.kind is not Kind.FREE:
            self._fail(call, self._stale_error())
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
        if call.state in ("sending", "sent") and call.epoch == self.epoch and not isinstance(error, WorkerCrashedError):
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
        if self._crowded(ctx, gen):
            return
        ctx.hold, ctx.hold_gen = Hold.CHECKPOINT, gen
        self._pause(ctx, gen, Why.CHECKPOINT)

    @staticmethod
    def _crowded(ctx: ContextState, gen: Generation) -> bool:
        """Whether a call that changes the context is under way besides gen's segment: a pause of gen for
        the machine's own ends (a checkpoint, a move) would let that call drop the paused generation."""
        return any(c is not gen.segment and (c.decodes or type(c.req) not in p.READS_ONLY)
                   for c in (*ctx.inflight, *ctx.queued))

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
        if ctx.move_token is not None:  # the move takes it paused (its target adopts it): it goes on there
            ctx.deferred.append(lambda m: m._resume_deferred(ctx, gen))
        else:
            self._go_on(ctx, gen)
        return True, self._take()

    def _resume_deferred(self, ctx: ContextState, gen: Generation) -> None:
        if gen.phase is Phase.PAUSED and gen.why is Why.CALLER and ctx.status is Status.RESIDENT:
            self._go_on(ctx, gen)

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
                self._out.append(Notify())  # a waiter on ``state.checkpointing`` (a benchmark's count)
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

    def _kill(self, ctx: ContextState, error: BaseException | None) -> None:
        ctx.status, ctx.death = Status.DEAD, error
        while ctx.queued:
            self._fail(ctx.queued.popleft(), self._dead_context_error(ctx))
        for gen in list(ctx.gens):
            gen.ended(None, self._dead_context_error(ctx))
            self._gen_gone(ctx, gen)

    # -- a move that ends here (the rest: _machine.CoreMachine) ---------------------------------------
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

    # -- errors -----------------------------------------------------------------------------------------
    def _stale_error(self) -> BaseException:
        dead = self.death
        if dead is None:
            return PoolClosedError("its worker is being closed")
        if isinstance(dead, PoolClosedError):
            return copy_error(dead)  # which worker, or the whole pool
        first = str(dead).split("\n--- worker stderr")[0]
        err = DeadWorkerError(f"{first}; its models and contexts are gone. Start a replacement with Pool.replace().",
                              returncode=getattr(dead, "returncode", None), worker_id=getattr(dead, "worker_id", None),
                              pid=getattr(dead, "pid", None), stderr_tail=getattr(dead, "stderr_tail", ""))
        err.__cause__ = dead
        return err

    def _dead_context_error(self, ctx: ContextState) -> BaseException:
        dead = ctx.death if ctx.death is not None else self.death
        if isinstance(dead, PoolClosedError):
            return copy_error(dead)
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


__all__ = ["CallMachine"]
