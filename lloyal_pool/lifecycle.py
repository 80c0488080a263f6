"""WorkerEvent and Subscribers: what a pool tells an application of its workers' deaths and replacements."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import WorkerCrashedError

if TYPE_CHECKING:
    from .instance import Instance

_log = logging.getLogger("lloyal_pool")


@dataclass(frozen=True)
class WorkerEvent:
    """What Pool.subscribe() callbacks receive. ``kind``: "died" (the worker crashed, was killed or hung;
    ``error`` says how: WorkerCrashedError, WorkerHungError), "replaced" (Pool.replace() started
    ``instance`` in its place, at ``index``) or "recovered" (Pool(recover=True) replaced the dead worker
    under the same ``instance``, at ``index``, its models and contexts rebuilt; ``error`` is the death's).
    Not sent for workers that close() ended."""

    kind: str
    worker_id: int
    pid: int
    error: WorkerCrashedError | None = None
    instance: Instance | None = None
    index: int | None = None


class Subscribers:
    """subscribe() and the events it delivers: what Pool and lloyal_pool.ray.RayPool share. A subclass
    sets ``_subscribers`` (a list) and ``_subscribers_lock`` in its constructor."""

    _subscribers: list[Callable[[WorkerEvent], None]]
    _subscribers_lock: threading.Lock

    def subscribe(self, callback: Callable[[WorkerEvent], None]) -> Callable[[], None]:
        """Calls ``callback(event)`` (a WorkerEvent) when a worker of this pool dies (crash, kill, hang;
        also a snapshot's fork) and when replace() has started a replacement, so an application need not
        poll ``alive``. It runs on a lloyal_pool thread (the dead worker's reader, or the thread that
        replaces it) and must return promptly; what it raises is logged, never propagated. Returns a
        function that unsubscribes it."""
        with self._subscribers_lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._subscribers_lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _emit(self, event: WorkerEvent) -> None:
        with self._subscribers_lock:
            callbacks = list(self._subscribers)
        for callback in callbacks:
            try:
                callback(event)
            except Exception:  # a subscriber's bug must not stop the pool's bookkeeping
                _log.exception("a subscribe() callback raised on %s", event.kind)

