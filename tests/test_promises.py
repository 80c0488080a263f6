"""Promises that small planted bugs used to slip past: each test here fails when the promise it names is
broken (process lifecycle, hardening, shared-memory reuse, error plumbing, callbacks, sampling). Real
workers and real models throughout; only the protocol tests (unit/test_frames_from_a_worker.py) use a fake worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import psutil
import pytest
from procs import FAULTS, all_end, ended

from lloyal_pool import (
    Context,
    ContextError,
    Model,
    Pool,
    PoolClosedError,
    SamplerParams,
    StaleHandleError,
    StopReason,
    WorkerCrashedError,
    _process,
)
from lloyal_pool import protocol as p
from lloyal_pool.errors import BranchError

T = TypeVar("T")
PATIENCE = 60.0  # a guard against hanging forever, never a timing assertion


def within(fn: Callable[[], T], patience: float = PATIENCE) -> T:
    """fn() on a thread of its own: its result, or a test failure (not a hung suite) if it never returns."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("error", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(patience)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} hung (no return within {patience:g}s)")
    kind, value = out[0]
    if kind == "error":
        raise value
    return value  # type: ignore[no-any-return]


@pytest.fixture
def tctx(tiny: Model) -> Iterator[Context]:
    ctx = tiny.new_context(n_ctx=4096)
    yield ctx
    ctx.close()


# -- interrupt ------------------------------------------------------------------------------------------
def test_interrupt_stops_the_oldest_request_in_flight_not_a_queued_one(tctx: Context) -> None:
    running = tctx.stream("Count:", n_predict=0, ignore_eos=True)  # until the context is full
    queued = tctx.generate_async("Hello", n_predict=8, ignore_eos=True)
    next(running)  # generating now; `queued` waits behind it in the worker
    tctx.interrupt()
    assert running.future.result(timeout=PATIENCE).stop_reason is StopReason.INTERRUPTED
    after = queued.result(timeout=PATIENCE)
    assert after.stop_reason is StopReason.LENGTH and after.n_decoded == 8


def test_a_request_interrupted_while_being_sent_takes_no_later_interrupt(tiny_model: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C while a decoding request is written to the pipe (a large frame blocks there while the worker is
    # busy) comes after its id was put in the context's list of requests in flight: left at its head, it
    # would take every later interrupt() of the context.
    def interrupted(fd: int, data: memoryview) -> int:
        raise KeyboardInterrupt

    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=4096)
        with monkeypatch.context() as m:
            m.setattr(_process, "_pipe_write", interrupted)
            with pytest.raises(KeyboardInterrupt):
                ctx.generate("Hello", n_predict=4)
        # Never sent, so not pending either: a pending id would have the hang watch kill the idle worker.
        assert not pool[0]._proc._pending
        running = ctx.stream("Count:", n_predict=0, ignore_eos=True)
        next(running)
        ctx.interrupt()
        assert running.future.result(timeout=PATIENCE).stop_reason is StopReason.INTERRUPTED


def test_a_request_interrupted_halfway_through_its_frame_is_still_sent_whole(tiny_model: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C after part of a frame went into the pipe: the rest must follow, or the worker would misread
    # every later frame. The request then runs, and the context keeps serving.
    import os

    calls = []

    def part_then_interrupt(fd: int, data: memoryview) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return os.write(fd, data[:8])
        raise KeyboardInterrupt

    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=256)
        with monkeypatch.context() as m:
            m.setattr(_process, "_pipe_write", part_then_interrupt)
            with pytest.raises(KeyboardInterrupt):
                ctx.generate("Hello", n_predict=4)
        assert len(calls) == 2
        assert ctx.generate("Hello", n_predict=4).n_decoded == 4
        assert pool[0].alive
        deadline = time.monotonic() + PATIENCE
        while pool[0]._proc._pending and time.monotonic() < deadline:  # the orphan's reply comes in too
            time.sleep(0.01)
        assert not pool[0]._proc._pending


# -- process lifecycle ----------------------------------------------------------------------------------
_BUSY_PARENT = textwrap.dedent("""
    import sys, threading
    from lloyal_pool import Pool
    pool = Pool(1)
    ctx = pool[0].load_model(sys.argv[1]).new_context(n_ctx=4096)
    started = threading.Event()
    # Minutes of decoding that write nothing to the pipes (no pieces streamed) once the prompt is in:
    # the worker neither reads its request pipe nor meets a broken reply pipe meanwhile.
    fut = ctx.generate_async("Count:", n_predict=0, ignore_eos=True,
                             progress=lambda done, total: started.set() if done == total else None)
    started.wait()
    print(pool[0].pid, flush=True)
    sys.stdin.read()  # until the test kills us
""")


def test_a_busy_worker_dies_with_its_parent(tiny_model: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _BUSY_PARENT, str(tiny_model)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not ended(pid)
        parent.kill()
        parent.wait()
        assert all_end([pid], PATIENCE), f"worker {pid} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()
        if pid and not ended(pid):
            os.kill(pid, 9)


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _limit(pid: int, name: str) -> tuple[str, str]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith(name):
                soft, hard = line[len(name):].split()[:2]
                return soft, hard
    raise AssertionError(f"no {name!r} in /proc/{pid}/limits")


def test_the_hardening_is_in_effect_in_the_worker() -> None:
    cap = 3 << 30
    with Pool(1, memory_limit=cap) as pool:
        pid = pool[0].pid
        status = _status(pid)
        assert status["NoNewPrivs"].strip() == "1"
        assert status["Umask"].strip() == "0077"
        assert _limit(pid, "Max core file size") == ("0", "0")
        assert _limit(pid, "Max data size") == (str(cap), str(cap))
    with Pool(1) as pool:  # no cap unless asked for
        assert _limit(pool[0].pid, "Max data size") == _limit(os.getpid(), "Max data size")


def test_a_worker_started_from_a_short_lived_thread_outlives_it(tiny_model: Path) -> None:
    made: list[Pool] = []
    t = threading.Thread(target=lambda: made.append(Pool(1)))
    t.start()
    t.join()
    pool = made[0]
    try:
        # The parent-death signal fires when the thread that spawned a worker ends: had this thread
        # spawned it, the worker would be dead by now.
        assert pool[0].ping(timeout=PATIENCE) > 0
        replaced: list[Any] = []
        t = threading.Thread(target=lambda: replaced.append(pool.replace(0)))
        t.start()
        t.join()
        assert pool[0].load_model(tiny_model).new_context(n_ctx=64).generate("Hi", n_predict=2).n_decoded == 2
        assert pool[0].alive and replaced[0] is pool[0]
    finally:
        pool.close()


def test_close_ends_the_workers_children_and_removes_its_directory() -> None:
    pool = Pool(1, env=FAULTS)
    try:
        pid = pool[0].pid
        cwd = os.readlink(f"/proc/{pid}/cwd")
        assert os.path.isdir(cwd) and os.path.dirname(cwd) == pool.temp_dir
        child = pool[0].fault("fork", seconds=3600).result(timeout=PATIENCE)["pid"]
        assert child in {c.pid for c in psutil.Process(pid).children()}
    finally:
        within(pool.close)
    assert all_end([pid, child]), "close() left a process behind"  # SIGKILLed: at most unmapping
    assert not os.path.exists(cwd), "close() left the worker's directory behind"
    assert not os.path.exists(os.path.dirname(cwd)), "close() left the pool's directory behind"


def test_calls_in_flight_at_close_get_pool_closed_error(tiny_model: Path) -> None:
    pool = Pool(1, env=FAULTS)
    try:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=4096)
        stream = ctx.stream("Count:", n_predict=0, ignore_eos=True)
        next(stream)
        hang = pool[0].fault("hang", seconds=3600)  # queued behind the generation
    finally:
        within(lambda: pool.close(timeout=0.5))
    for fut in (stream.future, hang):
        with pytest.raises(PoolClosedError):
            fut.result(timeout=PATIENCE)
    with pytest.raises(PoolClosedError):
        list(stream)


def test_a_stream_whose_worker_dies_raises(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=4096)
        stream = ctx.stream("Count:", n_predict=0, ignore_eos=True)
        next(stream)
        pool[0].kill()
        with pytest.raises(WorkerCrashedError, match="SIGKILL"):
            within(lambda: list(stream))


# -- user callbacks -------------------------------------------------------------------------------------
class Boom(Exception):
    pass


def _boom(*_: object) -> None:
    raise Boom("from a user callback")


def test_a_load_progress_callback_that_raises_reaches_the_caller(pool: Pool, tiny_model: Path) -> None:
    with pytest.raises(Boom):
        within(lambda: pool[1].load_model(tiny_model, progress=_boom))
    # Nothing hangs and nothing leaks: the worker serves on, and the model it loaded anyway was freed.
    assert pool[1].ping(timeout=PATIENCE) > 0
    model = pool[1].load_model(tiny_model)
    model.close()


def test_load_progress_delivers_intermediate_events(pool: Pool, gemma_path: Path) -> None:
    seen: list[float] = []
    model = pool[0].load_model(gemma_path, progress=seen.append)
    model.close()
    assert seen[-1] == 1.0 and seen == sorted(seen)
    assert len([f for f in seen if 0.0 < f < 1.0]) >= 5, seen


def test_an_on_piece_callback_that_raises_reaches_the_caller_and_stops_the_generation(tctx: Context) -> None:
    pieces: list[str] = []

    def on_piece(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            raise Boom("enough")

    with pytest.raises(Boom, match="enough"):
        within(lambda: tctx.generate("Count:", n_predict=0, ignore_eos=True, on_piece=on_piece))
    assert len(pieces) == 3  # not called again after it raised
    assert len(tctx.tokens()) < tctx.n_ctx  # stopped, not run on until the context was full
    assert tctx.generate("Hi", n_predict=2).n_decoded == 2
    with pytest.raises(Boom):
        within(lambda: tctx.generate("Count:", n_predict=4, progress=_boom))
    assert tctx.generate("Hi", n_predict=2).n_decoded == 2


# -- shared-region reuse --------------------------------------------------------------------------------
def test_a_thousand_contexts_and_branches_come_and_go(tiny: Model) -> None:
    for _ in range(1000):
        tiny.new_context(n_ctx=16, n_batch=16).close()
    ctx = tiny.new_context(n_ctx=64, n_seq_max=2)
    try:
        root = ctx.branch([1, 2, 3])
        for i in range(1000):
            child = root.fork()
            if i % 2:
                child.prune()
            else:
                child.set_logits(root.logits)
                child.prune()
        assert len(ctx.branches) == 1 and ctx.branches.available() == 1
    finally:
        ctx.close()


# -- handles --------------------------------------------------------------------------------------------
def test_the_worker_refuses_a_branch_handle_of_another_context(tiny: Model) -> None:
    a = tiny.new_context(n_ctx=64, n_seq_max=2)
    b = tiny.new_context(n_ctx=64, n_seq_max=2)
    try:
        mine = a.branch([1, 2])
        mine.prune()  # a's first slot moves on to its next generation: b's first handle is none of a's
        theirs = b.branch([1, 2])
        live = a.branch([1, 2])
        assert theirs.handle != live.handle
        # The client refuses it before sending anything ...
        with pytest.raises(BranchError):
            live.merge_logits([theirs], 0.5)
        # ... and so does the worker, sent the raw requests the client would not send.
        link = a._link
        for req in (p.BranchInfoRequest(context=a.handle, branch=theirs.handle),
                    p.Produce(context=a.handle, branches=[theirs.handle]),
                    p.BranchMergeLogits(context=a.handle, branch=live.handle, experts=[theirs.handle], alpha=0.5),
                    p.BranchPrune(context=a.handle, branch=theirs.handle)):
            with pytest.raises(StaleHandleError):
                link.call(req).result(timeout=PATIENCE)
        assert theirs.info().position == 2 and live.info().position == 2  # both untouched
    finally:
        a.close()
        b.close()


# -- samplers -------------------------------------------------------------------------------------------
# Five candidates with known probabilities; every other token far below (exp(-60) next to them).
CANDIDATES = np.array([10, 20, 30, 40, 50])
PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
DRAWS = 300


@pytest.fixture
def sampled(tiny: Model) -> Iterator[Callable[..., Counter[int]]]:
    ctx = tiny.new_context(n_ctx=64, n_seq_max=2)
    root = ctx.branch([1, 2, 3])

    def draws(n: int = DRAWS, probs: np.ndarray = PROBS, **params: Any) -> Counter[int]:
        """How often each token is drawn from logits whose softmax over CANDIDATES is probs."""
        b = root.fork()
        try:
            logits = np.full(tiny.n_vocab, -60.0, dtype=np.float32)
            logits[CANDIDATES] = np.log(probs)
            b.set_logits(logits)
            b.set_sampler_params(SamplerParams(**params))
            return Counter(b.produce().token for _ in range(n))
        finally:
            b.prune()

    yield draws
    ctx.close()


def test_each_sampler_changes_the_distribution_as_it_should(sampled: Callable[..., Counter[int]]) -> None:
    top = int(CANDIDATES[0])
    # Greedy: the argmax every time. The draws advance the PRNG: a seeded chain draws every candidate.
    assert sampled(n=20) == Counter({top: 20})
    free = sampled(temperature=1.0, seed=1)
    assert set(free) == set(CANDIDATES.tolist())
    assert abs(free[top] / DRAWS - 0.4) < 0.1  # the softmax, roughly
    # Temperature: colder sharpens, hotter flattens.
    assert sampled(temperature=0.3, seed=1)[top] > free[top] > sampled(temperature=3.0, seed=1)[top]
    # Truncation: top-k keeps k, top-p the smallest head reaching p, min-p those above p * the top's.
    assert set(sampled(temperature=1.0, top_k=2, seed=1)) == {10, 20}
    assert set(sampled(temperature=1.0, top_p=0.6, seed=1)) == {10, 20}
    assert set(sampled(temperature=1.0, min_p=0.3, seed=1)) == {10, 20, 30}
    assert set(sampled(temperature=1.0, typical_p=0.2, seed=1)) < set(CANDIDATES.tolist())
    # XTC, always on: every candidate above the threshold but the least likely of them is removed.
    assert set(sampled(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.12, seed=1)) == {30, 40, 50}
    # The seed: the same seed replays the same draws, another one differs.
    assert sampled(temperature=1.0, seed=1) == free and sampled(temperature=1.0, seed=2) != free


def test_penalties_push_down_tokens_already_chosen(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=64, n_seq_max=2)
    try:
        root = ctx.branch([1, 2, 3])
        root.commit(10)
        root.commit(10)

        def greedy_pick(**params: Any) -> int:
            b = root.fork()
            try:
                logits = np.full(tiny.n_vocab, -60.0, dtype=np.float32)
                logits[[10, 20]] = [2.0, 1.5]  # 10 leads, narrowly
                b.set_logits(logits)
                b.set_sampler_params(SamplerParams(repeat_last_n=16, **params))
                return b.produce().token
            finally:
                b.prune()

        assert greedy_pick() == 10
        assert greedy_pick(repeat_penalty=1.5) == 20  # 2.0 / 1.5 < 1.5
        assert greedy_pick(presence_penalty=1.0) == 20  # 2.0 - 1.0 < 1.5
        assert greedy_pick(frequency_penalty=0.3) == 20  # 2.0 - 2 * 0.3 < 1.5
        assert greedy_pick(frequency_penalty=0.2) == 10  # 2.0 - 2 * 0.2 > 1.5: it counts occurrences
    finally:
        ctx.close()


def test_a_branch_progress_callback_that_raises_leaves_no_branch_behind(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=256, n_batch=16, n_ubatch=16, n_seq_max=2)
    try:
        prompt = list(range(100, 164))  # four micro-batches: four progress events
        for when in ("first", "last") * 3:  # more creations than the context has sequences
            def fail(done: int, total: int, when: str = when) -> None:
                if when == "first" or done == total:
                    raise Boom(when)

            with pytest.raises(Boom, match=when):
                within(lambda fail=fail: ctx.branch(prompt, progress=fail))  # type: ignore[misc]
            # A branch made before the interrupt landed is pruned on a thread of its own: wait for it. That
            # thread forgets the branch once the prune's reply is in, which can be after a later call's reply
            # (available()) reached this one: wait for both.
            deadline = time.monotonic() + PATIENCE
            while (ctx.branches.available() != 2 or len(ctx.branches)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ctx.branches.available() == 2 and len(ctx.branches) == 0
        assert ctx.branch(prompt).position == len(prompt)
    finally:
        ctx.close()


def test_a_worker_holds_512_contexts_and_refuses_the_513th(tiny_model: Path) -> None:
    """The README's limit per worker, with a region sized for the rows (lloyal_pool.shm_bytes_for)."""
    from lloyal_pool import shm_bytes_for

    with Pool(1, shm_bytes=shm_bytes_for(32000, 513)) as pool:
        model = pool[0].load_model(tiny_model)
        assert model.n_vocab <= 32000
        contexts = [model.new_context(n_ctx=16, n_batch=16, n_ubatch=16) for _ in range(512)]
        with pytest.raises(ContextError, match="a worker holds at most 512 contexts"):
            model.new_context(n_ctx=16)
        contexts.pop().close()
        assert model.new_context(n_ctx=16).generate("Hi", n_predict=1).n_decoded == 1
