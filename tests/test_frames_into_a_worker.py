"""The protocol under arbitrary input into a worker (property-based, hypothesis): a real worker answers
every request frame, whatever its payload, with exactly one RESPONSE or ERROR for its id and serves on; a
frame that does not decode, or one of a kind only a worker sends, ends it with exit code 70 and the
violation named on stderr, never a signal or a hang. The other direction, from a worker, is
tests/unit/test_frames_from_a_worker.py.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from fuzzing import FUZZ, LEN, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lloyal_pool import protocol as p
from lloyal_pool.protocol import MAX_FRAME, PROTOCOL_VERSION, Kind, pack, read_frame, write_frame
from lloyal_pool.shm import Region
from lloyal_pool.worker.loop import PROTOCOL_VIOLATION_EXIT

PATIENCE = 60.0  # a guard against hanging forever, never a timing assertion


class RawWorker:
    """A real worker process on pipes of our own: frames go in as they are, replies are read raw."""

    def __init__(self) -> None:
        self.region = Region.create(16 << 20, backend="memfd")
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        cmd = [sys.executable, "-I", "-m", "lloyal_pool.worker", "--fds", f"{req_r},{rep_w}",
               "--shm", self.region.spec.to_arg(), "--parent-pid", str(os.getpid()), "--no-sandbox"]
        self.proc = subprocess.Popen(cmd, pass_fds=[req_r, rep_w, self.region.spec.fd], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self.stderr, env={}, start_new_session=True)
        os.close(req_r)
        os.close(rep_w)
        self.region.close_fd()
        kind, _, hello = self.read()
        assert kind == Kind.HELLO and hello["protocol"] == PROTOCOL_VERSION

    def read(self) -> tuple[Kind, int, Any]:
        ready, _, _ = select.select([self.rep_r], [], [], PATIENCE)
        if not ready:
            pytest.fail("the worker sent nothing")
        return read_frame(self.rep_r)

    def send(self, data: bytes) -> None:
        write_frame(self.req_w, data)

    def answer(self, req_id: int) -> tuple[Kind, Any]:
        """The RESPONSE or ERROR for req_id (after any EVENTs for it)."""
        while True:
            kind, got_id, payload = self.read()
            assert got_id == req_id, (kind, got_id, payload)
            if kind != Kind.EVENT:
                assert kind in (Kind.RESPONSE, Kind.ERROR)
                return kind, payload

    def exit_code(self) -> int:
        try:
            return self.proc.wait(timeout=PATIENCE)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker did not exit")

    def stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def close(self) -> None:
        os.close(self.req_w)
        self.proc.kill()
        self.proc.wait()
        os.close(self.rep_r)
        self.stderr.close()
        self.region.close()


@pytest.fixture(scope="module")
def raw_worker() -> Iterator[RawWorker]:
    w = RawWorker()
    yield w
    w.close()


def _request_shaped(op: p.Op, fields: dict[str, Any]) -> list[Any]:
    return [op.value, fields]


FIELD_NAMES = sorted({f for cls in p.REQUESTS.values() for f in cls.__struct_fields__})
requests = values | st.builds(_request_shaped, st.sampled_from(list(p.Op)), st.dictionaries(
    st.sampled_from(FIELD_NAMES), st.integers(-2, 2**33) | st.text(max_size=12) | values, max_size=5))


@FUZZ
@given(req_id=st.integers(0, 2**63 - 1), payload=requests)
def test_arbitrary_requests_get_one_answer_and_the_worker_serves_on(raw_worker: RawWorker, req_id: int,
                                                                    payload: Any) -> None:
    raw_worker.send(pack(Kind.REQUEST, req_id, payload))
    kind, answer = raw_worker.answer(req_id)
    if kind == Kind.ERROR:
        assert isinstance(answer["type"], str) and isinstance(answer["message"], str)
    raw_worker.send(pack(Kind.REQUEST, 7, p.request_payload(p.Ping())))
    assert raw_worker.answer(7)[0] == Kind.RESPONSE


def _raw_frame(kind: int, req_id: int, payload: Any) -> bytes:
    body = msgspec.msgpack.encode([kind, req_id, payload])
    return LEN.pack(len(body)) + body


unreadable = (st.builds(lambda b: LEN.pack(len(b) + 1) + b"\xc1" + b, st.binary(max_size=16))
              | st.builds(_raw_frame, st.sampled_from([Kind.HELLO, Kind.RESPONSE, Kind.ERROR, Kind.EVENT]),
                          st.integers(0, 9), values)
              | st.builds(_raw_frame, st.integers(7, 200) | st.text(max_size=3), st.integers(0, 9), values)
              | st.builds(_raw_frame, st.just(Kind.REQUEST), st.text(max_size=3) | st.floats(), values)
              | st.just(LEN.pack(MAX_FRAME + 1)))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=unreadable)
def test_a_frame_a_worker_cannot_take_ends_it_as_a_reported_violation(data: bytes) -> None:
    w = RawWorker()
    try:
        w.send(data)
        assert w.exit_code() == PROTOCOL_VIOLATION_EXIT
        assert "[worker] [crash] protocol violation" in w.stderr_text()
    finally:
        w.close()
