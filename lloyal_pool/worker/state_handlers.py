"""The requests that move a context's state in and out: the whole context to a file, one sequence to bytes
(that travel in a frame) or to a file.

A whole context's state is what a checkpoint, a move, a page-out and a crash recovery carry between
workers (_jobs.py, _image.py), and what Context.save_state() writes; one sequence's is the kv API's
(branches.py). A path is checked before native code opens it (file_checks.py), a save that is not in place
replaces its file only once the new state is whole, and a load into a branch's sequence reports that
branch's new state, since the branch moved without a request on it.
"""

from __future__ import annotations

import os

from .. import protocol as p
from ..errors import BadRequestError, ContextError
from ..protocol import MAX_FRAME
from ..shm import TRANSFER_MEMFD
from .branch_handlers import branch_state
from .file_checks import check_state_path
from .registry import Call, ContextEntry, Registry, handles


class StateHandlers(Registry):
    # -- the whole context ----------------------------------------------------------------------------
    @handles(p.SaveState)
    def save_state(self, req: p.SaveState, call: Call) -> int:
        native = self._context(req.context).native
        check_state_path(req.path, reading=False)
        if req.in_place:
            return int(native.save_state(req.path))
        # A file that is there is either the old state or the new one, never half of the new one.
        tmp = f"{req.path}.{os.getpid()}.tmp"
        try:
            n = int(native.save_state(tmp))
            os.replace(tmp, req.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return n

    @handles(p.LoadState)
    def load_state(self, req: p.LoadState, call: Call) -> int:
        entry = self._context(req.context)
        check_state_path(req.path, reading=True)
        return int(entry.native.load_state(req.path))

    @handles(p.RenewTransfer)
    def renew_transfer(self, req: p.RenewTransfer, call: Call) -> None:
        # The number stays, so the path the parent names in a SaveState or LoadState stays; the file
        # behind it is new. The parent holds the old one by its own descriptor: nothing is copied.
        try:
            name = os.readlink(f"/proc/self/fd/{req.fd}")
        except OSError:
            name = ""
        if not name.startswith(f"/memfd:{TRANSFER_MEMFD} "):
            raise BadRequestError(f"descriptor {req.fd} is not this worker's transfer file")
        fresh = os.memfd_create(TRANSFER_MEMFD, os.MFD_CLOEXEC)
        try:
            os.dup2(fresh, req.fd, inheritable=False)
        finally:
            os.close(fresh)

    # -- one sequence ---------------------------------------------------------------------------------
    @handles(p.StateSeqSize)
    def state_seq_size(self, req: p.StateSeqSize, call: Call) -> int:
        return int(self._context(req.context).native.state_seq_size(req.seq))

    @handles(p.StateSeqGet)
    def state_seq_get(self, req: p.StateSeqGet, call: Call) -> bytes:
        data = bytes(self._context(req.context).native.state_seq_get(req.seq))
        if len(data) > MAX_FRAME - 4096:
            raise ContextError(f"the state of sequence {req.seq} is {len(data)} bytes, more than one protocol frame "
                               f"carries ({MAX_FRAME}): save it to a file with kv.save_file instead")
        return data

    def _loaded(self, entry: ContextEntry, seq: int, tokens: list[int], n_bytes: int) -> p.StateLoaded:
        # A load into a branch's (empty) sequence moves that branch: its handle's cache needs the news.
        owners = [h for h in entry.native.branches() if entry.native.branch_info(h)["seq"] == seq]
        return p.StateLoaded(tokens=tokens, n_bytes=n_bytes, states=[branch_state(entry, h) for h in owners])

    @handles(p.StateSeqSet)
    def state_seq_set(self, req: p.StateSeqSet, call: Call) -> p.StateLoaded:
        entry = self._context(req.context)
        n = int(entry.native.state_seq_set(req.seq, req.data))
        return self._loaded(entry, req.seq, [], n)

    @handles(p.StateSeqSaveFile)
    def state_seq_save_file(self, req: p.StateSeqSaveFile, call: Call) -> int:
        entry = self._context(req.context)
        check_state_path(req.path, reading=False)
        return int(entry.native.state_seq_save_file(req.seq, req.path, req.tokens))

    @handles(p.StateSeqLoadFile)
    def state_seq_load_file(self, req: p.StateSeqLoadFile, call: Call) -> p.StateLoaded:
        entry = self._context(req.context)
        check_state_path(req.path, reading=True)
        tokens, n = entry.native.state_seq_load_file(req.seq, req.path)
        return self._loaded(entry, req.seq, [int(t) for t in tokens], int(n))


__all__ = ["StateHandlers"]
