"""The lifecycle machine's vocabulary (_machine.py): a context's status and hold, a call and where it is,
a context's state, and the actions the machine asks its driver (_core.WorkerCore) to carry out."""

from __future__ import annotations

import enum
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from . import protocol as p
from ._generation import Generation
from ._journal import Journal, Ledger, PendingState
from .errors import ContextError


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
    # What waits for it to settle, each run with the machine that holds it then (a move hands it over).
    deferred: list[Callable[[Any], None]] = field(default_factory=list)
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



def holds_nothing(error: BaseException) -> bool:
    """Whether a SaveState failed only because its context is empty (its state is then b"")."""
    return isinstance(error, ContextError) and "holds nothing" in str(error)


def _renamed(req: p.ContextRequest[Any], handle: int) -> p.ContextRequest[Any]:
    import msgspec

    return msgspec.structs.replace(req, context=handle)


__all__ = ["TRANSFERS", "Action", "CallRec", "ClosePage", "ContextState", "Deliver", "Hold", "Interrupt", "Kind",
           "Notify", "RunJob", "Settle", "Status", "holds_nothing"]
