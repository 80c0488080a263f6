"""What Stream (blocking) and AsyncStream (asyncio) share: a streamed request's end of the pipe. The
request's events put each text piece into ``_q`` and its future's end puts ``_END``; ``interrupt``
stops the request behind its future (its context's ContextCore.interrupt_future, or a batched request's own)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from .params import Result


class _Queue(Protocol):
    def put(self, item: Any, /) -> None: ...


class PieceStream:
    """The attach protocol Context._start_stream and the batched calls speak, and the interrupt."""

    _END = object()
    _q: _Queue

    def __init__(self, interrupt: Callable[[Future[Any]], None]) -> None:
        self._interrupt = interrupt  # of the request behind this future
        self.future: Future[Result]

    def _attach(self, fut: Future[Result]) -> None:
        self.future = fut
        q, end = self._q, self._END  # not self: a running request must not keep its stream alive
        fut.add_done_callback(lambda _: q.put(end))

    def __del__(self) -> None:
        fut = getattr(self, "future", None)  # absent when the request could not even be sent
        if fut is not None and not fut.done():
            self.interrupt()

    @property
    def done(self) -> bool:
        """Whether the generation has ended (its result is ready)."""
        return self.future.done()

    def interrupt(self) -> None:
        """Stops this stream's generation, from any thread: now if it runs, or as soon as it starts if it
        is still queued behind other calls on the context. Its result says ``interrupted``."""
        fut = getattr(self, "future", None)
        if fut is not None:
            self._interrupt(fut)
