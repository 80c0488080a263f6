"""Checks on the paths the worker opens, shared by the client (early, before a request is sent) and the
worker (before it opens anything). A FIFO blocks its reader until a writer comes, and a device such as
/dev/zero never ends: either would hang the worker inside llama.cpp's open or read, so only regular files
(after following links) are opened."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(mode: int) -> str | None:
    """What a file of this st_mode is when it is not a regular file ("a FIFO (named pipe)", ...), else
    None."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def irregular_path(path: str) -> str | None:
    """Why ``path`` (links followed) must not be opened as a file to read, or None when it is a regular
    file or cannot be examined here (missing, unreadable: the opener says why)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    kind = not_regular(mode)
    return None if kind is None else f"{path} is {kind}, not a regular file"


def beneath(path: str, dirs: Sequence[str]) -> bool:
    """Whether path (links followed) lies beneath one of dirs (real paths)."""
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, d]) == d for d in dirs)
