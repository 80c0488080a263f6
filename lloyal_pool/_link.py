"""A context's link to its worker: sends its requests and knows which of them are decoding.

    Context / BranchStore / Branch / KV ──call(req)──▶ ContextLink ──▶ WorkerProcess.call ──▶ pipe
                          Context.interrupt() ──────▶ ContextLink.interrupt ──▶ the context's word in shm

Every call returns a Future of the reply type its request declares (protocol.py); a blocking method is
that future's .result(). The lock guards the bookkeeping of which decoding requests are in flight and is
never held across I/O: a large request stuck in a full pipe behind a running generate must not keep
interrupt() from stopping that generate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ._process import WorkerProcess
from .errors import BadRequestError, StaleHandleError
from .protocol import Request

R = TypeVar("R")
EventHandler = Callable[[dict[str, Any]], None]
PromptProgress = Callable[[int, int], None]
"""Prompt evaluation progress: (tokens decoded so far, tokens to decode), after each micro-batch."""


def events(**handlers: Callable[[Any], None] | None) -> Callable[[dict[str, Any]], None] | None:
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


class ContextLink:
    def __init__(self, proc: WorkerProcess, handle: int, interrupt_slot: int) -> None:
        self.proc = proc
        self.handle = handle
        self._slot = interrupt_slot
        # Reentrant: a Stream's finalizer interrupts its request, and the garbage collector may run it on
        # a thread that holds this lock already.
        self._lock = threading.RLock()
        self._decoding: list[int] = []  # ids of decoding requests in flight, in the order the worker runs them
        self._cancelled: set[int] = set()  # of those, the ones to interrupt as soon as the worker starts them
        self.closed = False

    def call(self, req: Request[R], on_event: EventHandler | None = None,
             on_id: Callable[[int], None] | None = None) -> Future[R]:
        """Sends req; on_id(id) learns a decoding request's id (for interrupt_request)."""
        if self.closed:
            raise StaleHandleError(f"context handle {self.handle} was closed")
        if not req.decodes:
            return self.proc.call(req, on_event)
        sent: list[int] = []

        def track(req_id: int) -> None:
            sent.append(req_id)
            with self._lock:
                self._decoding.append(req_id)
            if on_id is not None:
                on_id(req_id)

        def untrack(req_id: int) -> None:
            with self._lock:
                self._decoding.remove(req_id)
                self._cancelled.discard(req_id)
                # The worker starts the next request now (or already has): if it was cancelled while
                # queued, its id goes into the word, which the worker checks between tokens and steps.
                target = self._decoding[0] if self._decoding and self._decoding[0] in self._cancelled else 0
            if target:
                self.proc.interrupt(self._slot, target)

        try:
            fut = self.proc.call(req, on_event, on_id=track)
        except BaseException:
            # Failed after the id was tracked (e.g. KeyboardInterrupt in a blocked write): a phantom id at
            # the head of the list would take every later interrupt() of this context.
            if sent:
                untrack(sent[0])
            raise
        fut.add_done_callback(lambda _: untrack(sent[0]))
        return fut

    def interrupt(self) -> None:
        """Stops the decoding request the worker runs (or runs next) on this context; a no-op when none."""
        with self._lock:
            target = self._decoding[0] if self._decoding else 0
        if target:
            self.proc.interrupt(self._slot, target)

    def interrupt_request(self, req_id: int) -> None:
        """Stops one decoding request: now if the worker runs it, else as soon as it starts; a no-op once
        it has ended."""
        with self._lock:
            if req_id not in self._decoding:
                return
            self._cancelled.add(req_id)
            target = req_id if self._decoding[0] == req_id else 0
        if target:
            self.proc.interrupt(self._slot, target)
