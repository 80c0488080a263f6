"""A worker that dies takes nothing else down: typed errors naming the cause, the other worker keeps
serving, a replacement starts, and close() leaves no process and no shared memory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from procs import FAULTS, PATIENCE, all_end

from lloyal_pool import Pool, ProtocolError, StaleHandleError, WorkerCrashedError, WorkerStartupError
from lloyal_pool._launch import ABORT_MARKER


def _memfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:lloyal_pool" in os.readlink(f"/proc/self/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


def _mapped_regions() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:lloyal_pool" in line for line in f)


def test_sigkill_mid_generation(tiny_model: Path) -> None:
    before_children = {p.pid for p in psutil.Process().children(recursive=True)}
    before_shm = set(os.listdir("/dev/shm"))
    before_fds, before_maps = _memfds(), _mapped_regions()
    pool = Pool(2)
    try:
        victim, other = pool[0], pool[1]
        ctx = victim.load_model(tiny_model).new_context(n_ctx=4096)
        other_ctx = other.load_model(tiny_model).new_context(n_ctx=512)
        stream = ctx.stream("Hello", n_predict=0, ignore_eos=True)
        next(stream)  # generation is under way
        fut = stream.future
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError) as info:  # how fast: bench/, not here
            fut.result(timeout=PATIENCE)
        assert info.value.signal_name == "SIGKILL" and "SIGKILL" in str(info.value)
        assert not victim.alive
        # Its handles are stale now; the other worker answers as if nothing happened.
        with pytest.raises(StaleHandleError):
            ctx.generate("Hello", n_predict=2)
        assert other_ctx.generate("Hello", n_predict=4).n_decoded == 4
        # A replacement takes the dead worker's place.
        fresh = pool.replace(victim)
        assert fresh.alive and fresh.pid != victim.pid and pool[0] is fresh
        assert fresh.load_model(tiny_model).new_context(n_ctx=128).generate("Hi", n_predict=2).n_decoded == 2
    finally:
        pool.close()
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before_children
    assert not left, f"processes left after close(): {left}"
    assert set(os.listdir("/dev/shm")) == before_shm
    assert (_memfds(), _mapped_regions()) == (before_fds, before_maps)


def test_a_closed_worker_forgets_the_descriptors_it_closed() -> None:
    # Closed pipe ends are set to -1, so that no later path (a second close, a reader outliving its join)
    # can act on a number the process has since reused: 1, say, is stdout.
    pool = Pool(1)
    proc = pool[0]._proc
    pool.close()
    assert (proc._req_w, proc._rep_r, proc._life_w) == (-1, -1, -1)


@pytest.mark.parametrize(("kind", "signame"), [("segv", "SIGSEGV"), ("abort", "SIGABRT")])
def test_native_style_crashes_are_reported_with_the_signal(fresh_pool: Pool, kind: str, signame: str) -> None:
    with pytest.raises(WorkerCrashedError) as info:
        fresh_pool[0].fault(kind).result(timeout=10)
    assert info.value.signal_name == signame
    if kind == "segv":
        assert "Fatal Python error" in info.value.stderr_tail  # faulthandler's report reached the tail
    assert fresh_pool[1].ping(timeout=5) < 1.0


def test_a_ggml_abort_reports_what_failed(fresh_pool: Pool) -> None:
    # A real GGML_ASSERT inside the native module: the line saying what failed is in the tail and in the
    # message, not scrolled out behind backtraces.
    with pytest.raises(WorkerCrashedError) as info:
        fresh_pool[0].fault("ggml_abort").result(timeout=30)
    err = info.value
    assert err.signal_name == "SIGABRT"
    # The crash line itself names it, and it ends the tail (nothing after it can push it out).
    first = str(err).splitlines()[0]
    assert "abort_report.cpp:" in first and "GGML_ASSERT(" in first and "failed" in first, first
    last = err.stderr_tail.splitlines()[-1]
    assert "GGML_ASSERT(" in last and "failed" in last, err.stderr_tail
    assert last.startswith(ABORT_MARKER) and first.endswith(last[len(ABORT_MARKER):].strip())  # the last one
    assert fresh_pool[1].ping(timeout=5) < 1.0


def test_exit_code_is_reported(fresh_pool: Pool) -> None:
    with pytest.raises(WorkerCrashedError, match="exited with code 42; its replies pipe closed") as info:
        fresh_pool[0].fault("exit", code=42).result(timeout=10)
    assert info.value.returncode == 42


def test_a_crash_report_quotes_the_last_40_lines_of_stderr(fresh_pool: Pool) -> None:
    # 101 lines on the worker's stderr (its stdout goes there too), then it dies: the error quotes the tail,
    # the last 40 lines, ending with the last one written.
    assert fresh_pool[0].fault("stdout").result(timeout=10) == "ok"
    with pytest.raises(WorkerCrashedError) as info:
        fresh_pool[0].fault("exit", code=3).result(timeout=10)
    lines = info.value.stderr_tail.splitlines()
    assert len(lines) == 40 and lines[-1] == "print() too"
    assert lines[0] == "garbage on stdout must not reach the protocol"


def test_unexpected_worker_exception_keeps_the_worker(fresh_pool: Pool) -> None:
    from lloyal_pool import RemoteError

    with pytest.raises(RemoteError, match="RuntimeError") as info:
        fresh_pool[0].fault("raise").result(timeout=10)
    assert "an unexpected error inside the worker" in (info.value.remote_traceback or "")
    assert fresh_pool[0].alive and fresh_pool[0].ping(timeout=5) < 1.0
    # A result that cannot be sent (not msgpack, or over the frame limit) fails its request only.
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        fresh_pool[0].fault("unpackable").result(timeout=10)
    assert fresh_pool[0].alive and fresh_pool[0].ping(timeout=5) < 1.0


def test_stdout_noise_never_reaches_the_protocol(fresh_pool: Pool) -> None:
    assert fresh_pool[0].fault("stdout").result(timeout=10) == "ok"
    assert fresh_pool[0].ping(timeout=5) < 1.0


def test_calls_waiting_behind_a_hang_fail_when_it_is_killed(fresh_pool: Pool) -> None:
    hang = fresh_pool[0].fault("hang", seconds=60)
    queued = fresh_pool[0].fault("raise")
    time.sleep(0.2)
    fresh_pool[0].kill()
    for fut in (hang, queued):
        with pytest.raises(WorkerCrashedError):
            fut.result(timeout=PATIENCE)


def test_unknown_variant_falls_back_to_cpu_unless_strict(caplog: pytest.LogCaptureFixture) -> None:
    with Pool(1, variant="vulkan") as pool:
        assert pool[0].variant == "cpu"
        assert pool[0].ping(timeout=5) < 1.0
    assert any("unavailable" in r.getMessage() for r in caplog.records)
    with pytest.raises(WorkerStartupError, match="vulkan"):
        Pool(1, variant="vulkan", strict_variant=True)


def test_parent_death_takes_its_workers_along(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time\n"
        "from lloyal_pool import Pool\n"
        "pool = Pool(2)\n"
        "print(' '.join(str(i.pid) for i in pool), flush=True)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        parent.kill()
        parent.wait()
        assert all_end(pids)
    finally:
        parent.kill()


# -- close() of a worker that does not answer -----------------------------------------------------------
def _warned_after(caplog: pytest.LogCaptureFixture, start: float, text: str) -> list[float]:
    return [r.created - start for r in caplog.records if text in r.getMessage()]


def test_close_kills_a_worker_whose_pipe_is_stuck_at_half_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    # A request frame larger than the pipe's buffer blocks its sender while the worker is busy; close()
    # waits half its timeout for that write before it kills the worker. The bounds are close()'s
    # promise (half the timeout, then a kill), with seconds of slack, not a speed figure.
    import threading

    from lloyal_pool import protocol as p

    with caplog.at_level("WARNING", logger="lloyal_pool"), Pool(1, env=FAULTS) as pool:
        proc = pool[0]._proc
        pool[0].fault("hang", seconds=60)
        sender = threading.Thread(target=lambda: proc.call(p.Fault(kind="hang", arg="x" * (4 << 20))), daemon=True)
        sender.start()
        deadline = time.monotonic() + PATIENCE
        while not proc._write_lock.locked():  # the sender holds it while its frame is stuck in the pipe
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        assert sender.is_alive()
        start = time.time()
        pool[0].close(timeout=6.0)
    stuck = _warned_after(caplog, start, "a request is stuck in its pipe")
    assert len(stuck) == 1 and 2.95 <= stuck[0] <= 5.5, stuck
    assert not pool[0].alive


def test_close_of_a_busy_worker_waits_its_timeout_then_kills(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="lloyal_pool"), Pool(1, env=FAULTS) as pool:
        pool[0].fault("hang", seconds=60)
        time.sleep(0.2)  # the worker is in its hang, not reading SHUTDOWN
        start = time.time()
        pool[0].close(timeout=1.0)
    late = _warned_after(caplog, start, "did not exit within 1.0s")
    assert len(late) == 1 and 0.99 <= late[0] <= 4.0, late  # well short of the 5 s default
