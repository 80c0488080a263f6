"""asyncio's view of the client: the calls the handles already make, awaited instead of blocked on.

    await ctx.agenerate(...)  ─▶ ctx.generate_async(...) ─▶ concurrent Future ─▶ settle() ─▶ the task
    async for piece in ctx.astream(...)  ─▶ the same request, its pieces handed to the event loop

There is no second implementation of any call: each ``a``-method sends the request its ``*_async`` twin
sends and awaits that future. The reply arrives on the worker's reader thread and is handed to the loop
with call_soon_threadsafe. Cancelling the awaiting task (``task.cancel()``, ``asyncio.timeout``, a client
that went away) interrupts the decoding request in its worker, now or as soon as it starts, so the
context is free again instead of generating for nobody; the task sees CancelledError as usual.

asyncio.wrap_future is not used: cancelling its wrapper cancels the concurrent future, which is the
reader's to settle.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

from ._futures import check_timeout
from ._pieces import PieceStream

if TYPE_CHECKING:
    from .params import Result

T = TypeVar("T")
P = ParamSpec("P")


class Link(Protocol):
    """What the asyncio face asks of a context's core (_core.ContextCore)."""

    def sending(self) -> AbstractContextManager[list[Any]]: ...

    def interrupt_calls(self, calls: list[Any]) -> None: ...

    def stopper(self, fut: Future[Any]) -> Callable[[], None] | None: ...


class OnALink(Protocol):
    """A handle whose requests go over one context's core (Context, BranchStore)."""

    @property
    def _link(self) -> Link: ...


H = TypeVar("H", bound=OnALink)


def _hand_over(src: Future[Any], dst: asyncio.Future[Any]) -> None:
    if dst.cancelled():
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


async def settle(fut: Future[T], stop: Callable[[], None] | None = None) -> T:
    """fut's result, awaited on the running loop. When the awaiting task is cancelled before fut is done,
    ``stop()`` runs (it interrupts the call) and CancelledError goes on."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def done(f: Future[Any]) -> None:
        try:
            loop.call_soon_threadsafe(_hand_over, f, waiter)
        except RuntimeError:  # the loop was closed: nobody awaits this any more
            pass

    fut.add_done_callback(done)
    try:
        return await waiter
    except asyncio.CancelledError:
        if stop is not None and not fut.done():
            stop()
        raise


class _LoopQueue:
    """The put() a Stream's request feeds from the reader thread, delivering to an asyncio.Queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.items: asyncio.Queue[object] = asyncio.Queue()

    def put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop was closed
            pass


class AsyncStream(PieceStream):
    """A generation's text pieces for asyncio: ``async for piece in stream``, then ``await
    stream.result()``. The pieces join to the Result's text, as a Stream's do.

    Leaving early stops the generation: ``await stream.aclose()`` (or the end of an ``async with`` block),
    cancelling the task that iterates it, or the stream being garbage-collected while it runs interrupts
    the request in its worker. ``interrupt()`` works from any thread. Time limits are asyncio's
    (``asyncio.timeout``), which cancel and so interrupt::

        async with ctx.astream("Once upon a time", n_predict=400) as stream:
            async for piece in stream:
                if "dragon" in piece:
                    break          # the worker stops generating here
    """

    def __init__(self, interrupt: Callable[[Future[Any]], None], loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(interrupt)
        # The loop that iterates it: the running one, unless it is made on another thread for a loop.
        self._q: _LoopQueue = _LoopQueue(loop or asyncio.get_running_loop())
        self._ended = False

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._q.items.get()
        except asyncio.CancelledError:
            self.interrupt()
            raise
        if item is self._END:
            self._ended = True
            self.future.result()  # raises the call's error, if any (the future is done: no wait)
            raise StopAsyncIteration
        assert isinstance(item, str)
        return item

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def result(self) -> Result:
        """The whole generation's Result, once it has ended (an interrupted one says ``interrupted``);
        raises the call's error, if it failed. Cancelling the task awaiting it interrupts the generation."""
        return await settle(self.future, self.interrupt)

    async def aclose(self) -> None:
        """Stops the generation unless it has ended. Does not wait for it to end: ``result()`` does."""
        if not self.future.done():
            self.interrupt()


async def awaited(link: Link, submit: Callable[[], Future[T]]) -> T:
    """submit()'s future awaited; cancelling the task interrupts the decoding requests submit sent on
    link."""
    with link.sending() as sent:
        fut = submit()
    return await settle(fut, link.stopper(fut) or (lambda: link.interrupt_calls(sent)))


def twin(submit: Callable[Concatenate[H, P], Future[T]],
         doc: str) -> Callable[Concatenate[H, P], Coroutine[Any, Any, T]]:
    """The asyncio method of a handle's ``*_async`` one (its *twin*): the same request, its future awaited;
    cancelling the awaiting task interrupts the decoding requests it sent. ``doc`` is its docstring. Its
    signature is ``submit``'s, returning what the future holds, so that help() and the API reference show
    the parameters."""

    async def method(self: H, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await awaited(self._link, lambda: submit(self, *args, **kwargs))

    name = "a" + submit.__name__.removesuffix("_async")
    method.__name__ = name
    method.__module__ = submit.__module__
    method.__qualname__ = submit.__qualname__.rsplit(".", 1)[0] + "." + name
    method.__doc__ = doc
    sig = inspect.signature(submit)
    returns = sig.return_annotation  # a string, under ``from __future__ import annotations``
    if isinstance(returns, str) and returns.startswith("Future[") and returns.endswith("]"):
        sig = sig.replace(return_annotation=returns.removeprefix("Future[")[:-1])
    method.__signature__ = sig  # type: ignore[attr-defined]
    method.__annotations__ = {**submit.__annotations__, "return": sig.return_annotation}
    return method


async def closed_in_thread(close: Callable[[float], None], timeout: float) -> None:
    """A blocking close() run off the loop, so other tasks go on while workers exit."""
    check_timeout(timeout)
    await asyncio.to_thread(close, timeout)


__all__ = ["AsyncStream", "awaited", "settle", "twin"]

