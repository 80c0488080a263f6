"""Live migration: a context, and the streams paused or running on it, moved to another worker under the
same handle (Context.move_to, Pool.drain). The caller's thread orchestrates; each worker's core does its
part on its own loop, so no core ever waits for another.

    source core: hold the context (calls other threads make on it wait), pause its streams at a token
                 boundary, SaveState after every call sent before it, read into an image (a memfd)
    target core: NewContext, SetLora, LoadState from the image, AdoptGeneration of each paused stream
    both cores:  commit (under both locks, in worker order): the context leaves the source (its copy
                 freed) and arrives in the target, with the calls that waited; the streams the move
                 paused resume there

Nothing is committed until the target holds all of it: a target that fails leaves the context serving
in its source (MigrationError), and a source that dies before its state is read out fails the move with
its own crash error (crash recovery, where the pool has it, restores the context there as for any crash).
Once the state is read out, the source is no longer needed. A paged-out context moves as its page file.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from . import _image
from . import protocol as p
from ._futures import running
from ._generation import Phase
from ._machine import Action
from .errors import BadRequestError, ContextError, InvalidArgumentError, LloyalError, MigrationError
from .lora import LoraAdapter

if TYPE_CHECKING:
    from ._core import WorkerCore
    from .context import Context
    from .model import Model


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


def move(ctx: Context, model: Model) -> None:
    """Context.move_to (module docstring): to the worker of ``model``, the context's model loaded there."""
    loras = _target_loras(ctx, model)
    if len(ctx.branches):
        raise ContextError("a context with branches does not move (its state holds one sequence): prune them first")
    link, state = ctx._link, ctx._link.state
    dest: WorkerCore = model.instance._core
    token = object()
    began: Future[tuple[str, Any]] = running()
    link._step("begin_move", state, token, began)  # on the core that holds it then, which another move
    # may change until the hold is ours
    kind, image = began.result()  # the source's crash error, if it died before the state was read
    source: WorkerCore = link.core  # held for this move now: no other move commits until it ends
    if source is dest:  # another thread's move took it there meanwhile
        _abort(source, state, image)
        return
    try:
        if any(g.phase is Phase.PAUSED and not g.in_prompt and g.suspension is None for g in state.gens):
            raise ContextError("a stream sampling with mirostat does not move (its sampler's state does not "
                               "travel): let it end first")
        built_in = None
        if kind == "paged" and dest.machine.budget is not None:
            desc = None  # its page file goes to the target's pager as it is, loaded at its next call
        else:
            adoptions = [g.adoption_at(0) for g in state.gens
                         if g.phase is Phase.PAUSED and not g.in_prompt and g.suspension is not None]
            desc, built_in = _build(dest, model, state.params, [(a._handle, s) for a, s in loras], image, adoptions)
    except BaseException as exc:
        _abort(source, state, image)
        if isinstance(exc, LloyalError) and not isinstance(exc, (BadRequestError, ContextError)):
            raise MigrationError(f"moving context {ctx.handle} to worker {model.instance.worker_id} failed; it "
                                 f"stays in worker {ctx.instance.worker_id}: {exc}") from exc
        raise
    if not _commit(ctx, model, loras, source, dest, desc, image, built_in):
        _abort(source, state, image)
        raise MigrationError(f"moving context {ctx.handle} to worker {model.instance.worker_id} failed; it stays "
                             f"in worker {ctx.instance.worker_id}: the target was closed or drained meanwhile")


def _abort(source: WorkerCore, state: Any, image: Any) -> None:
    """The move failed: the context goes on in its source; its image goes unless its journal keeps it."""
    source.step(source.machine.abort_move, state)
    if isinstance(image, _image.StateFile) and not source.machine.recover and image is not state.page:
        image.close()


def _build(dest: WorkerCore, model: Model, params: dict[str, Any], lora: list[tuple[int, float]], image: Any,
           adoptions: list[Any]) -> tuple[p.ContextCreated, Any]:
    """The context made in the target, whole (on the target's loop, which owns its transfer file), and the
    worker it was made in."""
    return dest.on_loop(lambda proc: (_image.make(proc, model._handle, params, lora, image, adoptions), proc)).result()


def _commit(ctx: Context, model: Model, loras: list[tuple[LoraAdapter, float]], source: WorkerCore,
            dest: WorkerCore, desc: Any, image: Any, built_in: Any) -> bool:
    """The handle now names the context in the target (module docstring): both cores' locks held, in
    worker order, so that no call slips between them. False, committing nothing, where the target no
    longer takes contexts (it was closed or is being drained) or its worker is not the one the context was
    made in (it died since)."""
    link, state = ctx._link, ctx._link.state
    taken = [False]

    def commit() -> tuple[list[Action], list[Action]]:
        if (dest.machine.phase != "alive" or not dest.machine.accepting
                or (built_in is not None and dest.proc is not built_in)):
            return [], []
        taken[0] = True
        queued, out_source = source.machine.release_moved(state)
        ctx.model._contexts.discard(ctx)
        ctx.model = model
        model._contexts.add(ctx)
        state.model, state.lora = model, loras
        link.core = dest
        out_dest = dest.machine.take_moved(state, desc, queued, image)
        if not dest.machine.recover and desc is not None and isinstance(image, _image.StateFile):
            image.close()  # no checkpoint keeps it
            if state.page is image:
                state.page = None
        return out_source, out_dest

    source.step_with(dest, commit)
    return taken[0]


__all__ = ["move"]
