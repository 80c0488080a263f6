"""Live migration: a context, and the stream paused or running on it, moved to another worker under the
same handle (Context.move_to, Pool.drain).

    hold the link (other threads' calls on the context wait)
    pause its streams at a token boundary ─▶ source: SaveState into a transfer file (after every call
    before it) ─▶ target: NewContext, SetLora, LoadState, AdoptGeneration ─▶ commit: the handle rebinds
    to the target, the source frees its copy ─▶ the streams resume in the target ─▶ release the link

Nothing is committed until the target holds all of it: a target that fails leaves the context serving
in its source (MigrationError), and a source that dies before its state is saved fails the move with
its own crash error (crash recovery, where the pool has it, restores the context there as for any
crash). Once the state is read out, the source is no longer needed.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from . import protocol as p
from .errors import (
    BadRequestError,
    ContextError,
    InvalidArgumentError,
    LloyalError,
    MigrationError,
    PoolClosedError,
    StaleHandleError,
    WorkerCrashedError,
)
from .lora import LoraAdapter, lora_wire

if TYPE_CHECKING:
    from ._process import WorkerProcess
    from .context import Context
    from .instance import Instance
    from .model import Model
    from .shm import TransferFile, WorkerTransfer
    from .stream import Pausable


def target_model(ctx: Context, target: Instance) -> Model:
    """The model in ``target`` the context's would move to: loaded from the same file, not closed."""
    if ctx.closed:
        raise StaleHandleError(f"context handle {ctx.handle} was closed")
    if target is ctx.instance:
        raise InvalidArgumentError(f"the context already lives in worker {target.worker_id}")
    if not target.alive:
        raise PoolClosedError(f"worker {target.worker_id} is closed or dead: it cannot take a context")
    for model in target.models:
        if model.path == ctx.model.path and not model._load.vocab_only:
            return model
    raise InvalidArgumentError(f"worker {target.worker_id} has not loaded {os.path.basename(ctx.model.path)} "
                               "(the context's model): load it there first")


def move(ctx: Context, target: Instance) -> None:
    """Context.move_to (module docstring)."""
    model = target_model(ctx, target)
    loras = _target_loras(ctx, model)
    if len(ctx.branches):
        raise ContextError("a context with branches does not move (its state holds one sequence): prune them first")
    link = ctx._link
    with link.moving():
        if link.paged and model.instance._pager is not None:  # its page file goes to the target as it is
            _commit_paged(ctx, model, loras)
            return
        if ctx._pager is not None:
            ctx._pager.use(ctx, holding_link=True)  # paged in here first where the target pages nothing
        runs = ctx._runs.live()
        running = [r for r in runs if r.state != "paused"]  # what the move pauses, and resumes: not the caller's
        for run in running:
            run.pause()
        paused = [r for r in runs if r.state == "paused"]
        running = [r for r in running if r.state == "paused"]
        source = link.proc
        # The transfer files are closed before any stream resumes: crash recovery of a worker that died
        # meanwhile closes that worker's file, and waits for it.
        with ExitStack() as files:
            try:
                _check_portable(paused)
                state, arriving = _transfers(files, source, model._proc)
                held = _save(ctx, state)
                # Crash recovery keeps the state it arrives with as the moved context's checkpoint;
                # without it the state goes from one worker's file to the other's in the kernel.
                data = state.read() if held and model._proc.recovery is not None else b""
            except BaseException:
                files.close()
                _resume(running)
                raise
            try:
                created = _build(ctx, model, loras, (state, arriving) if held else None, paused)
            except BaseException as exc:
                files.close()
                _resume(running)
                if isinstance(exc, LloyalError) and not isinstance(exc, BadRequestError):
                    raise MigrationError(f"moving context {ctx.handle} to worker {target.worker_id} failed; it "
                                         f"stays in worker {ctx.instance.worker_id}: {exc}") from exc
                raise
        old_handle = link.handle
        _commit(ctx, model, created, loras, data, paused)
        for run in paused:
            run.handed_over(link.proc)
        if source.alive:
            try:
                source.call(p.FreeContext(context=old_handle)).result()
            except LloyalError:
                pass  # the source died meanwhile: its copy went with it
        _resume(running)


def _transfers(files: ExitStack, source: WorkerProcess, dst: WorkerProcess
               ) -> tuple[TransferFile | WorkerTransfer, TransferFile | WorkerTransfer]:
    """The source's transfer file and the target's, taken in worker order: a worker's own file
    (WorkerTransfer) serves one transfer at a time, and two moves in opposite directions must not each
    hold one and wait for the other."""
    state, arriving = source.transfer(), dst.transfer()
    for f in (arriving, state) if dst.worker_id < source.worker_id else (state, arriving):
        files.enter_context(f)
    return state, arriving


def _target_loras(ctx: Context, model: Model) -> list[tuple[LoraAdapter, float]]:
    """The context's LoRA configuration with the target's adapters of the same files."""
    pairs = []
    for adapter, scale in ctx.lora:
        same = [a for a in model.loras if a.path == adapter.path]
        if not same:
            raise InvalidArgumentError(f"worker {model.instance.worker_id} has not loaded the LoRA adapter "
                                       f"{os.path.basename(adapter.path)} the context applies: load it there first")
        pairs.append((same[0], scale))
    return pairs


def _check_portable(paused: list[Pausable]) -> None:
    if any(r.suspension is None for r in paused):
        raise ContextError("a stream sampling with mirostat does not move (its sampler's state does not travel): "
                           "let it end first")


def _save(ctx: Context, state: TransferFile | WorkerTransfer) -> bool:
    """The context's state from its source into ``state``, after every call made before; False when it
    holds nothing."""
    source, handle = ctx._link.proc, ctx._link.handle
    if source.call(p.NPast(context=handle)).result() == 0:
        return False
    source.call(p.SaveState(context=handle, path=state.path, in_place=True)).result()
    return True


def _build(ctx: Context, model: Model, loras: list[tuple[LoraAdapter, float]],
           files: tuple[TransferFile | WorkerTransfer, TransferFile | WorkerTransfer] | None,
           paused: list[Pausable]) -> p.ContextCreated:
    """The context made again in the target, whole; freed there again if any step fails."""
    dst = model._proc
    created = dst.call(p.NewContext(model=model._handle, params=ctx._params.to_wire())).result()
    try:
        if loras:  # first: a changed configuration empties the context
            dst.call(p.SetLora(context=created.context, adapters=lora_wire(loras))).result()
        if files is not None:
            state, arriving = files
            arriving.write(state.fd)
            dst.call(p.LoadState(context=created.context, path=arriving.path)).result()
        for run in paused:
            assert run.suspension is not None
            if run.in_prompt:
                continue  # nothing to hand over: its Generate, sent again there, goes on
            dst.call(p.AdoptGeneration(context=created.context, params=run.params, suspension=run.suspension,
                                       origin=run.origin)).result()
    except BaseException:
        if dst.alive:
            try:
                dst.call(p.FreeContext(context=created.context)).result()
            except (LloyalError, WorkerCrashedError):
                pass
        raise
    return created


def _belong(ctx: Context, model: Model, loras: list[tuple[LoraAdapter, float]]) -> None:
    """The context is now one of ``model``'s, with the target's adapters."""
    old, link = ctx.model, ctx._link
    old._contexts.discard(ctx)
    old._links.discard(link)
    ctx.model, ctx.instance = model, model.instance
    ctx._lora = loras
    model._contexts.add(ctx)
    model._links.add(link)


def _commit_paged(ctx: Context, model: Model, loras: list[tuple[LoraAdapter, float]]) -> None:
    """A paged-out context moves as its page file: the target's pager takes it, and its next call pages
    it in there (its journal, whose checkpoint is that file, stays as it is)."""
    pager, target = ctx._pager, model.instance._pager
    assert pager is not None and target is not None
    _belong(ctx, model, loras)
    link = ctx._link
    link.rebind(model._proc, link.handle, link._slot)  # where its next call goes, once paged in
    if model._proc.recovery is None:
        link.journal = None
    pager.hand_over(ctx, target)


def _commit(ctx: Context, model: Model, created: p.ContextCreated, loras: list[tuple[LoraAdapter, float]],
            data: bytes, paused: list[Pausable]) -> None:
    """The handle now names the context in the target."""
    link = ctx._link
    _belong(ctx, model, loras)
    ctx._rebind(model._proc, created)
    if ctx._pager is not None:
        ctx._pager.forget(ctx)
    if model.instance._pager is not None:
        model.instance._pager.admit(ctx)
    # Crash recovery starts the moved context's journal from the state it arrived with.
    recovery = model._proc.recovery
    journal = link.journal = None if recovery is None else recovery.journal()
    if journal is not None:
        done: Future[Any] = Future()
        done.set_result(None)
        if loras:  # what the journal makes of adapters applied: not replayed
            journal.record(p.SetLora(context=created.context, adapters=lora_wire(loras)), done, created.context)
        if data:
            journal.restart(data)
        for run in paused:  # the generations handed over, which a Resume then caps
            assert run.suspension is not None
            if run.in_prompt:
                continue
            journal.record(p.AdoptGeneration(context=created.context, params=run.params, suspension=run.suspension,
                                             origin=run.origin), done, created.context)


def _resume(runs: list[Pausable]) -> None:
    """Resumes the streams the move paused; one that cannot go on ends with the error why (instead of
    staying paused with nobody to resume it)."""
    for run in runs:
        try:
            run.resume()
        except BaseException as exc:
            run.fail(exc)


__all__ = ["move", "target_model"]
