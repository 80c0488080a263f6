"""A context's pausable generation as pure state: the segments that make it (the Generate, then a Resume
after each pause), its phase and why it paused, and the accounting that keeps its caller's pieces whole
across pauses, moves and crashes. No thread, no lock, no I/O: the context's machine (_machine.py) owns it
and turns what it decides into requests.

    running ──pause(why)──▶ pausing ──segment replied "paused"──▶ paused(why) ──resume──▶ running
       │                       │                                      │
       └── segment ended ──────┴──────────────▶ done ◀── stopped ─────┘

``why`` is who paused it: the caller (Stream.pause), a checkpoint (Pool(checkpoint_tokens)), a move
(Context.move_to), or a crash under a Resume (the replacement takes it over and goes on). A caller pausing
while a checkpoint's or a move's pause lands makes the pause the caller's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec

from . import protocol as p
from ._futures import running
from ._journal import GENERATED_TOKEN_COST
from .params import Result, StopReason


class Phase(enum.Enum):
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    DONE = "done"


class Why(enum.Enum):
    CALLER = "caller"
    CHECKPOINT = "checkpoint"
    MOVE = "move"
    CRASH = "crash"  # its worker died under a Resume: the replacement goes on with it


class Generation:
    """One streamed generation on a context (module docstring); ``future`` is the whole generation's Result.
    ``deliver`` gets its events (pieces, prompt progress) as the caller is to see them."""

    def __init__(self, request: p.Generate, deliver: Callable[[dict[str, Any]], None] | None,
                 checkpoint_tokens: int | None = None) -> None:
        self.request = request
        self.deliver = deliver
        self.future: Future[Result] = running()  # cancel() cannot take it back: interrupt() stops it
        self.phase = Phase.RUNNING
        self.why: Why | None = None
        self.segment: Any = None  # the CallRec in flight (_machine.py), or None
        self.resuming = False  # the segment in flight is a Resume
        self.stop_wanted = False
        self.origin = 0  # the first segment's request id: what the worker knows the generation by
        self.holder: object = None  # the worker (its machine and epoch) that holds the paused generation
        self.suspension: dict[str, Any] | None = None  # its portable form (None: mirostat, which has none)
        # What its last segment to end left suspended in the worker (not inside its prompt), or None: what
        # a checkpoint taken after that segment holds of it (adoption()).
        self.left_suspended: dict[str, Any] | None = None
        self.partial: Result | None = None  # the paused segment's result
        # What the workers that took the generation over do not report: the segments before (their
        # logprobs and decode time), joined into the ones after.
        self.before: Result | None = None
        self.chars = 0  # of pieces delivered
        self.chars_at_pause = 0
        # Characters of pieces that a request sent again delivers once more (a Resume after a crash, a
        # Generate after a pause inside its prompt): counted in chars again, not passed on. chars plus
        # skip is always what the caller has been given.
        self.skip = 0
        self.adopting: Any = None  # the AdoptGeneration sent before the Resume in flight (its error says more)
        # Pool(checkpoint_tokens=N): paused for a checkpoint whenever decoding it again would cost N prompt
        # tokens: inside a whole prompt every N tokens (between two ubatches: then sent again, the cache
        # holding what was decoded), in the generation every N / GENERATED_TOKEN_COST pieces (then resumed).
        self.checkpoint_tokens = checkpoint_tokens
        self.checkpoint_pieces = (None if checkpoint_tokens is None
                                  else max(1, checkpoint_tokens // GENERATED_TOKEN_COST))
        self.pieces_since = 0
        params = request.params
        # The worker pauses inside a prompt only where the request sent again reuses what was decoded.
        self.prompt_pausable = (not request.append and bool(params.get("cache_prompt", True))
                                and not params.get("cache_bit_exact", False))
        self.prompt_done = 0  # of the prompt's tokens to decode, those decoded by the segments before
        self.last_done = 0  # ... and by this one too, as its last progress event said
        self.checkpointed_at = 0
        self.first_cached: int | None = None  # the first segment's n_cached: what the prompt reused
        self.prompt_ms_before = 0.0  # the prompt time of the segments that paused inside it

    @property
    def params(self) -> dict[str, Any]:
        return self.request.params

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def in_prompt(self) -> bool:
        """Whether it paused inside its prompt: nothing is suspended, the Generate sent again goes on."""
        return self.suspension is not None and bool(self.suspension.get("prompt"))

    @property
    def paused_by_caller(self) -> bool:
        return self.phase in (Phase.PAUSING, Phase.PAUSED) and self.why is Why.CALLER

    # -- events --------------------------------------------------------------------------------------------
    def on_event(self, event: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """An event of the segment in flight: what its caller is to see of it (or None), and whether a
        checkpoint's pause is due now."""
        if "paused" in event:
            self.suspension = event["paused"]
            return None, False
        due = False
        pair = event.get("prompt_progress")
        if pair is not None:
            done, total = int(pair[0]) + self.prompt_done, int(pair[1]) + self.prompt_done
            event = {**event, "prompt_progress": [done, total]}
            self.last_done = done
            every = self.checkpoint_tokens
            if (every is not None and self.prompt_pausable and done - self.checkpointed_at >= every
                    and done < total):
                self.checkpointed_at = done
                due = True
        piece = event.get("piece")
        if isinstance(piece, str):
            self.pieces_since += 1
            if self.checkpoint_pieces is not None and self.pieces_since >= self.checkpoint_pieces:
                self.pieces_since = 0
                due = True
            if self.skip:  # delivered before: counted again, not passed on again
                cut = min(self.skip, len(piece))
                self.skip -= cut
                self.chars += cut
                if cut == len(piece):
                    return None, due
                event = {**event, "piece": piece[cut:]}
            self.chars += len(event["piece"])
        return event, due

    # -- a segment's end -----------------------------------------------------------------------------------
    def joined(self, result: Result) -> Result:
        """result with what the segments before a take-over, or a pause inside the prompt, reported joined in."""
        before = self.before
        changes: dict[str, Any] = {}
        if before is not None:
            changes["logprobs"] = None if result.logprobs is None else [*(before.logprobs or []), *result.logprobs]
            changes["decode_ms"] = before.decode_ms + result.decode_ms
        if self.prompt_ms_before:  # the prompt's first part: its time, and the cache it reused
            changes["prompt_ms"] = self.prompt_ms_before + result.prompt_ms
            changes["n_cached"] = self.first_cached or 0
        return msgspec.structs.replace(result, **changes) if changes else result

    def paused_at(self, result: Result, request_id: int, holder: object) -> None:
        """The segment in flight (request_id) replied "paused": the worker ``holder`` holds the generation."""
        self.left_suspended = None if self.in_prompt else self.suspension
        if self.first_cached is None:
            self.first_cached = result.n_cached
        if not self.resuming:  # the Generate's id (the one a recovery sent it again under)
            self.origin = request_id
        self.partial, self.holder = result, holder
        # The segment after this one streams on from what the generation has streamed so far (a Generate
        # sent again after a pause inside its prompt, from nothing): what the caller was given beyond it
        # (before a crash whose replay paused) is not given twice.
        streamed, given = len(result.text), self.chars + self.skip
        self.skip, self.chars = max(0, given - streamed), min(given, streamed)
        self.chars_at_pause = self.chars
        self.phase = Phase.PAUSED
        if self.why is None:
            self.why = Why.CALLER  # a pause the worker took without our asking: the caller's to resume
        self.segment, self.adopting = None, None

    def ended(self, result: Result | None, error: BaseException | None) -> None:
        """The generation ended (its last segment's reply, or an error): the future gets it."""
        if error is None and self.first_cached is None and result is not None:
            self.first_cached = result.n_cached
        self.left_suspended = None
        self.phase, self.segment = Phase.DONE, None
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            assert result is not None
            self.future.set_result(self.joined(result))

    def crashed_under_resume(self, holder: object) -> None:
        """Its worker died under a Resume: paused where it last paused (the journal replays its history up
        to there), the pieces delivered since counted to be skipped when the replacement goes on."""
        self.skip, self.chars = self.chars + self.skip - self.chars_at_pause, self.chars_at_pause
        self.phase, self.why, self.segment, self.adopting = Phase.PAUSED, Why.CRASH, None, None
        self.holder = holder

    def stopped_while_paused(self) -> None:
        """Ended while paused: its result is the text it had streamed, stop_reason interrupted."""
        paused = self.joined(self.partial) if self.partial is not None else self.before
        self.phase, self.segment, self.left_suspended = Phase.DONE, None, None
        if not self.future.done():
            if paused is None:
                paused = Result(text="", tokens=[], n_prompt=0, n_decoded=0, n_cached=0,
                                stop_reason=StopReason.INTERRUPTED, prompt_ms=0.0, decode_ms=0.0)
            self.future.set_result(msgspec.structs.replace(paused, stop_reason=StopReason.INTERRUPTED))

    # -- going on ------------------------------------------------------------------------------------------
    def next_segment(self, context: int, holder: object) -> list[p.Request[Any]]:
        """The requests that go on with the paused generation in the worker ``holder`` (its history there):
        the Generate again for one paused inside its prompt; else a Resume, after its hand-over
        (AdoptGeneration) where another worker holds it. Raises ValueError for a generation with no
        portable form that would have to move."""
        self.phase, self.why = Phase.RUNNING, None
        if self.in_prompt:  # the same prompt again: the cache holds what was decoded
            assert self.partial is not None
            self.prompt_done = self.last_done  # its progress events come before its reply
            self.prompt_ms_before += self.partial.prompt_ms
            self.partial, self.holder, self.resuming = None, holder, False
            return [msgspec.structs.replace(self.request, context=context)]
        out: list[p.Request[Any]] = []
        if self.holder != holder:
            if self.suspension is None:
                raise ValueError("mirostat")
            out.append(self.adoption_at(context))
            self.handed_over(holder)
        self.resuming = True
        out.append(p.Resume(context=context, stream=self.request.stream, origin=self.origin))
        return out

    def adoption_at(self, context: int) -> p.AdoptGeneration:
        assert self.suspension is not None
        return p.AdoptGeneration(context=context, params=self.request.params, suspension=self.suspension,
                                 origin=self.origin)

    def adoption(self, context: int) -> p.AdoptGeneration | None:
        """At the reply of a SaveState: the request that takes over the generation as the saved state
        holds it, suspended there, or None (running, ended, or paused inside its prompt: its Generate, sent
        again, starts afresh). For one with no portable form (mirostat) the Resume's record finds no start
        and marks the journal lost."""
        suspension = self.left_suspended
        if suspension is None or self.done:
            return None
        return p.AdoptGeneration(context=context, params=self.request.params, suspension=suspension,
                                 origin=self.origin)

    def handed_over(self, holder: object) -> None:
        """The paused generation now lives in ``holder`` (AdoptGeneration sent there; or its context only,
        for one paused inside its prompt, which the next segment sends again)."""
        if self.partial is not None and not self.in_prompt:
            self.before, self.partial = self.joined(self.partial), None
        self.holder = holder


__all__ = ["Generation", "Phase", "Why"]
