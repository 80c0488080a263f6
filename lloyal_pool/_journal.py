"""What crash recovery keeps of a context and of a call, as pure bookkeeping: no thread, no lock, no I/O.

A context's **journal** is the requests that built its history since its last checkpoint (a saved state
held in this process: bytes, or a page file). A request whose prompt is the whole input (generate without
append, score) starts it afresh; eval and generate with append add to it. Replaying it is exact because
every generation it holds is deterministic: greedy, or sampled with a fixed seed. What cannot be replayed
(an interrupted generation, a random seed, a state loaded from a file, a failed call, branches) makes it
*lost*: its owner (_machine.py) then checkpoints the context where it can, which restarts the journal.

A call's **ledger** is what its caller has been given of its events, so that the call sent again to a
replacement worker delivers only what comes after.

    reply of a request on the context ─▶ Journal.record (in the worker's reply order: _machine.py)
    reply of a SaveState / LoadState ─▶ Journal.restart(state, first)
    a worker dies ─▶ replayable(call) for each call in flight; the journal of each context replayed
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from . import protocol as p
from .errors import (
    BadRequestError,
    ContextError,
    ContextOverflowError,
    GrammarError,
    InvalidTokenError,
    WorkerCrashedError,
)
from .params import MAX_SEED

GENERATED_TOKEN_COST = 16
"""What replaying one generated token costs, in prompt tokens: each is a decode of its own, where a prompt
goes in by ubatches (Gemma 3 270M on 2 cores: 24 ms a generated token, 1.6 ms a prompt token). A
journal's replay, and Pool(checkpoint_tokens=N), count in prompt tokens."""

MAX_ATTEMPTS = 3
"""How many workers one call may see die under it before its crash is reported instead of replayed."""

# Requests that leave a context's history as it was.
READ_ONLY: frozenset[type[p.Request[Any]]] = p.READS_ONLY | {p.ScoreChoices, p.Embed}
# Model-level requests (or none at all) that can be sent again as they are.
STATELESS: frozenset[type[p.Request[Any]]] = frozenset(
    {p.Ping, p.Tokenize, p.Detokenize, p.TokenToPiece, p.ApplyChatTemplate, p.ChatFormat, p.ParseChatOutput,
     p.JsonSchemaToGrammar, p.Devices, p.LoadModel, p.NewContext, p.LoadLora, p.FreeContext, p.FreeModel})
# Errors that a request raises before it changes anything (bad input).
UNCHANGED_ERRORS = (InvalidTokenError, GrammarError, BadRequestError, ContextOverflowError, ValueError, TypeError)


class SavedState(Protocol):
    """A context's state in a file this process holds (a page file, _image.PageFile): what a transfer copies
    into a worker from ``fd``."""

    @property
    def fd(self) -> int: ...


class PendingState:
    """A checkpoint whose bytes are still being read from the transfer file its SaveState wrote: the journal
    restarts from it at the SaveState's reply, and the job that sent the SaveState fills it (``data``; None
    when the read failed) before the worker's loop runs anything else, a recovery included."""

    def __init__(self) -> None:
        self.data: bytes | SavedState | None = None
        self.settled = False

    def set(self, data: bytes | SavedState | None) -> None:
        self.data, self.settled = data, True


Checkpoint = bytes | SavedState | PendingState


def deterministic(params: dict[str, Any]) -> bool:
    """Whether a generation with these params gives the same tokens again: greedy, or a fixed seed."""
    return int(params.get("seed", 0)) != MAX_SEED or float(params.get("temperature", 0.0)) <= 0.0


class Journal:
    """What a context's history was built from since its last checkpoint (module docstring). Owned by the
    context's machine: written in the order the worker answered."""

    def __init__(self, checkpoint_tokens: int | None = None) -> None:
        # Pool(checkpoint_tokens=N): the owner checkpoints once replaying the journal would decode N tokens.
        self.checkpoint_tokens = checkpoint_tokens
        self.replay_tokens = 0  # what replaying the entries costs, about, in prompt tokens (GENERATED_TOKEN_COST)
        self.checkpoint: Checkpoint | None = None  # None: the history starts empty
        self.entries: list[p.Request[Any]] = []
        self.lost: str | None = None  # why the history cannot be rebuilt, or None

    def restart(self, state: Checkpoint | None, first: Sequence[p.Request[Any]] = ()) -> None:
        """The history is ``state`` now (a checkpoint, a state loaded from bytes, a page file; None: empty),
        and ``first`` (the AdoptGenerations of generations suspended in it) replays on top of it."""
        self.checkpoint, self.entries, self.replay_tokens, self.lost = state, list(first), 0, None

    def wants_checkpoint(self) -> bool:
        """Whether replaying has grown to checkpoint_tokens (a background checkpoint is due)."""
        return (self.checkpoint_tokens is not None and self.lost is None
                and self.replay_tokens >= self.checkpoint_tokens)

    def _start(self, entries: list[p.Request[Any]], lost: str | None = None) -> None:
        self.checkpoint, self.entries, self.lost, self.replay_tokens = None, entries, lost, 0

    def record(self, req: p.Request[Any], result: Any, error: BaseException | None) -> None:
        """A request on the context ended with ``result`` or ``error``, the worker having answered every
        request before it (``req.context`` names the context's handle now)."""
        self.replay_tokens += self._record(req, result, error)

    def _record(self, req: p.Request[Any], result: Any, exc: BaseException | None) -> int:
        """Records req; returns about how many tokens replaying what it added decodes."""
        kind = type(req)
        if kind in READ_ONLY or (exc is not None and isinstance(exc, UNCHANGED_ERRORS)):
            return 0
        if isinstance(exc, WorkerCrashedError):
            return 0  # the recovery decides
        if isinstance(req, (p.Resume, p.AdoptGeneration)) and isinstance(exc, ContextError):
            return 0  # refused before it changed anything (nothing paused, another history)
        if exc is not None:
            self.lost = f"{req.op.value} failed ({type(exc).__name__}) and may have left the history half-changed"
            return 0
        if isinstance(req, (p.Generate, p.GenerateWithDraft)):
            return self._generated(req, result)
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
        elif isinstance(req, (p.Reset, p.Rerank)):
            self._start([])  # a generation context's rerank leaves it empty
        elif isinstance(req, p.SetLora):
            if result:  # a new configuration emptied the context; the owner applies it when it rebuilds
                self._start([])
        elif isinstance(req, p.LoadState):
            self.lost = "a state was loaded from a file"
        else:
            self.lost = f"{req.op.value} (branches and KV-sequence edits are not replayed)"
        return 0

    def _generated(self, req: p.Generate | p.GenerateWithDraft, result: Any) -> int:
        # Greedy/seeded output is generate()'s; a paused one's is its first n_decoded tokens, which the
        # same call capped at that many gives (then a Resume that goes on raises the cap).
        params = req.params if result.stop_reason != "paused" else {**req.params, "n_predict": result.n_decoded}
        replay: p.Request[Any] = p.Generate(context=req.context, prompt=req.prompt, params=params, append=req.append)
        why = None
        if result.stop_reason == "interrupted":
            why = "a generation was interrupted"
        elif result.stop_reason == "paused" and result.n_decoded == 0:
            why = "a generation paused before its first token"  # n_predict 0 would not cap its replay
        elif not deterministic(req.params):
            why = "a generation sampled with a random seed"
        tokens = int(result.n_prompt) + GENERATED_TOKEN_COST * int(result.n_decoded)
        # With background checkpoints (which bound the journal), a whole prompt that reused the history's
        # first n_cached tokens replays on top of that history, as it ran: the same prefix kept, the same
        # chunks decoded after it; the checkpoint it builds on stays.
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
        if not deterministic(start.params):  # taken over from a checkpoint or a move: it drew anew
            self.lost = "a generation sampled with a random seed"
            return
        self.entries[at] = msgspec.structs.replace(start, params={**start.params, "n_predict": result.n_decoded})
        if isinstance(start, p.AdoptGeneration) and at == len(self.entries) - 1:
            self.entries.append(p.Resume(context=req.context, origin=req.origin))


class Ledger:
    """The events a call delivered to its caller, so that a replay of it delivers only what comes after:
    stream pieces by their characters, prompt progress by its count."""

    def __init__(self) -> None:
        self.chars = 0  # of pieces the caller was given
        self.progress = -1  # the highest prompt count the caller was given
        self.attempts = 1
        self._skip = 0  # of the attempt now running: characters it delivers again, not passed on
        self._seen_progress = -1

    def again(self) -> None:
        """The call is sent once more: what its new attempt delivers again is skipped."""
        self.attempts += 1
        self._skip, self._seen_progress = self.chars, self.progress

    def admit(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The event as the caller is to see it (a piece cut to what is new), or None (nothing new)."""
        piece = event.get("piece")
        if isinstance(piece, str):
            cut = min(self._skip, len(piece))
            self._skip -= cut
            if cut == len(piece):
                return None
            if cut:
                event = {**event, "piece": piece[cut:]}
            self.chars += len(event["piece"])
        pair = event.get("prompt_progress")
        if pair is not None:
            if int(pair[0]) <= self._seen_progress:
                return None
            self.progress = max(self.progress, int(pair[0]))
        return event


def starts_afresh(req: p.Request[Any]) -> bool:
    """Whether req replaces its context's whole history (the journal starts again from it)."""
    return (isinstance(req, (p.Generate, p.GenerateWithDraft)) and not req.append) or isinstance(req, p.ScoreText)


def replayable(req: p.Request[Any], journal_ok: Callable[[], bool]) -> bool:
    """Whether a call in flight when its worker died can be sent again to the replacement and give the
    caller what the first worker would have: ``journal_ok()`` says whether its context's history is
    rebuilt exactly."""
    kind = type(req)
    if kind in STATELESS:
        return True
    if not isinstance(req, p.ContextRequest):
        return False
    if isinstance(req, (p.Generate, p.GenerateWithDraft)):
        return deterministic(req.params) and (not req.append or journal_ok())
    if isinstance(req, p.ScoreText):
        return True  # its text replaces the history
    if isinstance(req, (p.Embed, p.Rerank)):
        return True  # an embedding context holds nothing between calls
    if isinstance(req, p.Eval) or kind in READ_ONLY:
        return kind is not p.SaveState and journal_ok()
    return False


__all__ = ["GENERATED_TOKEN_COST", "MAX_ATTEMPTS", "Journal", "Ledger", "PendingState", "deterministic",
           "replayable", "starts_afresh"]
