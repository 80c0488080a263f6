"""A snapshot's zygote: a worker that was prepared once and now forks copy-on-write children.

    client ──Freeze──▶ zygote     checks no native thread is alive; from now on serves Fork/Reap/Ping
    client ──fds over the control socket, then Fork──▶ zygote ──os.fork()──▶ child
    child: takes the fds (requests, replies, lifeline, stderr, its own region), says HELLO on them and
           serves the engine it inherited: the same models, contexts, KV cache and handles
    client ──Reap(pid)──▶ zygote  the child's exit status (only its parent, the zygote, can wait for it)

Threads. llama.cpp's CPU backend runs its thread team on OpenMP, and GNU OpenMP does not survive a fork:
a child that inherits a thread pool whose threads do not exist waits for them forever. ggml opens no
OpenMP team for a graph computed on one thread, so a zygote's contexts compute on one thread
(Engine(single_threaded=True)) and no team ever exists in it; Freeze verifies that the process holds no
thread besides the Python ones, and a child gives its contexts back the threads they were created with.
The price is paid once: whatever prepare() decodes runs on one core.
"""

from __future__ import annotations

import array
import os
import socket
import threading
import time
import warnings
from typing import Any, Protocol

from .. import protocol as p
from ..errors import SnapshotError
from ..protocol import Kind
from ..shm import TRANSFER_MEMFD
from . import sandbox
from .engine import Call, Engine, handles


class ServingLoop(Protocol):
    """What a fork needs of the loop that serves the zygote's pipes (loop.WorkerLoop, which drives the
    zygote and so is the one that imports it): in the child it serves the child's own pipes instead."""

    engine: Engine
    rfd: int
    wfd: int
    zygote: Zygote | None

    def send(self, kind: Kind, req_id: int, payload: Any) -> None: ...

#: The descriptors a fork receives, in the order the client sends them (client side: _process.py).
FORK_FDS = ("requests", "replies", "lifeline", "stderr", "region")


class Zygote:
    """The zygote role of a worker: its control socket (descriptors arrive there) and its children."""

    def __init__(self, control_fd: int, lifeline_fd: int, hello: dict[str, Any]) -> None:
        self.control = socket.socket(fileno=control_fd)
        self.lifeline_fd = lifeline_fd
        self.hello = hello  # what a child says in its own HELLO, with its own pid, id and transfer memfd
        self.children: set[int] = set()
        # Threads no Python code started, before any native work: numpy's OpenBLAS pool (its pthread_atfork
        # handlers stop it around a fork, so it is safe). Any more at freeze time came from llama.cpp.
        self.native_threads_at_start = _native_threads()

    # -- freeze ---------------------------------------------------------------------------------------
    def freeze(self, engine: Engine) -> p.Frozen:
        extra = _native_threads() - self.native_threads_at_start
        if extra > 0:
            raise SnapshotError(
                f"the prepared worker started {extra} native thread(s) while it was prepared; it cannot fork "
                "safely (an OpenMP team would hang every fork)")
        engine.frozen = True
        return p.Frozen(threads=_threads(), region_used=engine.arena.used_end)

    # -- fork -----------------------------------------------------------------------------------------
    def fork(self, loop: ServingLoop, req_id: int, req: p.Fork) -> None:
        """Forks a child for the descriptors waiting on the control socket. In the zygote this replies
        with the child's pid; in the child it returns with the loop serving the child's own pipes."""
        fds = self._receive_fds()
        with warnings.catch_warnings():
            # Python 3.12+ warns about forking a process with threads: the zygote's only other thread
            # is the lifeline reader, blocked in read() and holding no lock the child needs.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                self._become_child(loop, fds, req)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(71)
            return
        for fd in fds.values():
            os.close(fd)
        self.children.add(pid)
        loop.send(Kind.RESPONSE, req_id, p.Forked(pid=pid))

    def _receive_fds(self) -> dict[str, int]:
        size = len(FORK_FDS) * array.array("i").itemsize
        msg, ancdata, _, _ = self.control.recvmsg(1, socket.CMSG_SPACE(size))
        fds = array.array("i")
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if not msg or len(fds) != len(FORK_FDS):
            for fd in fds:
                os.close(fd)
            raise SnapshotError(f"a fork needs {len(FORK_FDS)} descriptors on the control socket, "
                                f"got {len(fds)}")
        return dict(zip(FORK_FDS, fds, strict=True))

    def _become_child(self, loop: ServingLoop, fds: dict[str, int], req: p.Fork) -> None:
        # Nothing of the zygote's own plumbing may stay open here: its request pipe (the zygote would
        # never see EOF), its control socket, its lifeline (the child watches its own).
        # A session of its own, as a spawned worker has: closing the zygote (its process group) leaves it
        # alone, and closing this worker ends the processes it started, however they were orphaned.
        os.setsid()
        for fd in (loop.rfd, loop.wfd, self.lifeline_fd):
            os.close(fd)
        self.control.close()
        os.dup2(fds["stderr"], 2)
        os.dup2(2, 1)
        os.close(fds["stderr"])
        os.chdir(req.cwd)
        engine = loop.engine
        engine.region.move_to(fds["region"], engine.arena.used_end)
        sandbox.watch_lifeline(fds["lifeline"])
        engine.thaw()
        hello = dict(self.hello, pid=os.getpid(), worker_id=req.worker_id, forked_from=self.hello["pid"])
        box = dict(hello.get("sandbox", {}))
        if box.get("transfer_fd") is not None:
            os.close(int(box["transfer_fd"]))  # the zygote's, shared with every other child
            box["transfer_fd"] = os.memfd_create(TRANSFER_MEMFD, os.MFD_CLOEXEC)
        hello["sandbox"] = box
        loop.rfd, loop.wfd = fds["requests"], fds["replies"]
        loop.zygote = None
        loop.send(Kind.HELLO, 0, hello)

    # -- reap -----------------------------------------------------------------------------------------
    def reap(self, pid: int, timeout: float) -> int | None:
        if pid not in self.children:
            raise SnapshotError(f"pid {pid} is not a child of this zygote")
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got == pid:
                self.children.discard(pid)
                return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _native_threads() -> int:
    return _threads() - threading.active_count()


@handles(p.Freeze)
def _freeze(engine: Engine, req: p.Freeze, call: Call) -> p.Frozen:
    zygote = engine.zygote
    if not isinstance(zygote, Zygote):
        raise SnapshotError("this worker was not started as a snapshot's zygote")
    return zygote.freeze(engine)


@handles(p.Reap)
def _reap(engine: Engine, req: p.Reap, call: Call) -> int | None:
    zygote = engine.zygote
    if not isinstance(zygote, Zygote):
        raise SnapshotError("this worker was not started as a snapshot's zygote")
    return zygote.reap(req.pid, req.timeout)


@handles(p.Fork)
def _fork(engine: Engine, req: p.Fork, call: Call) -> p.Forked:
    # A frozen zygote's loop serves Fork itself (it must answer from the zygote and go on in the child);
    # any other worker, or an engine run in-process, gets here.
    raise SnapshotError("only a frozen snapshot's zygote forks")

