"""A context's state outside its worker, and the one way to make a context exist in a worker from it: what
a page-in, a move's target and a crash recovery all do.

    StateFile: a saved state in a file this process holds (a page file on disk in the pool's page_dir,
               or an anonymous memfd: the worker's transfer file itself, kept()), which a transfer
               copies into a worker in the kernel
    make():    NewContext ─▶ SetLora (a changed configuration empties a context: first) ─▶ LoadState
               (bytes, or a StateFile) ─▶ each request to replay on top (a journal's entries, a move's
               hand-overs) ─▶ the context's handle; freed again if any step fails

These run on a worker's loop thread (_core.py), the only user of its transfer file: one transfer at a time.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from . import protocol as p
from .errors import LloyalError, WorkerCrashedError
from .shm import write_all

if TYPE_CHECKING:
    from ._journal import SavedState
    from ._process import WorkerProcess
    from .shm import TransferFile, WorkerTransfer


class StateFile:
    """A context's saved state in an unnamed file this process holds: in ``directory`` (O_TMPFILE, a page
    file: nothing is left behind whoever crashes), or an anonymous memfd (None); ``fd``: the file a
    worker wrote, taken over (kept())."""

    def __init__(self, directory: str | None, fd: int | None = None) -> None:
        if fd is not None:
            self._fd = fd
        elif directory is None and hasattr(os, "memfd_create"):
            self._fd = os.memfd_create("lloyal_pool_image", os.MFD_CLOEXEC)
        else:
            directory = directory or tempfile.gettempdir()
            flag = getattr(os, "O_TMPFILE", 0)
            if flag:
                try:
                    self._fd = os.open(directory, flag | os.O_RDWR | os.O_CLOEXEC, 0o600)
                except OSError:  # a file system without unnamed files
                    flag = 0
            if not flag:
                self._fd, path = tempfile.mkstemp(prefix="lloyal_pool_page_", dir=directory)
                os.unlink(path)
        self.size = 0 if fd is None else os.fstat(fd).st_size
        self._closer = weakref.finalize(self, os.close, self._fd)  # dropped unclosed (its context collected)

    @property
    def fd(self) -> int:
        """What a transfer's write() copies the state from."""
        return self._fd

    def fill(self, src: int) -> None:
        """The file holds what the descriptor ``src`` reads from its start (a transfer file)."""
        os.ftruncate(self._fd, 0)
        write_all(self._fd, src)
        self.size = os.fstat(self._fd).st_size

    def read(self) -> bytes:
        return os.pread(self._fd, self.size, 0) if self.size else b""

    @property
    def disk_bytes(self) -> int:
        try:
            return os.fstat(self._fd).st_blocks * 512
        except OSError:
            return 0

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Idempotent."""
        self._closer()
        self._fd = -1


def kept(proc: WorkerProcess, f: TransferFile | WorkerTransfer, directory: str | None) -> StateFile:
    """The state proc just wrote into its transfer file f, as a StateFile in ``directory``: in memory
    (None: a move's image) the file itself, taken from the worker, since a copy costs ~15 ms for the
    38 MB of a 2,000-token Gemma context; on disk (a page file), or where the worker could not let go of
    it, a copy."""
    if directory is None:
        fd = proc.take_transfer(f)
        if fd is not None:
            return StateFile(None, fd)
    image = StateFile(directory)
    try:
        image.fill(f.fd)
    except BaseException:
        image.close()
        raise
    return image


def _renamed(req: p.Request[Any], handle: int) -> p.Request[Any]:
    if isinstance(req, p.ContextRequest) and req.context != handle:
        return msgspec.structs.replace(req, context=handle)
    return req


def make(proc: WorkerProcess, model: int, params: dict[str, Any], lora: Sequence[tuple[int, float]],
         state: bytes | SavedState | None, replay: Sequence[p.Request[Any]] = ()) -> p.ContextCreated:
    """The context made in proc (module docstring): ``model`` its model's handle there, ``params`` its
    ContextParams on the wire, ``lora`` its adapter configuration as (handle, scale) there, ``state`` what
    it held (None or b"": nothing), ``replay`` the requests that go on top. Raises the first step's error;
    the context is freed again then (where its worker still lives)."""
    created = proc.call(p.NewContext(model=model, params=params)).result()
    try:
        if lora:
            proc.call(p.SetLora(context=created.context, adapters=list(lora))).result()
        if state is not None and (not isinstance(state, bytes) or state):
            if getattr(state, "closed", False):
                raise LloyalError("the context's saved state was closed (its pool closed)")
            with proc.transfer() as f:
                f.write(state if isinstance(state, bytes) else state.fd)
                proc.call(p.LoadState(context=created.context, path=f.path)).result()
        for req in replay:
            proc.call(_renamed(req, created.context)).result()
    except BaseException:
        if proc.alive:
            try:
                proc.call(p.FreeContext(context=created.context)).result()
            except (LloyalError, WorkerCrashedError):
                pass
        raise
    return created


__all__ = ["StateFile", "kept", "make"]
