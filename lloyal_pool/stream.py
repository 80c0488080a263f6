"""Stream: the pieces of one generation as they are decoded, on a client thread's queue. A context's stream
pauses, resumes and moves between workers: its generation (_generation.Generation) lives in its context's
core, which pauses it at a token boundary and goes on with it, in whichever worker holds the context.

    Stream.pause() ─▶ the context's interrupt word: request id | PAUSE_BIT ─▶ the worker stops at the next
                      token boundary, keeps the generation, emits {"paused": portable form}, replies
    Stream.resume() ─▶ Resume (after AdoptGeneration when another worker now holds the context: a move,
                       or crash recovery) ─▶ the same generation goes on, its pieces into the same queue
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ._futures import check_timeout, wait
from ._generation import Phase, Why
from ._pieces import PieceStream
from .errors import CallTimeoutError, ContextError
from .params import Result

if TYPE_CHECKING:
    from ._core import ContextCore
    from ._generation import Generation


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

    def __init__(self, interrupt: Callable[[Future[Any]], None], timeout: float | None = None) -> None:
        super().__init__(interrupt)
        self._run: Generation | None = None
        self._core: ContextCore | None = None
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

    def _start_run(self, core: ContextCore, start: Callable[[], Generation]) -> None:
        self._core = core
        self._run = run = start()
        self._attach(run.future)

    def interrupt(self) -> None:
        """Stops this stream's generation, from any thread: now if it runs, as soon as it starts if it is
        still queued behind other calls on the context, at once if it is paused. Its result says
        ``interrupted``."""
        if self._run is not None and self._core is not None:
            self._core.stop(self._run)
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
        if self._run is None or self._core is None:
            raise ContextError("only a context's stream (Context.stream) pauses")
        check_timeout(timeout)
        return self._core.pause(self._run, wait, timeout)

    def resume(self) -> bool:
        """Goes on with a paused stream, from any thread, token for token as if it had not stopped
        (seeded sampling included); in another worker too, after Context.move_to or a crash of its
        worker with Pool(recover=True). Waits for a pause that is under way; False when the stream is
        not paused."""
        if self._run is None or self._core is None:
            raise ContextError("only a context's stream (Context.stream) pauses")
        return self._core.resume(self._run)

    @property
    def paused(self) -> bool:
        """Whether the stream is paused (or pausing) by its caller (not for one of Pool(checkpoint_tokens)'s
        checkpoints)."""
        run = self._run
        return run is not None and run.phase in (Phase.PAUSING, Phase.PAUSED) and run.why is Why.CALLER

