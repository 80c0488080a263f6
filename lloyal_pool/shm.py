"""The shared-memory region of one worker. Both sides import this module.

The parent creates the region (so the parent can always clean it up, even after the worker is
SIGKILLed) and hands it to the worker; the worker writes bulk data (logits) into it and the client
reads it back as numpy arrays, with no serialization.

    offset 0      header      magic, layout version, size
    offset 64     heartbeat   a u64 the worker advances while it works (every interrupt check of the native
                              loops, every request): the parent's hang watchdog reads it, no round trip
    offset 4096   interrupt   INTERRUPT_SLOTS u64 words, one per context: the client stores the id of the
                              request to stop; the native loop compares it with the request it runs
    offset 8192   bulk        page-aligned blocks the worker's native arena hands out: a logits row per
                              context, a snapshot per branch, each freed with its owner

On Linux the region is a memfd, fully allocated up front (posix_fallocate: a full tmpfs becomes an
ENOSPC here instead of a SIGBUS later) and sealed against shrinking and growing, so a misbehaving worker
cannot truncate it under the parent. It has no name in /dev/shm, so nothing can leak there. Elsewhere a
POSIX SharedMemory segment is used, created and unlinked by the parent only.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import LloyalError, StaleHandleError

MAGIC = 0x4C4C4F59414C5348  # "LLOYALSH"
LAYOUT_VERSION = 1
PAGE = mmap.PAGESIZE
HEARTBEAT_OFFSET = 64  # its own cache line: the native side stores to it from the decode loops
INTERRUPT_OFFSET = 4096
INTERRUPT_SLOTS = 512
BULK_OFFSET = 8192
DEFAULT_SIZE = 64 << 20
_HEADER = struct.Struct("<QII")
_MAP_FIXED = 0x10  # Linux, every architecture


@dataclass(frozen=True)
class RegionSpec:
    """How the worker finds the region: an inherited fd (memfd) or a POSIX shm name."""

    size: int
    fd: int = -1
    name: str = ""

    def to_arg(self) -> str:
        return f"{self.size}:{self.fd}:{self.name}"

    @classmethod
    def from_arg(cls, text: str) -> RegionSpec:
        size, fd, name = text.split(":", 2)
        return cls(int(size), int(fd), name)


class Region:
    """A mapped region plus the views both sides need."""

    def __init__(self, buf: mmap.mmap | bytearray, spec: RegionSpec, owner: object = None) -> None:
        self._buf = buf
        self._owner = owner  # SharedMemory (POSIX fallback) or None
        self.spec = spec
        self.size = spec.size
        self.view = memoryview(buf)
        # Only the interrupt words are touched through numpy; keeping one array avoids re-wrapping per call.
        self.interrupt = np.frombuffer(self.view, dtype=np.uint64, count=INTERRUPT_SLOTS,
                                       offset=INTERRUPT_OFFSET)
        self._heartbeat = np.frombuffer(self.view, dtype=np.uint64, count=1, offset=HEARTBEAT_OFFSET)

    # -- creation -----------------------------------------------------------------------------------
    @classmethod
    def create(cls, size: int = DEFAULT_SIZE, *, backend: str = "auto", allocate: bool = True) -> Region:
        """Parent side. backend: "memfd" (Linux), "posix" (SharedMemory) or "auto". ``allocate=False``
        (memfd only) leaves the pages to be allocated as they are first written: a snapshot's fork gets
        its region in microseconds instead of the ~150 ms that allocating and touching 64 MiB takes."""
        size = max(_round_up(size, PAGE), BULK_OFFSET + PAGE)
        if backend == "auto":
            backend = "memfd" if hasattr(os, "memfd_create") else "posix"
        if backend == "memfd":
            region = cls._create_memfd(size, allocate)
        elif backend == "posix":
            region = cls._create_posix(size)
        else:
            raise ValueError(f"unknown shared-memory backend {backend!r}")
        _HEADER.pack_into(region.view, 0, MAGIC, LAYOUT_VERSION, size)
        return region

    @classmethod
    def _create_memfd(cls, size: int, allocate: bool = True) -> Region:
        import fcntl

        fd = os.memfd_create("lloyal_pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            try:
                if allocate:
                    os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise LloyalError(f"cannot allocate {size} bytes of shared memory: {exc}") from exc
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            buf = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if allocate:
            _prefault(buf, size)
        # The mmap keeps its own descriptor; this fd only exists to be inherited by the worker.
        return cls(buf, RegionSpec(size=size, fd=fd))

    @classmethod
    def _create_posix(cls, size: int) -> Region:
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(create=True, size=size)
        assert shm.buf is not None
        _prefault(shm.buf, size)
        return cls(shm.buf, RegionSpec(size=size, name=shm.name), owner=shm)  # type: ignore[arg-type]

    @classmethod
    def attach(cls, spec: RegionSpec) -> Region:
        """Worker side."""
        if spec.fd >= 0:
            buf = mmap.mmap(spec.fd, spec.size)
            os.close(spec.fd)
            region = cls(buf, spec)
        else:
            from multiprocessing import resource_tracker, shared_memory

            shm = shared_memory.SharedMemory(name=spec.name)
            # Attaching registers the segment with this process's resource tracker, which would unlink it
            # when the worker exits; only the parent owns its lifetime.
            if sys.version_info < (3, 13):
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            region = cls(shm.buf, spec, owner=shm)  # type: ignore[arg-type]
        magic, version, size = _HEADER.unpack_from(region.view, 0)
        if magic != MAGIC or version != LAYOUT_VERSION or size != spec.size:
            raise LloyalError("shared-memory region header does not match this lloyal_pool version")
        _prefault(region.view, spec.size)
        return region

    def move_to(self, fd: int, used: int) -> None:
        """Worker side, in a snapshot's forked child: copies the first ``used`` bytes of this region into
        the memfd ``fd`` (the child's own region, the same size) and maps that memfd at this region's
        address in place of the zygote's, so every pointer the native side holds into the region (logits
        rows, branch snapshots, interrupt words) stays valid and now reaches the child's parent. Closes
        fd."""
        import ctypes

        if not isinstance(self._buf, mmap.mmap) or os.fstat(fd).st_size != self.size:
            raise LloyalError("a forked worker's region must be a memfd of its zygote's size")
        anchor = ctypes.c_char.from_buffer(self._buf)
        address = ctypes.addressof(anchor)
        del anchor  # the export would pin the mmap
        with mmap.mmap(fd, self.size) as fresh:
            fresh[:used] = self.view[:used]
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        got = libc.mmap(address, self.size, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != address:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap(MAP_FIXED) of the forked region: {os.strerror(err)}")
        os.close(fd)
        self.spec = RegionSpec(self.size)

    @classmethod
    def anonymous(cls, size: int = DEFAULT_SIZE) -> Region:
        """A private region for the in-process engine (tests, debugging)."""
        size = max(_round_up(size, PAGE), BULK_OFFSET + PAGE)
        region = cls(bytearray(size), RegionSpec(size=size))
        _HEADER.pack_into(region.view, 0, MAGIC, LAYOUT_VERSION, size)
        return region

    # -- use ----------------------------------------------------------------------------------------
    def floats(self, offset: int, count: int, guard: Callable[[], str] | None = None) -> np.ndarray:
        """A read-only float32 view of count floats at offset (no copy). With ``guard``, a GuardedView
        that raises StaleHandleError once guard() names a reason (its owner wrote the floats again)."""
        arr = np.frombuffer(self.view, dtype=np.float32, count=count, offset=offset)
        arr.flags.writeable = False
        return arr if guard is None else GuardedView.of(arr, guard)

    @property
    def heartbeat(self) -> int:
        """The worker's heartbeat count: it changes while the worker makes progress."""
        return int(self._heartbeat[0]) if len(self._heartbeat) else 0

    def beat(self) -> None:
        """Worker side: a sign of life (the native loops give theirs through the same word)."""
        self._heartbeat[0] += 1

    def set_interrupt(self, slot: int, request_id: int) -> None:
        # One aligned 8-byte store; the native side loads it atomically. No lock, no round trip.
        self.interrupt[slot] = request_id

    def close_fd(self) -> None:
        """Parent side, after the worker inherited the fd."""
        if self.spec.fd >= 0:
            try:
                os.close(self.spec.fd)
            except OSError:
                pass
            self.spec = RegionSpec(self.spec.size, -1, self.spec.name)

    def close(self) -> None:
        """Unmaps (and for POSIX shm, unlinks). Idempotent. A numpy view still alive keeps the pages
        mapped until it is collected; the segment itself is gone either way."""
        self.close_fd()
        self.interrupt = np.zeros(0, dtype=np.uint64)
        self._heartbeat = np.zeros(0, dtype=np.uint64)
        try:
            self.view.release()
        except BufferError:
            pass
        if self._owner is not None:
            shm = self._owner
            self._owner = None
            try:
                shm.close()  # type: ignore[attr-defined]
            except BufferError:
                pass
            try:
                shm.unlink()  # type: ignore[attr-defined]
            except FileNotFoundError:
                pass
        elif isinstance(self._buf, mmap.mmap):
            try:
                self._buf.close()
            except BufferError:
                pass


class GuardedView(np.ndarray):
    """A view of the region that refuses to be read once what it shows is gone: its owner wrote the
    floats again, or freed them. numpy cannot revoke a buffer it handed out, so the checks sit where the
    data is read: indexing, every ufunc and numpy function, iteration, conversions and the methods
    listed in _CHECKED. ``np.asarray(view)`` and ``copy()`` give a plain array; asarray's is unguarded."""

    _guard: Callable[[], str] | None = None

    @classmethod
    def of(cls, arr: np.ndarray, guard: Callable[[], str]) -> GuardedView:
        view = arr.view(cls)
        view._guard = guard
        return view

    def __array_finalize__(self, obj: Any) -> None:
        self._guard = getattr(obj, "_guard", None)

    def _plain(self) -> np.ndarray:
        if self._guard is not None and (why := self._guard()):
            raise StaleHandleError(f"this logits view is stale: {why} (copy what you keep: logits(copy=True))")
        return self.view(np.ndarray)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        args = [x._plain() if isinstance(x, GuardedView) else x for x in inputs]
        return getattr(ufunc, method)(*args, **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        def plain(x: Any) -> Any:
            if isinstance(x, GuardedView):
                return x._plain()
            if isinstance(x, (list, tuple)):
                return type(x)(plain(y) for y in x)
            return x

        return func(*plain(args), **{k: plain(v) for k, v in kwargs.items()})

    def __getitem__(self, key: Any) -> Any:
        self._plain()
        return super().__getitem__(key)

    def __iter__(self) -> Any:
        return iter(self._plain())

    def __array__(self, dtype: Any = None, /, *, copy: bool | None = None) -> np.ndarray:  # type: ignore[override]
        plain = self._plain()
        return plain if dtype is None else plain.astype(dtype)

    def __repr__(self) -> str:
        return repr(self._plain())


def _checked(name: str) -> Callable[..., Any]:
    def method(self: GuardedView, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._plain(), name)(*args, **kwargs)

    method.__name__ = name
    return method


# ndarray's own methods read the buffer in C without asking __array_ufunc__ or __array_function__.
_CHECKED = ("copy", "astype", "tolist", "tobytes", "argmax", "argmin", "argsort", "argpartition", "max", "min",
            "sum", "mean", "std", "var", "sort", "partition", "nonzero", "item", "dot", "round", "clip", "cumsum",
            "__str__", "__float__", "__int__", "__bool__", "__reduce__", "__reduce_ex__", "__copy__",
            "__deepcopy__")
for _name in _CHECKED:
    setattr(GuardedView, _name, _checked(_name))


class TransferFile:
    """A temporary file for bulk data that must not ride in a frame (a context's state, gigabytes for a
    long context), created by the parent; the worker reads or writes it by ``path``.

    On Linux it is an anonymous memfd that the worker opens as /proc/<parent pid>/fd/<n>: it has no name
    anywhere, so nothing is left behind whoever crashes (the memory goes with the last descriptor), and
    there is no resource tracker to fight. Before the parent maps it, it seals the file against
    shrinking and growing, so a worker cannot turn the parent's read into a SIGBUS; data for the worker
    is written with write(2) (never through a mapping) and sealed read-only before the worker sees it.
    Elsewhere a file in the temporary directory, removed on close (a parent SIGKILLed in between leaves
    it behind there). ``dir``: a file there instead of a memfd, for a Landlock-confined worker
    that has no WorkerTransfer (it may not open the parent's /proc/<pid>/fd).
    """

    def __init__(self, dir: str | None = None) -> None:
        self._memfd = dir is None and hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")
        self._tmp_path: str | None = None
        if self._memfd:
            self._fd = os.memfd_create("lloyal_pool_state", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        else:
            import tempfile

            self._fd, self._tmp_path = tempfile.mkstemp(prefix="lloyal_pool_state_", dir=dir)
            self.path = self._tmp_path

    def __enter__(self) -> TransferFile:
        return self

    @property
    def fd(self) -> int:
        """This process's descriptor of the file (what another transfer's write() copies from)."""
        return self._fd

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _seal(self, seals: int) -> None:
        if self._memfd:
            import fcntl

            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, seals)

    def write(self, data: bytes | bytearray | memoryview | int) -> None:
        """The worker's input: all of data (or of the file an int descriptor reads, from its start),
        then sealed (no write, shrink or grow from then on)."""
        os.ftruncate(self._fd, 0)
        write_all(self._fd, data)
        if self._memfd:
            import fcntl

            self._seal(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)

    def read(self) -> bytes:
        """What the worker wrote, once it replied."""
        if self._memfd:
            import fcntl

            self._seal(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        size = os.fstat(self._fd).st_size
        if size == 0:
            return b""
        if not self._memfd:
            return _pread_all(self._fd)  # unsealed: a worker could shrink it under a mapping (SIGBUS)
        # MAP_POPULATE: one pass over the page tables instead of a fault per page.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(self._fd, size, flags=flags, prot=mmap.PROT_READ) as mm:
            return mm[:]

    def take(self) -> int:
        """The file, with what the worker wrote, as a descriptor now the caller's (unnamed from now on);
        this object is closed."""
        taken, self._fd = self._fd, -1
        self.close()
        return taken

    def close(self) -> None:
        """Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tmp_path is not None:
            try:
                os.unlink(self._tmp_path)
            except FileNotFoundError:
                pass
            self._tmp_path = None


TRANSFER_MEMFD = "lloyal_pool_transfer"  # the name of a confined worker's transfer memfd


class WorkerTransfer:
    """TransferFile's stand-in for a Landlock-confined worker, which may not open the parent's
    /proc/<pid>/fd: a memfd the worker created before it confined itself (it opens it as /proc/self/fd/<n>),
    opened here through /proc/<worker pid>/fd/<n>. One per worker, reused: ``lock`` keeps one transfer at
    a time, and it is emptied after each. It cannot be sealed (the worker keeps it), so it is read with
    pread, never mapped: a worker that shrinks it cannot SIGBUS the parent."""

    def __init__(self, worker_pid: int, worker_fd: int) -> None:
        import threading

        self._proc_path = f"/proc/{worker_pid}/fd/{worker_fd}"
        self._fd = os.open(self._proc_path, os.O_RDWR | os.O_CLOEXEC)
        self.worker_fd = worker_fd
        self.path = f"/proc/self/fd/{worker_fd}"  # the worker's path to it
        self.lock = threading.Lock()

    @property
    def fd(self) -> int:
        """This process's descriptor of the file (what another transfer's write() copies from)."""
        return self._fd

    def __enter__(self) -> WorkerTransfer:
        self.lock.acquire()
        os.ftruncate(self._fd, 0)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._fd >= 0:
                os.ftruncate(self._fd, 0)  # frees its memory
        finally:
            self.lock.release()

    def write(self, data: bytes | bytearray | memoryview | int) -> None:
        """The worker's input: all of data (or of the file an int descriptor reads, from its start)."""
        write_all(self._fd, data)

    def read(self) -> bytes:
        """What the worker wrote, once it replied."""
        return _pread_all(self._fd)

    def take(self) -> int:
        """This file, with what the worker wrote, as a descriptor now the caller's, once the worker's
        number names a new file (protocol.RenewTransfer): this object goes on with that one (closed, where
        the worker died meanwhile). Called inside the transfer."""
        taken = self._fd
        try:
            self._fd = os.open(self._proc_path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            self._fd = -1
        return taken

    def close(self) -> None:
        """Idempotent."""
        with self.lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def write_all(fd: int, data: bytes | bytearray | memoryview | int) -> None:
    if isinstance(data, int):  # a descriptor: copied in pieces, never all of it in this process at once
        off = _copy_in_kernel(data, fd)
        while chunk := os.pread(data, 8 << 20, off):
            _write_all_at(fd, memoryview(chunk), off)
            off += len(chunk)
        return
    _write_all_at(fd, memoryview(data).cast("B"), 0)


def _copy_in_kernel(src: int, dst: int) -> int:
    """Copies src into dst from offset 0 without passing through this process (copy_file_range: a
    state moving between two workers' memfds); returns how far it got, the rest for the caller to copy
    (0 where the kernel cannot do it for these files)."""
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        return 0
    off = 0
    try:
        while n := copy(src, dst, 1 << 30, off, off):
            off += n
    except OSError:
        pass  # EXDEV, EINVAL, ENOSYS ...: whatever was copied stays, the caller goes on from there
    return off


def _write_all_at(fd: int, view: memoryview, at: int) -> None:
    off = 0
    while off < len(view):
        off += os.pwrite(fd, view[off:off + (1 << 30)], at + off)


def _pread_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    out = bytearray(size)
    view = memoryview(out)
    off = 0
    while off < size:
        n = os.preadv(fd, [view[off:off + (1 << 30)]], off)  # straight into the buffer: no chunk copies
        if not n:
            break  # shrunk meanwhile
        off += n
    view.release()
    del out[off:]
    return bytes(out)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _prefault(buf: mmap.mmap | memoryview | bytearray, size: int) -> None:
    # Touch one byte per page now, so the first logits copy does not pay ~3 us per page in faults.
    arr = np.frombuffer(buf, dtype=np.uint8, count=size)
    arr[::PAGE].sum()


#: The smallest region: the header, the interrupt words and one page of bulk area.
MIN_SIZE = BULK_OFFSET + PAGE


def available_memory(backend: str = "auto") -> int | None:
    """Bytes a new region can take without pushing the machine into its OOM killer (regions are allocated
    up front): MemAvailable, bounded by the cgroup's memory limit and, for POSIX shared memory, by the
    free space of /dev/shm. None where none of these can be read."""
    known: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    known.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                text = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max", or v1's page-rounded LONG_MAX: no limit
            known.append(max(0, int(text) - usage))
        break
    if backend == "posix" or (backend == "auto" and not hasattr(os, "memfd_create")):
        try:
            st = os.statvfs("/dev/shm")
            known.append(st.f_bavail * st.f_frsize)
        except OSError:
            pass
    return min(known) if known else None


def check_size(size: object, backend: str = "auto", regions: int = 1) -> int:
    """``Pool(shm_bytes=size)`` checked: an int of at least MIN_SIZE, and ``regions`` of it within what
    the machine can hold (available_memory). InvalidArgumentError naming shm_bytes otherwise."""
    from .errors import InvalidArgumentError

    if isinstance(size, bool) or not isinstance(size, int):
        raise InvalidArgumentError(f"shm_bytes is a number of bytes (an int), got {size!r}")
    if size < MIN_SIZE:
        raise InvalidArgumentError(f"shm_bytes must be at least {MIN_SIZE} (the region's header, its interrupt "
                                   f"words and one page for logits), got {size}")
    available = available_memory(backend)
    if available is not None and size * regions > available:
        raise InvalidArgumentError(
            f"shm_bytes={size} for {regions} worker(s) needs {size * regions} bytes of shared memory, allocated up "
            f"front, and this machine has {available} available: lower shm_bytes (each context takes "
            f"n_vocab * 4 bytes of it, rounded up to a page)")
    return size


def row_bytes(n_vocab: int) -> int:
    """The bytes of the region one logits row of a model takes: a context's row, a branch's snapshot (and
    the rows of an embeddings result are packed the same way, n_embd floats each)."""
    return _round_up(n_vocab * 4, PAGE)


def shm_bytes_for(n_vocab: int, rows: int) -> int:
    """The ``Pool(shm_bytes=...)`` whose region holds ``rows`` logits rows of a model with ``n_vocab``
    tokens: one per context and one per live branch (e.g. 8 contexts of Gemma 3, n_vocab 262,144, with
    4 branches each: ``shm_bytes_for(262144, 8 + 8 * 4)``)."""
    if n_vocab < 1 or rows < 0:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"n_vocab must be positive and rows not negative, got {n_vocab} and {rows}")
    return max(BULK_OFFSET + rows * row_bytes(n_vocab), MIN_SIZE)
