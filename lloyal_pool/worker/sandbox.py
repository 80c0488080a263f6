"""Process hardening a worker applies to itself before it loads native code. Pure Python, Linux-first.

What each step is for:
- parent death signal: if the parent dies (even SIGKILLed), the kernel SIGKILLs the worker, so no
  orphan keeps a model in memory; the getppid() check covers a parent that died before prctl ran;
- lifeline pipe: the signal fires when the parent's spawning *thread* ends, and exists only on Linux;
  EOF on a pipe whose write end only the parent holds means the parent is gone, whatever the thread;
- fd 1 pointed at fd 2: anything native code prints to stdout lands in the log, never in a pipe the
  protocol uses;
- no new privileges, no core dumps (a core would hold the mapped model and logits), umask 077;
- optional RLIMIT_DATA cap (memory_limit): an allocation past it fails inside the worker instead of
  growing until the OOM killer picks a victim. RLIMIT_AS is unusable with mmap'd models.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
# Tests set this in a worker's environment to show that the lifeline alone ends an orphaned worker.
NO_PDEATHSIG_ENV = "LLOYAL_POOL_TEST_NO_PDEATHSIG"


def _prctl(option: int, arg: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int) -> None:
    if os.environ.get(NO_PDEATHSIG_ENV) != "1":
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if parent_pid and os.getppid() != parent_pid:
        os._exit(0)  # the parent is already gone


def watch_lifeline(fd: int) -> None:
    """Exits the process once fd (the lifeline's read end) reaches EOF: the parent is gone."""
    if fd < 0:
        return
    os.set_inheritable(fd, False)  # nothing this worker might start may hold it open

    def watch() -> None:
        try:
            while os.read(fd, 64):
                pass  # the parent never writes; a byte is ignored
        except OSError:
            pass
        os._exit(0)

    threading.Thread(target=watch, name="lloyal-lifeline", daemon=True).start()


def stdout_to_stderr() -> None:
    sys.stdout.flush()
    os.dup2(2, 1)


def harden(memory_limit: int | None = None) -> None:
    import resource

    os.umask(0o077)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_limit:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_limit, memory_limit))
