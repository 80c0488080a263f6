"""What a desktop app meets in the wild: hung workers, per-call timeouts, crashes that race with
replace(), deaths to be told of, and a parent that dies without closing its pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from procs import FAULTS, PATIENCE, all_end

from lloyal_pool import (
    CallTimeoutError,
    Context,
    DeadWorkerError,
    InvalidArgumentError,
    Pool,
    PoolClosedError,
    StaleHandleError,
    WorkerCrashedError,
    WorkerEvent,
    WorkerHungError,
)


@pytest.fixture
def hang_pool() -> Pool:
    with Pool(2, env=FAULTS, hang_timeout=1.0) as p:
        yield p  # type: ignore[misc]


# -- hangs -------------------------------------------------------------------------------------------
def test_a_stopped_worker_is_found_hung_killed_and_reported(hang_pool: Pool) -> None:
    victim = hang_pool[0]
    os.kill(victim.pid, signal.SIGSTOP)
    with pytest.raises(WorkerHungError, match="hung: no sign of life") as info:
        victim.ping()  # no timeout of its own: the pool's hang watch ends it
    assert info.value.hung_for >= 1.0 and info.value.signal_name == "SIGKILL"
    assert isinstance(info.value, WorkerCrashedError)
    assert all_end([victim.pid])
    assert hang_pool[1].ping(timeout=5) < 1.0


def test_a_loop_with_no_sign_of_life_is_a_hang(hang_pool: Pool) -> None:
    # The test fault sleeps in Python: like a native loop with no interrupt check, it never beats.
    stuck = hang_pool[0].fault("hang", seconds=60)
    waiting = hang_pool[0].fault("raise")  # queued behind it: fails with it
    for fut in (stuck, waiting):
        with pytest.raises(WorkerHungError):
            fut.result(timeout=10)


def test_long_work_that_beats_is_not_a_hang(gemma_path: Path) -> None:
    # Prompt decoding and generation advance the heartbeat at every interrupt check: a call far longer
    # than hang_timeout completes.
    with Pool(1, hang_timeout=1.0) as pool:
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=1024)
        t0 = time.monotonic()
        r = ctx.generate("Write a long story about a lighthouse keeper. " * 20, n_predict=160, ignore_eos=True)
        assert r.n_decoded == 160 and time.monotonic() - t0 > 2.0
        assert pool[0].alive


def test_an_idle_stopped_worker_is_not_killed_until_a_call_waits() -> None:
    with Pool(1, hang_timeout=1.0) as pool:
        os.kill(pool[0].pid, signal.SIGSTOP)
        time.sleep(2.0)
        assert pool[0].alive  # nothing waited on it
        os.kill(pool[0].pid, signal.SIGCONT)
        assert pool[0].ping(timeout=5) < 1.0


def test_a_hang_check_that_fails_for_one_worker_leaves_the_watch_over_the_others(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(now: float, hang_timeout: float) -> None:
        raise RuntimeError("this worker's check is broken")

    with Pool(2, hang_timeout=0.5) as pool:
        monkeypatch.setattr(pool[0]._proc, "check_hang", broken)  # checked first, at every tick
        os.kill(pool[1].pid, signal.SIGSTOP)
        with caplog.at_level("ERROR", logger="lloyal_pool"), pytest.raises(WorkerHungError):
            pool[1].ping(timeout=30)
        assert "hang check of worker 0 failed" in caplog.text
        assert pool[0].ping(timeout=5) < 1.0


@pytest.mark.parametrize("hang_timeout", [0.5, 30.0])
def test_an_idle_pool_with_its_hang_watch_costs_no_cpu(hang_timeout: float) -> None:
    with Pool(2, hang_timeout=hang_timeout) as pool:
        pool[0].ping()
        pool[1].ping()
        me = psutil.Process()
        before = sum(me.cpu_times()[:2])
        time.sleep(1.0)
        # The watch ticks a few times a second; a tick of 0 (a spinning thread) would burn the second whole.
        assert sum(me.cpu_times()[:2]) - before < 0.2


def test_hang_timeout_is_validated() -> None:
    for bad in (0, -1.0, "30", True):
        with pytest.raises(ValueError, match="hang_timeout"):
            Pool(1, hang_timeout=bad)  # type: ignore[arg-type]


# -- per-call timeouts -------------------------------------------------------------------------------
def test_a_generate_timeout_interrupts_and_keeps_the_partial_result(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=8192)
        with pytest.raises(CallTimeoutError, match=r"timeout=1s; it was interrupted") as info:
            ctx.generate("Hello", n_predict=0, ignore_eos=True, timeout=1.0)
        assert isinstance(info.value, TimeoutError)
        partial = info.value.result
        assert partial is not None and partial.stop_reason == "interrupted"
        # The context is free again at once.
        assert ctx.generate("Hello", n_predict=3, ignore_eos=True, timeout=30).n_decoded == 3


def test_a_stream_timeout_raises_while_iterating(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=8192)
        stream = ctx.stream("Hello", n_predict=0, ignore_eos=True, timeout=1.0)
        with pytest.raises(CallTimeoutError) as info:
            for _ in stream:
                pass
        assert info.value.result is not None and info.value.result.stop_reason == "interrupted"
        with pytest.raises(CallTimeoutError):
            stream.result  # noqa: B018 - stays timed out
        assert ctx.eval("Hi", timeout=30).n_tokens > 0


def test_a_call_within_its_timeout_returns_normally(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model, timeout=60).new_context(n_ctx=512)
        assert ctx.generate("Hi", n_predict=2, timeout=60).n_decoded == 2
        assert ctx.score("Hello there", timeout=60).n_scored > 0
        stream = ctx.stream("Hi", n_predict=3, ignore_eos=True, timeout=60)
        assert "".join(stream) == stream.result.text and stream.result.n_decoded == 3
        with pytest.raises(ValueError, match="timeout"):
            ctx.generate("Hi", n_predict=2, timeout=-1)


@pytest.mark.parametrize("timeout", [-1, -0.001, True, "5", float("nan")])
def test_a_bad_timeout_is_refused_before_anything_is_sent(tiny_model: Path, timeout: object) -> None:
    with Pool(1) as pool:
        worker = pool[0]
        model = worker.load_model(tiny_model)
        ctx = model.new_context(n_ctx=512)
        long = {"n_predict": 100_000, "ignore_eos": True}
        calls = [lambda t: worker.ping(timeout=t), lambda t: worker.load_model(tiny_model, timeout=t),
                 lambda t: ctx.generate("Hi", timeout=t, **long), lambda t: ctx.stream("Hi", timeout=t, **long),
                 lambda t: ctx.generate_with_draft("Hi", timeout=t, **long),
                 lambda t: ctx.eval("Hi " * 100, timeout=t), lambda t: ctx.score("Hi there", timeout=t),
                 lambda t: ctx.score_choices(["a", "b"], timeout=t)]
        for call in calls:
            with pytest.raises(InvalidArgumentError, match="timeout is a number of seconds"):
                call(timeout)
            assert worker._proc._pending == {}  # nothing went out to run unobserved
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2


def test_a_zero_timeout_is_a_timeout_that_has_passed_not_a_bad_value(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=512)
        for call in (lambda: ctx.generate("Hi", n_predict=2, timeout=0),
                     lambda: "".join(ctx.stream("Hi", n_predict=2, timeout=0))):
            try:
                call()
            except CallTimeoutError:
                pass  # as a rule; a reply already there when it is checked is taken
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2


def test_a_ping_timeout_is_a_lloyal_error_and_a_timeout_error() -> None:
    with Pool(1, hang_timeout=None) as pool:
        os.kill(pool[0].pid, signal.SIGSTOP)
        try:
            with pytest.raises(CallTimeoutError) as info:
                pool[0].ping(timeout=0.2)
            assert isinstance(info.value, TimeoutError)
        finally:
            os.kill(pool[0].pid, signal.SIGCONT)
        assert pool[0].ping(timeout=5) < 1.0


# -- crash reports -----------------------------------------------------------------------------------
def test_a_crash_racing_with_replace_is_a_crash_not_a_close(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=8192)
        for _ in range(3):
            fut = ctx.generate_async("Hello", n_predict=0, ignore_eos=True)
            time.sleep(0.05)
            os.kill(pool[0].pid, signal.SIGKILL)
            pool.replace(0)  # at once: the reader may not have seen the death yet
            with pytest.raises(WorkerCrashedError) as info:
                fut.result(timeout=10)
            assert not isinstance(info.value, PoolClosedError) and info.value.signal_name == "SIGKILL"
            ctx = pool[0].load_model(tiny_model).new_context(n_ctx=8192)


def test_a_worker_that_died_idle_reports_how_on_the_next_call(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=256)
        os.kill(pool[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + PATIENCE
        while pool[0].alive:  # seen dead before the next call, or that call would be in flight on it
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(WorkerCrashedError) as info:
            ctx.generate("Hi", n_predict=2)
        err = info.value
        assert isinstance(err, DeadWorkerError) and isinstance(err, StaleHandleError)
        assert err.signal_name == "SIGKILL" and "Pool.replace()" in str(err)


def test_calls_in_flight_at_close_get_pool_closed(tiny_model: Path) -> None:
    pool = Pool(1)
    ctx = pool[0].load_model(tiny_model).new_context(n_ctx=8192)
    fut = ctx.generate_async("Hello", n_predict=0, ignore_eos=True)
    time.sleep(0.1)
    pool.close(timeout=0.5)
    with pytest.raises(PoolClosedError):
        fut.result(timeout=10)


def test_subscribers_hear_of_deaths_and_replacements(hang_pool: Pool) -> None:
    events: list[WorkerEvent] = []
    got = threading.Event()

    def on_event(event: WorkerEvent) -> None:
        events.append(event)
        got.set()

    def broken(event: WorkerEvent) -> None:
        raise RuntimeError("an application's bug must not reach the pool")

    hang_pool.subscribe(broken)
    unsubscribe = hang_pool.subscribe(on_event)
    victim = hang_pool[0]
    os.kill(victim.pid, signal.SIGKILL)
    assert got.wait(PATIENCE)
    died = events[0]
    assert (died.kind, died.worker_id, died.pid) == ("died", victim.worker_id, victim.pid)
    assert died.error is not None and died.error.signal_name == "SIGKILL"
    fresh = hang_pool.replace(0)
    replaced = events[-1]
    assert (replaced.kind, replaced.instance, replaced.index) == ("replaced", fresh, 0)
    # A hang is a death too, with its own error type.
    os.kill(hang_pool[1].pid, signal.SIGSTOP)
    with pytest.raises(WorkerHungError):
        hang_pool[1].ping()
    deadline = time.monotonic() + PATIENCE
    while len(events) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert isinstance(events[2].error, WorkerHungError)
    unsubscribe()
    hang_pool[0].kill()
    time.sleep(0.5)
    assert len(events) == 3
    # close() ends workers without a "died" event.


# -- temporary directories ---------------------------------------------------------------------------
def test_close_removes_the_pool_temporary_directory() -> None:
    pool = Pool(2)
    root = pool.temp_dir
    assert sorted(n.split("-")[0] for n in os.listdir(root)) == ["worker0", "worker1"]
    pool.close()
    assert not os.path.exists(root)


def test_a_failed_pool_leaves_no_directory_descriptor_or_memfd() -> None:
    from lloyal_pool import WorkerStartupError

    before_fds = set(os.listdir("/proc/self/fd"))
    before_tmp = {n for n in os.listdir("/tmp") if n.startswith("lloyal-pool-")}
    before_children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(WorkerStartupError):
        Pool(2, variant="vulkan", strict_variant=True)
    assert {n for n in os.listdir("/tmp") if n.startswith("lloyal-pool-")} == before_tmp
    assert set(os.listdir("/proc/self/fd")) <= before_fds
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before_children


def test_a_killed_parent_leaves_no_temporary_directory(tmp_path: Path, tiny_model: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from lloyal_pool import Pool\n"
        "pool = Pool(2)\n"
        f"ctx = pool[0].load_model({str(tiny_model)!r}).new_context(n_ctx=8192)\n"
        "stream = ctx.stream('Hello', n_predict=0, ignore_eos=True)\n"
        "next(stream)\n"  # a busy worker, not only an idle one
        "print(pool.temp_dir, ' '.join(str(i.pid) for i in pool), flush=True)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        root, *pids = parent.stdout.readline().split()
        assert os.path.isdir(root) and len(pids) == 2
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(root):
            time.sleep(0.05)
        assert not os.path.exists(root)
        # the janitor can empty the directory before the kernel has finished unmapping a dying worker
        assert all_end(int(p) for p in pids)
    finally:
        parent.kill()


# -- a busy machine ----------------------------------------------------------------------------------
def _hogs() -> list[subprocess.Popen[bytes]]:
    """A busy process per usable CPU, each in a session of its own, as another desktop app would be."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in os.sched_getaffinity(0)]


def _threads_until(ctx: Context, want: int, calls: int = 10) -> list[int]:
    """n_threads of up to `calls` generations, stopping at the first that used `want` threads: the
    governor returns to the asked-for count once it sees free cores, which a machine running other work
    may take a moment to show."""
    seen: list[int] = []
    while len(seen) < calls and (not seen or seen[-1] != want):
        seen.append(ctx.generate("Hello", n_predict=16, ignore_eos=True).n_threads)
        time.sleep(0.05)
    return seen


def test_a_busy_machine_lowers_the_threads_and_a_quiet_one_restores_them(gemma_path: Path) -> None:
    with Pool(1, threads_per_worker=2) as pool:
        model = pool[0].load_model(gemma_path)
        ctx = model.new_context(n_ctx=256)
        fixed = model.new_context(n_ctx=256, adapt_threads=False)
        assert _threads_until(ctx, 2)[-1] == 2
        assert fixed.generate("Hello", n_predict=8, ignore_eos=True).n_threads == 2
        hogs = _hogs()
        try:
            busy = [ctx.generate("Hello", n_predict=16, ignore_eos=True).n_threads for _ in range(3)]
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        assert busy[-1] == 1, busy
        after = _threads_until(ctx, 2)
        assert after[-1] == 2, after


def test_a_new_context_starts_from_what_the_worker_learnt_of_the_machine(gemma_path: Path) -> None:
    # A context made while the machine is busy (a new conversation, a batcher's) computes its first decode
    # with the cap its worker's other contexts found, not with every thread asked for: on 2 busy cores
    # that first decode took 65 times as long.
    with Pool(1, threads_per_worker=2) as pool:
        model = pool[0].load_model(gemma_path)
        ctx = model.new_context(n_ctx=256)
        hogs = _hogs()
        try:
            busy = [ctx.generate("Hello", n_predict=16, ignore_eos=True).n_threads for _ in range(3)]
            assert busy[-1] == 1, busy
            fresh = model.new_context(n_ctx=256)
            t0 = time.perf_counter()
            first = fresh.eval("Hello there, how are you today?")  # one decode
            took = time.perf_counter() - t0
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        print(f"first decode of a new context on a busy machine: {took * 1000:.0f} ms, {first.n_threads} thread(s)")
        assert first.n_threads == 1
        assert _threads_until(fresh, 2)[-1] == 2  # and it goes back up with the machine


def test_a_worker_that_beat_many_times_is_still_found_hung(tiny_model: Path) -> None:
    # The heartbeat is a counter: a worker hangs once it stops changing, however high it got (past the
    # small ints Python keeps one object of), and the error says for how long it saw no change (over a
    # timeout above one second: a ratio of two clock readings, about 1.0, would not pass for a duration).
    with Pool(1, hang_timeout=1.5) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=512)
        ctx.generate("Hi", n_predict=64, ignore_eos=True)
        assert pool[0]._proc.region.heartbeat > 1000
        os.kill(pool[0].pid, signal.SIGSTOP)
        with pytest.raises(WorkerHungError) as info:
            pool[0].ping()
        assert 1.5 <= info.value.hung_for < 60.0


def test_a_process_gone_before_its_kill_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with Pool(1) as pool:
        def already_gone(self: psutil.Process) -> None:
            raise psutil.NoSuchProcess(self.pid)

        monkeypatch.setattr(psutil.Process, "kill", already_gone)
        pool[0].kill()  # every psutil kill fails as if the process had just exited: the group kill ends it
        monkeypatch.undo()
        with pytest.raises(WorkerCrashedError):
            pool[0].ping(timeout=30)


def test_close_keeps_its_timeout_when_a_request_is_stuck_in_the_pipe(gemma_path: Path) -> None:
    # A frame larger than the pipe's buffer, sent while a generate runs, blocks its sender; close() waits
    # half its timeout for that write, then kills the worker. The bound below is 2.5 timeouts, a promise
    # of close() (kill after timeout), not a speed figure.
    with Pool(1) as pool:
        model = pool[0].load_model(gemma_path)
        ctx = model.new_context(n_ctx=4096)
        stream = ctx.stream("Count from one to one thousand:", n_predict=0, ignore_eos=True)
        next(iter(stream))
        big = [model.info.bos] * (6 << 20)
        sender = threading.Thread(target=lambda: ctx.eval_async(big), daemon=True)
        sender.start()
        time.sleep(0.5)
        assert sender.is_alive()  # stuck in the pipe
        t0 = time.monotonic()
        pool[0].close(timeout=4.0)
        assert time.monotonic() - t0 < 10.0
        assert not pool[0].alive
