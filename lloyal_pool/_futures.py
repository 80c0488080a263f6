"""Futures plumbing shared by the client's handle modules."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def running() -> Future[T]:
    """A call's future, already in the running state: the request is sent when the future is made, so
    ``cancel()`` cannot take it back and returns False, as for any running future (stop a decoding call
    with interrupt()). Left pending, a cancel() would succeed and the reply's set_result would then fail
    on the reader thread."""
    fut: Future[T] = Future()
    fut.set_running_or_notify_cancel()
    return fut


def mapped(fut: Future[Any], fn: Callable[[Any], T]) -> Future[T]:
    """A future of fn(fut's result), or of fut's error."""
    out: Future[T] = running()

    def done(f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:
            out.set_exception(e)

    fut.add_done_callback(done)
    return out
