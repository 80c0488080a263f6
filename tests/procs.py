"""Worker processes in tests: the environment that arms test-only faults, and whether a process has
ended, for tests that check a worker did not outlive what should end it.

A SIGKILLed process is not gone the instant the signal is sent: the kernel first unmaps its memory
(a loaded model, a KV cache), which on a loaded 2-core machine takes a visible while. Checks that
follow a kill therefore wait, with a patience that only guards against waiting forever."""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil

PATIENCE = 30.0
# A worker started with this takes Instance.fault requests (crash, hang, fork...); others refuse them.
FAULTS = {"LLOYAL_POOL_TEST_FAULTS": "1"}


def ended(pid: int) -> bool:
    """A zombie or a dying (state X) process counts as ended: it holds no memory and runs no code."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def all_end(pids: Iterable[int], patience: float = PATIENCE) -> bool:
    """Whether every pid has ended before patience runs out; patience 0 checks once."""
    pids = list(pids)
    deadline = time.monotonic() + patience
    while not all(ended(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
