"""Futures plumbing shared by the client's handle modules: a call's future, waiting on it with a timeout,
and the event handlers a request's callbacks become."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from .errors import BadRequestError, CallTimeoutError, InvalidArgumentError, WorkerError

T = TypeVar("T")
R = TypeVar("R")
EventHandler = Callable[[dict[str, Any]], None]
PromptProgress = Callable[[int, int], None]
"""Prompt evaluation progress: (tokens decoded so far, tokens to decode), after each micro-batch."""


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


def events(**handlers: Callable[[Any], None] | None) -> EventHandler | None:
    """An EVENT handler that passes ``event[key]`` to ``handlers[key]`` for each key it carries."""
    active = {k: fn for k, fn in handlers.items() if fn is not None}
    for key, fn in active.items():
        if not callable(fn):  # it would only fail on the reader thread, where nobody sees it
            raise BadRequestError(f"the {key} callback must be callable, got {type(fn).__name__}")
    if not active:
        return None

    def on_event(event: dict[str, Any]) -> None:
        for key, fn in active.items():
            if key in event:
                fn(event[key])

    return on_event


def spread_progress(progress: PromptProgress | None) -> Callable[[Any], None] | None:
    """A prompt_progress event's (done, total) pair as the two arguments of progress."""
    if progress is None:
        return None
    if not callable(progress):
        raise BadRequestError(f"progress must be callable, got {type(progress).__name__}")
    return lambda pair: progress(int(pair[0]), int(pair[1]))


STOP_GRACE = 2.0
"""Seconds a timed-out call that was interrupted gets to end before wait() gives up on it."""


def check_timeout(timeout: float | None) -> None:
    """A call's ``timeout`` (None or seconds >= 0), checked before its request is sent: a bad value must
    not leave the call running unobserved in its worker."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise InvalidArgumentError(f"timeout is a number of seconds >= 0 or None, got {timeout!r}")


def wait(fut: Future[R], timeout: float | None, stop: Callable[[], None] | None = None,
         what: str = "the call") -> R:
    """fut's result, waiting at most ``timeout`` seconds (None: as long as it takes; checked by
    check_timeout before the call was sent). When the time has passed, ``stop()`` (an interrupt) runs,
    the call gets STOP_GRACE seconds to end, and CallTimeoutError is raised, carrying what the stopped
    call returned (an interrupted generation's partial Result). Its worker dying meanwhile raises that
    error instead: it says more."""
    if timeout is None:
        return fut.result()
    try:
        return fut.result(timeout)
    except TimeoutError:
        if fut.done():
            raise  # the call's own error happens to be a TimeoutError
    partial: Any = None
    state = "it may still complete in its worker, unobserved"
    if stop is not None:
        stop()
        try:
            partial = fut.result(STOP_GRACE)
            state = "it was interrupted"
        except WorkerError:
            raise
        except TimeoutError:
            state = f"it was interrupted but had not ended {STOP_GRACE:g}s later"
        except Exception:
            state = "it was interrupted"
    err = CallTimeoutError(f"{what} did not end within timeout={timeout:g}s; {state}")
    err.result = partial
    raise err
