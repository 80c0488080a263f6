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

from collections import deque
from concurrent.futures import Future
from typing import Any, cast

from . import protocol as p
from ._calls import CallMachine
from ._generation import Generation, Phase, Why
from ._journal import MAX_ATTEMPTS, STATELESS, Journal, PendingState, replayable
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
)
from .errors import DeadWorkerError, PoolClosedError, StaleHandleError, WorkerCrashedError, copy_error


class CoreMachine(CallMachine):
    """The contexts of one worker slot (module docstring): its calls (CallMachine), moves, its worker's
    death and the recovery after it."""

    # -- moves (migration.py orchestrates: begin here, build in the target, commit or abort) -----------
    def refuse_moves(self) -> list[Action]:
        """The worker is being drained (Pool.drain): no context moves in from here on."""
        self.accepting = False
        return self._take()

    def begin_move(self, ctx: ContextState, token: object, future: Future[Any]) -> list[Action]:
        """Holds ctx for a move: pauses its running generations and, after every call sent before, saves its
        state (a MOVE_SAVE, whose job reads it out: the future gets ("state", file)); a paged-out one moves
        as its page file (("paged", page)). A context in transition settles first."""
        if ctx.status is Status.CLOSED:
            self._out.append(Settle(future, error=StaleHandleError(f"context handle {ctx.handle} was closed")))
        elif ctx.status is Status.DEAD:
            self._out.append(Settle(future, error=self._dead_context_error(ctx)))
        elif not ctx.settled:
            ctx.deferred.append(lambda m: cast(CoreMachine, m)._begin_move(ctx, token, future))
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
        for gen in ctx.gens:  # paused, it moves as it is; with calls behind it, it ends here first
            if gen.phase is Phase.RUNNING and not self._crowded(ctx, gen):
                self._pause(ctx, gen, Why.MOVE)
        ctx.hold = Hold.MOVE
        self._submit(ctx, CallRec(p.SaveState(context=ctx.handle, path="", in_place=True), ctx, future=future,
                                  kind=Kind.MOVE_SAVE, internal=True,
                                  pending=PendingState() if ctx.journal is not None else None))

    def abort_move(self, ctx: ContextState) -> list[Action]:
        """The target failed (or the state could not be read): the context goes on here, the generations
        the move paused resumed; rebuilt from its journal where its worker died meanwhile."""
        self._abort_move(ctx)
        return self._take()

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

    # -- the page-out and page-in jobs' ends (the policy: CallMachine._police) ----------------------------
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
        if not isinstance(error, WorkerCrashedError):  # its death, once seen, says what becomes of them
            while ctx.queued:
                self._fail(ctx.queued.popleft(), copy_error(error))
        self._run_deferred(ctx)
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
        self.deaths += 1
        self.epoch += 1  # the next worker's: a generation resumed from here on is taken over there first
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
        if ctx.status in (Status.LOADING, Status.PAGED):
            if recovering:
                ctx.status = Status.PAGED  # its page file is whole: the replacement pages it in
                return
            if ctx.page is not None:  # no replacement will page it in
                self._out.append(ClosePage(ctx.page))
                ctx.page = None
            self._kill(ctx, error)
            return
        if ctx.status is Status.MOVING:
            ctx.death = error  # its state was read out: the move commits or aborts (then it is rebuilt)
            return
        held = ctx.hold_gen
        ctx.hold, ctx.hold_gen, ctx.move_token = None, None, None
        ctx.checkpointing = False
        ctx.incarnation += 1
        for gen in ctx.gens:
            seg = gen.segment
            if seg is not None and seg.state == "queued" and isinstance(seg.req, p.Resume) and recovering:
                # Resumed, not sent yet: its Resume was for the dead worker, which held it paused. Paused
                # again, it goes on after the recovery, taken over there first (_serve).
                ctx.queued = deque(c for c in ctx.queued if c.gen is not gen)
                gen.segment, gen.adopting = None, None
                caller = gen.phase is Phase.PAUSING and gen.why is Why.CALLER
                gen.phase, gen.why = Phase.PAUSED, Why.CALLER if caller else Why.CRASH
                continue
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

    def to_rebuild(self) -> list[ContextState]:
        """What the recovery job makes again in the replacement: every context the dead worker held."""
        return [c for c in self.contexts if c.status is Status.RECOVERING]

    def restored(self, ctx: ContextState, desc: Any, lost: str | None = None, *, alone: bool = False,
                 deaths: int | None = None) -> tuple[bool, list[Action]]:
        """A job made ctx again in the replacement (``lost``: empty, its history not rebuilt, why); False
        when it no longer wants it (closed meanwhile: the job frees it). ``alone``: a context rebuilt by
        itself (a move that aborted after its worker died), which serves at once."""
        if ctx.status is not Status.RECOVERING or (deaths is not None and deaths != self.deaths):
            return False, self._take()  # closed meanwhile, or made in a worker that died since
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

    def unrestorable(self, ctx: ContextState, why: str, deaths: int | None = None) -> list[Action]:
        """Not even an empty context could be made again for ctx: it is dead."""
        if ctx.status is Status.RECOVERING and (deaths is None or deaths == self.deaths):
            self._kill(ctx, DeadWorkerError(f"context handle {ctx.handle}: its worker died and {why}"))
        return self._take()

    def recovered(self, deaths: int | None = None) -> list[Action]:
        """The replacement serves: the calls kept at the crash are sent again in their order, then what
        waited meanwhile; generations a crash or a checkpoint left paused go on. Not when the replacement
        died meanwhile (``deaths``, as the job found them, is stale): the next recovery does it."""
        if self.phase != "recovering" or (deaths is not None and deaths != self.deaths):
            return self._take()
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
        """The pool closes: what runs is interrupted (so that the worker reads its SHUTDOWN at once), and
        every call in flight ends with PoolClosedError, whatever its reply says; a death from here on is a
        close, not a crash."""
        for call in self.inflight:
            if call.callback_error is None:
                call.callback_error = PoolClosedError("the pool was closed while the call was in flight")
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
            checkpoint = None if ctx.journal is None else ctx.journal.checkpoint
            if isinstance(checkpoint, PendingState):
                checkpoint = checkpoint.data
            if hasattr(checkpoint, "close"):  # a state file a move left as the checkpoint
                self._out.append(ClosePage(checkpoint))
            if ctx.status is not Status.CLOSED:
                ctx.status, ctx.death = Status.DEAD, error
        while self.queued:
            self._fail(self.queued.popleft(), copy_error(error))
        for call in self.salvaged:
            self._end(call, None, copy_error(error))
        self.salvaged = []
        self._out.append(Notify())
        return self._take()


__all__ = ["Action", "CallRec", "ClosePage", "ContextState", "CoreMachine", "Deliver", "Hold", "Interrupt",
           "Kind", "Notify", "RunJob", "Settle", "Status"]
