"""Interrupt from another thread: a word in shared memory, no round trip, checked every token and inside
each decode step."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from lloyal_pool import ContextOverflowError, EvalResult, Model, StopReason


def test_interrupt_stops_generation_within_one_step(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=2048)
    try:
        stream = ctx.stream("Tell me a very long story.", n_predict=0, ignore_eos=True)
        first = next(iter(stream))
        assert first is not None
        time.sleep(0.3)
        t0 = time.perf_counter()
        threading.Thread(target=ctx.interrupt).start()
        for _ in stream:
            pass
        stopped = time.perf_counter() - t0
        result = stream.result
        # Token rate of this run: no more than ~one step (plus IPC) may pass between interrupt and stop.
        step = result.decode_ms / 1000.0 / max(result.n_decoded, 1)
        assert result.stop_reason is StopReason.INTERRUPTED
        assert result.interrupted
        assert stopped < 2 * step + 0.25, (stopped, step)
        n_before = result.n_prompt + result.n_decoded
        # The context is consistent afterwards: it continues from where it stopped.
        assert len(ctx.tokens()) in (n_before, n_before - 1)
        more = ctx.generate("", n_predict=4, append=True)
        assert more.n_decoded == 4
    finally:
        ctx.close()


def test_interrupt_stops_a_long_prompt_within_one_ubatch(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=8192, n_batch=8192, n_ubatch=64)
    try:
        prompt = [gemma.info.bos] + gemma.tokenize(" the quick brown fox" * 1500, add_special=False)[:7000]
        # What one ubatch costs here, deeper into the cache (where steps are slower) than the prompt gets
        # in the second before the interrupt.
        ctx.eval(prompt[:2048])
        t0 = time.perf_counter()
        ctx.eval(prompt[2048:2112])
        per_ubatch = time.perf_counter() - t0
        ctx.reset()
        fut = ctx.generate_async(prompt, n_predict=8)
        time.sleep(1.0)
        t0 = time.perf_counter()
        ctx.interrupt()
        result = fut.result(timeout=120)
        stopped = time.perf_counter() - t0
        assert result.stop_reason is StopReason.INTERRUPTED
        assert result.n_decoded == 0
        kept = ctx.tokens()
        # Whatever was kept is a prefix of the prompt and the cache agrees with it: decoding continues.
        assert len(kept) < len(prompt) and kept == prompt[:len(kept)]
        assert stopped < 2 * per_ubatch + 0.25, (stopped, per_ubatch)
        assert ctx.generate(prompt[len(kept):len(kept) + 8], n_predict=2).n_decoded == 2
    finally:
        ctx.close()


def test_interrupt_when_idle_is_a_no_op(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=128)
    try:
        ctx.interrupt()
        r = ctx.generate("Hello", n_predict=3)
        assert r.stop_reason is StopReason.LENGTH and r.n_decoded == 3
    finally:
        ctx.close()


def test_interrupt_one_context_leaves_another_running(gemma: Model, tiny: Model) -> None:
    a = gemma.new_context(n_ctx=512)
    b = tiny.new_context(n_ctx=256)
    try:
        fa = a.generate_async("Count:", n_predict=0, ignore_eos=True)
        fb = b.generate_async("Hello", n_predict=64, ignore_eos=True)
        time.sleep(0.2)
        a.interrupt()
        assert fa.result(timeout=30).stop_reason is StopReason.INTERRUPTED
        assert fb.result(timeout=30).stop_reason is StopReason.LENGTH
    finally:
        a.close()
        b.close()


def test_interrupt_is_not_held_up_by_a_large_request_stuck_behind_a_generate(gemma: Model) -> None:
    """A request larger than the pipe's buffer, sent while a generate runs on the same context, blocks
    its sender until the worker reads it. interrupt() must still stop the generate at once (it writes
    shared memory, not the pipe), and the large request is served after it."""
    ctx = gemma.new_context(n_ctx=4096)
    order: list[str] = []
    try:
        stream = ctx.stream("Count from one to one thousand:", n_predict=0, ignore_eos=True)
        next(iter(stream))  # generating: the worker reads no frame until this ends (about a minute)
        stream.future.add_done_callback(lambda _: order.append("generate"))
        big = [gemma.info.bos] * (6 << 20)  # about 6 MiB of msgpack, far past a pipe's 64 KiB
        sent: list[Future[EvalResult]] = []
        sender = threading.Thread(target=lambda: sent.append(ctx.eval_async(big)), daemon=True)
        sender.start()
        time.sleep(1.0)
        assert sender.is_alive(), "the large request should be stuck in the pipe"
        interrupted = threading.Event()
        t0 = time.perf_counter()
        threading.Thread(target=lambda: (ctx.interrupt(), interrupted.set()), daemon=True).start()
        assert interrupted.wait(5.0), "interrupt() was blocked by the request stuck in the pipe"
        assert stream.future.result(timeout=30).stop_reason is StopReason.INTERRUPTED
        assert time.perf_counter() - t0 < 5.0
        sender.join(timeout=60)
        with pytest.raises(ContextOverflowError):
            sent[0].result(timeout=60)
        order.append("eval")
        assert order == ["generate", "eval"]
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2  # and the context still serves
    finally:
        ctx.close()
