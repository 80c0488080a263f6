"""One worker slot's core: the only owner of its contexts' lifecycle, as vLLM's EngineCore owns an engine's
state behind one loop. It drives a pure machine (_machine.CoreMachine) and carries out what it decides.

    caller threads ──submit/pause/move...──▶ [core lock: machine step] ──▶ outbox ──flush──▶ WorkerProcess
    reader thread  ──reply/event/death─────▶ [core lock: machine step] ──▶ settle futures, deliver pieces
    loop thread (one per core) ◀──RunJob── the steps that wait on the worker: transfers (checkpoints,
        save/load_state, a move's state), page-out and page-in, crash recovery and rebuilds

The core lock is held for a machine step only, never across I/O: a frame stuck in a full pipe behind a
running generation must not keep an interrupt (a word in shared memory) from stopping it. Frames leave in
the order the machine decided them (the flush lock, taken before the core lock, keeps that order across
threads). The reader never writes: what a reply decides to send is flushed by the loop. Jobs run one at a
time on the loop, so the worker's transfer file has one user; a job waits on worker replies only (never
on another job, a caller, or another core), and a worker's death fails every reply it waits for, so no
job waits on a dead worker.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from . import _jobs
from . import protocol as p
from ._futures import running, wait
from ._generation import Generation, Phase
from ._jobs import Host
from ._machine import (
    Action,
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
from ._process import READING
from .errors import ContextError, LloyalError, PoolClosedError, WorkerCrashedError

if TYPE_CHECKING:
    from ._journal import Journal
    from ._process import WorkerProcess
    from .shm import Region

log = logging.getLogger("lloyal_pool")
R = TypeVar("R")
MOVED = object()  # WorkerCore.step's answer when its guard failed: the context moved to another core
_serials = itertools.count()


class WorkerCore:
    """The core of one worker slot (module docstring): ``proc`` is the worker serving it now (a recovery
    replaces it). ``host`` is the pool's, for recovery; ``page_dir`` where page files go."""

    def __init__(self, proc: WorkerProcess, *, recover: bool = False, checkpoint_tokens: int | None = None,
                 budget: int | None = None, page_dir: str | None = None, host: Host | None = None) -> None:
        self.proc = proc
        self.serial = next(_serials)  # the order two cores' locks are taken in (step_with)
        self.machine = CoreMachine(recover=recover, checkpoint_tokens=checkpoint_tokens, budget=budget)
        self.page_dir = page_dir
        self._host = host
        self._lock = threading.RLock()  # reentrant: a finalizer (a Stream's) may interrupt on a thread that holds it
        self._changed = threading.Condition(self._lock)
        self._flush_lock = threading.Lock()
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()  # ModelEntry: what a recovery loads again
        self._urgent: deque[RunJob] = deque()
        self._background: deque[RunJob] = deque()
        self._job_ready = threading.Condition(threading.Lock())
        self._stopping = False
        self._exited = False  # the loop returned: a job posted now is never run
        self.page_in_s = 0.0
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"lloyal-core{proc.worker_id}")
        self._thread.start()
        proc.owner = self

    def __repr__(self) -> str:
        return f"<WorkerCore worker={self.proc.worker_id} {self.machine.phase}>"

    # -- stepping the machine -------------------------------------------------------------------------
    def step(self, fn: Callable[..., Any], *args: Any, guard: Callable[[], bool] | None = None,
             flush: bool = True, **kwargs: Any) -> Any:
        """fn (a machine message) under the core lock, then its actions, then the outbox written (by the
        loop when on a reader thread, which must never block on the pipe; not at all with ``flush``
        False: inside a write). Returns what fn returns besides its actions (when it returns a pair);
        MOVED, doing nothing, when ``guard()`` (read under the lock) is false."""
        with self._lock:
            if guard is not None and not guard():
                return MOVED
            out = fn(*args, **kwargs)
            actions: list[Action]
            value: Any = None
            if isinstance(out, tuple):
                value, actions = out
            else:
                actions = out
            if any(isinstance(a, Notify) for a in actions):
                self._changed.notify_all()
            pending = bool(self.machine.outbox)
        self._carry_out(actions)
        if pending and flush:
            if getattr(READING, "active", False):
                self._post(RunJob("flush"))
            else:
                self._flush()
        return value

    def step_with(self, other: WorkerCore, fn: Callable[[], tuple[list[Action], list[Action]]]) -> None:
        """fn() with both cores' locks held (taken in worker order, so that two moves in opposite
        directions cannot each hold one): a move's commit. fn returns this core's actions and other's."""
        first, second = sorted((self, other), key=lambda c: c.serial)
        with first._lock, second._lock:
            mine, theirs = fn()
            for core, actions in ((self, mine), (other, theirs)):
                if any(isinstance(a, Notify) for a in actions):
                    core._changed.notify_all()
        for core, actions in ((self, mine), (other, theirs)):
            core._carry_out(actions)
            core._flush()

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Settle):
                fut = action.future
                if fut.done():
                    continue
                if action.error is not None:
                    fut.set_exception(action.error)
                else:
                    fut.set_result(action.result)
            elif isinstance(action, Deliver):
                proc = self.proc
                proc._in_callback = True  # the hang watch waits: the worker may block on a full pipe
                try:
                    action.fn(action.event)
                except BaseException as exc:  # the caller's, when the call ends; the reader goes on
                    self.step(self.machine.callback_failed, action.call, exc, flush=False)
                finally:
                    proc._in_callback = False
            elif isinstance(action, Interrupt):
                self.proc.interrupt(action.slot, action.value)
            elif isinstance(action, RunJob):
                self._post(action)
            elif isinstance(action, ClosePage):
                action.page.close()

    def _flush(self) -> None:
        """Writes the outbox in order (the flush lock keeps two threads' frames from crossing)."""
        with self._flush_lock:
            while True:
                with self._lock:
                    if not self.machine.outbox:
                        return
                    call = self.machine.outbox.popleft()
                    proc = self.proc
                    req = self._wire(call)
                try:
                    self._write(proc, call, req)
                except BaseException as exc:
                    self.step(self.machine.unsent, call, exc, flush=False)
                    if not isinstance(exc, (LloyalError, WorkerCrashedError)):
                        self._post(RunJob("flush"))  # what is left goes out from the loop
                        raise

    def _wire(self, call: CallRec) -> p.Request[Any]:
        """The call's request as the worker knows its handles now (under the lock)."""
        req = call.req
        ctx = call.ctx
        if ctx is not None and isinstance(req, p.ContextRequest) and req.context != ctx.handle:
            req = msgspec.structs.replace(req, context=ctx.handle)
        model = call.model
        if model is not None and getattr(req, "model", model._handle) != model._handle:
            req = msgspec.structs.replace(req, model=model._handle)
        draft = call.data
        if isinstance(req, p.GenerateWithDraft) and isinstance(draft, ContextState) and req.draft != draft.handle:
            req = msgspec.structs.replace(req, draft=draft.handle)  # a draft made again since
        return req

    def _write(self, proc: WorkerProcess, call: CallRec, req: p.Request[Any]) -> Future[Any]:
        machine = self.machine

        def on_event(payload: dict[str, Any]) -> None:
            self.step(machine.event, call, payload)

        def on_done(result: Any, error: BaseException | None) -> None:
            self.step(machine.reply, call, result, error)

        wants_events = call.on_event is not None or call.gen is not None
        return proc.call(req, on_event if wants_events else None,
                         on_id=lambda req_id: self.step(machine.sent, call, req_id, flush=False), on_done=on_done)

    # -- the loop and its jobs ------------------------------------------------------------------------
    def _post(self, job: RunJob) -> None:
        with self._job_ready:
            if self._exited:
                if job.kind == "call":  # its caller waits: the worker is closed
                    job.data[1].set_exception(PoolClosedError(f"worker {self.proc.worker_id} was closed"))
                return
            (self._background if job.kind in ("page_out", "flush") else self._urgent).append(job)
            self._job_ready.notify()

    def _loop(self) -> None:
        while True:
            with self._job_ready:
                while not (self._urgent or self._background or self._stopping):
                    self._job_ready.wait()
                if self._stopping and not self._urgent:
                    for left in self._background:  # the loop is gone: nobody runs them
                        if left.kind == "call":
                            left.data[1].set_exception(PoolClosedError("the worker was closed"))
                    self._background.clear()
                    self._exited = True
                    return
                job = self._urgent.popleft() if self._urgent else self._background.popleft()
            try:
                _jobs.run(self, job)
            except BaseException:  # a job's bug must not end the loop: every later job would hang
                log.exception("[core] worker %d: job %s failed", self.proc.worker_id, job.kind)
            try:
                self._flush()
            except BaseException:
                log.exception("[core] worker %d: flush failed", self.proc.worker_id)

    # -- the worker's death ----------------------------------------------------------------------------
    def worker_died(self, proc: WorkerProcess, error: WorkerCrashedError | PoolClosedError) -> None:
        """The reader learnt of the death (_process.WorkerProcess calls it before it fails anything else)."""
        if proc is self.proc:
            self.step(self.machine.died, error)

    # -- what the facades call --------------------------------------------------------------------------
    def call(self, req: p.Request[R], on_event: Callable[[dict[str, Any]], None] | None = None, *,
             model: Any = None) -> Future[R]:
        """A worker-level request (a model's, the tokenizer's, a ping): sent now, or once a recovery ends."""
        fut: Future[R] = running()
        self.step(self.machine.submit, CallRec(req, None, future=fut, on_event=on_event, model=model))
        return fut

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Waits until predicate() (read under the core lock) holds; False on timeout."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def settle(self, timeout: float | None = None) -> bool:
        """Waits until no page-out is under way or due (tests, a benchmark's counts)."""
        def quiet() -> bool:
            m = self.machine
            return m.paging_out is None and not any(j.kind == "page_out" for j in self._background)
        return self.wait_for(quiet, timeout)

    def contexts_of(self, model: Any) -> list[ContextState]:
        with self._lock:
            return [c for c in self.machine.contexts if c.model is model]

    def forget(self, state: ContextState) -> None:
        """A context its model's close freed in the worker: its handle goes stale."""
        self.step(self.machine.close, state, running(), freed=True)

    def on_loop(self, fn: Callable[[WorkerProcess], R]) -> Future[R]:
        """fn(the worker) run on the loop thread, between jobs (a move's target making its context: it uses
        the transfer file)."""
        fut: Future[R] = running()
        self._post(RunJob("call", data=(fn, fut)))
        return fut

    def shutdown(self) -> None:
        """The pool closes: what runs is interrupted (so that the worker ends at once); the loop stops
        once its urgent jobs are done."""
        self.step(self.machine.closing)
        with self._job_ready:
            self._stopping = True
            self._job_ready.notify_all()

    def closed(self, error: BaseException) -> None:
        """After the worker was closed: whatever waits fails, the page files go."""
        self.step(self.machine.close_all, error)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def paging_stats(self) -> dict[str, Any]:
        with self._lock:
            m = self.machine
            counted = [c for c in m.contexts if c.pageable]
            pages = [c.page for c in m.contexts if c.page is not None]
            resident = sum(1 for c in counted if c.status in (Status.RESIDENT, Status.PAGING_OUT, Status.LOADING))
            paged = sum(1 for c in counted if c.status is Status.PAGED)
            out: dict[str, Any] = {
                "budget": m.budget, "resident": resident, "paged": paged, "page_outs": m.page_outs,
                "page_ins": m.page_ins,
                "page_in_ms_mean": 1000 * self.page_in_s / m.page_ins if m.page_ins else 0.0}
        out["page_bytes"] = sum(pg.size for pg in pages)
        out["page_disk_bytes"] = sum(pg.disk_bytes for pg in pages)
        out["page_dir"] = self.page_dir
        return out


class ContextCore:
    """A context's face to its core: what Context, its BranchStore, its Samplers and Session call. The
    state it names (``state``) moves with the context between cores (Context.move_to)."""

    def __init__(self, core: WorkerCore, state: ContextState) -> None:
        self.core = core
        self.state = state
        self._calls: weakref.WeakKeyDictionary[Future[Any], CallRec] = weakref.WeakKeyDictionary()
        self._stops: weakref.WeakKeyDictionary[Future[Any], Callable[[], None]] = weakref.WeakKeyDictionary()
        self._sending = threading.local()

    # -- where it lives ------------------------------------------------------------------------------------
    @property
    def handle(self) -> int:
        return self.state.handle

    @property
    def proc(self) -> WorkerProcess:
        return self.core.proc

    @property
    def region(self) -> Region:
        return self.core.proc.region

    @property
    def closed(self) -> bool:
        return self.state.status is Status.CLOSED

    @property
    def paged(self) -> bool:
        return self.state.status in (Status.PAGED, Status.PAGING_OUT)

    @property
    def journal(self) -> Journal | None:
        return self.state.journal

    @property
    def incarnation(self) -> int:
        return self.state.incarnation

    def _step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """A machine message on the core that holds the context now (a move may hand it to another)."""
        while True:
            core = self.core

            def here(held: WorkerCore = core) -> bool:
                return self.core is held

            out = core.step(getattr(core.machine, name), *args, guard=here, **kwargs)
            if out is not MOVED:
                return out

    # -- calls ---------------------------------------------------------------------------------------------
    def call(self, req: p.Request[R], on_event: Callable[[dict[str, Any]], None] | None = None, *,
             data: Any = None) -> Future[R]:
        """Sends req on the context (queued while it pages in, is held, moves or recovers)."""
        fut: Future[R] = running()
        call = CallRec(req, self.state, future=fut, on_event=on_event, data=data)
        if call.decodes:
            self._calls[fut] = call
            collect = getattr(self._sending, "calls", None)
            if collect is not None:
                collect.append(call)
        self._step("submit", call)
        return fut

    def wait(self, fut: Future[R], timeout: float | None, what: str) -> R:
        """fut's result within timeout seconds (a decoding call is interrupted when the time has passed)."""
        return wait(fut, timeout, self.stopper(fut), what)

    def stopper(self, fut: Future[Any]) -> Callable[[], None] | None:
        """What ends the call behind fut (a generation: its stop; a decoding call: its interrupt)."""
        stop = self._stops.get(fut)
        if stop is not None:
            return stop
        call = self._calls.get(fut)
        if call is None:
            return None
        return lambda: self._step("interrupt_call", call)

    def stop_with(self, fut: Future[Any], stop: Callable[[], None]) -> None:
        self._stops[fut] = stop

    @contextmanager
    def sending(self) -> Iterator[list[CallRec]]:
        """Collects the decoding calls this thread sends on the context inside the block: the asyncio face
        (_aio.py) interrupts them when the awaiting task is cancelled, whatever future carries their reply."""
        outer = getattr(self._sending, "calls", None)
        calls: list[CallRec] = []
        self._sending.calls = calls
        try:
            yield calls
        finally:
            self._sending.calls = outer

    def interrupt_calls(self, calls: list[CallRec]) -> None:
        for call in calls:
            self._step("interrupt_call", call)

    def interrupt_future(self, fut: Future[Any]) -> None:
        stop = self.stopper(fut)
        if stop is not None:
            stop()

    def interrupt(self) -> None:
        """Stops the decoding call the worker runs (or runs next) on this context; a no-op when none."""
        self._step("interrupt", self.state)

    # -- generations ---------------------------------------------------------------------------------------
    def generation(self, req: p.Generate, deliver: Callable[[dict[str, Any]], None] | None) -> Generation:
        gen = Generation(req, deliver, self.core.machine.checkpoint_tokens if self.state.journal else None)
        self.stop_with(gen.future, lambda: self.stop(gen))
        self._step("start_generation", self.state, gen)
        return gen

    def pause(self, gen: Generation, wait_for: bool, timeout: float | None) -> bool:
        self._step("pause", self.state, gen)
        if not wait_for:
            return gen.phase in (Phase.PAUSING, Phase.PAUSED)
        self.core.wait_for(lambda: gen.phase in (Phase.PAUSED, Phase.DONE), timeout)
        return gen.phase is Phase.PAUSED

    def resume(self, gen: Generation) -> bool:
        self.core.wait_for(lambda: gen.phase is not Phase.PAUSING, None)
        return bool(self._step("resume", self.state, gen))

    def stop(self, gen: Generation) -> None:
        self._step("stop", self.state, gen)

    # -- state -------------------------------------------------------------------------------------------
    def save_state(self) -> bytes:
        fut: Future[bytes] = running()
        self._step("submit", CallRec(p.SaveState(context=self.state.handle, path="", in_place=True), self.state,
                                     future=fut, kind=Kind.SAVE))
        return fut.result()

    def load_state(self, data: bytes) -> int:
        fut: Future[int] = running()
        self._step("submit", CallRec(p.LoadState(context=self.state.handle, path=""), self.state, future=fut,
                                     kind=Kind.LOAD, data=data))
        return fut.result()

    def checkpoint(self) -> int:
        if self.state.journal is None:
            raise ContextError("checkpoint() is for crash recovery: create the pool with Pool(recover=True)")
        fut: Future[int] = running()
        self._step("checkpoint", self.state, fut)
        return fut.result()

    def pin(self, delta: int) -> None:
        self._step("pin", self.state, delta)

    def close(self, *, freed: bool = False) -> None:
        if self.state.status is Status.CLOSED:
            return
        fut: Future[None] = running()
        self._step("close", self.state, fut, freed=freed)
        try:
            fut.result()
        except LloyalError:
            pass  # its worker died or closed meanwhile: nothing is left to free



__all__ = ["ContextCore", "WorkerCore"]
