"""Frames on the pipes between the client and a worker (protocol.py declares what they carry): a
little-endian u32 length, then that many bytes of msgpack [kind, id, payload]. Only msgpack's own types
cross; a frame longer than MAX_FRAME, or one that does not decode to [kind, id, payload] with integer kind
and id, is a protocol violation."""

from __future__ import annotations

import enum
import os
import struct
from typing import Any

import msgspec

from .errors import InvalidArgumentError, ProtocolError

MAX_FRAME = 256 << 20  # state blobs can be large; anything bigger is a bug or garbage
_LEN = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class Kind(enum.IntEnum):
    HELLO = 1
    REQUEST = 2
    RESPONSE = 3
    ERROR = 4
    EVENT = 5
    SHUTDOWN = 6


def _unencodable_field(payload: Any) -> str | None:
    """The field of a request payload ([op, request]) that msgpack cannot carry, or None."""
    req = payload[1] if isinstance(payload, list) and len(payload) == 2 else None
    if not isinstance(req, msgspec.Struct):
        return None
    for name in req.__struct_fields__:
        try:
            _encoder.encode(getattr(req, name))
        except (TypeError, ValueError, OverflowError):
            return name
    return None


def pack(kind: Kind, req_id: int, payload: Any) -> bytes:
    """ProtocolError for a frame over MAX_FRAME, or for a payload msgpack cannot carry: refused by the
    side that would send it, since the receiving side must treat such a frame as a broken peer."""
    try:
        body = _encoder.encode([int(kind), req_id, payload])
    except (TypeError, ValueError, OverflowError) as exc:
        field = _unencodable_field(payload) if kind == Kind.REQUEST else None
        if field is not None:  # a value the caller gave: a str that is not Unicode, an int past 64 bits
            raise InvalidArgumentError(f"{payload[0]}: {field} cannot be sent to the worker: {exc}") from None
        raise ProtocolError(f"a {kind.name} frame cannot be encoded: {exc}") from None
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a {kind.name} frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LEN.pack(len(body)) + body


def unpack(body: bytes) -> tuple[Kind, int, Any]:
    try:
        kind, req_id, payload = _decoder.decode(body)
        if type(kind) is not int or type(req_id) is not int:  # not a bool, a float or a numeric string
            raise TypeError(f"kind and id must be integers, got {kind!r} and {req_id!r}")
        return Kind(kind), req_id, payload
    except Exception as exc:  # any malformed frame is the same protocol violation
        raise ProtocolError(f"malformed frame ({len(body)} bytes): {exc}") from None


def write_frame(fd: int, data: bytes) -> None:
    """Writes a whole packed frame; os.write may write less than asked on a pipe."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class PeerClosed(EOFError):
    """The other end closed its pipe (process exit or close)."""


def _read_exact(fd: int, n: int) -> bytes:
    chunks: list[bytes] = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise PeerClosed
        chunks.append(chunk)
        n -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_frame(fd: int) -> tuple[Kind, int, Any]:
    """Blocks for one frame. Raises PeerClosed on EOF, ProtocolError on garbage."""
    (length,) = _LEN.unpack(_read_exact(fd, _LEN.size))
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return unpack(_read_exact(fd, length))


def error_payload(exc: BaseException, tb: str) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc), "traceback": tb}


__all__ = ["MAX_FRAME", "Kind", "PeerClosed", "error_payload", "pack", "read_frame", "unpack", "write_frame"]
