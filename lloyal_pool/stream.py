"""Stream: the pieces of one generation as they are decoded, on a client thread's queue."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

from ._link import check_timeout, wait
from ._pieces import PieceStream
from .errors import CallTimeoutError
from .params import Result


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

