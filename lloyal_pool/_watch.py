"""A pool's hang watchdog (Pool(hang_timeout=)): a thread that has every worker with calls waiting compare
its heartbeat with the last one seen (WorkerProcess.check_hang)."""

from __future__ import annotations

import logging
import threading
import time

from ._process import WorkerProcess

log = logging.getLogger("lloyal_pool")


class HangWatch:
    """A pool's hang watchdog: one daemon thread that, every tick, has each worker with calls waiting
    compare its heartbeat with the last one seen (WorkerProcess.check_hang). No round trip, no signal:
    reading a word of shared memory costs nothing to a worker that is busy decoding."""

    def __init__(self, procs: list[WorkerProcess], hang_timeout: float) -> None:
        # The pool's own list (it holds no reference to the Pool, whose finalizer stops this thread).
        self._procs = procs
        self.hang_timeout = hang_timeout
        self._tick = min(0.25, hang_timeout / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lloyal-hang-watch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            for proc in list(self._procs):
                try:
                    proc.check_hang(now, self.hang_timeout)
                except Exception:  # one worker's trouble must not end the watch over the others
                    log.exception("hang check of worker %d failed", proc.worker_id)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
