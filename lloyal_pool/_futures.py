"""Futures plumbing shared by the client's handle modules."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def mapped(fut: Future[Any], fn: Callable[[Any], T]) -> Future[T]:
    out: Future[T] = Future()

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
