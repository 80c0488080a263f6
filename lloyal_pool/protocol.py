"""The wire protocol between the client and a worker process. Both sides import this module.

    client                                   worker
      │  REQUEST  [2, id, [op, {args}]]  ──────▶ │
      │  ◀────── EVENT    [5, id, {...}]         │  stream pieces, load progress (0..n per request)
      │  ◀────── RESPONSE [3, id, result]        │  exactly one of RESPONSE / ERROR per request
      │  ◀────── ERROR    [4, id, {type, message, traceback}]
      │  ◀────── HELLO    [1, 0, {...}]          │  once, after the native module loaded
      │  SHUTDOWN [6, 0, None]           ──────▶ │

A frame is a little-endian u32 length followed by that many bytes of msgpack. Only msgpack's own types
cross (nothing is ever unpickled); bulk data (logits) never rides in a frame but in the worker's shared
memory region (shm.py), and a response names where. A frame longer than MAX_FRAME, or one that does not
decode to [kind, id, payload], is a protocol violation: the client treats the worker as crashed.
"""

from __future__ import annotations

import enum
import os
import struct
from typing import Any

import msgpack

from .errors import ProtocolError

PROTOCOL_VERSION = 2
MAX_FRAME = 256 << 20  # state blobs can be large; anything bigger is a bug or garbage
_LEN = struct.Struct("<I")


class Kind(enum.IntEnum):
    HELLO = 1
    REQUEST = 2
    RESPONSE = 3
    ERROR = 4
    EVENT = 5
    SHUTDOWN = 6


class Op(str, enum.Enum):
    """Request operations. The worker dispatches through an explicit table (worker/loop.py), never by name."""

    PING = "ping"
    LOAD_MODEL = "load_model"
    FREE_MODEL = "free_model"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    TOKEN_TO_PIECE = "token_to_piece"
    APPLY_CHAT_TEMPLATE = "apply_chat_template"
    JSON_SCHEMA_TO_GRAMMAR = "json_schema_to_grammar"
    NEW_CONTEXT = "new_context"
    FREE_CONTEXT = "free_context"
    EVAL = "eval"
    GENERATE = "generate"
    LOGITS = "logits"
    RESET = "reset"
    TOKENS = "tokens"
    # Branches (client.Branch / BranchStore), all on one context.
    BRANCH_CREATE = "branch_create"
    BRANCH_FORK = "branch_fork"
    BRANCH_ADOPT = "branch_adopt"
    BRANCH_PRUNE = "branch_prune"
    BRANCH_RETAIN_ONLY = "branch_retain_only"
    BRANCH_DETACH = "branch_detach"
    BRANCH_INFO = "branch_info"
    BRANCH_SET_PARAMS = "branch_set_params"
    BRANCH_SET_GRAMMAR = "branch_set_grammar"
    BRANCH_SET_LOGIT_BIAS = "branch_set_logit_bias"
    BRANCH_RESEED = "branch_reseed"
    BRANCH_SET_LOGITS = "branch_set_logits"
    BRANCH_MERGE_LOGITS = "branch_merge_logits"
    PRODUCE = "produce"
    COMMIT = "commit"
    PREFILL = "prefill"
    STEP = "step"
    # Raw KV-cache sequences (client.KV).
    KV_SEQ = "kv_seq"
    KV_PRESSURE = "kv_pressure"
    STATE_SEQ_GET = "state_seq_get"
    STATE_SEQ_SET = "state_seq_set"
    STATE_SEQ_SAVE_FILE = "state_seq_save_file"
    STATE_SEQ_LOAD_FILE = "state_seq_load_file"
    CLEAR_AND_RESEED = "clear_and_reseed"
    FAULT = "_fault"  # test-only, refused unless the worker runs with LLOYAL_POOL_TEST_FAULTS=1


def pack(kind: Kind, req_id: int, payload: Any) -> bytes:
    """ProtocolError for a frame over MAX_FRAME: refused by the side that would send it, since the
    receiving side must treat such a frame as a broken peer."""
    body: bytes = msgpack.packb([int(kind), req_id, payload], use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a {kind.name} frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LEN.pack(len(body)) + body


def unpack(body: bytes) -> tuple[Kind, int, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
        kind, req_id, payload = msg
        return Kind(kind), int(req_id), payload
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
