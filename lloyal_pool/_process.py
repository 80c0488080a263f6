"""One worker process as the client sees it: spawn, handshake, calls as futures, death, shutdown.

    caller threads ──call(req)──▶ [write lock] ──requests pipe──▶ worker
                     ◀─Future─ reader thread ◀──replies pipe── worker   (RESPONSE/ERROR resolve, EVENT calls back)
                               stderr thread ◀──stderr pipe─── worker   (ring buffer + Python logging)

Death is learned from the OS: when the worker exits for any reason its end of the replies pipe closes,
the reader thread sees EOF at once, reaps the process for its exit status, and fails every waiting call
with WorkerCrashedError (exit code or signal, stderr tail). Other workers have their own pipes and threads
and never notice. A worker that is alive but stuck (stopped, deadlocked, in a loop with no interrupt check)
is found by the pool's watchdog (HangWatch): while calls wait on it, its heartbeat word in shared memory
must move; one that stands still for hang_timeout is killed, and its calls fail with WorkerHungError.
"""

from __future__ import annotations

import array
import itertools
import logging
import os
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import psutil

from ._futures import running
from ._launch import (
    START_DATA_BYTES,
    StderrTail,
    WorkerOptions,
    WorkerPipes,
    kill_tree,
    spawn,
)
from .errors import (
    DeadWorkerError,
    LloyalError,
    PoolClosedError,
    ProtocolError,
    SnapshotError,
    WorkerCrashedError,
    WorkerHungError,
    WorkerStartupError,
    copy_error,
    describe_exit,
    rebuild,
)
from .protocol import (
    PROTOCOL_VERSION,
    Fork,
    Kind,
    PeerClosed,
    Reap,
    RenewTransfer,
    Request,
    pack,
    parse_reply,
    read_frame,
    request_payload,
    write_frame,
)
from .shm import Region, TransferFile, WorkerTransfer

log = logging.getLogger("lloyal_pool")
R = TypeVar("R")



class Owner(Protocol):
    """Who owns what a worker holds (_core.WorkerCore): told of the worker's death first, on the reader
    thread, so that it settles its own calls before anything else is failed."""

    def worker_died(self, proc: WorkerProcess, error: WorkerCrashedError | PoolClosedError) -> None: ...


READING = threading.local()
"""``active`` on a worker's reader thread: what runs there (a reply's callbacks) must not write to a pipe."""


@dataclass
class _Pending:
    future: Future[Any]
    on_event: Callable[[dict[str, Any]], None] | None
    request: type[Request[Any]]
    callback_error: BaseException | None = None  # what on_event raised: the call's outcome once it ends
    # The owner's: called with the outcome before the future is settled, in the order the worker replied
    # (so that what the owner records of the call is recorded before its caller wakes). Its owner settles
    # it at the worker's death.
    on_done: Callable[[Any, BaseException | None], None] | None = None


# Request ids are unique across every worker of this process, so that a call sent again to a replacement
# (crash recovery) never shares an id with one of the replacement's own.
_request_ids = itertools.count(1)


# The request pipe's write, one chunk at a time (a name of its own, so that a test can interrupt it).
_pipe_write: Callable[[int, memoryview], int] = os.write


class ForkedChild:
    """A worker forked from a snapshot's zygote, as WorkerProcess sees it (what a Popen is for a spawned
    one). Its parent is the zygote, so only the zygote can wait for it: wait() asks it (Reap). Should the
    zygote be gone, the child was handed to init, which reaps it; its exit status is then unknown (None)."""

    def __init__(self, pid: int, stderr_fd: int, zygote: WorkerProcess) -> None:
        self.pid = pid
        self.stderr = os.fdopen(stderr_fd, "rb")
        self.returncode: int | None = None
        self._zygote = zygote
        self._done = False

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status once the child has exited; subprocess.TimeoutExpired after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            left = 0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic()))
            try:
                code = self._zygote.call(Reap(pid=self.pid, timeout=left)).result()
            except (LloyalError, OSError):
                code = None
                if not _running(self.pid):
                    self._done = True  # reaped by init (or about to be): the status is gone with the zygote
                    break
                time.sleep(left)
            if code is not None:
                self.returncode, self._done = code, True
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        return self.returncode


def _running(pid: int) -> bool:
    """Whether pid is a process that has not exited (a zombie has)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class WorkerProcess:
    """Owns one worker's process, pipes, shared region, threads and in-flight calls."""

    def __init__(self, worker_id: int, options: WorkerOptions, *, zygote: bool = False,
                 fork_from: WorkerProcess | None = None) -> None:
        """Spawns a worker; with ``zygote``, one that becomes a snapshot's zygote (it receives its forks'
        descriptors on a Unix socket); with ``fork_from``, a child forked from that frozen zygote (its
        parent is the zygote, which reports its exit status: ForkedChild)."""
        self.worker_id = worker_id
        self.options = options
        self.hello: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._dead: WorkerCrashedError | PoolClosedError | None = None
        self._closing = False  # close() was asked for: calls in flight end with PoolClosedError
        self._closed = False
        # Set before close() sends its kill: a worker that close() ended is "closed", one that died before
        # (a crash racing with Pool.replace()) stays a crash.
        self._killed_by_close = False
        self._hung_for = 0.0  # > 0 once the watchdog killed it as hung
        # The watchdog's view: the heartbeat it last saw and when it last moved (None: nothing waits).
        self._beat_seen = 0
        self._beat_since: float | None = None
        self._in_callback = False  # the reader runs a user callback: the worker may block on a full pipe
        #: Called (on the reader thread) with this process and its error when it dies other than by close().
        self.on_death: Callable[[WorkerProcess, WorkerCrashedError], None] | None = None
        #: Its owner (_core.WorkerCore), told of its death before anything else.
        self.owner: Owner | None = None
        self._dead_event = threading.Event()
        self._stderr = StderrTail(worker_id)
        self._psutil: psutil.Process | None = None
        self._transfer: WorkerTransfer | None = None
        self._control: socket.socket | None = None  # a zygote's: its forks' descriptors go through it
        self._fork_lock = threading.Lock()
        zygote_end: socket.socket | None = None
        if zygote:
            self._control, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

        self.region: Region
        self._cwd: str
        if fork_from is not None:
            # The child copies what its zygote's region holds and maps this one in its place.
            self.region = Region.create(fork_from.region.size, backend="memfd", allocate=False)
            # Inside the zygote's directory: the child inherits its Landlock scope, which allows writes there.
            self._cwd = tempfile.mkdtemp(prefix=f"fork{worker_id}-", dir=fork_from._cwd)
        else:
            self.region = Region.create(options.shm_bytes, backend=options.shm_backend)
            self._cwd = tempfile.mkdtemp(prefix=f"worker{worker_id}-", dir=options.temp_root)
        pipes = WorkerPipes.open()
        self._req_w, self._rep_r, self._life_w = pipes.req_w, pipes.rep_r, pipes.life_w
        try:
            if fork_from is not None:
                self.proc: subprocess.Popen[bytes] | ForkedChild = fork_from.fork_child(
                    worker_id, self._cwd, pipes.req_r, pipes.rep_w, pipes.life_r, self.region)
            else:
                self.proc = spawn(worker_id, options, pipes, self.region, self._cwd, zygote_end)
        except BaseException:
            pipes.close_all()
            self.region.close()
            if self._control is not None:
                self._control.close()
            shutil.rmtree(self._cwd, ignore_errors=True)
            raise
        finally:
            self.region.close_fd()
            if zygote_end is not None:
                zygote_end.close()
        pipes.close_workers_ends()  # it has its copies
        self._start_threads()

    def _start_threads(self) -> None:
        """Starts the stderr thread; the reader starts with the handshake."""
        self.pid = self.proc.pid
        assert self.proc.stderr is not None
        self._stderr_thread = threading.Thread(target=self._stderr.drain, args=(self.proc.stderr,), daemon=True,
                                               name=f"lloyal-worker{self.worker_id}-stderr")
        self._stderr_thread.start()
        self._reader = threading.Thread(target=self._read_replies, daemon=True,
                                        name=f"lloyal-worker{self.worker_id}-reader")

    # -- a snapshot's zygote ---------------------------------------------------------------------------
    def fork_child(self, worker_id: int, cwd: str, req_r: int, rep_w: int, life_r: int,
                   region: Region) -> ForkedChild:
        """This worker being a frozen zygote: has it fork a child that serves these descriptors (the
        child's ends of its pipes and its region) and a fresh stderr pipe."""
        if self._control is None:
            raise SnapshotError("this worker is not a snapshot's zygote")
        err_r, err_w = os.pipe()
        try:
            # One fork at a time: the zygote takes the descriptors off its socket when it serves the
            # Fork that follows them, so the pair must not interleave with another fork's.
            with self._fork_lock:
                fds = array.array("i", [req_r, rep_w, life_r, err_w, region.spec.fd])
                self._control.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                forked = self.call(Fork(worker_id=worker_id, cwd=cwd)).result()
        except BaseException:
            os.close(err_r)
            raise
        finally:
            os.close(err_w)
            region.close_fd()
        return ForkedChild(forked.pid, err_r, self)

    # -- start-up -------------------------------------------------------------------------------------
    def wait_ready(self) -> dict[str, Any]:
        """Waits for HELLO; a worker that dies or errors first is reported with its cause at once."""
        deadline = time.monotonic() + self.options.start_timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._startup_error(
                        f"no handshake within start_timeout={self.options.start_timeout:g}s "
                        "(raise Pool(start_timeout=...) on a slow machine)")
                ready, _, _ = select.select([self._rep_r], [], [], min(left, 0.5))
                if not ready:
                    continue
                try:
                    kind, _, payload = read_frame(self._rep_r)
                except (PeerClosed, ProtocolError) as exc:
                    raise self._startup_error(f"died during start-up ({str(exc) or 'its pipe closed'})") from None
                if kind == Kind.ERROR:
                    raise self._startup_error(f"{payload.get('type')}: {payload.get('message')}")
                if kind != Kind.HELLO:
                    raise self._startup_error(f"sent {kind.name} before HELLO")
                if payload.get("protocol") != PROTOCOL_VERSION:
                    raise self._startup_error(
                        f"speaks protocol {payload.get('protocol')}, this client {PROTOCOL_VERSION}")
                self.hello = dict(payload)
                box = self.hello.get("sandbox", {})
                if box.get("landlock") and not box.get("disabled") and box.get("transfer_fd") is not None:
                    try:
                        self._transfer = WorkerTransfer(self.pid, int(box["transfer_fd"]))
                    except OSError as exc:
                        log.warning("[startup] worker %d: no transfer memfd (%s); using its directory",
                                    self.worker_id, exc)
                break
        except BaseException:
            self.close(timeout=1.0)
            raise
        box = payload.get("sandbox", {})
        if self.options.sandbox and not box.get("writes_scoped"):
            log.warning("[startup] worker %d: this kernel offers no Landlock; the worker runs unconfined",
                        self.worker_id)
        elif self.options.sandbox and not self.options.network and not box.get("tcp_blocked"):
            log.warning("[startup] worker %d: Landlock ABI %s cannot block TCP (needs 4); the worker can "
                        "reach the network", self.worker_id, box.get("landlock"))
        if payload.get("fallback_reason"):
            log.warning("[startup] worker %d: requested native variant %r unavailable, running %r (%s)",
                        self.worker_id, payload.get("requested_variant"), payload.get("variant"),
                        payload.get("fallback_reason"))
        self._reader.start()
        return self.hello

    def _startup_error(self, why: str) -> WorkerStartupError:
        # Killed whatever went wrong: a worker that errs, speaks garbage or closes its pipe may linger,
        # and one that has exited is past killing (its status is kept).
        self._kill_tree()
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._stderr_thread.join(timeout=1.0)
        limit = self.options.memory_limit
        if limit and limit < START_DATA_BYTES * 2:
            why += (f"; memory_limit={limit} bytes ({limit / 2**20:.0f} MiB) is likely too small for a worker to "
                    f"start: one needs about {START_DATA_BYTES >> 20} MiB of data before it loads a model")
        return WorkerStartupError(
            f"worker {self.worker_id} (pid {self.pid}) failed to start: {why}; {describe_exit(code)}",
            worker_id=self.worker_id, pid=self.pid, stderr_tail=self.stderr_tail())

    @property
    def private_dir(self) -> str:
        """The worker's own directory (its cwd): the one place it may write besides writable_dirs."""
        return self._cwd

    def transfer(self) -> TransferFile | WorkerTransfer:
        """A file for one bulk transfer with this worker (a context's state). A Landlock-confined worker
        cannot open an unconfined process's /proc/<pid>/fd, so it gets its own memfd, made before it
        confined itself (WorkerTransfer), or failing that a file in its private directory."""
        if self._transfer is not None:
            return self._transfer
        box = self.hello.get("sandbox", {})
        return TransferFile(self._cwd if box.get("landlock") and not box.get("disabled") else None)

    def take_transfer(self, f: TransferFile | WorkerTransfer) -> int | None:
        """What the worker wrote into f (its reply received), as a descriptor now the caller's, the
        worker's next transfer given a new file: a state kept without copying it out. None where the
        worker could not renew its file (it died): f still holds the state, for the caller to copy."""
        if isinstance(f, WorkerTransfer):
            try:
                self.call(RenewTransfer(fd=f.worker_fd)).result()
            except LloyalError:  # WorkerCrashedError among them
                return None
        return f.take()

    # -- calls ----------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._dead is None

    def call(self, req: Request[R], on_event: Callable[[dict[str, Any]], None] | None = None,
             on_id: Callable[[int], None] | None = None, *,
             on_done: Callable[[Any, BaseException | None], None] | None = None) -> Future[R]:
        """Sends req; the future gets its reply, converted to the type req declares (protocol.py).

        Request ids follow the order frames enter the pipe, which is the order the worker serves them.
        on_id(id) runs just before the frame is written: the caller's bookkeeping of what is in flight,
        never I/O. ``on_done(result, error)`` runs on the reader thread before the future is settled, in
        reply order (the owner's record of the call; at the worker's death the owner is told instead).
        The pipe write itself can block (a frame larger than the pipe buffer while the worker is busy),
        so nothing a caller holds across it may be needed to interrupt the worker."""
        fut: Future[R] = running()
        with self._write_lock:
            with self._lock:
                if self._dead is not None:
                    raise self._stale_error()
                req_id = next(_request_ids)
                self._pending[req_id] = _Pending(fut, on_event, type(req), on_done=on_done)
            try:
                frame = pack(Kind.REQUEST, req_id, request_payload(req))
            except BaseException:
                with self._lock:
                    self._pending.pop(req_id, None)
                raise
            if on_id is not None:
                on_id(req_id)
            self._write_request(req_id, frame)
        return fut

    def _write_request(self, req_id: int, frame: bytes) -> None:
        """Writes a request's frame. A KeyboardInterrupt (or another exception a signal handler raises)
        may land while the write blocks on a full pipe. If nothing went out yet, the request was never
        sent: it is forgotten, or its id would stay pending and the hang watch would take the idle worker
        for a hung one. If part went out, the rest is written before the exception goes on, since the
        worker would otherwise misread every frame after it; the request then runs, and its reply goes
        to a future nobody waits on."""
        view = memoryview(frame)
        try:
            while view:
                view = view[_pipe_write(self._req_w, view):]
        except OSError:
            pass  # the worker is gone; the reader thread fails this call with the cause
        except BaseException:
            if len(view) == len(frame):
                with self._lock:
                    self._pending.pop(req_id, None)
                raise
            try:
                write_frame(self._req_w, bytes(view))
            except OSError:
                pass
            raise

    def _stale_error(self) -> BaseException:
        dead = self._dead
        if isinstance(dead, PoolClosedError) or dead is None:
            return PoolClosedError(f"worker {self.worker_id} was closed")
        first = str(dead).split("\n--- worker stderr")[0]
        err = DeadWorkerError(
            f"{first}; its models and contexts are gone. Start a replacement with Pool.replace().",
            returncode=dead.returncode, worker_id=self.worker_id, pid=self.pid, stderr_tail=dead.stderr_tail)
        err.__cause__ = dead
        return err

    def interrupt(self, slot: int, request_id: int) -> None:
        if self._dead is None:
            self.region.set_interrupt(slot, request_id)

    # -- the reader thread ----------------------------------------------------------------------------
    def _read_replies(self) -> None:
        READING.active = True
        why = "its replies pipe closed"
        while True:
            try:
                kind, req_id, payload = read_frame(self._rep_r)
                violation = self._deliver(kind, req_id, payload)
            except PeerClosed:
                break
            except (ProtocolError, OSError) as exc:
                violation = str(exc)
            except Exception as exc:  # a frame the client cannot take must not end this thread quietly
                violation = f"{type(exc).__name__}: {exc}"
            if violation:
                why = f"protocol violation: {violation}"
                self._kill_tree()
                break
        self._on_death(why)

    def _deliver(self, kind: Kind, req_id: int, payload: Any) -> str | None:
        """Hands one frame to the call in flight it belongs to; what is wrong with it when it belongs to
        none or is not what that call expects (the worker is then killed, and the call fails with the rest).
        Only this thread removes calls from _pending (besides call() undoing a frame it never sent), so a
        call looked up here is still there when it is resolved."""
        if kind not in (Kind.EVENT, Kind.RESPONSE, Kind.ERROR):
            return f"unexpected {kind.name} frame"
        with self._lock:
            pending = self._pending.get(req_id)
        if pending is None:
            return f"a {kind.name} frame for request {req_id}, which is not in flight"
        if kind == Kind.EVENT:
            if not isinstance(payload, dict):
                return f"an EVENT payload for request {req_id} that is not a map"
            if pending.on_event is not None and pending.callback_error is None:
                self._in_callback = True  # the hang watch waits: the worker may block on a full pipe
                try:
                    pending.on_event(payload)
                except BaseException as exc:  # the caller's to see, when the call ends; this thread goes on
                    log.debug("event callback for request %d raised %r", req_id, exc)
                    pending.callback_error = exc
                finally:
                    self._in_callback = False
            return None
        result: Any = None
        if kind == Kind.RESPONSE:
            try:
                result = parse_reply(pending.request, payload)
            except ProtocolError as exc:
                return str(exc)
            error = pending.callback_error
        else:
            if not (isinstance(payload, dict) and isinstance(payload.get("type"), str)
                    and isinstance(payload.get("message"), str)
                    and isinstance(payload.get("traceback"), (str, type(None)))):
                return f"a malformed ERROR payload for request {req_id}"
            error = pending.callback_error or rebuild(payload["type"], payload["message"], payload.get("traceback"))
        with self._lock:
            self._pending.pop(req_id, None)
        if pending.on_done is not None:
            try:
                pending.on_done(result, error)
            except Exception:  # the owner's bug must not end this thread: every later reply would be lost
                log.exception("a reply's owner failed on request %d", req_id)
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(result)
        return None

    def _on_death(self, why: str) -> None:
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            # The pipe closed but the process lingers (or spoke garbage): it is of no use any more.
            self._kill_tree()
            code = self.proc.wait()
        self._stderr_thread.join(timeout=1.0)
        error: WorkerCrashedError | PoolClosedError
        closed = self._closing and (code == 0 or self._killed_by_close)
        if closed:
            error = PoolClosedError(f"worker {self.worker_id} was closed while the call was in flight")
        elif self._hung_for > 0:
            error = WorkerHungError(
                f"worker {self.worker_id} (pid {self.pid}) hung: no sign of life for {self._hung_for:.1f}s "
                f"with calls waiting (hang_timeout), so the pool killed it; {describe_exit(code)}",
                hung_for=self._hung_for, returncode=code, worker_id=self.worker_id, pid=self.pid,
                stderr_tail=self.stderr_tail())
        else:
            failed = self._stderr.abort_line()
            error = WorkerCrashedError(
                f"worker {self.worker_id} (pid {self.pid}) {describe_exit(code)}; {why}"
                + (f"; {failed}" if failed else ""),
                returncode=code, worker_id=self.worker_id, pid=self.pid, stderr_tail=self.stderr_tail())
        if isinstance(error, WorkerCrashedError):
            log.error("[crash] %s", str(error).splitlines()[0])
        with self._lock:
            self._dead = error
            pending, self._pending = self._pending, {}
        self._dead_event.set()
        owner = self.owner
        if owner is not None:
            try:
                owner.worker_died(self, error)  # it settles its own calls (on_done), replaying what it can
            except Exception:
                log.exception("the owner of worker %d failed at its death", self.worker_id)
        for p in pending.values():
            if p.on_done is not None and owner is None:
                p.on_done(None, copy_error(error))
            if not p.future.done():  # a timed-out call may have been failed already
                p.future.set_exception(copy_error(error))
        if isinstance(error, WorkerCrashedError) and self.on_death is not None:
            try:
                self.on_death(self, error)
            except Exception:  # an application's callback must not take the reader down
                log.exception("worker death callback raised")

    # -- the hang watchdog's check --------------------------------------------------------------------
    def check_hang(self, now: float, hang_timeout: float) -> None:
        """Called by the pool's watchdog every tick: kills the worker when calls wait on it and its
        heartbeat has not moved for hang_timeout seconds. An idle worker is not watched (nothing waits,
        and its next call starts the clock), nor one whose reader runs a user callback (then the worker
        may rightly be blocked writing to a full pipe)."""
        if self._dead is not None or self._closing or self._hung_for > 0:
            return
        with self._lock:
            busy = bool(self._pending)
        if not busy:
            self._beat_since = None
            return
        beat = self.region.heartbeat
        if self._beat_since is None or beat != self._beat_seen or self._in_callback:
            self._beat_seen, self._beat_since = beat, now
            return
        if now - self._beat_since >= hang_timeout:
            self._hung_for = now - self._beat_since
            log.error("[hang] worker %d (pid %d): no sign of life for %.1fs with calls waiting; killing it",
                      self.worker_id, self.pid, self._hung_for)
            self._kill_tree()

    def stderr_tail(self, max_lines: int = 40) -> str:
        return self._stderr.tail(max_lines)

    # -- figures --------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._pending)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"worker_id": self.worker_id, "pid": self.pid,
                               "state": "alive" if self._dead is None else "dead",
                               "variant": self.hello.get("variant"), "in_flight": len(self._pending)}
        if self._dead is not None:
            out["returncode"] = self.proc.returncode
            return out
        try:
            if self._psutil is None:
                self._psutil = psutil.Process(self.pid)
                self._psutil.cpu_percent(None)  # first call primes the counter
            p = self._psutil
            with p.oneshot():
                mem = p.memory_info()
                out.update(rss=mem.rss, vms=mem.vms, cpu_percent=p.cpu_percent(None),
                           cpu_times=p.cpu_times()._asdict(), num_threads=p.num_threads(), status=p.status())
        except psutil.Error as exc:
            out["error"] = str(exc)
        return out

    # -- shutdown -------------------------------------------------------------------------------------
    def _kill_tree(self) -> None:
        kill_tree(self.pid, own_session_only=self._control is not None)  # a zygote's forks live on

    def _kill_by_close(self) -> None:
        if self.proc.returncode is None:
            self._killed_by_close = True
        self._kill_tree()

    def kill(self) -> None:
        """SIGKILL the worker (and its children) now; waiting calls fail with WorkerCrashedError."""
        self._kill_tree()

    def close(self, timeout: float = 5.0) -> None:
        """SHUTDOWN, then EOF, then kill what is left; reaps everything and frees the region. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing = self._dead is None
        deadline = time.monotonic() + timeout
        if self._req_w >= 0:
            # A caller may be blocked writing a large frame to a worker that no longer reads. Then the
            # SHUTDOWN frame is skipped and the worker killed first, which fails that write (EPIPE);
            # the fd is closed only under the write lock, so no write can reach a reused fd number.
            if not self._write_lock.acquire(timeout=timeout / 2):
                log.warning("[shutdown] worker %d: a request is stuck in its pipe; killing it", self.worker_id)
                self._kill_by_close()
                self._write_lock.acquire()
            try:
                write_frame(self._req_w, pack(Kind.SHUTDOWN, 0, None))
            except OSError:
                pass
            try:
                os.close(self._req_w)
            except OSError:
                pass
            self._req_w = -1
            self._write_lock.release()
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("[shutdown] worker %d did not exit within %.1fs; killing it", self.worker_id, timeout)
        self._kill_by_close()  # also any grandchildren the worker left behind
        self.proc.wait()
        if self._reader.is_alive():
            self._reader.join(timeout=5.0)
        elif self._dead is None:
            self._on_death("closed before start-up completed")
        self._stderr_thread.join(timeout=2.0)
        if self._life_w >= 0:
            os.close(self._life_w)
            self._life_w = -1
        if self._rep_r >= 0:
            os.close(self._rep_r)
            self._rep_r = -1
        self.region.close()
        if self._transfer is not None:
            self._transfer.close()
        if self._control is not None:
            self._control.close()
            _remove_all_but_forks(self._cwd)
        else:
            shutil.rmtree(self._cwd, ignore_errors=True)


def _remove_all_but_forks(path: str) -> None:
    """Empties a zygote's directory but for its forks' directories: they live on, each removes its own,
    and the pool's temporary directory goes at its close."""
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)
                elif not entry.name.startswith("fork"):
                    shutil.rmtree(entry.path, ignore_errors=True)
    except OSError:
        pass
