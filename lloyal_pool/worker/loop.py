"""The worker's request loop: read a frame, dispatch through an explicit table, reply.

    parent ──requests──▶ [read_frame] ─▶ HANDLERS[op](engine, args, ctx) ─▶ [write_frame] ──replies──▶ parent
                                                     │ emit(EVENT) for stream pieces / load progress

One request runs at a time, on the main thread, like one engine instance in go-llama: calls on a context
stay in order, and the native code never sees two threads. Interrupts do not need this loop: they are a
word in shared memory that the native loop reads. A request that fails replies with an ERROR frame and
the loop goes on; only a broken pipe (the parent is gone) or SHUTDOWN ends it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..errors import LloyalError, ProtocolError
from ..protocol import Kind, Op, PeerClosed, error_payload, pack, read_frame, write_frame
from .engine import Engine, EventSink

Handler = Callable[[Engine, dict[str, Any], int, EventSink], Any]
FAULTS_ENV = "LLOYAL_POOL_TEST_FAULTS"


def _fault(engine: Engine, args: dict[str, Any], req_id: int, emit: EventSink) -> Any:
    """Test-only crash kit: how a worker can die, on demand."""
    if os.environ.get(FAULTS_ENV) != "1":
        raise LloyalError(f"fault injection is disabled (set {FAULTS_ENV}=1 in the worker's environment)")
    kind = args.get("kind")
    if kind == "segv":
        faulthandler._sigsegv()  # type: ignore[attr-defined]
    elif kind == "abort":
        os.abort()
    elif kind == "exit":
        os._exit(int(args.get("code", 3)))
    elif kind == "hang":
        time.sleep(float(args.get("seconds", 3600)))
    elif kind == "stdout":
        os.write(1, b"garbage on stdout must not reach the protocol\n" * 100)
        print("print() too", flush=True)
        return "ok"
    elif kind == "unpackable":
        return {"a set is not msgpack": {1, 2}}
    elif kind == "raise":
        raise RuntimeError("an unexpected error inside the worker")
    raise ValueError(f"unknown fault kind {kind!r}")


HANDLERS: dict[Op, Handler] = {
    Op.PING: lambda e, a, r, emit: {"pid": os.getpid()},
    Op.LOAD_MODEL: lambda e, a, r, emit: e.load_model(**a, emit=emit),
    Op.FREE_MODEL: lambda e, a, r, emit: e.free_model(**a),
    Op.TOKENIZE: lambda e, a, r, emit: e.tokenize(**a),
    Op.DETOKENIZE: lambda e, a, r, emit: e.detokenize(**a),
    Op.TOKEN_TO_PIECE: lambda e, a, r, emit: e.token_to_piece(**a),
    Op.APPLY_CHAT_TEMPLATE: lambda e, a, r, emit: e.apply_chat_template(**a),
    Op.JSON_SCHEMA_TO_GRAMMAR: lambda e, a, r, emit: e.json_schema_to_grammar(**a),
    Op.NEW_CONTEXT: lambda e, a, r, emit: e.new_context(**a),
    Op.FREE_CONTEXT: lambda e, a, r, emit: e.free_context(**a),
    Op.EVAL: lambda e, a, r, emit: e.eval(**a, request_id=r),
    Op.GENERATE: lambda e, a, r, emit: e.generate(**a, request_id=r, emit=emit),
    Op.LOGITS: lambda e, a, r, emit: e.logits(**a),
    Op.RESET: lambda e, a, r, emit: e.reset(**a),
    Op.TOKENS: lambda e, a, r, emit: e.tokens(**a),
    Op.BRANCH_CREATE: lambda e, a, r, emit: e.branch_create(**a, request_id=r),
    Op.BRANCH_FORK: lambda e, a, r, emit: e.branch_fork(**a),
    Op.BRANCH_ADOPT: lambda e, a, r, emit: e.branch_adopt(**a),
    Op.BRANCH_PRUNE: lambda e, a, r, emit: e.branch_prune(**a),
    Op.BRANCH_RETAIN_ONLY: lambda e, a, r, emit: e.branch_retain_only(**a),
    Op.BRANCH_DETACH: lambda e, a, r, emit: e.branch_detach(**a),
    Op.BRANCH_INFO: lambda e, a, r, emit: e.branch_info(**a),
    Op.BRANCH_SET_PARAMS: lambda e, a, r, emit: e.branch_set_params(**a),
    Op.BRANCH_SET_GRAMMAR: lambda e, a, r, emit: e.branch_set_grammar(**a),
    Op.BRANCH_SET_LOGIT_BIAS: lambda e, a, r, emit: e.branch_set_logit_bias(**a),
    Op.BRANCH_RESEED: lambda e, a, r, emit: e.branch_reseed(**a),
    Op.BRANCH_SET_LOGITS: lambda e, a, r, emit: e.branch_set_logits(**a),
    Op.BRANCH_MERGE_LOGITS: lambda e, a, r, emit: e.branch_merge_logits(**a),
    Op.PRODUCE: lambda e, a, r, emit: e.produce(**a),
    Op.COMMIT: lambda e, a, r, emit: e.commit(**a, request_id=r),
    Op.PREFILL: lambda e, a, r, emit: e.prefill(**a, request_id=r),
    Op.STEP: lambda e, a, r, emit: e.step(**a, request_id=r),
    Op.KV_SEQ: lambda e, a, r, emit: e.kv_seq(**a),
    Op.KV_PRESSURE: lambda e, a, r, emit: e.kv_pressure(**a),
    Op.STATE_SEQ_GET: lambda e, a, r, emit: e.state_seq_get(**a),
    Op.STATE_SEQ_SET: lambda e, a, r, emit: e.state_seq_set(**a),
    Op.STATE_SEQ_SAVE_FILE: lambda e, a, r, emit: e.state_seq_save_file(**a),
    Op.STATE_SEQ_LOAD_FILE: lambda e, a, r, emit: e.state_seq_load_file(**a),
    Op.CLEAR_AND_RESEED: lambda e, a, r, emit: e.clear_and_reseed(**a, request_id=r),
    Op.FAULT: _fault,
}


def _parse_request(payload: Any) -> tuple[Op, dict[str, Any]]:
    if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[1], dict)):
        raise ProtocolError("a request payload must be [operation, {arguments}]")
    try:
        return Op(payload[0]), payload[1]
    except ValueError:
        raise ProtocolError(f"unknown operation {payload[0]!r}") from None


class WorkerLoop:
    def __init__(self, engine: Engine, rfd: int, wfd: int) -> None:
        self.engine = engine
        self.rfd = rfd
        self.wfd = wfd

    def send(self, kind: Kind, req_id: int, payload: Any) -> None:
        write_frame(self.wfd, pack(kind, req_id, payload))

    def run(self) -> int:
        while True:
            try:
                kind, req_id, payload = read_frame(self.rfd)
            except PeerClosed:
                return 0  # the parent closed our request pipe: it is done with us, or dead
            except ProtocolError as exc:
                print(f"[worker] [crash] unreadable request: {exc}", file=sys.stderr, flush=True)
                return 70
            if kind == Kind.SHUTDOWN:
                return 0
            if kind != Kind.REQUEST:
                print(f"[worker] ignoring frame kind {kind.name}", file=sys.stderr, flush=True)
                continue
            self.handle(req_id, payload)

    def handle(self, req_id: int, payload: Any) -> None:
        def emit(event: dict[str, Any]) -> None:
            self.send(Kind.EVENT, req_id, event)

        try:
            op, args = _parse_request(payload)
            result = HANDLERS[op](self.engine, args, req_id, emit)
            # Packed here, so that a result too big for one frame (or not msgpack-able) fails this
            # request instead of the worker.
            frame = pack(Kind.RESPONSE, req_id, result)
        except (BrokenPipeError, PeerClosed, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # every request failure becomes an ERROR frame
            self.send(Kind.ERROR, req_id, error_payload(exc, traceback.format_exc()))
            return
        write_frame(self.wfd, frame)
