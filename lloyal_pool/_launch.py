"""How a worker process starts, and what stands around it: its options, its command line and environment,
the thread that spawns it, the pool's temporary directory, a child forked from a snapshot's zygote, and its
stderr (logged line by line, the tail kept for errors). _process.py runs the worker once it is started."""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

import psutil

from .shm import DEFAULT_SIZE, Region

log = logging.getLogger("lloyal_pool")
T = TypeVar("T")
STDERR_TAIL_BYTES = 64 << 10
# The line native/abort_report.cpp writes when ggml aborts the worker (common.hpp, LLOYAL_ABORT_MARKER).
ABORT_MARKER = "lloyal worker: GGML abort:"
# What a worker's data segment (RLIMIT_DATA, Pool(memory_limit=)) holds once it has started: Python, numpy,
# the native module. Measured: 105 MiB; it fails to start under about 110 MiB.
START_DATA_BYTES = 110 << 20
LOG_LEVELS = {"debug": 0, "info": 1, "warning": 2, "error": 3, "none": 4}


@dataclass(frozen=True)
class WorkerOptions:
    # What the pool resolved once (variants.py): its workers all run the same backends.
    variant: str = "cpu"
    strict_variant: bool = False
    cpu: str = "auto"
    shm_bytes: int = DEFAULT_SIZE
    shm_backend: str = "auto"
    memory_limit: int | None = None
    start_timeout: float = 60.0
    env: dict[str, str | None] = field(default_factory=dict)
    native_log_level: str = "warning"
    threads: int | None = None  # a context's default n_threads in this worker
    # Landlock (worker/landlock.py): None reads anywhere; writes go only to the private cwd and these.
    allowed_dirs: tuple[str, ...] | None = None
    writable_dirs: tuple[str, ...] = ()
    network: bool = False
    sandbox: bool = True
    temp_root: str | None = None  # where the workers' private directories go (the pool's TempRoot)


def worker_command(worker_id: int, options: WorkerOptions, fds: tuple[int, int], lifeline: int, shm: str,
                   zygote_fd: int | None) -> list[str]:
    """The worker's command line: the interpreter by absolute path in isolated mode (-I: no user site, no
    PYTHON* variables), its protocol pipes, lifeline and region, and its options."""
    cmd = [sys.executable, "-I", "-m", "lloyal_pool.worker",
           "--fds", f"{fds[0]},{fds[1]}", "--lifeline", str(lifeline), "--shm", shm,
           "--parent-pid", str(os.getpid()), "--worker-id", str(worker_id), "--variant", options.variant,
           "--cpu", options.cpu, "--log-level", str(LOG_LEVELS[options.native_log_level])]
    if options.strict_variant:
        cmd.append("--strict-variant")
    if options.threads:
        cmd += ["--threads", str(int(options.threads))]
    if options.memory_limit:
        cmd += ["--memory-limit", str(int(options.memory_limit))]
    cmd += _sandbox_args(options)
    if zygote_fd is not None:
        cmd += ["--zygote", str(zygote_fd)]
    return cmd


@dataclass
class WorkerPipes:
    """A worker's three pipes: requests (we write), replies (we read), and the lifeline, whose write end
    only we hold: the worker exits when it reaches EOF, that is when every copy of our end is closed (we
    died, however). Unlike the parent-death signal it does not depend on the spawning thread; os.pipe()
    fds are close-on-exec, so no other child inherits our end."""

    req_r: int
    req_w: int
    rep_r: int
    rep_w: int
    life_r: int
    life_w: int

    @classmethod
    def open(cls) -> WorkerPipes:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        life_r, life_w = os.pipe()
        return cls(req_r, req_w, rep_r, rep_w, life_r, life_w)

    def close_workers_ends(self) -> None:
        for fd in (self.req_r, self.rep_w, self.life_r):
            os.close(fd)

    def close_all(self) -> None:
        self.close_workers_ends()
        for fd in (self.req_w, self.rep_r, self.life_w):
            os.close(fd)


def spawn(worker_id: int, options: WorkerOptions, pipes: WorkerPipes, region: Region, cwd: str,
          zygote_end: socket.socket | None) -> subprocess.Popen[bytes]:
    """Starts ``python -m lloyal_pool.worker`` from the spawner thread, in a session of its own (a
    terminal's Ctrl-C reaches only the parent), with exactly its pipes, lifeline, region and (a zygote's)
    control socket, in its private directory, with the environment Pool(env=...) allows."""
    zygote_fd = None if zygote_end is None else zygote_end.fileno()
    cmd = worker_command(worker_id, options, (pipes.req_r, pipes.rep_w), pipes.life_r, region.spec.to_arg(),
                         zygote_fd)
    pass_fds = [pipes.req_r, pipes.rep_w, pipes.life_r] + ([region.spec.fd] if region.spec.fd >= 0 else [])
    if zygote_fd is not None:
        pass_fds.append(zygote_fd)
    return spawner.run(lambda: subprocess.Popen(
        cmd, pass_fds=pass_fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        cwd=cwd, env=worker_env(options.env), start_new_session=True))


def kill_tree(pid: int, own_session_only: bool = False) -> None:
    """SIGKILL a worker and every process below it; with ``own_session_only`` (a zygote), only those in
    its own session: its forks, which lead sessions of their own, live on."""
    try:
        parent = psutil.Process(pid)
        procs = [*(c for c in parent.children(recursive=True)
                   if not own_session_only or _session(c.pid) in (pid, None)), parent]
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        # A worker leads a session and process group of its own (start_new_session), which its
        # children stay in after it exited and they were handed to init, out of reach of the above.
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _sandbox_args(options: WorkerOptions) -> list[str]:
    if not options.sandbox:
        return ["--no-sandbox"]
    out = ["--writable-dirs", json.dumps([os.path.realpath(d) for d in options.writable_dirs])]
    if options.allowed_dirs is not None:
        out += ["--allowed-dirs", json.dumps([os.path.realpath(d) for d in options.allowed_dirs])]
    if options.network:
        out.append("--network")
    return out


def worker_env(allowed: dict[str, str | None]) -> dict[str, str]:
    """A worker's whole environment: only what Pool(env=...) names (None: our value, when we have one).

    The interpreter needs none of ours: it is started by absolute path in isolated mode (-I), and with
    no locale set Python coerces the C locale to UTF-8. Nothing of the parent's (tokens, proxies,
    credentials) reaches code that parses untrusted model files unless it is asked for by name."""
    env: dict[str, str] = {}
    for name, value in allowed.items():
        if value is None:
            if name in os.environ:
                env[name] = os.environ[name]
        else:
            env[name] = value
    return env


class Spawner:
    """Starts workers from one long-lived thread. A worker's parent-death signal fires when the *thread*
    that spawned it exits, so spawning from a caller's short-lived thread would kill its workers."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="lloyal-spawner", daemon=True)
                self._thread.start()
        fut: Future[T] = Future()
        self._q.put((fn, fut))
        return fut.result()

    def _loop(self) -> None:
        while True:
            fn, fut = self._q.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)


spawner = Spawner()

class TempRoot:
    """A pool's temporary directory, which holds its workers' private directories, and a janitor that
    removes it should this process die without closing the pool (SIGKILL, os._exit): a shell whose stdin
    is a pipe only we hold the write end of. When we die, however, it reads EOF and removes the directory
    (retrying while dying workers may still be writing there); when close() ends it, we have already."""

    _SCRIPT = ('cat >/dev/null; for i in 1 2 3 4 5; do rm -rf -- "$1" 2>/dev/null; '
               '[ -e "$1" ] || exit 0; sleep 1; done')

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="lloyal-pool-")
        life_r, self._life_w = os.pipe()
        try:
            self._janitor: subprocess.Popen[bytes] | None = spawner.run(lambda: subprocess.Popen(
                ["/bin/sh", "-c", self._SCRIPT, "lloyal-janitor", self.path], stdin=life_r,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"},
                start_new_session=True))
        except OSError as exc:
            # Without a shell the directory is still removed by close(), only not after a SIGKILL.
            log.warning("[startup] no janitor for %s (%s): a killed parent would leave it behind", self.path, exc)
            self._janitor = None
        finally:
            os.close(life_r)

    def close(self) -> None:
        """Removes the directory and ends the janitor. Idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._life_w >= 0:
            os.close(self._life_w)
            self._life_w = -1
        if self._janitor is not None:
            try:
                self._janitor.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._janitor.kill()
                self._janitor.wait()
            self._janitor = None


class StderrTail:
    """A worker's stderr: every line logged (``lloyal_pool.worker.<id>``, at the level a llama.cpp line
    names) and the last STDERR_TAIL_BYTES of them kept, for the errors that report its death."""

    def __init__(self, worker_id: int) -> None:
        self._lines: collections.deque[str] = collections.deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._log = logging.getLogger(f"lloyal_pool.worker.{worker_id}")

    def drain(self, stream: IO[bytes]) -> None:
        """Reads stream to its end (a thread's whole life) and closes it."""
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                self._lines.append(line)
                self._bytes += len(line) + 1
                while self._bytes > STDERR_TAIL_BYTES and len(self._lines) > 1:
                    self._bytes -= len(self._lines.popleft()) + 1
            self._log.log(_line_level(line), "%s", line)
        stream.close()

    def abort_line(self) -> str:
        """What a GGML abort said failed (native/abort_report.cpp marks the line), or ""."""
        with self._lock:
            found = [line for line in self._lines if line.startswith(ABORT_MARKER)]
        return found[-1][len(ABORT_MARKER):].strip() if found else ""

    def tail(self, max_lines: int = 40) -> str:
        with self._lock:
            lines = list(self._lines)[-max_lines:]
        return "\n".join(lines)


def _line_level(line: str) -> int:
    if line.startswith("[llama.cpp "):
        return {"E": logging.ERROR, "W": logging.WARNING, "I": logging.DEBUG, "D": logging.DEBUG}.get(
            line[11:12], logging.DEBUG)
    return logging.INFO
