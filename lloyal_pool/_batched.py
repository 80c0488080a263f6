"""BatchedCalls: generate, stream and submit of independent requests, each on a model's Batcher (continuous
batching, batching.py): what Instance and Pool share. They differ in where a request goes (``_route``): an
instance names one of its models, the pool picks a live worker that holds it (routing.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, overload

from ._aio import AsyncStream, settle
from ._futures import check_timeout, wait
from .batching import Batcher, BatchRequest, best_choices, ranked_params
from .errors import InvalidArgumentError
from .params import GenerateParams, Result, whole
from .stream import Stream

if TYPE_CHECKING:
    from .model import Model


def _wait_all(handles: Sequence[BatchRequest], timeout: float | None) -> list[Result]:
    """Every handle's Result within one ``timeout``; when it passes, all are interrupted (CallTimeoutError
    carrying the first unfinished one's partial Result)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        return [wait(h.future, None if deadline is None else max(0.0, deadline - time.monotonic()), h.interrupt,
                     "generate") for h in handles]
    except BaseException:
        for h in handles:
            h.interrupt()
        raise



class BatchedCalls:
    """generate, stream and their asyncio twins for independent requests, batched by a Batcher: what
    Instance and Pool share. A subclass says which batcher takes a request (``_route``)."""

    def _route(self, model: Model | str | None, prompt: str | Sequence[int],
               lora: Iterable[str] = ()) -> tuple[Batcher, list[int]]:
        # The batcher a request goes to (of a model that has loaded the ``lora`` adapters it names), and
        # its prompt's tokens.
        raise NotImplementedError

    def submit(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               model: Model | str | None = None, on_piece: Callable[[str], None] | None = None,
               **overrides: Any) -> BatchRequest:
        """Queues an independent generation on a model's Batcher: its ``future`` is the Result's, its
        ``interrupt()`` ends it. ``model``: a loaded Model, or a name (its path, file name or stem);
        None: the only model loaded."""
        gen = GenerateParams.of(params, overrides)  # refused before any round trip
        batcher, tokens = self._route(model, prompt, gen.lora)
        return batcher.submit(tokens, gen, on_piece=on_piece)

    def submit_many(self, prompt: str | Sequence[int], params: GenerateParams | None = None, n: int = 1, *,
                    model: Model | str | None = None, on_piece: Callable[[int, str], None] | None = None,
                    **overrides: Any) -> list[BatchRequest]:
        """``n`` choices of one prompt on one batcher (Batcher.submit_many): its prompt decoded once."""
        gen = GenerateParams.of(params, overrides)
        batcher, tokens = self._route(model, prompt, gen.lora)
        return batcher.submit_many(tokens, gen, n, on_piece=on_piece)

    @overload
    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 model: Model | str | None = None, on_piece: Callable[[str], None] | None = None,
                 timeout: float | None = None, n: None = None, best_of: None = None, **overrides: Any) -> Result: ...

    @overload
    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 model: Model | str | None = None, on_piece: Callable[[int, str], None] | None = None,
                 timeout: float | None = None, n: int, best_of: int | None = None,
                 **overrides: Any) -> list[Result]: ...

    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 model: Model | str | None = None, on_piece: Callable[..., None] | None = None,
                 timeout: float | None = None, n: int | None = None, best_of: int | None = None,
                 **overrides: Any) -> Result | list[Result]:
        """An independent generation, batched with the others running on the model (continuous
        batching): the same Result as Context.generate on a fresh context. ``timeout`` interrupts it
        (CallTimeoutError carrying the partial Result).

        With ``n``: a list of n choices of the prompt (submit_many; ``on_piece(i, piece)``). ``best_of``
        (>= n): that many are generated and the n with the highest mean token log-probability returned,
        best first (best_choices); their logprobs are kept only if params asked for them."""
        check_timeout(timeout)
        if n is None:
            if best_of is not None:
                raise InvalidArgumentError("best_of ranks several choices: give n too")
            handle = self.submit(prompt, params, model=model, on_piece=on_piece, **overrides)
            return wait(handle.future, timeout, handle.interrupt, "generate")
        gen = GenerateParams.of(params, overrides)
        if best_of is None or best_of == n:
            handles = self.submit_many(prompt, gen, n, model=model, on_piece=on_piece)
            return _wait_all(handles, timeout)
        if whole(best_of, "best_of") < n:
            raise InvalidArgumentError(f"best_of ({best_of}) must be at least n ({n})")
        if on_piece is not None:
            raise InvalidArgumentError("best_of picks choices once they have ended: nothing to stream")
        generated = _wait_all(self.submit_many(prompt, ranked_params(gen), best_of, model=model), timeout)
        return best_choices(generated, n, keep_logprobs=gen.logprobs is not None)

    def stream(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               model: Model | str | None = None, timeout: float | None = None, **overrides: Any) -> Stream:
        """generate() piece by piece: a Stream (closing it, or leaving its ``with`` block, interrupts)."""
        box: list[BatchRequest] = []
        stream = Stream(lambda _id: box[0].interrupt() if box else None, timeout)
        handle = self.submit(prompt, params, model=model, on_piece=stream._q.put, **overrides)
        box.append(handle)
        stream._attach(handle.future)
        return stream

    async def agenerate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                        model: Model | str | None = None, on_piece: Callable[[str], None] | None = None,
                        **overrides: Any) -> Result:
        """generate() for asyncio; cancelling the awaiting task interrupts the request."""
        handle = self.submit(prompt, params, model=model, on_piece=on_piece, **overrides)
        return await settle(handle.future, handle.interrupt)

    def astream(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                model: Model | str | None = None, **overrides: Any) -> AsyncStream:
        """stream() for asyncio (inside a running loop): ``async for piece in ...``."""
        box: list[BatchRequest] = []
        stream = AsyncStream(lambda _id: box[0].interrupt() if box else None)
        handle = self.submit(prompt, params, model=model, on_piece=stream._q.put, **overrides)
        box.append(handle)
        stream._attach(handle.future)
        return stream


__all__ = ["BatchedCalls"]
