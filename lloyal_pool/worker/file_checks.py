"""The checks a path gets before native code opens it: a model or adapter file, a state file.

llama.cpp reports a file it cannot use only as a log line and a null result, and it reads whatever it is
given: a FIFO would block its read forever, a device would never end it. These checks turn each into the
request's own error before the native call, and never open anything that could block.
"""

from __future__ import annotations

import os
import stat

from .._files import not_regular
from ..errors import ModelLoadError, StateError

_GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: str, error: type[Exception] = ModelLoadError, what: str = "model") -> None:
    """The cheap checks llama.cpp would otherwise report only as a log line and a null model, and what it
    would never report: a FIFO or a device (links followed) would block or never end its read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise error(f"cannot read {what} file {path}: {exc}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what} path is a directory: {path}")
    kind = not_regular(st.st_mode)
    if kind is not None:
        raise error(f"{what} path is {kind}, not a regular file: {path}")
    try:
        # O_NONBLOCK: a FIFO swapped in since the stat does not wait for a writer, and fstat refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise error(f"cannot read {what} file {path}: {exc}") from exc
    try:
        kind = not_regular(os.fstat(fd).st_mode)
        if kind is not None:
            raise error(f"{what} path is {kind}, not a regular file: {path}")
        magic = os.pread(fd, 4, 0)
    except OSError as exc:
        raise error(f"cannot read {what} file {path}: {exc}") from exc
    finally:
        os.close(fd)
    if magic != _GGUF_MAGIC:
        raise error(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {path}")


def check_state_path(path: str, reading: bool) -> None:
    """A state file is read or written by native code that would block on a FIFO (or never end on a
    device): only a regular file, or for a write a path that does not exist yet."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: the native side says which
    kind = not_regular(mode)
    if kind is not None:
        raise StateError(f"cannot {'read a state from' if reading else 'write a state to'} {path}: it is {kind}, "
                         "not a regular file")


__all__ = ["check_gguf_file", "check_state_path"]
