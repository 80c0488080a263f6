"""What a desktop app's user does to a pool under crash recovery, and what no crash may take away: a
conversation whose reply was stopped survives its worker's death (idle, or while another conversation
generates), with and without spares and checkpoints; a batched request on a worker that dies completes
on another; close() during a generation returns at once. Every comparison is with a run on this machine."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from lloyal_pool import ContextLostError, DeadWorkerError, Pool, PoolClosedError, Result, StopReason

GREEDY: dict[str, Any] = dict(temperature=0.0, n_predict=24, ignore_eos=True)
POOLS = {
    "recover": dict(recover=True),
    "spares": dict(recover=True, spares=1),
    "checkpoints": dict(recover=True, checkpoint_tokens=128),
    "spares+checkpoints": dict(recover=True, spares=1, checkpoint_tokens=128),
}


def _recovered(pool: Pool, kill: Any) -> None:
    """Runs kill() (a SIGKILL of pool[0] at some point) and waits until the recovery it causes has ended."""
    done = threading.Event()
    dying = pool[0].pid
    unsubscribe = pool.subscribe(lambda e: done.set() if e.kind == "recovered" and e.pid != dying else None)
    kill()
    assert done.wait(90), "no recovery"
    unsubscribe()


def _stop_a_reply(session: Any) -> Result:
    """A streamed chat reply, stopped after a few pieces (the Stop button)."""
    with session.stream("Tell me a long story about a lighthouse.", **{**GREEDY, "n_predict": 200}) as stream:
        for i, _ in enumerate(stream):
            if i == 6:
                break
    result: Result = stream.result
    assert result.stop_reason == StopReason.INTERRUPTED
    return result


@pytest.mark.parametrize("config", list(POOLS), ids=list(POOLS))
@pytest.mark.parametrize("when", ["idle", "while another generates"])
def test_a_stopped_conversation_survives_its_worker_s_death(gemma_path: Path, config: str, when: str) -> None:
    with Pool(1, **POOLS[config]) as pool:
        model = pool[0].load_model(gemma_path)
        reference = model.new_context(n_ctx=1024)
        expected = reference.generate("The capital of France is", **GREEDY).text
        reference.close()
        ctx, other = model.new_context(n_ctx=1024), model.new_context(n_ctx=1024)
        session = ctx.chat("You are a storyteller.")
        session.send("Hello!", **GREEDY)
        _stop_a_reply(session)
        held = ctx.tokens()
        if when == "idle":
            _recovered(pool, lambda: os.kill(pool[0].pid, signal.SIGKILL))
        else:
            running: Future[Result] = other.generate_async("Once upon a time", n_predict=160, ignore_eos=True)

            def kill_mid_generation() -> None:
                time.sleep(0.3)
                os.kill(pool[0].pid, signal.SIGKILL)

            _recovered(pool, kill_mid_generation)
            assert running.result(timeout=120).n_decoded == 160  # greedy: replayed to its end
        # Nothing of the conversation was lost: the next turn, a reset, a new stream all work.
        assert ctx.tokens() == held
        turn = session.send("Go on, briefly.", **GREEDY)
        assert turn.result.n_decoded == GREEDY["n_predict"]
        ctx.reset()
        assert ctx.n_past() == 0
        with ctx.stream("The capital of France is", **GREEDY) as stream:
            assert "".join(stream) == stream.result.text == expected


@pytest.mark.parametrize("recover", [False, True], ids=["without recovery", "with recovery"])
def test_batched_requests_of_a_killed_worker_complete_on_the_other(gemma_path: Path, recover: bool) -> None:
    """24 greedy batched requests over two workers, one worker killed while they run: every one completes
    with the text it has alone (queued ones go to the live worker; started ones are sent again there,
    the pieces already delivered not twice)."""
    prompts = [f"Request {i}: the {w} walked into the" for i, w in enumerate(["cat", "dog", "fox", "owl"] * 6)]
    with Pool(2, recover=recover) as pool:
        for inst in pool:
            # Deterministic batchers: a request's tokens do not depend on what else is batched, so that its
            # replay on the other worker, beside other requests, writes what its first attempt wrote.
            inst.load_model(gemma_path, repack=False).batcher(deterministic=True)
        short = {**GREEDY, "n_predict": 12}  # the reference kernels of deterministic batchers are slow
        expected = {p: pool.generate(p, **short).text for p in set(prompts)}
        streamed: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
        handles = [pool.submit(p, **short, on_piece=streamed[i].append) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 60
        while not any(streamed.values()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(pool[0].pid, signal.SIGKILL)
        results = [h.future.result(timeout=300) for h in handles]
        for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            assert result.text == expected[prompt], (i, prompt)
            assert "".join(streamed[i]) == result.text, i


def test_close_during_a_generation_returns_at_once(gemma_path: Path) -> None:
    pool = Pool(2, recover=True)
    contexts = [inst.load_model(gemma_path).new_context(n_ctx=2048) for inst in pool]
    running = [ctx.generate_async("Once upon a time", n_predict=1500, ignore_eos=True) for ctx in contexts]
    time.sleep(1.0)  # both decode
    t0 = time.monotonic()
    pool.close()
    took = time.monotonic() - t0
    assert took < 1.0, f"close() took {took:.2f} s"
    for fut in running:
        assert fut.done()


def _dead(pool: Pool, index: int) -> None:
    """SIGKILLs pool[index] and waits until the pool has seen it die."""
    inst = pool[index]
    os.kill(inst.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while inst.alive:
        assert time.monotonic() < deadline, "the death was never seen"
        time.sleep(0.01)


def test_calls_around_a_dead_worker_are_typed_errors_naming_the_cause(tiny_model: Path) -> None:
    """A move to a worker that died, a page-in in one, a checkpoint of a context that came back empty:
    each a LloyalError that says why, never an OSError; with recovery the page-in just works."""
    with Pool(2, max_resident_contexts=1) as pool:
        here, there = (inst.load_model(tiny_model) for inst in pool)
        ctx, paged = here.new_context(n_ctx=256), here.new_context(n_ctx=256)
        ctx.eval([1, 2, 3])
        paged.eval([4, 5])
        ctx.eval([6])  # the other one pages out to make room
        pool[0]._core.settle(10)
        assert paged.paged
        _dead(pool, 1)
        with pytest.raises(PoolClosedError, match="dead"):
            ctx.move_to(pool[1])
        assert ctx.tokens() == [1, 2, 3, 6]
        _dead(pool, 0)
        with pytest.raises(DeadWorkerError, match="SIGKILL"):
            paged.tokens()  # its page-in has no worker
        del there
    with Pool(1, recover=True, max_resident_contexts=1) as pool:
        model = pool[0].load_model(tiny_model)
        ctx, paged = model.new_context(n_ctx=256, n_seq_max=2), model.new_context(n_ctx=256)
        paged.eval([4, 5])
        ctx.branch([1, 2, 3])  # branches: nothing rebuilds it, it comes back empty
        pool[0]._core.settle(10)
        assert paged.paged
        _recovered(pool, lambda: os.kill(pool[0].pid, signal.SIGKILL))
        assert paged.tokens() == [4, 5]  # paged in in the replacement
        with pytest.raises(ContextLostError, match="branches"):
            ctx.tokens()
        ctx.checkpoint()  # once said, it serves: empty
        assert ctx.tokens() == []
