"""The protocol under arbitrary input from a worker (property-based, hypothesis): whatever frames it
writes, the parent never hangs or crashes. A frame that is malformed, of a kind a worker does not send,
for a request not in flight (never sent, or already answered), or whose payload is not what its request
declares, is a protocol violation: the worker is killed and its calls fail with WorkerCrashedError
naming the violation. A fake worker (fakeworker.py, beside this file) writes the frames, so these tests
need no native module; the other direction, into a real worker, is tests/test_frames_into_a_worker.py.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import psutil
import pytest
from fuzzing import FUZZ, LEN, values
from hypothesis import given
from hypothesis import strategies as st

from lloyal_pool import Pool, WorkerCrashedError, WorkerStartupError
from lloyal_pool import protocol as p
from lloyal_pool.errors import ProtocolError
from lloyal_pool.protocol import MAX_FRAME, PROTOCOL_VERSION

PATIENCE = 60.0  # a guard against hanging forever, never a timing assertion
PONG = {"kind": 3, "id": None, "payload": {"pid": 1}}  # the answer to the first request, a Ping
MALFORMED = {"raw": LEN.pack(3) + b"\xc1\xc1\xc1"}  # a frame whose body is not msgpack


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An executable that runs fakeworker.py (beside this file) with the arguments a worker gets."""
    exe = tmp_path_factory.mktemp("fake") / "python"
    exe.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                   "import fakeworker\nsys.exit(fakeworker.main(sys.argv[1:]))\n")
    exe.chmod(0o755)
    return exe


@contextmanager
def fake_pool(fake_python: Path, frames: list[dict[str, Any]], protocol: int = PROTOCOL_VERSION,
              script: dict[str, Any] | None = None, **options: Any) -> Iterator[Pool]:
    """A one-worker pool of the fake; ``script``: more of its script (hello, before), ``options``: Pool's."""
    with tempfile.NamedTemporaryFile(suffix=".msgpack") as f:
        f.write(msgspec.msgpack.encode({"protocol": protocol, "frames": frames, **(script or {})}))
        f.flush()
        with mock.patch.object(sys, "executable", str(fake_python)):
            pool = Pool(1, env={"LLOYAL_FAKE_SCRIPT": f.name}, **{"sandbox": False, **options})
        try:
            yield pool
        finally:
            pool.close(timeout=2.0)


def ping(pool: Pool) -> concurrent.futures.Future[Any]:
    return pool[0]._proc.call(p.Ping())


def outcome(fut: concurrent.futures.Future[Any]) -> Any:
    try:
        return fut.result(timeout=PATIENCE)
    except concurrent.futures.TimeoutError:
        pytest.fail("the call hung")
    except Exception as exc:
        return exc


def died_of_a_violation(pool: Pool) -> bool:
    proc = pool[0]._proc
    assert proc._dead_event.wait(PATIENCE), "the worker was not killed"
    return isinstance(proc._dead, WorkerCrashedError) and "protocol violation" in str(proc._dead)


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, PROTOCOL_VERSION - 1])
def test_a_worker_speaking_another_protocol_version_fails_start_up(fake_python: Path, version: int) -> None:
    # ... and is killed at once: it would otherwise go on serving requests nobody can read.
    with pytest.raises(WorkerStartupError, match=f"speaks protocol {version}.*SIGKILL"), \
            fake_pool(fake_python, [], protocol=version):
        pytest.fail("the pool started")


@pytest.mark.parametrize(("before", "named"), [
    ([], r"died during start-up \(its pipe closed\); exited with code 3"),  # not killed: it had exited
    ([MALFORMED], "died during start-up .*malformed frame"),
    ([{"kind": 4, "id": 0, "payload": {"type": "OSError", "message": "no such variant"}}],
     "OSError: no such variant"),
    ([{"kind": 3, "id": 0, "payload": {"pid": 1}}], "sent RESPONSE before HELLO"),
    ([{"kind": 5, "id": 0, "payload": {}}], "sent EVENT before HELLO"),
])
def test_a_worker_that_fails_before_its_handshake_names_the_cause(fake_python: Path, before: list[dict[str, Any]],
                                                                  named: str) -> None:
    with pytest.raises(WorkerStartupError, match=named), fake_pool(fake_python, [], script={"before": before}):
        pytest.fail("the pool started")


@pytest.mark.parametrize(("frame", "named"), [
    (MALFORMED, "died during start-up .*malformed frame"),
    ({"kind": 3, "id": 0, "payload": {"pid": 1}}, "sent RESPONSE before HELLO"),
    ({"kind": 4, "id": 0, "payload": {"type": "OSError", "message": "no such variant"}}, "OSError: no such variant"),
])
def test_a_worker_that_fails_its_handshake_is_killed(fake_python: Path, frame: dict[str, Any], named: str) -> None:
    # It lingers (waits for its pipe to close) instead of exiting: only the pool's kill ends it at once.
    with pytest.raises(WorkerStartupError, match=f"{named}.*SIGKILL"), \
            fake_pool(fake_python, [], script={"before": [frame], "linger": True}):
        pytest.fail("the pool started")


@pytest.mark.parametrize(("limit", "blamed"), [(1, True), (150 << 20, True), ((150 << 20) + (3 << 18), True),
                                               (220 << 20, False), (1 << 30, False), (None, False)])
def test_a_failed_start_blames_the_memory_cap_only_when_it_is_small(fake_python: Path, limit: int | None,
                                                                    blamed: bool) -> None:
    with pytest.raises(WorkerStartupError) as info, \
            fake_pool(fake_python, [], script={"before": []}, memory_limit=limit):
        pytest.fail("the pool started")
    assert ("likely too small" in str(info.value)) is blamed, str(info.value)
    if blamed:
        assert limit is not None and f"({round(limit / 2**20)} MiB)" in str(info.value)  # 150.75 MiB: 151


def test_the_stderr_tail_keeps_a_last_line_longer_than_the_tail_itself(fake_python: Path) -> None:
    from lloyal_pool._launch import STDERR_TAIL_BYTES

    huge = "x" * (STDERR_TAIL_BYTES + 1000)
    stderr = "".join(f"line {i}\n" for i in range(10)) + huge + "\n"
    with pytest.raises(WorkerStartupError) as info, \
            fake_pool(fake_python, [], script={"before": [], "stderr": stderr.encode()}):
        pytest.fail("the pool started")
    assert info.value.stderr_tail == huge  # the lines before it no longer fit


def tail_kept(fake_python: Path, lines: list[str]) -> list[str]:
    """The lines of its stderr tail a live fake keeps after writing ``lines`` (all read by then)."""
    with fake_pool(fake_python, [PONG], script={"stderr": ("\n".join(lines) + "\n").encode()}) as pool:
        assert isinstance(outcome(ping(pool)), p.Pong)
        proc = pool[0]._proc
        deadline = time.monotonic() + PATIENCE
        while not proc.stderr_tail(1).endswith(lines[-1]) and time.monotonic() < deadline:
            time.sleep(0.01)  # the stderr thread is still reading
        return proc.stderr_tail(len(lines)).splitlines()


@pytest.mark.parametrize("extra", [0, 1])
def test_the_stderr_tail_holds_at_most_its_bytes(fake_python: Path, extra: int) -> None:
    # Lines (newlines counted) that fill the tail exactly are all kept; one byte more and the oldest goes.
    from lloyal_pool._launch import STDERR_TAIL_BYTES

    first = "f" * (99 + extra)
    rest = ["r" * 99] * ((STDERR_TAIL_BYTES - 100) // 100)
    pad = STDERR_TAIL_BYTES - 100 - 100 * len(rest)
    lines = [first, *rest] + (["p" * (pad - 1)] if pad else [])
    assert sum(len(x) + 1 for x in lines) == STDERR_TAIL_BYTES + extra
    assert tail_kept(fake_python, lines) == (lines[1:] if extra else lines)


@pytest.mark.parametrize("marks", [1, 3])
def test_a_crash_names_the_last_abort_line_in_the_tail(fake_python: Path, marks: int) -> None:
    # One marked line (a backtrace long enough can push the report's first copy out of the tail) or
    # several: the crash message quotes the last one.
    from lloyal_pool._launch import ABORT_MARKER

    stderr = "".join(f"noise {i}\n{ABORT_MARKER} k.cpp:{i}: GGML_ASSERT(x{i}) failed\n" for i in range(marks))
    with fake_pool(fake_python, [MALFORMED],
                   script={"stderr": (stderr + "after\n").encode()}) as pool:
        time.sleep(0.2)  # the stderr thread reads the lines the fake wrote before its handshake
        err = outcome(ping(pool))
        assert isinstance(err, WorkerCrashedError), err
        assert str(err).splitlines()[0].endswith(f"k.cpp:{marks - 1}: GGML_ASSERT(x{marks - 1}) failed"), str(err)


def test_the_stderr_tail_holds_the_64_kib_the_readme_promises(fake_python: Path) -> None:
    # Lines of 63 characters take 64 bytes with their newline: exactly 1024 of them fit.
    lines = [f"{i:05d}" + "x" * 58 for i in range(1024 + 100)]
    assert tail_kept(fake_python, lines) == lines[-1024:]


def test_a_worker_that_cannot_be_spawned_leaves_nothing_behind(fake_python: Path) -> None:
    # The interpreter is gone (an uninstalled venv): Popen fails in the spawner thread, and the pipes,
    # region, directory and janitor made for the worker go with the error; the next pool starts.
    root = tempfile.gettempdir()
    fds, dirs = set(os.listdir("/proc/self/fd")), {d for d in os.listdir(root) if d.startswith("lloyal-pool-")}
    with mock.patch.object(sys, "executable", str(fake_python.parent / "no-such-python")), \
            pytest.raises(FileNotFoundError, match="no-such-python"):
        Pool(1, sandbox=False)
    assert set(os.listdir("/proc/self/fd")) == fds
    assert {d for d in os.listdir(root) if d.startswith("lloyal-pool-")} == dirs
    with fake_pool(fake_python, [PONG]) as pool:
        assert isinstance(outcome(ping(pool)), p.Pong)


def test_workers_and_the_janitor_lead_sessions_of_their_own_and_close_is_idempotent(fake_python: Path) -> None:
    import shutil

    with fake_pool(fake_python, [PONG]) as pool:
        temp, worker = pool._temp, pool[0].pid
        janitor = temp._janitor
        assert janitor is not None
        # Out of the terminal's process group: a Ctrl-C meant for the application reaches only it.
        assert os.getsid(worker) == worker and os.getsid(janitor.pid) == janitor.pid
        shutil.rmtree(pool.temp_dir)  # something cleaned /tmp under the pool: close() is not bothered
    assert temp._life_w == -1 and temp._janitor is None and janitor.returncode is not None
    fds = set(os.listdir("/proc/self/fd"))
    pool.close()
    assert set(os.listdir("/proc/self/fd")) == fds


def test_a_pool_without_a_shell_has_no_janitor_and_close_still_cleans_up(fake_python: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    popen = subprocess.Popen

    def no_shell(args: list[str], *rest: Any, **options: Any) -> Any:
        if args[0] == "/bin/sh":
            raise FileNotFoundError(2, "No such file or directory", "/bin/sh")
        return popen(args, *rest, **options)

    monkeypatch.setattr(subprocess, "Popen", no_shell)
    with caplog.at_level("WARNING", logger="lloyal_pool"), fake_pool(fake_python, [PONG]) as pool:
        assert pool._temp._janitor is None and isinstance(outcome(ping(pool)), p.Pong)
        root = pool.temp_dir
    assert not os.path.exists(root)
    assert any("no janitor for" in r.getMessage() for r in caplog.records)


def test_a_worker_that_never_shakes_hands_fails_start_up_at_its_timeout(fake_python: Path) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerStartupError, match=r"no handshake within start_timeout=1s.*SIGKILL"), \
            fake_pool(fake_python, [], script={"before": [], "linger": True}, start_timeout=1.0):
        pytest.fail("the pool started")
    assert time.monotonic() - start >= 1.0


@pytest.mark.parametrize(("box", "options", "warned"), [
    ({"writes_scoped": False}, {"sandbox": True}, "offers no Landlock; the worker runs unconfined"),
    ({"writes_scoped": True, "tcp_blocked": False, "landlock": 3}, {"sandbox": True},
     "Landlock ABI 3 cannot block TCP"),
    ({"writes_scoped": True, "tcp_blocked": False, "landlock": 3}, {"sandbox": True, "network": True}, None),
    ({"writes_scoped": True, "tcp_blocked": True, "landlock": 4}, {"sandbox": True}, None),
    ({"writes_scoped": False}, {"sandbox": False}, None),
])
def test_a_weaker_sandbox_than_asked_is_a_warning(fake_python: Path, caplog: pytest.LogCaptureFixture,
                                                  box: dict[str, Any], options: dict[str, Any],
                                                  warned: str | None) -> None:
    with caplog.at_level("WARNING", logger="lloyal_pool"), \
            fake_pool(fake_python, [PONG], script={"hello": {"sandbox": {"disabled": True, **box}}},
                      **options) as pool:
        assert isinstance(outcome(ping(pool)), p.Pong)
    startup = [r.getMessage() for r in caplog.records if "[startup]" in r.getMessage()]
    if warned is None:
        assert startup == []
    else:
        assert len(startup) == 1 and warned in startup[0], startup


@pytest.mark.parametrize(("box", "where"), [
    ({"landlock": 3, "disabled": False, "transfer_fd": 999}, "dir"),  # its memfd cannot be opened: warned
    ({"landlock": 3, "disabled": True, "transfer_fd": 999}, "memfd"),  # Landlock off: the parent's memfd
    ({"landlock": 0}, "memfd"),
    ({"landlock": 3, "disabled": False}, "dir"),  # confined, no memfd of its own offered
])
def test_a_transfer_file_is_one_the_worker_can_open(fake_python: Path, caplog: pytest.LogCaptureFixture,
                                                    box: dict[str, Any], where: str) -> None:
    from lloyal_pool.shm import TransferFile

    with caplog.at_level("WARNING", logger="lloyal_pool"), \
            fake_pool(fake_python, [], script={"hello": {"sandbox": box}}) as pool:
        proc = pool[0]._proc
        with proc.transfer() as transfer:
            assert isinstance(transfer, TransferFile)
            in_dir = os.path.dirname(transfer.path) == proc._cwd
            assert in_dir if where == "dir" else transfer.path.startswith(f"/proc/{os.getpid()}/fd/"), transfer.path
    warned = [r.getMessage() for r in caplog.records if "no transfer memfd" in r.getMessage()]
    assert len(warned) == ("transfer_fd" in box and not box["disabled"]), warned


def test_a_fallback_to_another_variant_is_a_warning(fake_python: Path, caplog: pytest.LogCaptureFixture) -> None:
    hello = {"requested_variant": "cuda", "variant": "cpu", "fallback_reason": "no CUDA driver"}
    with caplog.at_level("WARNING", logger="lloyal_pool"), fake_pool(fake_python, [], script={"hello": hello}):
        pass
    assert any("requested native variant 'cuda' unavailable, running 'cpu' (no CUDA driver)" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize(("frames", "named"), [
    ([{"kind": 3, "id": 99, "payload": {"pid": 1}}], "request 99, which is not in flight"),
    ([{"kind": 5, "id": 99, "payload": {}}], "request 99, which is not in flight"),
    ([{"kind": 3, "id": None, "payload": "not a Pong"}], "does not match its declaration"),
    ([{"kind": 4, "id": None, "payload": ["not", "a", "map"]}], "malformed ERROR payload"),
    ([{"kind": 4, "id": None, "payload": {"type": "ValueError", "message": 5}}], "malformed ERROR payload"),
    ([{"kind": 4, "id": None, "payload": {"type": 3, "message": "m"}}], "malformed ERROR payload"),
    ([{"kind": 5, "id": None, "payload": [1, 2]}], "EVENT payload"),
    ([{"kind": 1, "id": 0, "payload": {}}], "unexpected HELLO frame"),
    ([{"kind": 3, "id": "1", "payload": {"pid": 1}}], "must be integers"),
    ([MALFORMED], "malformed frame"),
    ([{"raw": LEN.pack(MAX_FRAME + 1)}], "exceeds"),
])
def test_a_protocol_violation_kills_the_worker_and_names_itself(fake_python: Path, frames: list[dict[str, Any]],
                                                                 named: str) -> None:
    with fake_pool(fake_python, frames) as pool:
        pid = pool[0].pid
        got = outcome(ping(pool))
        assert isinstance(got, WorkerCrashedError), got
        assert "protocol violation" in str(got) and named in str(got)
        assert died_of_a_violation(pool) and not pool[0].alive
        assert not psutil.pid_exists(pid)  # killed and reaped


def test_a_crash_is_logged_once_and_a_clean_close_not_at_all(fake_python: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="lloyal_pool"):
        with fake_pool(fake_python, [PONG]) as pool:
            assert isinstance(outcome(ping(pool)), p.Pong)
        assert [r for r in caplog.records if r.levelname == "ERROR"] == []
        with fake_pool(fake_python, [MALFORMED],
                       script={"stderr": b"a line of its stderr\n"}) as pool:
            pid = pool[0].pid
            got = outcome(ping(pool))
            assert died_of_a_violation(pool)
    assert "protocol violation: malformed frame" in str(got), got  # named as such, not as an unknown error
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0] == f"[crash] {str(got).splitlines()[0]}", errors
    assert errors[0].startswith(f"[crash] worker 0 (pid {pid}) killed by SIGKILL"), errors


def test_the_reader_stops_at_the_first_violation(fake_python: Path) -> None:
    # A good reply after a bad frame is not delivered: the worker that sent the bad one is not trusted.
    with fake_pool(fake_python, [{"kind": 3, "id": 99, "payload": {"pid": 1}}, PONG]) as pool:
        got = outcome(ping(pool))
        assert isinstance(got, WorkerCrashedError) and "request 99, which is not in flight" in str(got), got


def test_a_reply_the_client_cannot_take_is_a_violation_not_a_dead_reader(fake_python: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from lloyal_pool import _process

    def broken(request: object, payload: object) -> object:
        raise RuntimeError("the client cannot take this")

    monkeypatch.setattr(_process, "parse_reply", broken)
    with fake_pool(fake_python, [PONG]) as pool:
        got = outcome(ping(pool))
        assert isinstance(got, WorkerCrashedError), got
        assert "protocol violation: RuntimeError: the client cannot take this" in str(got)
        assert died_of_a_violation(pool)


def test_a_crash_recovery_that_cannot_start_fails_the_calls_and_keeps_no_one_waiting(
        fake_python: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from lloyal_pool import DeadWorkerError
    from lloyal_pool import pool as pool_module

    def broken(*args: object) -> Any:
        raise RuntimeError("no replacement today")

    monkeypatch.setattr(pool_module._Host, "replacement", broken)
    with caplog.at_level("ERROR", logger="lloyal_pool"), fake_pool(fake_python, [], recover=True) as pool:
        first = ping(pool)  # the fake leaves its first request unanswered (a ping is sent again: none comes)
        pool[0]._proc.kill()
        assert isinstance(outcome(first), WorkerCrashedError), first
        # A later call would wait for the replacement; none is coming, so it is told the worker is dead.
        ex = concurrent.futures.ThreadPoolExecutor(1)
        try:
            assert isinstance(outcome(ex.submit(pool[0].ping, 5.0)), DeadWorkerError)
        finally:
            ex.shutdown(wait=False)
    assert any("could not be replaced" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("alive_by", ["heartbeat", "callback"])
def test_a_worker_is_hung_only_once_it_shows_no_life_for_the_hang_timeout(fake_python: Path, alive_by: str) -> None:
    # For 1.5 s the worker shows life (its heartbeat moves, or the reader runs the caller's callback on
    # its EVENT, while the worker may rightly block on a full pipe); then it goes silent, unanswered.
    from lloyal_pool import WorkerHungError

    frames = [{"kind": 5, "id": None, "payload": {}}] if alive_by == "callback" else []
    with fake_pool(fake_python, frames, hang_timeout=0.5) as pool:
        proc = pool[0]._proc
        start = time.monotonic()
        if alive_by == "callback":
            first = proc.call(p.Ping(), on_event=lambda event: time.sleep(1.5))
        else:
            first = ping(pool)
            while time.monotonic() - start < 1.5:
                proc.region.beat()
                time.sleep(0.05)
        got = outcome(first)
        assert isinstance(got, WorkerHungError), got
        assert time.monotonic() - start >= 1.8  # 1.5 s of life, then the hang timeout (less a 0.125 s tick)
        assert 0.5 <= got.hung_for < 1.4, got.hung_for  # counted from the last sign of life
        assert not pool[0].alive


def test_the_hang_watch_has_stopped_when_its_stop_returns(fake_python: Path) -> None:
    with fake_pool(fake_python, [PONG], hang_timeout=0.3) as pool:
        watch = pool._watch
        assert watch is not None and watch._thread.is_alive()
        watch.stop()
        assert not watch._thread.is_alive()


def test_an_idle_worker_is_not_watched(fake_python: Path) -> None:
    with fake_pool(fake_python, [PONG], hang_timeout=0.3) as pool:
        assert isinstance(outcome(ping(pool)), p.Pong)
        time.sleep(1.0)  # nothing waits on it: silence is no hang
        assert pool[0].alive and isinstance(outcome(ping(pool)), p.Pong)


def test_a_second_reply_to_an_answered_request_is_a_violation(fake_python: Path) -> None:
    pong = {"kind": 3, "id": None, "payload": {"pid": 1}}
    with fake_pool(fake_python, [pong, pong]) as pool:
        assert isinstance(outcome(ping(pool)), p.Pong)
        assert died_of_a_violation(pool)


def _frame_item(kind: Any, req_id: Any, payload: Any) -> dict[str, Any]:
    return {"kind": kind, "id": req_id, "payload": payload}


events = st.builds(_frame_item, st.just(5), st.none(), st.dictionaries(st.text(max_size=8), values, max_size=3))
responses = st.builds(_frame_item, st.just(3), st.none(),
                      st.fixed_dictionaries({"pid": st.integers(0, 2**31)}) | values)
errors = st.builds(_frame_item, st.just(4), st.none(), st.fixed_dictionaries(
    {"type": st.sampled_from(["ValueError", "ContextError", "NoSuchError", "WorkerCrashedError"]),
     "message": st.text(max_size=20), "traceback": st.none() | st.text(max_size=20)}) | values)
anything = st.builds(_frame_item, st.integers(-1, 8) | values, st.none() | st.integers(-3, 5) | values, values)
garbage = st.builds(lambda b: {"raw": LEN.pack(len(b) + 1) + b"\xc1" + b}, st.binary(max_size=16))
frame_items = events | responses | errors | anything | garbage


def expected(frames: list[dict[str, Any]], rid: int) -> tuple[bool, str | None]:
    """(whether the frames hold a violation, how the first request, of id ``rid``, was answered before it:
    "result", "error" or None), by the protocol's rules."""
    answered = None
    for item in frames:
        if "raw" in item:
            return True, answered
        kind, req_id, payload = item["kind"], rid if item["id"] is None else item["id"], item["payload"]
        if type(kind) is not int or type(req_id) is not int or kind not in (3, 4, 5):
            return True, answered
        if req_id != rid or answered is not None:
            return True, answered  # not in flight
        if kind == 5:
            if not isinstance(payload, dict):
                return True, answered
            continue
        if kind == 3:
            try:
                p.parse_reply(p.Ping, payload)
            except ProtocolError:
                return True, answered
            answered = "result"
        elif not (isinstance(payload, dict) and isinstance(payload.get("type"), str)
                  and isinstance(payload.get("message"), str)
                  and isinstance(payload.get("traceback"), (str, type(None)))):
            return True, answered
        else:
            answered = "error"
    return False, answered


@FUZZ
@given(frames=st.lists(frame_items, min_size=1, max_size=5))
def test_arbitrary_frames_from_a_worker_never_hang_or_crash_the_parent(fake_python: Path,
                                                                       frames: list[dict[str, Any]]) -> None:
    with fake_pool(fake_python, frames) as pool:
        # Request ids are counted across the process: an id the strategy draws is in flight only if it
        # happens to be the one this ping got.
        sent: list[int] = []
        first = pool[0]._proc.call(p.Ping(), on_id=sent.append)
        violation, answered = expected(frames, sent[0])
        if answered is None and not violation:
            # Only events so far: the call is still in flight, and the worker serves the next one.
            assert isinstance(outcome(ping(pool)), p.Pong) and not first.done()
            return
        got = outcome(first)
        if answered == "result":
            assert isinstance(got, p.Pong)
        elif answered == "error":
            assert isinstance(got, Exception) and "protocol violation" not in str(got)
        else:
            assert isinstance(got, WorkerCrashedError) and "protocol violation" in str(got), got
        if violation:
            assert died_of_a_violation(pool)
        else:
            assert isinstance(outcome(ping(pool)), p.Pong) and pool[0].alive
