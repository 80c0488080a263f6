"""A fake worker for protocol tests: started in place of ``python -m lloyal_pool.worker`` (the test points
sys.executable at a script that runs main()), it speaks frames from a script instead of serving requests.
It stands in for the worker's side of the pipes only, never for llama.cpp.

The script (a msgpack file named by LLOYAL_FAKE_SCRIPT in its environment) is a map:
    protocol: the version its HELLO claims
    hello:    (optional) entries that replace the HELLO payload's ("sandbox": the sandbox report)
    stderr:   (optional) bytes it writes to its stderr first
    before:   (optional) frames written instead of HELLO, as in frames; the fake then exits with code 3,
              or with linger true waits for its request pipe to close first
    frames:   what it writes once the first request arrives, in order: {"raw": bytes} as they are, or
              {"kind": k, "id": i, "payload": x} packed as a frame (id None: that request's id)
then it answers every further request with a Pong, until its request pipe closes.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import Any

import msgspec

_LEN = struct.Struct("<I")


def _frame(kind: int, req_id: int, payload: Any) -> bytes:
    body = msgspec.msgpack.encode([kind, req_id, payload])
    return _LEN.pack(len(body)) + body


def _read_exact(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _read_request(fd: int) -> tuple[int, int] | None:
    head = _read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0])
    if body is None:
        return None
    kind, req_id, _ = msgspec.msgpack.decode(body)
    return int(kind), int(req_id)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_all(fd: int, items: list[dict[str, Any]], req_id: int) -> None:
    for item in items:
        if "raw" in item:
            _write(fd, item["raw"])
        else:
            _write(fd, _frame(item["kind"], req_id if item["id"] is None else item["id"], item["payload"]))


def main(argv: list[str]) -> int:
    rfd, wfd = (int(x) for x in argv[argv.index("--fds") + 1].split(","))
    with open(os.environ["LLOYAL_FAKE_SCRIPT"], "rb") as f:
        script = msgspec.msgpack.decode(f.read())
    if "stderr" in script:
        _write(2, script["stderr"])
    if "before" in script:
        _write_all(wfd, script["before"], 0)
        while script.get("linger") and os.read(rfd, 1 << 16):
            pass
        return 3
    box = {"landlock": 0, "disabled": True, "writes_scoped": False, "tcp_blocked": False}
    hello = {"protocol": script["protocol"], "pid": os.getpid(), "variant": "cpu", "build": {}, "threads": 1,
             "sandbox": box, **script.get("hello", {})}
    _write(wfd, _frame(1, 0, hello))
    first = True
    try:
        while True:
            got = _read_request(rfd)
            if got is None or got[0] == 6:  # EOF, SHUTDOWN
                return 0
            req_id = got[1]
            if first:
                first = False
                _write_all(wfd, script["frames"], req_id)
                continue
            _write(wfd, _frame(3, req_id, {"pid": os.getpid()}))
    except (BrokenPipeError, OSError):
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
