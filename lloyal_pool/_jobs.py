"""The steps of a worker's core that wait on the worker, run one at a time on the core's loop thread
(_core.WorkerCore._loop): the transfers (a checkpoint's or save_state()'s SaveState and the state read out,
load_state()'s LoadState, a move's SaveState), page-outs and page-ins, and a crash recovery (a replacement,
its models loaded again, each context rebuilt: _image.make). Each hears of the worker only through its
replies, which its death fails, so none waits on a dead worker; each tells the machine how it ended."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from . import _image
from . import protocol as p
from ._journal import PendingState
from ._machine import CallRec, ContextState, CoreMachine, Kind, RunJob, Status
from ._states import holds_nothing
from .errors import LloyalError, PoolClosedError, WorkerCrashedError, copy_error

if TYPE_CHECKING:
    import weakref

    from ._journal import Journal
    from ._process import WorkerProcess

log = logging.getLogger("lloyal_pool")


class ModelEntry(Protocol):
    """A model of the worker, as its core rebuilds it in a replacement (model.Model)."""

    _handle: int

    @property
    def _closed(self) -> bool: ...

    def _load_into(self, proc: WorkerProcess) -> Future[p.ModelLoaded]: ...

    def _adapters(self) -> list[AdapterEntry]: ...


class AdapterEntry(Protocol):
    """A LoRA adapter of a model (lora.LoraAdapter)."""

    _handle: int
    path: str

    @property
    def closed(self) -> bool: ...

    def _lost(self) -> None: ...


class Spare(Protocol):
    """A ready worker with models loaded ahead (spares.Spare)."""

    proc: WorkerProcess
    lock: threading.Lock

    def claim(self, model: Any) -> p.ModelLoaded | None: ...

    def release_unclaimed(self) -> None: ...


class Host(Protocol):
    """What a core asks of its pool when its worker dies under recovery (pool.Pool provides it)."""

    def replacement(self) -> tuple[WorkerProcess, Spare | None]:
        """A started worker to take the dead one's place (a ready spare, or one spawned now)."""

    def adopted(self, dead: WorkerProcess, proc: WorkerProcess) -> None:
        """proc now serves in dead's place (the pool forgets dead)."""

    def recovered(self, core: Any, dead: WorkerProcess, error: WorkerCrashedError, replayed: int) -> None:
        """The recovery ended (the pool tells its subscribers, starts a spare)."""

class JobHost(Protocol):
    """The core a job runs for (_core.WorkerCore)."""

    machine: CoreMachine
    proc: WorkerProcess
    page_dir: str | None
    page_in_s: float
    models: weakref.WeakSet[Any]
    _lock: threading.RLock
    _host: Host | None
    _stopping: bool

    def step(self, fn: Callable[..., Any], *args: Any, guard: Callable[[], bool] | None = None,
             flush: bool = True, **kwargs: Any) -> Any: ...

    def _write(self, proc: WorkerProcess, call: CallRec, req: p.Request[Any]) -> Future[Any]: ...

    def worker_died(self, proc: WorkerProcess, error: WorkerCrashedError | PoolClosedError) -> None: ...


def run(core: JobHost, job: RunJob) -> None:
    """Runs one job on the core's loop (module docstring)."""
    kind = job.kind
    if kind == "flush":
        return
    if kind == "transfer":
        assert job.call is not None
        transfer(core, job.call)
    elif kind == "page_out":
        assert job.ctx is not None
        page_out(core, job.ctx)
    elif kind == "page_in":
        assert job.ctx is not None
        page_in(core, job.ctx)
    elif kind == "recover":
        recover(core)
    elif kind == "rebuild":
        assert job.ctx is not None
        rebuild(core, job.ctx, alone=True)
    elif kind == "call":
        fn, fut = job.data
        try:
            fut.set_result(fn(core.proc))
        except BaseException as exc:
            fut.set_exception(exc)

def transfer(core: JobHost, call: CallRec) -> None:
    """A SAVE, LOAD or MOVE_SAVE the machine sent: the transfer file written (a LOAD's bytes), the frame,
    the reply, and the state read out (bytes; for a move a StateFile; b"" for an empty context's own
    checkpoint). The machine hears of the reply (in reply order) and of the state read."""
    machine = core.machine
    with core._lock:
        if call.state != "sending" or call.epoch != machine.epoch:
            return  # its worker died before it went out: the machine has dealt with it
        proc = core.proc
    data: Any = None
    try:
        with proc.transfer() as f:
            with core._lock:
                handle = call.ctx.handle if call.ctx is not None else 0
            if call.kind is Kind.LOAD:
                f.write(call.data)
                req: p.Request[Any] = p.LoadState(context=handle, path=f.path)
            else:
                req = p.SaveState(context=handle, path=f.path, in_place=True)
            fut = core._write(proc, call, req)
            try:
                fut.result()
            except BaseException as exc:
                if call.internal and holds_nothing(exc):
                    data = b""
                return
            if call.kind is Kind.MOVE_SAVE:
                data = _image.kept(proc, f, None)
            elif call.kind is Kind.SAVE:
                data = f.read()
    except (OSError, LloyalError) as exc:
        log.warning("[core] worker %d: a state transfer failed: %s", proc.worker_id, exc)
        data = None
    finally:
        if call.kind is not Kind.LOAD:
            core.step(machine.state_read, call, data)

def page_out(core: JobHost, ctx: ContextState) -> None:
    machine = core.machine
    with core._lock:
        if ctx.status is not Status.PAGING_OUT:
            machine.page_out_failed(ctx)
            return
        proc, handle = core.proc, ctx.handle
    page: _image.StateFile | None = None
    try:
        if proc.call(p.NPast(context=handle)).result():
            with proc.transfer() as f:
                proc.call(p.SaveState(context=handle, path=f.path, in_place=True)).result()
                page = _image.kept(proc, f, core.page_dir)
        proc.call(p.FreeContext(context=handle)).result()
    except (LloyalError, WorkerCrashedError, OSError) as exc:
        log.debug("page-out of context %d failed: %s", handle, exc)
        if page is not None:
            page.close()
        core.step(machine.page_out_failed, ctx)
        return
    core.step(machine.paged_out, ctx, page)

def page_in(core: JobHost, ctx: ContextState) -> None:
    machine = core.machine
    with core._lock:
        if ctx.status is not Status.LOADING:
            return
        proc, page = core.proc, ctx.page
        model, params, lora = ctx.model, ctx.params, _lora_wire(ctx)
    t0 = time.perf_counter()
    try:
        created = _image.make(proc, model._handle, params, lora, page)
    except BaseException as exc:
        core.step(machine.page_in_failed, ctx, exc)
        return
    core.page_in_s += time.perf_counter() - t0
    if not core.step(machine.paged_in, ctx, created):
        _free(proc, created.context)


def rebuild(core: JobHost, ctx: ContextState, *, alone: bool = False, deaths: int | None = None) -> None:
    """Makes ctx again in the worker from its checkpoint and journal; empty, and saying so once, where
    its history cannot be rebuilt; dead where not even that works. A worker that dies meanwhile leaves it
    to the next recovery. ``deaths``: as the recovery found them (a rebuild by itself reads them now)."""
    machine = core.machine
    with core._lock:
        if ctx.status is not Status.RECOVERING:
            return
        deaths = machine.deaths if deaths is None else deaths
        proc, model, params, lora = core.proc, ctx.model, ctx.params, _lora_wire(ctx)
        journal: Journal | None = ctx.journal
        lost = "it keeps no journal" if journal is None else journal.lost
        state = None if journal is None else journal.checkpoint
        entries = [] if journal is None else list(journal.entries)
    if model._closed:
        core.step(machine.unrestorable, ctx, "its model was closed", deaths)
        return
    if isinstance(state, PendingState):  # read before this job ran (jobs run one at a time)
        state = state.data
    why = lost
    created = None
    if why is None:
        try:
            created = _image.make(proc, model._handle, params, lora, state, entries)
        except BaseException as exc:
            if not proc.alive:
                return  # the worker died under it: the recovery after that death makes it
            why = f"replaying its history failed ({type(exc).__name__}: {exc})"
    if created is None:
        try:
            created = _image.make(proc, model._handle, params, lora, None)
        except BaseException as exc:
            if proc.alive:
                core.step(machine.unrestorable, ctx, f"it could not be made again ({exc})", deaths)
            return
    if not core.step(machine.restored, ctx, created, why, alone=alone, deaths=deaths):
        _free(proc, created.context)

def recover(core: JobHost) -> None:
    """The dead worker's place taken by a replacement: its models loaded again (a spare's stand in for
    them), its contexts rebuilt, then the calls kept at the crash sent again (machine.recovered)."""
    machine = core.machine
    dead, error = core.proc, machine.death
    host = core._host
    assert isinstance(error, WorkerCrashedError)
    if host is None or core._stopping:
        core.step(machine.close_all, PoolClosedError("the pool was closed during a recovery"))
        return
    try:
        proc, spare = host.replacement()
    except BaseException as exc:
        log.error("[recover] worker %d could not be replaced: %s", dead.worker_id, exc)
        core.step(machine.close_all, copy_error(error), phase="dead")
        return
    with core._lock:
        core.proc = proc
        proc.owner = core
        deaths = machine.deaths  # a death of the replacement from here on makes this recovery stale
    if not proc.alive:  # it died before it was ours: nobody told the machine
        core.step(machine.died, proc._dead or WorkerCrashedError("the replacement died at once"))
    host.adopted(dead, proc)
    if spare is not None:
        with spare.lock:  # its models, loaded ahead, stand in for the dead worker's
            load_models(core, proc, spare)
            spare.release_unclaimed()
    else:
        load_models(core, proc, None)
    with core._lock:
        contexts = machine.to_rebuild()
    for ctx in contexts:
        rebuild(core, ctx, deaths=deaths)
    replayed = len(machine.salvaged)
    core.step(machine.recovered, deaths)
    if machine.deaths != deaths:
        return  # the replacement died meanwhile: the recovery queued after that death takes over
    log.warning("[recover] worker %d (pid %d) replaced by worker %d (pid %d): %d call(s) replayed",
                dead.worker_id, dead.pid, proc.worker_id, proc.pid, replayed)
    host.recovered(core, dead, error, replayed)


def load_models(core: JobHost, proc: WorkerProcess, spare: Spare | None) -> None:
    for model in sorted(core.models, key=lambda m: getattr(m, "_serial", 0)):  # in the order first loaded
        if model._closed:
            continue
        try:
            loaded = (spare.claim(model) if spare is not None else None) or model._load_into(proc).result()
        except Exception as exc:
            log.error("[recover] model %s could not be loaded again: %s", getattr(model, "path", "?"), exc)
            continue
        with core._lock:
            model._handle = loaded.model
        for adapter in model._adapters():
            if adapter.closed:
                continue
            try:
                adapter._handle = proc.call(p.LoadLora(model=loaded.model, path=adapter.path)).result().lora
            except Exception as exc:
                adapter._lost()
                log.error("[recover] LoRA adapter %s could not be loaded again: %s", adapter.path, exc)


def _lora_wire(ctx: ContextState) -> list[tuple[int, float]]:
    return [(a._handle, s) for a, s in ctx.lora if not a.closed]


def _free(proc: WorkerProcess, handle: int) -> None:
    """A context made for nothing (closed meanwhile): freed, not waited for."""
    if proc.alive:
        try:
            proc.call(p.FreeContext(context=handle))
        except LloyalError:
            pass


__all__ = ["AdapterEntry", "Host", "JobHost", "ModelEntry", "Spare", "run"]
