"""A context's link to its worker: sends its requests and knows which of them are decoding.

    Context / BranchStore / Branch / KV ──call(req)──▶ ContextLink ──▶ WorkerProcess.call ──▶ pipe
                          Context.interrupt() ──────▶ ContextLink.interrupt ──▶ the context's word in shm

Every call returns a Future of the reply type its request declares (protocol.py); a blocking method is
that future's .result(). The lock guards the bookkeeping of which decoding requests are in flight and is
never held across I/O: a large request stuck in a full pipe behind a running generate must not keep
interrupt() from stopping that generate.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import msgspec

from ._process import ContextJournal, PendingState, WorkerProcess
from .errors import (
    BadRequestError,
    CallTimeoutError,
    DeadWorkerError,
    InvalidArgumentError,
    StaleHandleError,
    WorkerCrashedError,
    WorkerError,
)
from .protocol import PAUSE_BIT, READS_ONLY, ContextRequest, Request, SaveState

R = TypeVar("R")
EventHandler = Callable[[dict[str, Any]], None]
PromptProgress = Callable[[int, int], None]
"""Prompt evaluation progress: (tokens decoded so far, tokens to decode), after each micro-batch."""


def events(**handlers: Callable[[Any], None] | None) -> Callable[[dict[str, Any]], None] | None:
    """An EVENT handler that passes ``event[key]`` to ``handlers[key]`` for each key it carries."""
    active = {k: fn for k, fn in handlers.items() if fn is not None}
    for key, fn in active.items():
        if not callable(fn):  # it would only fail on the reader thread, where nobody sees it
            raise BadRequestError(f"the {key} callback must be callable, got {type(fn).__name__}")
    if not active:
        return None

    def on_event(event: dict[str, Any]) -> None:
        for key, fn in active.items():
            if key in event:
                fn(event[key])

    return on_event


def spread_progress(progress: PromptProgress | None) -> Callable[[Any], None] | None:
    """A prompt_progress event's (done, total) pair as the two arguments of progress."""
    if progress is None:
        return None
    if not callable(progress):
        raise BadRequestError(f"progress must be callable, got {type(progress).__name__}")
    return lambda pair: progress(int(pair[0]), int(pair[1]))


STOP_GRACE = 2.0
"""Seconds a timed-out call that was interrupted gets to end before wait() gives up on it."""


def check_timeout(timeout: float | None) -> None:
    """A call's ``timeout`` (None or seconds >= 0), checked before its request is sent: a bad value must
    not leave the call running unobserved in its worker."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise InvalidArgumentError(f"timeout is a number of seconds >= 0 or None, got {timeout!r}")


def wait(fut: Future[R], timeout: float | None, stop: Callable[[], None] | None = None,
         what: str = "the call") -> R:
    """fut's result, waiting at most ``timeout`` seconds (None: as long as it takes; checked by
    check_timeout before the call was sent). When the time has passed, ``stop()`` (an interrupt) runs,
    the call gets STOP_GRACE seconds to end, and CallTimeoutError is raised, carrying what the stopped
    call returned (an interrupted generation's partial Result). Its worker dying meanwhile raises that
    error instead: it says more."""
    if timeout is None:
        return fut.result()
    try:
        return fut.result(timeout)
    except TimeoutError:
        if fut.done():
            raise  # the call's own error happens to be a TimeoutError
    partial: Any = None
    state = "it may still complete in its worker, unobserved"
    if stop is not None:
        stop()
        try:
            partial = fut.result(STOP_GRACE)
            state = "it was interrupted"
        except WorkerError:
            raise
        except TimeoutError:
            state = f"it was interrupted but had not ended {STOP_GRACE:g}s later"
        except Exception:
            state = "it was interrupted"
    err = CallTimeoutError(f"{what} did not end within timeout={timeout:g}s; {state}")
    err.result = partial
    raise err


def _paused(fut: Future[Any]) -> bool:
    return not fut.cancelled() and fut.exception() is None and getattr(fut.result(), "stop_reason", None) == "paused"


_CHECKPOINT = -1  # the gate's holder while a stream's checkpoint pause lands (no thread has taken it yet)


class ContextLink:
    def __init__(self, proc: WorkerProcess, handle: int, interrupt_slot: int) -> None:
        self.proc = proc
        self.handle = handle
        self._slot = interrupt_slot
        # Reentrant: a Stream's finalizer interrupts its request, and the garbage collector may run it on
        # a thread that holds this lock already.
        self._lock = threading.RLock()
        self._decoding: list[int] = []  # ids of decoding requests in flight, in the order the worker runs them
        self._cancelled: set[int] = set()  # of those, the ones to interrupt as soon as the worker starts them
        self._other_calls = 0  # calls in flight that do not decode but may change the context
        self._prompt_pauses: set[int] = set()  # generations that paused inside their prompt (prompt_paused)
        # A decoding call's future -> its request id, for wait()'s interrupt when its timeout passes.
        self._ids: weakref.WeakKeyDictionary[Future[Any], int] = weakref.WeakKeyDictionary()
        # A future whose call spans several requests (a pausable generation's segments) -> what stops it.
        self._stops: weakref.WeakKeyDictionary[Future[Any], Callable[[], None]] = weakref.WeakKeyDictionary()
        self.closed = False
        # Crash recovery (_recovery.py): the context's journal, why it could not be restored, and the ids
        # its calls in flight were sent again under (first id -> latest).
        self.journal: ContextJournal | None = None if proc.recovery is None else proc.recovery.journal()
        self.lost: str | None = None
        self._lost_error: WorkerCrashedError | None = None
        self._alias: dict[int, int] = {}
        self._sending = threading.local()  # .ids: where sending() collects this thread's decoding ids
        # While the context moves to another worker (migration.py) the thread moving it holds the link:
        # other threads' calls wait, then go to the worker it moved to.
        self._gate = threading.Condition(threading.Lock())
        self._mover: int | None = None
        self._senders = 0  # other threads' calls past the gate and not yet sent
        # Session paging (paging.py): called by each call past the gate, it pages the context in when it
        # is out (``paged``) and marks it used. Things holding handles of the context's worker (grammar
        # samplers) register in ``handle_holders``: while one is open the context stays resident.
        self.on_use: Callable[[], None] | None = None
        self.paged = False
        self.handle_holders: weakref.WeakSet[Any] = weakref.WeakSet()
        self.stream_checkpoint = False  # a stream paused to checkpoint the context (stream.Pausable)
        # The generations suspended in the context's worker now, as the AdoptGenerations that take them
        # over (its paused streams): asked at each checkpoint's reply, they replay first on top of it.
        self.suspended: Callable[[], list[Request[Any]]] | None = None
        self._checkpointing = 0  # checkpoint() calls under way

    @contextmanager
    def moving(self) -> Iterator[None]:
        """Holds the link for the calling thread (see _gate) once every call already past the gate has been
        sent; reentrant."""
        me = threading.get_ident()
        if self._mover == me:  # only this thread sets it to its own id
            yield
            return
        with self._gate:
            self._gate.wait_for(lambda: self._mover is None and self._senders == 0)
            self._mover = me
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def held_if_idle(self) -> Iterator[bool]:
        """Holds the link as moving() does, but only when nothing is under way on it: no call waiting at
        or past the gate, none decoding; yields whether it holds it (a pager's page-out)."""
        me = threading.get_ident()
        with self._gate:
            held = self._mover is None and self._senders == 0
            if held:
                self._mover = me
        if held:
            with self._lock:
                held = not self._decoding
            if not held:
                self._release()
        try:
            yield held
        finally:
            if held:
                self._release()

    def hold_for_checkpoint(self, request_id: int) -> bool:
        """Holds the link for a stream's own checkpoint (its pause, the SaveState, its resume), so that no
        other call runs on the context in between, but only when nothing else is under way on it: no call
        at or past the gate, nothing in flight but the stream's request (``request_id``) and calls that
        only read the context (protocol.READS_ONLY: a background checkpoint's SaveState). Never waits
        (the reader thread asks); the checkpoint's thread takes the hold over (adopt_hold) and releases it."""
        with self._gate:
            if self._mover is not None or self._senders:
                return False
            with self._lock:
                if self._decoding != [self._latest(request_id)] or self._other_calls:
                    return False
            self._mover = _CHECKPOINT
            return True

    def adopt_hold(self) -> None:
        """The calling thread takes over a hold_for_checkpoint() hold: its calls pass the gate."""
        with self._gate:
            assert self._mover == _CHECKPOINT
            self._mover = threading.get_ident()

    def release_hold(self) -> None:
        """Ends a hold_for_checkpoint() hold, taken over or not."""
        self._release()

    def _release(self) -> None:
        with self._gate:
            self._mover = None
            self._gate.notify_all()

    def holds_handles(self) -> bool:
        """Whether a grammar sampler of the context is open (its state is in the worker)."""
        return any(not h.closed for h in list(self.handle_holders))

    @contextmanager
    def sending(self) -> Iterator[list[int]]:
        """Collects the ids of the decoding requests this thread sends on the link inside the block: the
        asyncio face (_aio.py) interrupts them when the awaiting task is cancelled, whatever future (a
        mapped one, a Branch's) carries their reply."""
        outer = getattr(self._sending, "ids", None)
        ids: list[int] = []
        self._sending.ids = ids
        try:
            yield ids
        finally:
            self._sending.ids = outer

    def call(self, req: Request[R], on_event: EventHandler | None = None,
             on_id: Callable[[int], None] | None = None,
             after: Callable[[Future[Any]], None] | None = None) -> Future[R]:
        """Sends req; on_id(id) learns a decoding request's id (for interrupt_request); ``after`` is a done
        callback that runs right after the journal has recorded the call (a checkpoint's mark)."""
        if self.closed:
            raise StaleHandleError(f"context handle {self.handle} was closed")
        self._enter()
        try:
            return self._send(req, on_event, on_id, after)
        finally:
            self._leave()

    def _enter(self) -> None:
        """Past a move under way, and counted, so that the next move (or page-out) waits for this call;
        a paged-out context is paged in."""
        me = threading.get_ident()
        with self._gate:
            self._gate.wait_for(lambda: self._mover in (None, me))
            self._senders += 1
        if self.on_use is not None:
            try:
                self.on_use()
            except BaseException:
                self._leave()
                raise

    def _other_call_ended(self, _: Future[Any]) -> None:
        with self._lock:
            self._other_calls -= 1

    def _leave(self) -> None:
        with self._gate:
            self._senders -= 1
            self._gate.notify_all()

    def _send(self, req: Request[R], on_event: EventHandler | None, on_id: Callable[[int], None] | None,
              after: Callable[[Future[Any]], None] | None) -> Future[R]:
        if not self.proc.alive:
            self.proc.await_recovery()  # rebinds this link when it succeeds
        if isinstance(req, ContextRequest) and req.context != self.handle:
            req = msgspec.structs.replace(req, context=self.handle)  # made before a recovery or a move
        if self.closed:
            raise StaleHandleError(f"context handle {self.handle} was closed")
        if self.lost is not None:
            err = self._lost_error
            raise DeadWorkerError(
                f"context handle {self.handle}: its worker died and crash recovery could not restore it: "
                f"{self.lost}", returncode=getattr(err, "returncode", None), worker_id=getattr(err, "worker_id", None),
                pid=getattr(err, "pid", None))
        if not req.decodes:
            fut = self.proc.call(req, on_event)
            if type(req) not in READS_ONLY:  # a call that may change the context: no stream pauses before it
                with self._lock:
                    self._other_calls += 1
                fut.add_done_callback(self._other_call_ended)
            self._journal(req, fut, after)
            return fut
        sent: list[int] = []

        def track(req_id: int) -> None:
            sent.append(req_id)
            collect = getattr(self._sending, "ids", None)
            if collect is not None:
                collect.append(req_id)
            with self._lock:
                self._decoding.append(req_id)
            if on_id is not None:
                on_id(req_id)

        def untrack(req_id: int) -> None:
            with self._lock:
                req_id = self._latest(req_id)
                self._decoding.remove(req_id)
                self._cancelled.discard(req_id)
                # The worker starts the next request now (or already has): if it was cancelled while
                # queued, its id goes into the word, which the worker checks between tokens and steps.
                target = self._decoding[0] if self._decoding and self._decoding[0] in self._cancelled else 0
            if target:
                self.proc.interrupt(self._slot, target)

        def stop_on_error(event: dict[str, Any]) -> None:
            assert on_event is not None
            try:
                on_event(event)
            except BaseException:
                # A callback that raised (the caller gets its error when the call ends) wants no more of
                # this request: stop it instead of decoding on for nobody.
                if sent:
                    self.interrupt_request(sent[0])
                raise

        try:
            fut = self.proc.call(req, None if on_event is None else stop_on_error, on_id=track,
                                 on_resent=self._resent)
        except BaseException:
            # Failed after the id was tracked (e.g. KeyboardInterrupt in a blocked write): a phantom id at
            # the head of the list would take every later interrupt() of this context.
            if sent:
                untrack(sent[0])
            raise
        self._ids[fut] = sent[0]
        fut.add_done_callback(lambda _: untrack(sent[0]))
        self._journal(req, fut, after)
        return fut

    def _journal(self, req: Request[Any], fut: Future[Any], after: Callable[[Future[Any]], None] | None) -> None:
        if self.journal is not None:
            journal = self.journal

            def record(f: Future[Any]) -> None:
                if self._prompt_pauses and self._ids.get(f) in self._prompt_pauses:
                    # Paused inside its whole prompt: the history holds part of it, which the same
                    # request, sent again on resume, decodes again after whatever the cache then holds
                    # (the journal's history, after a crash). Nothing to record.
                    self._prompt_pauses.discard(self._ids[f])
                    return
                journal.record(req, f, self.handle)
                if journal.wants_checkpoint():  # its replay grew long: a checkpoint, off the reader thread
                    if self._checkpointing or (self.stream_checkpoint and _paused(f)):
                        # One is being taken (this is its SaveState), or a stream paused to take its own.
                        journal.checkpoint_done()
                    else:
                        threading.Thread(target=self._checkpoint_quietly, args=(journal,), daemon=True,
                                         name="lloyal-checkpoint").start()

            fut.add_done_callback(record)
        if after is not None:
            fut.add_done_callback(after)

    def checkpoint(self) -> int:
        """Context.checkpoint(): the context's state, saved after every call made before, becomes its
        journal's checkpoint; returns its size. Passes the gate before it takes the worker's transfer
        file, which a move holds while it waits for calls past the gate."""
        journal = self.journal
        if journal is None:
            raise InvalidArgumentError("a checkpoint needs crash recovery (Pool(recover=True))")
        if self.closed:
            raise StaleHandleError(f"context handle {self.handle} was closed")
        self._enter()
        counted, pending, data = True, PendingState(), None

        def saved(fut: Future[Any]) -> None:
            # At the reply, on the reader thread: the calls the worker ran before the SaveState have been
            # recorded, none after it, and a stream's segment that ended before it has said so.
            if fut.exception() is None:
                journal.restart(pending, self.suspended() if self.suspended is not None else ())

        with self._lock:
            self._checkpointing += 1
        try:
            with self.proc.transfer() as f:
                fut = self._send(SaveState(context=self.handle, path=f.path, in_place=True), None, None, saved)
                counted = False
                self._leave()
                fut.result()
                data = f.read()
        finally:
            pending.set(data)  # None (it failed, or was given up): a recovery waiting for it gives the context up
            if data is None and journal.checkpoint is pending:
                journal.lost = "its last checkpoint could not be read"
            with self._lock:
                self._checkpointing -= 1
            if counted:
                self._leave()
        assert data is not None  # else it raised
        return len(data)

    def _checkpoint_quietly(self, journal: ContextJournal) -> None:
        try:
            if journal is self.journal and not self.closed and not self.paged:  # a page file is one
                self.checkpoint()
        except Exception:
            pass  # a worker that died or a context closed meanwhile: recovery replays the journal instead
        finally:
            journal.checkpoint_done()

    # -- crash recovery ---------------------------------------------------------------------------------
    def rebind(self, proc: WorkerProcess, handle: int, interrupt_slot: int) -> None:
        """Points the link at the context recovery made in a replacement worker."""
        with self._lock:
            self.proc, self.handle, self._slot = proc, handle, interrupt_slot

    def lose(self, why: str, error: WorkerCrashedError | None = None) -> None:
        """Recovery could not restore the context: its calls raise DeadWorkerError saying why."""
        self.lost, self._lost_error = why, error

    def latest(self, req_id: int) -> int:
        """The id a call first sent as req_id runs under now (crash recovery sends calls again)."""
        with self._lock:
            return self._latest(req_id)

    def _latest(self, req_id: int) -> int:
        while req_id in self._alias:
            req_id = self._alias[req_id]
        return req_id

    def _resent(self, old_id: int, new_id: int) -> None:
        """A decoding call in flight at a crash was sent again under new_id."""
        with self._lock:
            old_id = self._latest(old_id)
            self._alias[old_id] = new_id
            if old_id in self._decoding:
                self._decoding[self._decoding.index(old_id)] = new_id
            if old_id in self._cancelled:
                self._cancelled.discard(old_id)
                self._cancelled.add(new_id)
            target = new_id if self._decoding and self._decoding[0] == new_id and new_id in self._cancelled else 0
        if target:
            self.proc.interrupt(self._slot, target)

    def stop_with(self, fut: Future[Any], stop: Callable[[], None]) -> None:
        """``stop`` ends the call behind fut (made of several requests): for wait() and stopper()."""
        self._stops[fut] = stop

    def stopper(self, fut: Future[Any]) -> Callable[[], None] | None:
        """What ends the call behind fut, if it is one stop_with() named."""
        return self._stops.get(fut)

    def wait(self, fut: Future[R], timeout: float | None, what: str) -> R:
        """fut's result within timeout seconds (module wait()); a decoding call is interrupted when the
        time has passed."""
        stop = self._stops.get(fut)
        req_id = self._ids.get(fut)
        if stop is None and req_id is not None:
            stop = lambda: self.interrupt_request(req_id)  # noqa: E731
        return wait(fut, timeout, stop, what)

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Past the gate (as a call is, paged in) for the block: for a call that takes the worker's transfer
        file before its request is sent. A hold (a move, a stream's checkpoint) takes the link and then
        that file: taking the file first and then waiting at the gate would deadlock with it."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def interrupt(self) -> None:
        """Stops the decoding request the worker runs (or runs next) on this context; a no-op when none."""
        with self._lock:
            target = self._decoding[0] if self._decoding else 0
        if target:
            self.proc.interrupt(self._slot, target)

    def prompt_paused(self, req_id: int) -> None:
        """The generation sent as req_id paused inside its prompt (its "paused" event, which comes before
        its reply): the journal does not record it."""
        self._prompt_pauses.add(req_id)

    def pause_request(self, req_id: int) -> bool:
        """Asks one generation to pause at its next token boundary (protocol.PAUSE_BIT): now if the
        worker runs it, else as soon as it starts. False when it is no longer in flight."""
        with self._lock:
            req_id = self._latest(req_id)
            if req_id not in self._decoding:
                return False
        self.proc.interrupt(self._slot, req_id | PAUSE_BIT)
        return True

    def interrupt_request(self, req_id: int) -> None:
        """Stops one decoding request: now if the worker runs it, else as soon as it starts; a no-op once
        it has ended."""
        with self._lock:
            req_id = self._latest(req_id)
            if req_id not in self._decoding:
                return
            self._cancelled.add(req_id)
            target = req_id if self._decoding[0] == req_id else 0
        if target:
            self.proc.interrupt(self._slot, target)
