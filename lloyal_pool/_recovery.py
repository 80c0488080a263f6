"""Crash recovery (Pool(recover=True)): a worker that dies is replaced in place, its models and contexts
are rebuilt in the replacement, and the calls that were in flight are sent again where that gives the
caller the same answer an uninterrupted run would have.

    worker dies ─▶ _on_death: salvage() takes the calls that can be replayed, the rest fail as before
                ─▶ recover(): a fresh worker; every live Model loaded again, every Context created again
                   with its parameters, restored from its checkpoint and its journal; the handles rebound
                   (same objects, new handle numbers); the salvaged calls sent again, in their order

A context's **journal** is what makes it restorable without a checkpoint after every call: the requests
that built its history since its last checkpoint (Context.checkpoint(), or a load_state of bytes), kept
in the client. A request whose prompt is the whole input (generate without append, score) starts the
journal afresh; eval and generate with append add to it. Replaying it is exact because every generation
it holds is deterministic: greedy, or sampled with a fixed seed (every seed but 0xFFFFFFFF). What cannot
be replayed exactly makes the context *lost* until the next call that replaces its whole history: a
generation or eval that was interrupted (the point it stopped at is not reproducible), a sampled
generation with a random seed, LoRA adapters, branches and raw KV-sequence edits, a state loaded from a
file. A lost context's handle goes stale with the crash (DeadWorkerError naming why).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

import msgspec

from . import protocol as p
from ._process import GENERATED_TOKEN_COST, PendingState
from .errors import (
    BadRequestError,
    ContextError,
    ContextOverflowError,
    GrammarError,
    InvalidTokenError,
    WorkerCrashedError,
    copy_error,
)
from .params import MAX_SEED

if TYPE_CHECKING:
    from ._process import SavedState, WorkerProcess, _Pending
    from .instance import Instance
    from .pool import Pool
    from .spares import Spare

log = logging.getLogger("lloyal_pool")

MAX_ATTEMPTS = 3
"""How many workers one call may see die under it before its crash is reported instead of replayed."""

# Requests that leave a context's history as it was.
_READ_ONLY: frozenset[type[p.Request[Any]]] = p.READS_ONLY | {p.ScoreChoices, p.Embed}
# Model-level requests (or none at all) that can be sent again as they are.
_STATELESS: frozenset[type[p.Request[Any]]] = frozenset(
    {p.Ping, p.Tokenize, p.Detokenize, p.TokenToPiece, p.ApplyChatTemplate, p.ChatFormat, p.ParseChatOutput,
     p.JsonSchemaToGrammar, p.Devices, p.LoadModel, p.NewContext, p.LoadLora, p.FreeContext, p.FreeModel})
# Errors that a request raises before it changes anything (bad input).
_UNCHANGED_ERRORS = (InvalidTokenError, GrammarError, BadRequestError, ContextOverflowError, ValueError, TypeError)


def _deterministic(params: dict[str, Any]) -> bool:
    return int(params.get("seed", 0)) != MAX_SEED or float(params.get("temperature", 0.0)) <= 0.0


class Journal:
    """What a context's history was built from since its last checkpoint (module docstring)."""

    def __init__(self, checkpoint_tokens: int | None = None) -> None:
        self._lock = threading.Lock()
        # Pool(checkpoint_tokens=N): a checkpoint is taken in the background once replaying the journal
        # would decode N tokens or more.
        self.checkpoint_tokens = checkpoint_tokens
        self.replay_tokens = 0  # what replaying the entries costs, about, in prompt tokens (GENERATED_TOKEN_COST)
        self._checkpointing = False
        self.checkpoint: bytes | SavedState | PendingState | None = None  # a page file's state: in that file
        self.entries: list[p.Request[Any]] = []
        self.lost: str | None = None  # why the history cannot be rebuilt, or None
        # Set while LoRA adapters are applied: every history computed under them is lost, until set_lora([]).
        self._lora: str | None = None

    def restart(self, state: bytes | SavedState | PendingState, first: Sequence[p.Request[Any]] = ()) -> None:
        """The history is ``state`` now (a checkpoint, or a state loaded from bytes), and ``first`` (the
        AdoptGenerations of generations suspended in it) is what replays on top of it. Called in the
        request's reply order (from the done-callback of the SaveState or LoadState that made the state),
        so that every call the worker ran after it is recorded after it, and none before it stays."""
        with self._lock:
            self.checkpoint = state
            self.entries = list(first)
            self.replay_tokens = 0
            self.lost = self._lora

    def wants_checkpoint(self) -> bool:
        """Whether a background checkpoint is due now (then it counts as begun: checkpoint_done ends it)."""
        with self._lock:
            due = (self.checkpoint_tokens is not None and not self._checkpointing and self.lost is None
                   and self.replay_tokens >= self.checkpoint_tokens)
            self._checkpointing = self._checkpointing or due
            return due

    def checkpoint_done(self) -> None:
        with self._lock:
            self._checkpointing = False

    @property
    def restartable(self) -> bool:
        """Whether a call that replaces the whole history rebuilds the context from nothing, lost or not:
        not while LoRA adapters are applied (they are not loaded into the context again)."""
        return self._lora is None

    def _start(self, entries: list[p.Request[Any]], lost: str | None = None) -> None:
        self.checkpoint, self.entries, self.lost = None, entries, lost or self._lora
        self.replay_tokens = 0

    def record(self, req: p.Request[Any], fut: Future[Any], handle: int) -> None:
        """A done-callback of every request on the context (the reader thread runs them in reply order);
        ``handle``: the context's handle now (a call replayed by a recovery was made under the old one)."""
        if isinstance(req, p.ContextRequest) and req.context != handle:
            req = msgspec.structs.replace(req, context=handle)
        with self._lock:
            self.replay_tokens += self._record(req, fut)

    def _record(self, req: p.Request[Any], fut: Future[Any]) -> int:
        """Records req; returns about how many tokens replaying what it added decodes."""
        kind = type(req)
        if fut.cancelled():
            return 0
        exc = fut.exception()
        if kind in _READ_ONLY or (exc is not None and isinstance(exc, _UNCHANGED_ERRORS)):
            return 0
        if isinstance(exc, WorkerCrashedError):
            return 0  # the recovery decides
        if isinstance(req, (p.Resume, p.AdoptGeneration)) and isinstance(exc, ContextError):
            return 0  # refused before it changed anything (nothing paused, another history)
        if exc is not None:
            self.lost = f"{req.op.value} failed ({type(exc).__name__}) and may have left the history half-changed"
            return 0
        result = fut.result()
        if isinstance(req, (p.Generate, p.GenerateWithDraft)):
            # Greedy/seeded output is generate()'s; a paused one's is its first n_decoded tokens, which
            # the same call capped at that many gives (then a Resume that goes on raises the cap).
            params = req.params if result.stop_reason != "paused" else {**req.params, "n_predict": result.n_decoded}
            replay: p.Request[Any] = p.Generate(context=req.context, prompt=req.prompt, params=params,
                                                append=req.append)
            why = None
            if getattr(result, "stop_reason", None) == "interrupted":
                why = "a generation was interrupted"
            elif result.stop_reason == "paused" and result.n_decoded == 0:
                why = "a generation paused before its first token"  # n_predict 0 would not cap its replay
            elif not _deterministic(req.params):
                why = "a generation sampled with a random seed (seed=0xFFFFFFFF)"
            tokens = int(result.n_prompt) + GENERATED_TOKEN_COST * int(result.n_decoded)
            # With background checkpoints (which bound the journal), a whole prompt that reused the
            # history's first n_cached tokens replays on top of that history, as it ran: the same prefix
            # kept, the same chunks decoded after it; the checkpoint it builds on stays.
            on_top = (self.checkpoint_tokens is not None and not req.append and result.n_cached > 0
                      and self.lost is None and not req.params.get("cache_bit_exact", False))
            if not req.append and not on_top:
                self._start([replay], why)
                return tokens
            if why is not None:
                self.lost = why
            elif self.lost is None:
                self.entries.append(replay)
            return tokens - int(result.n_cached) if on_top else tokens
        if isinstance(req, p.Resume):
            self._resumed(req, result)
            return GENERATED_TOKEN_COST * int(result.n_decoded)
        if isinstance(req, p.AdoptGeneration):
            if self.lost is None:
                self.entries.append(req)  # the history is unchanged; the Resume that follows caps it
        elif isinstance(req, p.Eval):
            if result.interrupted:
                self.lost = "an eval was interrupted"
            elif self.lost is None:
                self.entries.append(req)
            return int(result.n_tokens)
        elif isinstance(req, p.ScoreText):
            self._start([req])
            return int(result.n_tokens)
        elif isinstance(req, p.Reset):
            self._start([])
        elif isinstance(req, p.Rerank):
            self._start([])  # a generation context's rerank leaves it empty
        elif isinstance(req, p.SetLora):
            if req.adapters:
                self._lora = self.lost = "LoRA adapters are applied (they are not replayed)"
            else:
                self._lora = None
                self._start([])  # set_lora([]) that changed anything emptied the context
        elif isinstance(req, p.LoadState):
            self.lost = "a state was loaded from a file (checkpoint() after it to make the context recoverable)"
        else:
            self.lost = f"{req.op.value} (branches and KV-sequence edits are not replayed)"
        return 0

    def _resumed(self, req: p.Resume, result: Any) -> None:
        """A Resume went on with the generation that the last entry started (a Generate, or an
        AdoptGeneration that took it over): the entry replays it capped at the tokens it has sampled now,
        which a deterministic generation reproduces exactly."""
        if self.lost is not None:
            return
        if result.stop_reason == "interrupted":
            self.lost = "a resumed generation was interrupted"
            return
        at = len(self.entries) - 1
        if at >= 1 and isinstance(self.entries[at], p.Resume):
            at -= 1  # resumed again after another pause
        start = self.entries[at] if at >= 0 else None
        if not isinstance(start, (p.Generate, p.AdoptGeneration)):
            self.lost = "a resumed generation whose start is not in the journal"
            return
        if not _deterministic(start.params):  # taken over from a checkpoint or a move: it drew anew
            self.lost = "a generation sampled with a random seed (seed=0xFFFFFFFF)"
            return
        self.entries[at] = msgspec.structs.replace(start, params={**start.params, "n_predict": result.n_decoded})
        if isinstance(start, p.AdoptGeneration) and at == len(self.entries) - 1:
            self.entries.append(p.Resume(context=req.context, origin=req.origin))


class Ledger:
    """The events a call delivered to its caller, so that a replay of it delivers only what comes after:
    stream pieces by their characters, prompt progress by its count."""

    def __init__(self, on_event: Callable[[dict[str, Any]], None] | None) -> None:
        self.on_event = on_event
        self.chars = 0
        self.progress = -1
        self.attempts = 1

    def deliver(self, event: dict[str, Any]) -> None:
        if self.on_event is None:
            return
        piece = event.get("piece")
        if isinstance(piece, str):
            self.chars += len(piece)
        pair = event.get("prompt_progress")
        if pair is not None:
            self.progress = max(self.progress, int(pair[0]))
        self.on_event(event)

    def replayer(self) -> Callable[[dict[str, Any]], None]:
        """The event handler for the call sent again: skips what the caller has already seen."""
        skip, seen_progress = self.chars, self.progress
        replayed = [0]

        def on_event(event: dict[str, Any]) -> None:
            piece = event.get("piece")
            if isinstance(piece, str):
                start = replayed[0]
                replayed[0] += len(piece)
                if replayed[0] <= skip:
                    return
                event = {**event, "piece": piece[max(0, skip - start):]}
            pair = event.get("prompt_progress")
            if pair is not None and int(pair[0]) <= seen_progress:
                return
            self.deliver(event)

        return on_event


class HandleMap:
    """Old handle numbers to new ones, for the requests sent again."""

    def __init__(self) -> None:
        self.models: dict[int, int] = {}
        self.contexts: dict[int, int] = {}
        self.lost_contexts: dict[int, str] = {}

    def remap(self, req: p.Request[Any]) -> p.Request[Any] | None:
        """req with its handles renumbered, or None where it cannot be replayed."""
        changes: dict[str, Any] = {}
        if isinstance(req, p.ContextRequest):
            if req.context not in self.contexts:
                return None
            changes["context"] = self.contexts[req.context]
        model = getattr(req, "model", None)
        if isinstance(model, int) and not isinstance(req, p.ContextRequest):
            if model not in self.models:
                return None
            changes["model"] = self.models[model]
        if isinstance(req, p.GenerateWithDraft) and isinstance(req.draft, int):
            if req.draft not in self.contexts:
                return None
            changes["draft"] = self.contexts[req.draft]
        return msgspec.structs.replace(req, **changes) if changes else req


def starts_afresh(req: p.Request[Any]) -> bool:
    """Whether req replaces its context's whole history (the journal starts again from it)."""
    return (isinstance(req, (p.Generate, p.GenerateWithDraft)) and not req.append) or isinstance(req, p.ScoreText)


def replayable(req: p.Request[Any], journal_ok: Callable[[int], bool]) -> bool:
    """Whether a call in flight when its worker died can be sent again to the replacement and give the
    caller what the first worker would have: ``journal_ok(context)`` says whether a context's history is
    rebuilt exactly."""
    kind = type(req)
    if kind in _STATELESS:
        return True
    if not isinstance(req, p.ContextRequest):
        return False
    if isinstance(req, (p.Generate, p.GenerateWithDraft)):
        return _deterministic(req.params) and (not req.append or journal_ok(req.context))
    if isinstance(req, p.ScoreText):
        return True  # its text replaces the history
    if isinstance(req, (p.Embed, p.Rerank)):
        return True  # an embedding context holds nothing between calls
    if isinstance(req, p.Eval) or kind in _READ_ONLY:
        return kind is not p.SaveState and journal_ok(req.context)
    return False


class PoolRecovery:
    """The observer Pool(recover=True) installs on each worker (_process.Recovery): a Ledger for every
    call, a Journal for every context, and at a crash the choice of calls to send again and the recovery
    thread. It holds the pool weakly: a pool dropped without close() is not kept alive by its workers."""

    def __init__(self, pool: weakref.ref[Pool], checkpoint_tokens: int | None = None) -> None:
        self._pool = pool
        self._checkpoint_tokens = checkpoint_tokens

    def ledger(self, on_event: Callable[[dict[str, Any]], None] | None) -> Ledger:
        return Ledger(on_event)

    def journal(self) -> Journal:
        return Journal(self._checkpoint_tokens)

    def salvage(self, proc: WorkerProcess, error: WorkerCrashedError, pending: list[_Pending]) -> list[_Pending]:
        """On the dead worker's reader thread: picks the calls to send again and starts the recovery."""
        pool = self._pool()
        instance = None if pool is None or pool._closed else next(
            (i for i in pool._instances if i._proc is proc), None)
        if pool is None or instance is None:
            assert proc.recovering is not None
            proc.recovering.set()
            return []
        journals = {ctx.handle: ctx._link.journal for m in list(instance._models) for ctx in list(m._contexts)}

        def journal_ok(handle: int) -> bool:
            journal = journals.get(handle)
            return journal is not None and journal.lost is None

        taken = [x for x in pending if x.ledger is not None and x.ledger.attempts < MAX_ATTEMPTS
                 and x.request_obj is not None and replayable(x.request_obj, journal_ok)]
        threading.Thread(target=recover, args=(pool, instance, proc, error, taken), daemon=True,
                         name=f"lloyal-recover{proc.worker_id}").start()
        return taken


def recover(pool: Pool, instance: Instance, dead: WorkerProcess, error: WorkerCrashedError,
            salvaged: list[Any]) -> None:
    """Runs on its own thread: replaces ``dead`` in place (module docstring); salvaged are its _Pending
    records that were replayable, in request order. Whatever cannot be recovered fails with ``error``."""

    def fail_all(why: BaseException) -> None:
        for pending in salvaged:
            if not pending.future.done():
                pending.future.set_exception(copy_error(why))

    spare = pool._spares.take()
    try:
        if spare is not None:
            proc = spare.proc  # ready: its handshake is done
        else:
            proc = pool._spawn(recoverable=True)
            proc.wait_ready()
    except BaseException as exc:
        log.error("[recover] worker %d could not be replaced: %s", dead.worker_id, exc)
        fail_all(error)
        assert dead.recovering is not None
        dead.recovering.set()
        return
    # A context whose history cannot be rebuilt is made again all the same when a call sent again
    # replaces that history (a Stop, then a new whole-prompt generation that the crash cut short).
    afresh = {x.request_obj.context for x in salvaged if starts_afresh(x.request_obj)}
    if spare is None:
        handles = _rebuild(instance, proc, error, afresh)
    else:
        with spare.lock:  # its models, loaded ahead, stand in for the dead worker's
            handles = _rebuild(instance, proc, error, afresh, spare)
            spare.release_unclaimed()
    pool._adopt(instance, dead, proc)
    for pending in salvaged:
        req = handles.remap(pending.request_obj)
        if req is None:
            pending.future.set_exception(copy_error(error))
            continue
        pending.ledger.attempts += 1
        resent = pending.on_resent

        def on_id(new_id: int, old_id: int = pending.request_id, hook: Any = resent) -> None:
            if hook is not None:
                hook(old_id, new_id)

        try:
            again = proc.call(req, pending.ledger.replayer(), on_id=on_id, ledger=pending.ledger,
                              on_resent=resent)
        except BaseException as exc:
            pending.future.set_exception(exc)
            continue
        _chain(again, pending.future)
    assert dead.recovering is not None
    dead.recovering.set()
    pool._spares.fill_after([x.future for x in salvaged], at_most=5.0, idle=lambda: proc.in_flight == 0)
    log.warning("[recover] worker %d (pid %d) replaced by worker %d (pid %d): %d call(s) replayed, %d context(s) "
                "lost", dead.worker_id, dead.pid, proc.worker_id, proc.pid, len(salvaged), len(handles.lost_contexts))
    from .lifecycle import WorkerEvent

    pool._emit(WorkerEvent("recovered", proc.worker_id, proc.pid, error=error, instance=instance,
                           index=pool._index_of(instance)))


def _chain(src: Future[Any], dst: Future[Any]) -> None:
    def done(f: Future[Any]) -> None:
        if dst.done():
            return
        exc = f.exception()
        if exc is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(f.result())

    src.add_done_callback(done)


def _rebuild(instance: Instance, proc: WorkerProcess, error: WorkerCrashedError, afresh: set[int],
             spare: Spare | None = None) -> HandleMap:
    """Loads every live model of the instance into proc and creates every live context again, restored;
    rebinds the handle objects. A lost context in ``afresh`` (a call sent again replaces its whole
    history) is created empty instead. Returns the old->new handle numbers."""
    handles = HandleMap()
    for model in list(instance._models):
        if model._closed:
            continue
        old_model = model._handle
        try:
            loaded = (spare.claim(model) if spare is not None else None) or model._load_into(proc).result()
        except Exception as exc:
            log.error("[recover] model %s could not be loaded again: %s", model.path, exc)
            for ctx in list(model._contexts):
                ctx._link.lose(f"its model could not be loaded again ({exc})", error)
            continue
        model._rebind(proc, loaded.model)
        handles.models[old_model] = loaded.model
        for adapter in list(model._loras):
            if adapter.closed:
                continue
            try:
                adapter._handle = proc.call(p.LoadLora(model=loaded.model, path=adapter.path)).result().lora
            except Exception as exc:
                adapter._closed = True
                log.error("[recover] LoRA adapter %s could not be loaded again: %s", adapter.path, exc)
        for ctx in list(model._contexts):
            if ctx.closed or ctx.paged:  # a paged-out one: its next call pages it in here (paging.py)
                continue
            old_ctx = ctx.handle
            journal = cast("Journal | None", ctx._link.journal)  # PoolRecovery.journal() made it
            if journal is None:
                why: str | None = "it keeps no journal"
            else:
                # Only a lost one: a restorable context is restored, for calls sent before that one.
                fresh = journal.lost is not None and old_ctx in afresh and journal.restartable
                why = None if fresh else journal.lost
            if why is None and journal is not None:
                try:
                    created = proc.call(p.NewContext(model=loaded.model, params=ctx._params.to_wire())).result()
                except Exception as exc:
                    why = f"it could not be created again ({exc})"
                else:
                    handles.contexts[old_ctx] = created.context
                    if fresh:
                        journal._start([])  # empty: the call sent again fills it
                    else:
                        why = _restore(proc, created.context, journal, handles)
                    if why is None:
                        # Only now: a call another thread makes on the context meanwhile waits for the
                        # recovery to end, instead of running beside the replay.
                        ctx._rebind(proc, created)
                    else:
                        handles.contexts.pop(old_ctx, None)
                        proc.call(p.FreeContext(context=created.context))  # not waited for: nothing uses it
            if why is not None:
                ctx._link.lose(why, error)
                handles.lost_contexts[old_ctx] = why
    return handles


def _restore(proc: WorkerProcess, context: int, journal: Journal, handles: HandleMap) -> str | None:
    """Loads the checkpoint and replays the journal into the context made again in proc; why it failed,
    or None."""
    replayed: list[p.Request[Any]] = []
    try:
        checkpoint = journal.checkpoint
        if isinstance(checkpoint, PendingState):
            checkpoint = checkpoint.wait(60.0)
            if checkpoint is None:
                return "its last checkpoint could not be read"
        if checkpoint:  # b"": the state of an empty context
            with proc.transfer() as f:
                f.write(checkpoint if isinstance(checkpoint, bytes) else checkpoint.fd)
                proc.call(p.LoadState(context=context, path=f.path)).result()
        for entry in list(journal.entries):
            req = handles.remap(entry)
            if req is None:
                return f"{entry.op.value} could not be replayed"
            proc.call(req).result()
            replayed.append(req)
    except Exception as exc:
        return f"replaying its history failed ({type(exc).__name__}: {exc})"
    journal.entries = replayed  # renumbered: a later recovery maps from these handles
    return None


__all__ = ["Journal", "Ledger", "recover", "replayable"]
