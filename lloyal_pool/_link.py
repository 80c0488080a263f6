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
from .errors import StaleHandleError
from .protocol import Request

R = TypeVar("R")
EventHandler = Callable[[dict[str, Any]], None]


class ContextLink:
    def __init__(self, proc: WorkerProcess, handle: int, interrupt_slot: int) -> None:
        self.proc = proc
        self.handle = handle
        self._slot = interrupt_slot
        self._lock = threading.Lock()
        self._decoding: list[int] = []  # ids of decoding requests in flight, in the order the worker runs them
        self.closed = False

    def call(self, req: Request[R], on_event: EventHandler | None = None) -> Future[R]:
        if self.closed:
            raise StaleHandleError(f"context handle {self.handle} was closed")
        if not req.decodes:
            return self.proc.call(req, on_event)
        sent: list[int] = []

        def track(req_id: int) -> None:
            sent.append(req_id)
            with self._lock:
                self._decoding.append(req_id)

        def untrack(req_id: int) -> None:
            with self._lock:
                self._decoding.remove(req_id)

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
