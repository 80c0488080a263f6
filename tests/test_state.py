"""Whole-context state: Context.save_state / load_state (bytes, through a transfer memfd) and the file
variants, restored in another worker process, and every way a state can be refused."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lloyal_pool import (
    ContextError,
    ContextOverflowError,
    Model,
    Pool,
    StaleHandleError,
    StateError,
    WorkerCrashedError,
)
from lloyal_pool.client import Context

PROMPT = ("The printing press was invented in the fifteenth century. Before it, books were copied by hand, "
          "which made them rare and expensive. Within a few decades of its invention, printed books spread "
          "across Europe, and the price of knowledge fell. Historians still argue about which of its effects "
          "mattered most:")


@pytest.fixture(scope="module")
def other(gemma_path: Path) -> Iterator[Model]:
    """Gemma in a worker of another Pool: another process than the one that saves."""
    with Pool(1) as pool:
        yield pool[0].load_model(gemma_path)


def greedy(ctx: Context, n: int = 12) -> tuple[list[int], int]:
    """The greedy continuation of what ctx holds, as a cache_prompt generate of its whole history."""
    r = ctx.generate(ctx.tokens(), n_predict=n, temperature=0.0, cache_prompt=True)
    return r.tokens, r.n_cached


def snapshot(ctx: Context) -> tuple[list[int], np.ndarray]:
    return ctx.tokens(), ctx.logits(copy=True)


def test_state_bytes_restore_in_another_pool_generates_the_same(gemma: Model, other: Model) -> None:
    src = gemma.new_context(n_ctx=512, n_batch=16, n_ubatch=16)
    src.eval(PROMPT)
    history, logits = snapshot(src)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    data = src.save_state()
    assert data[:8] == b"LLOYALST"

    dst = other.new_context(n_ctx=512, n_batch=16, n_ubatch=16)
    assert dst.load_state(data) == len(history)
    assert dst.instance.pid != src.instance.pid
    assert dst.tokens() == history
    assert np.array_equal(dst.logits(), logits)  # the last position's logits travel with the state
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) == shm_before  # the transfer left nothing behind

    want, cached_src = greedy(src)
    got, cached_dst = greedy(dst)
    assert got == want
    # The restored history is the prompt and its logits came along: all of it is reused, nothing decoded.
    assert cached_dst == cached_src == len(history)


def test_state_file_round_trip(gemma: Model, other: Model, tmp_path: Path) -> None:
    src = gemma.new_context(n_ctx=512)
    src.eval(PROMPT)
    src.generate(src.tokens(), n_predict=5, temperature=0.0, cache_prompt=True)  # generated tokens too
    path = tmp_path / "ctx.state"
    n = src.save_state_file(path)
    assert path.stat().st_size == n
    assert not [p for p in tmp_path.iterdir() if p.name != "ctx.state"]  # no temporary left

    dst = other.new_context(n_ctx=1024)  # a larger context takes it too
    assert dst.load_state_file(path) == len(src.tokens())
    assert dst.tokens() == src.tokens()
    assert greedy(dst) == greedy(src)


def test_load_replaces_what_the_context_held(gemma: Model) -> None:
    src = gemma.new_context(n_ctx=256)
    src.eval("Once upon a time")
    data = src.save_state()
    dst = gemma.new_context(n_ctx=256)
    dst.eval("Something else entirely, and longer than the other prompt")
    dst.load_state(data)
    assert dst.tokens() == src.tokens()
    assert greedy(dst) == greedy(src)


def _unchanged_after(ctx: Context, twin: Context, action: type[Exception], fn: object) -> None:
    """fn() raises action; ctx then holds and generates exactly what its twin (same prompt) does."""
    tokens, logits = snapshot(ctx)
    with pytest.raises(action):
        fn()  # type: ignore[operator]
    assert ctx.tokens() == tokens
    assert np.array_equal(ctx.logits(), logits)
    assert greedy(ctx) == greedy(twin)


def _pair(model: Model, n_ctx: int = 512, **params: object) -> tuple[Context, Context]:
    a = model.new_context(n_ctx=n_ctx, **params)
    b = model.new_context(n_ctx=n_ctx, **params)
    a.eval(PROMPT)
    b.eval(PROMPT)
    return a, b


def test_bad_states_are_refused_and_leave_the_context_serving(gemma: Model, tmp_path: Path) -> None:
    src = gemma.new_context(n_ctx=512)
    src.eval("A short history")
    data = src.save_state()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    ctx, twin = _pair(gemma)
    for bad in (b"", b"garbage", bytes(4096), os.urandom(70000), data[: len(data) // 2], data[:255], bytes(flipped),
                data + b"\0"):
        _unchanged_after(ctx, twin, StateError, lambda bad=bad: ctx.load_state(bad))
    missing = tmp_path / "missing.state"
    _unchanged_after(ctx, twin, StateError, lambda: ctx.load_state_file(missing))
    _unchanged_after(ctx, twin, StateError, lambda: ctx.load_state_file(tmp_path))  # a directory


def test_a_state_of_another_model_is_refused(gemma: Model, tiny: Model) -> None:
    small = tiny.new_context(n_ctx=128)
    small.eval("hello world")
    data = small.save_state()
    ctx, twin = _pair(gemma)
    with pytest.raises(StateError, match="another model"):
        ctx.load_state(data)
    _unchanged_after(ctx, twin, StateError, lambda: ctx.load_state(data))
    # and the other way round, in the tiny model's worker
    big = gemma.new_context(n_ctx=256)
    big.eval("hello world")
    with pytest.raises(StateError, match="another model"):
        small.load_state(big.save_state())
    assert small.tokens() == tiny.tokenize("hello world")


def test_a_state_longer_than_n_ctx_is_refused(gemma: Model) -> None:
    src = gemma.new_context(n_ctx=512)
    src.eval(PROMPT)
    data = src.save_state()
    n = len(src.tokens())
    assert n > 32
    small = gemma.new_context(n_ctx=32)
    small.eval("Short")
    before = small.tokens()
    with pytest.raises(ContextOverflowError):
        small.load_state(data)
    assert small.tokens() == before
    fits = gemma.new_context(n_ctx=n)  # exactly enough
    assert fits.load_state(data) == n


def test_a_state_llama_cpp_refuses_puts_the_old_state_back(gemma: Model) -> None:
    # Another cache type passes our checks (same model) but not llama.cpp's: it clears the cache before
    # it refuses, and the context must get its own state back.
    src = gemma.new_context(n_ctx=512, type_k="q8_0")
    src.eval("The same model, another cache type")
    data = src.save_state()
    ctx, twin = _pair(gemma)
    _unchanged_after(ctx, twin, StateError, lambda: ctx.load_state(data))
    empty = gemma.new_context(n_ctx=512)
    with pytest.raises(StateError):
        empty.load_state(data)
    assert empty.tokens() == []


def test_state_needs_a_plain_history(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256, n_seq_max=2)
    with pytest.raises(ContextError, match="nothing to save"):
        ctx.save_state()
    src = gemma.new_context(n_ctx=256)
    src.eval("Hello")
    data = src.save_state()
    ctx.branch("Hello there")
    with pytest.raises(ContextError, match="branches"):
        ctx.save_state()
    with pytest.raises(ContextError, match="branches"):
        ctx.load_state(data)
    ctx.reset()
    assert ctx.load_state(data) == len(src.tokens())
    assert ctx.instance.ping() >= 0


def _transfer_fds() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "lloyal_pool_state" in os.readlink(f"/proc/self/fd/{fd}"):
                found.add(fd)
        except OSError:
            pass
    return found


def _state_call(ctx: Context, op: str, data: bytes, outcome: list[BaseException | None]) -> None:
    try:
        if op == "load":
            ctx.load_state(data)
        else:
            ctx.save_state()
        outcome.append(None)
    except BaseException as exc:
        outcome.append(exc)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the memfd transfer is Linux's")
def test_a_worker_dying_midway_leaves_nothing_behind(fresh_pool: Pool, gemma_path: Path, gemma: Model) -> None:
    src = gemma.new_context(n_ctx=256)
    src.eval("Hello there")
    data = src.save_state()
    ctx = fresh_pool[0].load_model(gemma_path).new_context(n_ctx=256)
    ctx.eval("Hello there")
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not _transfer_fds()
    for op in ("load", "save"):
        fresh_pool[0].fault("hang", seconds=120)  # the worker is stuck: the state call waits behind it
        outcome: list[BaseException | None] = []
        t = threading.Thread(target=_state_call, args=(ctx, op, data, outcome))
        t.start()
        # A Landlock-confined worker's transfers go through the one memfd it made (shm.WorkerTransfer),
        # which the parent holds while a transfer is on; an unconfined one's through a fresh memfd.
        shared = fresh_pool[0]._proc._transfer
        while not (shared.lock.locked() if shared is not None else _transfer_fds()):
            assert t.is_alive()  # the parent made or took its transfer file: now the worker dies
            time.sleep(0.005)
        fresh_pool[0].kill()
        t.join()
        assert isinstance(outcome[0], (WorkerCrashedError, StaleHandleError))
        # The caller hears of the death at once; the thread that ran the transfer lets go of its file
        # as it unwinds, a moment later.
        deadline = time.monotonic() + 30.0  # a guard, never a timing assertion
        while _transfer_fds() or (shared is not None and os.fstat(shared._fd).st_size):
            assert time.monotonic() < deadline, "a transfer file outlived the worker's death"
            time.sleep(0.01)
        if os.path.isdir("/dev/shm"):
            assert set(os.listdir("/dev/shm")) == shm_before
        ctx = fresh_pool.replace(0).load_model(gemma_path).new_context(n_ctx=256)
        if shared is not None:
            assert shared._fd == -1  # closed with its worker
        ctx.eval("Hello there")
    assert ctx.load_state(data) == len(src.tokens())  # a fresh worker takes it
