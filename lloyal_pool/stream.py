"""Stream: the pieces of one generation as they are decoded, on a client thread's queue; and Pausable,
what lets a context's stream pause, resume and move between workers.

    Stream.pause() ─▶ the context's interrupt word: request id | PAUSE_BIT ─▶ the worker stops at the next
                      token boundary, keeps the generation, emits {"paused": portable form}, replies
    Stream.resume() ─▶ Resume (after AdoptGeneration when another worker now holds the context: a move,
                       or crash recovery) ─▶ the same generation goes on, its pieces into the same queue
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec

from . import protocol as p
from ._futures import running
from ._link import check_timeout, wait
from ._pieces import PieceStream
from ._process import GENERATED_TOKEN_COST
from .errors import CallTimeoutError, ContextError, WorkerCrashedError
from .params import Result, StopReason

if TYPE_CHECKING:
    from ._link import ContextLink
    from ._process import WorkerProcess


class Pausable:
    """One streamed generation on a context across its pauses and moves: ``future`` is the whole
    generation's result, behind the segments that make it (the Generate, then a Resume after each
    pause). States: running, pausing (asked, not yet stopped), paused, done."""

    def __init__(self, link: ContextLink, request: p.Generate,
                 deliver: Callable[[dict[str, Any]], None] | None, checkpoint_tokens: int | None = None) -> None:
        self._link = link
        self._request = request
        self._deliver = deliver
        self.future: Future[Result] = running()  # cancel() cannot take it back: interrupt() stops it
        self._cond = threading.Condition(threading.Lock())
        self.state = "running"
        self._request_id = 0
        self.origin = 0  # the first segment's request id: what the worker knows the generation by
        self.holder: WorkerProcess | None = None  # the worker that holds the paused generation
        self.suspension: dict[str, Any] | None = None  # its portable form (None: mirostat, which has none)
        # The portable form its last segment to end left suspended in the worker (not inside its prompt),
        # or None: what a checkpoint taken after that segment holds of it (adoption()).
        self._left_suspended: dict[str, Any] | None = None
        self._partial: Result | None = None  # the paused segment's result
        self._stop_wanted = False
        self._adopting: Future[None] | None = None
        self._resuming = False  # the current segment is a Resume
        self._sending = False  # a segment is being sent (its id may not be known yet)
        self._auto_resuming = False  # ... the Resume (or Generate sent again) after a checkpoint's pause
        # What the workers that took the generation over do not report: the segments before (their
        # logprobs and decode time), joined into the ones after.
        self._before: Result | None = None
        self._chars = 0  # of pieces delivered
        self._chars_at_pause = 0
        # Characters of pieces that a request sent again delivers once more (a Resume after a crash, a
        # Generate after a pause inside its prompt): counted in _chars again, not passed on. _chars plus
        # _skip is always what the caller has been given.
        self._skip = 0
        # Pool(checkpoint_tokens=N) with recover=True: the stream is checkpointed whenever decoding it again
        # would cost N prompt tokens, so that a crash does not decode it all again: paused (in a whole
        # prompt every N tokens, between two ubatches: then sent again, the cache holding what was
        # decoded; in the generation every N / GENERATED_TOKEN_COST pieces: then resumed), its state saved
        # as the journal's checkpoint.
        self._checkpoint_tokens = checkpoint_tokens
        self._checkpoint_pieces = (None if checkpoint_tokens is None
                                   else max(1, checkpoint_tokens // GENERATED_TOKEN_COST))
        self._pieces_since = 0  # pieces (about tokens) since the last checkpoint
        # The worker pauses inside a prompt only where the request sent again reuses what was decoded.
        params = request.params
        self._prompt_pausable = (not request.append and bool(params.get("cache_prompt", True))
                                 and not params.get("cache_bit_exact", False))
        self._auto = False  # the pause under way is such a checkpoint's, not the caller's
        self._held = False  # ... for which the stream holds its link (no other call runs in between)
        self._prompt_done = 0  # of the prompt's tokens to decode, those decoded by the segments before
        self._last_done = 0  # ... and by this one too, as its last progress event said
        self._checkpointed_at = 0
        self._first_cached: int | None = None  # the first segment's n_cached: what the prompt reused
        self._prompt_ms_before = 0.0  # the prompt time of the segments that paused inside it

    @property
    def params(self) -> dict[str, Any]:
        return self._request.params

    def start(self) -> None:
        self._send(self._request)

    def _send(self, req: p.Generate | p.Resume) -> None:
        self._resuming = isinstance(req, p.Resume)
        with self._cond:
            self._sending = True
        try:
            fut = self._link.call(req, self._on_event, on_id=self._set_id)
        finally:
            with self._cond:
                self._sending = False
        fut.add_done_callback(self._segment_ended)

    def _set_id(self, request_id: int) -> None:
        """The segment being sent has its id: a stop or a pause asked for while it was sent (the one
        before had ended) is asked of it."""
        with self._cond:
            self._request_id = request_id
            stop, pause = self._stop_wanted, self.state == "pausing"
        if stop:
            self._link.interrupt_request(request_id)
        elif pause:
            self._link.pause_request(request_id)

    @property
    def in_prompt(self) -> bool:
        """Whether it paused inside its prompt: nothing is suspended, the Generate sent again goes on."""
        return self.suspension is not None and bool(self.suspension.get("prompt"))

    def _on_event(self, event: dict[str, Any]) -> None:
        if "paused" in event:
            self.suspension = event["paused"]
            if self.in_prompt:
                self._link.prompt_paused(self._request_id)
            return
        pair = event.get("prompt_progress")
        if pair is not None:
            done, total = int(pair[0]) + self._prompt_done, int(pair[1]) + self._prompt_done
            event = {**event, "prompt_progress": [done, total]}
            self._last_done = done
            every = self._checkpoint_tokens
            if (every is not None and self._prompt_pausable and done - self._checkpointed_at >= every
                    and done < total):
                self._checkpointed_at = done
                self._auto_pause()
        piece = event.get("piece")
        if isinstance(piece, str):
            self._pieces_since += 1
            if self._checkpoint_pieces is not None and self._pieces_since >= self._checkpoint_pieces:
                self._pieces_since = 0
                self._auto_pause()
            if self._skip:  # delivered before: counted again, not passed on again
                cut = min(self._skip, len(piece))
                self._skip -= cut
                self._chars += cut
                if cut == len(piece):
                    return
                event = {**event, "piece": piece[cut:]}
            self._chars += len(event["piece"])
        if self._deliver is not None:
            self._deliver(event)

    def _joined(self, result: Result) -> Result:
        """result with what the segments before a take-over, or a pause inside the prompt, reported
        joined in."""
        before = self._before
        changes: dict[str, Any] = {}
        if before is not None:
            changes["logprobs"] = None if result.logprobs is None else [*(before.logprobs or []), *result.logprobs]
            changes["decode_ms"] = before.decode_ms + result.decode_ms
        if self._prompt_ms_before:  # the prompt's first part: its time, and the cache it reused
            changes["prompt_ms"] = self._prompt_ms_before + result.prompt_ms
            changes["n_cached"] = self._first_cached or 0
        return msgspec.structs.replace(result, **changes) if changes else result

    def _segment_ended(self, fut: Future[Result]) -> None:
        error = fut.exception()
        paused = error is None and fut.result().stop_reason == StopReason.PAUSED
        self._left_suspended = self.suspension if paused and not self.in_prompt else None
        with self._cond:
            if not (paused and self._auto and not self._stop_wanted):  # no checkpoint's pause: other calls go on
                self._auto = False
                self._end_hold()
        adopting, self._adopting = self._adopting, None
        if error is not None and adopting is not None and adopting.exception() is not None:
            error = adopting.exception()  # the Resume failed because the take-over did: say why
        if isinstance(error, WorkerCrashedError) and self._resuming and self._recoverable():
            # Its worker died under the Resume: crash recovery rebuilds the history up to the pause
            # (the journal), and the generation goes on from its portable form, the pieces it had
            # delivered since the pause not delivered twice.
            with self._cond:
                self.state, self._skip = "paused", self._chars + self._skip - self._chars_at_pause
                self._chars = self._chars_at_pause
                self._cond.notify_all()
            threading.Thread(target=self._resume_after_crash, daemon=True, name="lloyal-resume").start()
            return
        if self._first_cached is None and error is None:
            self._first_cached = fut.result().n_cached
        if paused:
            if not self._resuming:  # the Generate's id, or the one crash recovery sent it again under
                self.origin = self._link.latest(self._request_id)
            with self._cond:
                self._partial, self.holder = fut.result(), self._link.proc
                # The segment after this one streams on from what the generation has streamed so far
                # (a Generate sent again after a pause inside its prompt, from nothing): what the caller
                # was given beyond it (before a crash whose replay paused) is not given twice.
                streamed, given = len(self._partial.text), self._chars + self._skip
                self._skip, self._chars = max(0, given - streamed), min(given, streamed)
                self._chars_at_pause = self._chars
                self.state = "paused"
                self._cond.notify_all()
                stop, auto = self._stop_wanted, self._auto
                if stop or not auto:  # the caller paused or stopped it since the check above
                    self._auto = False
                    self._end_hold()
            if stop:
                self.interrupt()
            elif auto:
                threading.Thread(target=self._checkpoint_and_go, daemon=True, name="lloyal-checkpoint").start()
            return
        with self._cond:
            self.state = "done"
            self._cond.notify_all()
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(self._joined(fut.result()))

    def _recoverable(self) -> bool:
        proc = self._link.proc
        return proc.recovery is not None and self.suspension is not None and self._link.journal is not None

    def _resume_after_crash(self) -> None:
        try:
            self.resume()
        except BaseException as exc:
            self.fail(exc)

    def fail(self, error: BaseException) -> None:
        """Ends a paused generation that cannot go on with ``error``."""
        with self._cond:
            if self.state == "done":
                return
            self.state = "done"
            self._cond.notify_all()
        self.future.set_exception(error)

    def _auto_pause(self) -> None:
        """A checkpoint's pause, asked for where nothing but this stream is under way on the context (else
        none now: the next is due after as many tokens again). The link is held from here to the resume,
        so that no call of another thread runs on the context in between (it would end the generation)."""
        with self._cond:
            if self.state != "running" or not self._link.hold_for_checkpoint(self._request_id):
                return
            self._held = True
            self._auto = self._link.stream_checkpoint = True
            self.state = "pausing"
            if not self._link.pause_request(self._request_id):
                self.state, self._auto = "running", False
                self._end_hold()

    def _end_hold(self) -> None:
        """(Under _cond.) Releases the link held for a checkpoint's pause, if it is."""
        self._link.stream_checkpoint = False
        if self._held:
            self._held = False
            self._link.release_hold()

    def _checkpoint_and_go(self) -> None:
        """A checkpoint's pause: the state saved as the journal's checkpoint, then on, unless the caller
        paused the stream meanwhile (then it is theirs to resume)."""
        self._link.adopt_hold()
        try:
            try:
                self._link.checkpoint()  # whose journal takes this generation over (adoption())
            except Exception:
                pass  # a worker that died or a context closed meanwhile: recovery replays the journal instead
            self._link.stream_checkpoint = False
            try:
                self._resume(auto=True)
            except BaseException as exc:
                self.fail(exc)
        finally:
            with self._cond:
                self._end_hold()

    def adoption(self) -> p.AdoptGeneration | None:
        """At the reply of a SaveState (the reader thread runs segments' ends and replies in order): the
        request that takes over the generation as the saved state holds it, suspended there (its tokens
        in the state), or None. A checkpoint's journal starts with it, as a move's does, and the Resume
        that follows caps it. None for one paused inside its prompt (its Generate, sent again, starts
        afresh) or running; for one with no portable form (mirostat) the Resume's record finds no start
        and marks the journal lost."""
        suspension = self._left_suspended
        if suspension is None or self.state == "done":
            return None
        return p.AdoptGeneration(context=self._link.handle, params=self._request.params, suspension=suspension,
                                 origin=self.origin)

    def pause(self, wait: bool = True, timeout: float | None = None) -> bool:
        """Asks the generation to pause at its next token boundary; with ``wait``, returns once it has
        (True) or has ended (False)."""
        with self._cond:
            if self._auto:  # a checkpoint's pause under way is the caller's now
                self._auto = self._link.stream_checkpoint = False
            if self.state == "running":
                self.state = "pausing"
                if not self._link.pause_request(self._request_id) and not self._sending:
                    self.state = "running"  # it ended meanwhile: its reply settles the state
            if not wait:
                return self.state in ("pausing", "paused")
            self._cond.wait_for(lambda: self.state in ("paused", "done"), timeout)
            return self.state == "paused"

    def resume(self) -> bool:
        """Goes on with a paused generation (after its pause has taken effect); False when it is not
        paused (running, or ended). Holds the link while it sends the Resume, so that a move sees the
        generation either paused or running under its new request id."""
        return self._resume(auto=False)

    def _resume(self, auto: bool) -> bool:
        """resume(); with ``auto``, a checkpoint's: only while its pause is not the caller's."""
        link = self._link
        with link.moving():
            with self._cond:
                self._cond.wait_for(lambda: self.state != "pausing")
                if self.state != "paused" or (auto and not self._auto):
                    return False
                # A checkpoint's Resume is being sent: a Context.interrupt() meanwhile ends it
                # (interrupt_checkpointing), as one before the pause would have.
                self.state, self._auto, self._auto_resuming = "running", False, auto
            try:
                if not link.proc.alive:
                    link.proc.await_recovery()  # crash recovery rebuilds the history; the generation is ours
                if self.in_prompt:  # the same prompt again: the cache holds what was decoded
                    assert self._partial is not None
                    self._prompt_done = self._last_done  # its progress events come before its reply
                    self._prompt_ms_before += self._partial.prompt_ms
                    self._partial = None  # nothing of it but its prompt time
                    self.holder = link.proc
                    self._send(self._request)
                    return True
                if self.holder is not link.proc:
                    self.take_over()
                self._send(p.Resume(context=link.handle, stream=self._request.stream, origin=self.origin))
            except BaseException:
                with self._cond:
                    self.state = "paused"
                    self._cond.notify_all()
                raise
            finally:
                with self._cond:
                    self._auto_resuming = False
        return True

    def take_over(self) -> None:
        """Hands the paused generation to the worker that now holds the context (its history already
        there): sends its portable form, not waited for (the Resume after it fails if it does)."""
        if self.suspension is None:
            raise ContextError("the paused generation cannot go on in another worker: a mirostat sampler's state "
                               "does not travel")
        link = self._link
        self._adopting = link.call(p.AdoptGeneration(context=link.handle, params=self._request.params,
                                                     suspension=self.suspension, origin=self.origin))
        self.handed_over(link.proc)

    def handed_over(self, proc: WorkerProcess) -> None:
        """The paused generation now lives in ``proc`` (AdoptGeneration sent there; or its context only,
        for one paused inside its prompt, which resume() sends again)."""
        if self._partial is not None and not self.in_prompt:
            self._before, self._partial = self._joined(self._partial), None
        self.holder = proc

    def interrupt_checkpointing(self) -> None:
        """Context.interrupt() for a generation that is paused, or being resumed, for a checkpoint (the
        worker runs nothing of it then): ends it. Not one its caller paused, nor one that is running or
        starting (Context.interrupt() stops the request the worker runs, as for any call)."""
        with self._cond:
            if not (self._auto or self._auto_resuming):
                return
        self.interrupt()

    def interrupt(self) -> None:
        """Ends the generation: a running one as interrupt() does; a paused one at once, its result the
        text it had streamed, stop_reason interrupted."""
        with self._cond:
            if self.state in ("running", "pausing"):  # also for a segment being sent (_set_id)
                self._stop_wanted = True
            if self.state != "paused":
                request_id = self._request_id
                paused = None
            else:
                self.state = "done"
                self._cond.notify_all()
                paused = self._joined(self._partial) if self._partial is not None else self._before
        if paused is None:
            self._link.interrupt_request(request_id)
            return
        self.future.set_result(msgspec.structs.replace(paused, stop_reason=StopReason.INTERRUPTED))


class Runs:
    """A context's pausable generations, weakly held: added by the thread that starts one, listed by any
    (a move, a page-out, a checkpoint's reply on the reader thread)."""

    def __init__(self) -> None:
        self._runs: weakref.WeakSet[Pausable] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, run: Pausable) -> None:
        with self._lock:
            self._runs.add(run)

    def live(self) -> list[Pausable]:
        """Those that have not ended."""
        with self._lock:
            runs = list(self._runs)
        return [r for r in runs if r.state != "done"]

    def suspended(self) -> list[p.Request[Any]]:
        """What a checkpoint's journal starts with: the generations suspended in the saved state (adoption())."""
        return [req for run in self.live() if (req := run.adoption()) is not None]


class Stream(PieceStream):
    """Text pieces as they are decoded: iterate, then read ``result``. The pieces always join to
    ``result.text`` (text that could be the start of a stop string is held back until it is not).

    Leaving early stops the generation: ``close()`` (or the end of a ``with`` block, or the stream being
    garbage-collected while it runs) interrupts the request, so the context is free again at once
    instead of generating on for nobody:

        with ctx.stream("Once upon a time", n_predict=400) as stream:
            for piece in stream:
                if "dragon" in piece:
                    break          # the worker stops generating here
    """

    def __init__(self, interrupt: Callable[[int], None], timeout: float | None = None) -> None:
        super().__init__(interrupt)
        self._run: Pausable | None = None
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        check_timeout(timeout)
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._timed_out: CallTimeoutError | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._timed_out is not None:
            raise self._timed_out
        try:
            item = self._q.get(timeout=self._left())
        except queue.Empty:
            self._wait_result()  # raises CallTimeoutError, unless the generation ended just now
            item = self._q.get()
        if item is self._END:
            self._q.put(self._END)  # stay exhausted
            self.future.result()  # raises the call's error, if any
            raise StopIteration
        assert isinstance(item, str)
        return item

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _wait_result(self) -> Result:
        if self._timed_out is not None:
            raise self._timed_out
        try:
            return wait(self.future, self._left(), self.interrupt, f"stream (timeout={self._timeout:g}s)"
                        if self._timeout is not None else "stream")
        except CallTimeoutError as exc:
            self._timed_out = exc
            raise

    @property
    def result(self) -> Result:
        """The whole generation's Result. Blocks until the generation ends (read it after iterating, or
        instead of iterating); raises the call's error, if it failed, and CallTimeoutError once the
        stream's timeout has passed."""
        return self._wait_result()

    def close(self) -> None:
        """Stops the generation unless it has ended; the pieces already received stay readable. Does not
        wait: ``result`` does."""
        if not self.future.done():
            self.interrupt()

    def _start_run(self, run: Pausable) -> None:
        self._run = run
        self._attach(run.future)
        run.start()

    def interrupt(self) -> None:
        """Stops this stream's generation, from any thread: now if it runs, as soon as it starts if it is
        still queued behind other calls on the context, at once if it is paused. Its result says
        ``interrupted``."""
        if self._run is not None:
            self._run.interrupt()
        else:
            super().interrupt()

    def pause(self, *, wait: bool = True, timeout: float | None = None) -> bool:
        """Pauses a context's stream, from any thread: the generation stops at its next token boundary
        (everything it streamed decoded), keeping its place, its sampler (the PRNG where it stood, the
        grammar, the penalty windows) and its held-back text; iterating waits meanwhile. With ``wait``
        (the default) returns once it has stopped (True) or ended first (False); a generation still
        decoding a whole prompt with the prompt cache stops between two of its ubatches (resume() sends
        it again, which goes on from the cache), others after the prompt. The context is free while it
        is paused: another call
        on it drops the paused generation (resume() then raises ContextError). ContextError for a
        stream of batched calls (Pool/Instance.stream), which do not pause."""
        if self._run is None:
            raise ContextError("only a context's stream (Context.stream) pauses")
        check_timeout(timeout)
        return self._run.pause(wait, timeout)

    def resume(self) -> bool:
        """Goes on with a paused stream, from any thread, token for token as if it had not stopped
        (seeded sampling included); in another worker too, after Context.move_to or a crash of its
        worker with Pool(recover=True). Waits for a pause that is under way; False when the stream is
        not paused."""
        if self._run is None:
            raise ContextError("only a context's stream (Context.stream) pauses")
        return self._run.resume()

    @property
    def paused(self) -> bool:
        """Whether the stream is paused (or pausing) by its caller (not for one of Pool(checkpoint_tokens)'s
        checkpoints)."""
        run = self._run
        return run is not None and run.state in ("pausing", "paused") and not run._auto

