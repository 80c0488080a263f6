"""The worker's request loop: read a frame, parse it into its request struct, run its handler, reply.

    parent ──requests──▶ [read_frame] ─▶ parse_request ─▶ engine.handle(req) ─▶ [write_frame] ──replies──▶ parent
                                                     │ emit(EVENT) for stream pieces / load progress

One request runs at a time, on the main thread, like one engine instance in go-llama: calls on a context
stay in order, and the native code never sees two threads. Interrupts do not need this loop: they are a
word in shared memory that the native loop reads. A request that fails replies with an ERROR frame and
the loop goes on; only a broken pipe (the parent is gone), SHUTDOWN, or a protocol violation (a frame
that does not decode, or one of a kind only a worker sends: exit code 70, the cause on stderr) ends it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback
from typing import Any

from .. import protocol as p
from ..errors import LloyalError, ProtocolError
from ..protocol import Kind, PeerClosed, error_payload, pack, parse_request, read_frame, write_frame
from .engine import Call, Engine, handles
from .zygote import Zygote

FAULTS_ENV = "LLOYAL_POOL_TEST_FAULTS"


@handles(p.Fault)
def _fault(engine: Engine, req: p.Fault, call: Call) -> Any:
    """Test-only crash kit: how a worker can die, on demand."""
    if os.environ.get(FAULTS_ENV) != "1":
        raise LloyalError(f"fault injection is disabled (set {FAULTS_ENV}=1 in the worker's environment)")
    kind = req.kind
    if kind == "segv":
        faulthandler._sigsegv()  # type: ignore[attr-defined]
    elif kind == "abort":
        os.abort()
    elif kind == "ggml_abort":
        engine.native._test_ggml_assert(0x6A6D)
    elif kind == "exit":
        os._exit(req.code)
    elif kind == "hang":
        time.sleep(req.seconds)
    elif kind == "fork":  # a child process of the worker's own, for close() to end
        pid = os.fork()
        if pid == 0:
            try:
                time.sleep(req.seconds)
            finally:
                os._exit(0)
        return {"pid": pid}
    elif kind == "stdout":
        os.write(1, b"garbage on stdout must not reach the protocol\n" * 100)
        print("print() too", flush=True)
        return "ok"
    elif kind == "unpackable":
        return {"an object is not msgpack": object()}
    elif kind == "raise":
        raise RuntimeError("an unexpected error inside the worker")
    elif kind in ("read_file", "write_file", "connect", "udp"):
        return _probe(kind, req.arg)
    raise ValueError(f"unknown fault kind {kind!r}")


def _probe(kind: str, arg: str) -> dict[str, Any]:
    """What the sandbox lets the worker do: {"ok": True, ...} or the OSError it got, never a crash."""
    import socket

    try:
        if kind == "read_file":
            with open(arg, "rb") as f:
                return {"ok": True, "data": f.read(4096)}
        if kind == "write_file":
            with open(arg, "wb") as f:
                f.write(b"written by a worker\n")
            return {"ok": True}
        host, port = arg.rsplit(":", 1)
        if kind == "udp":
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(b"datagram from a worker", (host, int(port)))
            return {"ok": True}
        with socket.create_connection((host, int(port)), timeout=10):
            return {"ok": True}
    except OSError as exc:
        return {"ok": False, "errno": exc.errno, "error": str(exc)}


#: The exit code of a worker that ends on a protocol violation from its parent (it says which on stderr).
PROTOCOL_VIOLATION_EXIT = 70


def _violation(why: str) -> int:
    print(f"[worker] [crash] protocol violation: {why}", file=sys.stderr, flush=True)
    return PROTOCOL_VIOLATION_EXIT


class WorkerLoop:
    def __init__(self, engine: Engine, rfd: int, wfd: int, zygote: Zygote | None = None) -> None:
        self.engine = engine
        self.rfd = rfd
        self.wfd = wfd
        self.zygote = zygote  # a snapshot's zygote forks children on Fork; a child serves its own pipes

    def send(self, kind: Kind, req_id: int, payload: Any) -> None:
        write_frame(self.wfd, pack(kind, req_id, payload))

    def run(self) -> int:
        while True:
            try:
                kind, req_id, payload = read_frame(self.rfd)
            except PeerClosed:
                return 0  # the parent closed our request pipe: it is done with us, or dead
            except ProtocolError as exc:
                return _violation(f"unreadable request: {exc}")
            if kind == Kind.SHUTDOWN:
                return 0
            if kind != Kind.REQUEST:
                # Only a broken or foreign parent sends anything else: what follows cannot be trusted.
                return _violation(f"unexpected {kind.name} frame")
            self.handle(req_id, payload)

    def handle(self, req_id: int, payload: Any) -> None:
        def emit(event: dict[str, Any]) -> None:
            self.send(Kind.EVENT, req_id, event)

        try:
            req = parse_request(payload)
            if isinstance(req, p.Fork) and self.zygote is not None and self.engine.frozen:
                self.zygote.fork(self, req_id, req)  # replies itself; returns in the child too
                return
            result = self.engine.handle(req, req_id, emit)
            # Packed here, so that a result too big for one frame (or not msgpack-able) fails this
            # request instead of the worker.
            frame = pack(Kind.RESPONSE, req_id, result)
        except (BrokenPipeError, PeerClosed, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # every request failure becomes an ERROR frame
            self.send(Kind.ERROR, req_id, error_payload(exc, traceback.format_exc()))
            return
        write_frame(self.wfd, frame)
