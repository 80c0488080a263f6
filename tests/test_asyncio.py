"""The asyncio face (_aio.py): the same requests as the blocking calls, awaited, with cancellation that
interrupts the work in the worker. Plain asyncio.run in each test: no plugin between the test and the
loop."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from readme import run_section

from lloyal_pool import (
    AsyncStream,
    Context,
    ContextOverflowError,
    InvalidTokenError,
    Model,
    Pool,
    PoolClosedError,
    StaleHandleError,
    StopReason,
)
from lloyal_pool import protocol as p

T = TypeVar("T")
PATIENCE = 60.0  # a guard against hanging forever, never a timing assertion
UNTIL_FULL = {"n_predict": 0, "ignore_eos": True}  # generates until the context is full unless stopped


def run(aw: Awaitable[T]) -> T:
    async def guarded() -> T:
        return await asyncio.wait_for(aw, PATIENCE)

    return asyncio.run(guarded())


@pytest.fixture
def tctx(tiny: Model) -> Iterator[Context]:
    ctx = tiny.new_context(n_ctx=4096)
    yield ctx
    ctx.close()


def test_agenerate_is_generate(tctx: Context) -> None:
    want = tctx.generate("Once upon a time", n_predict=24)
    got = run(tctx.agenerate("Once upon a time", n_predict=24))
    assert got.tokens == want.tokens and got.text == want.text and got.stop_reason == want.stop_reason


def test_astream_pieces_join_to_its_result(tctx: Context) -> None:
    want = tctx.generate("Once upon a time", n_predict=24)

    async def main() -> tuple[list[str], str]:
        stream = tctx.astream("Once upon a time", n_predict=24)
        assert isinstance(stream, AsyncStream)
        pieces = [piece async for piece in stream]
        return pieces, (await stream.result()).text

    pieces, text = run(main())
    assert "".join(pieces) == text == want.text and len(pieces) > 1


def test_requests_on_many_contexts_run_concurrently_and_the_loop_stays_free(tiny: Model) -> None:
    contexts = [tiny.new_context(n_ctx=512) for _ in range(3)]
    try:
        want = [c.generate(f"Story {i}:", n_predict=32, ignore_eos=True).text for i, c in enumerate(contexts)]
        ticks = 0

        async def ticker(stop: asyncio.Event) -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async def main() -> list[str]:
            stop = asyncio.Event()
            tick = asyncio.create_task(ticker(stop))
            results = await asyncio.gather(*(c.agenerate(f"Story {i}:", n_predict=32, ignore_eos=True)
                                             for i, c in enumerate(contexts)))
            stop.set()
            await tick
            return [r.text for r in results]

        assert run(main()) == want
        assert ticks > 10  # the loop ran other tasks while the workers generated
    finally:
        for c in contexts:
            c.close()


def test_cancelling_the_task_interrupts_the_generation(tctx: Context) -> None:
    pieces: list[str] = []
    first = threading.Event()

    def on_piece(piece: str) -> None:
        pieces.append(piece)
        first.set()

    async def main() -> int:
        task = asyncio.create_task(tctx.agenerate("Count:", on_piece=on_piece, **UNTIL_FULL))
        await asyncio.to_thread(first.wait, PATIENCE)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The next call on the context runs once the cancelled one has ended.
        return (await tctx.agenerate("Hi", n_predict=2)).n_decoded

    assert run(main()) == 2
    assert 1 <= len(pieces) < tctx.n_ctx // 2  # stopped, not run on until the context was full


def test_a_timeout_interrupts_the_generation(tctx: Context) -> None:
    async def main() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await tctx.agenerate("Count:", **UNTIL_FULL)
        await tctx.agenerate("", append=True, n_predict=1)  # runs once the interrupted one has ended

    run(main())
    assert len(tctx.tokens()) < tctx.n_ctx // 2


def test_a_cancelled_request_still_queued_is_stopped_when_it_starts(tctx: Context) -> None:
    later: list[str] = []

    async def main() -> str:
        running = tctx.astream("Count:", n_predict=64, ignore_eos=True)
        queued = asyncio.create_task(tctx.agenerate("Count:", on_piece=later.append, **UNTIL_FULL))
        await asyncio.sleep(0)  # the queued request is sent
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        text = "".join([piece async for piece in running])
        assert (await running.result()).n_decoded == 64  # the one that ran was not the one stopped
        await tctx.agenerate("Hi", n_predict=1)
        return text

    assert run(main())
    assert len(later) < tctx.n_ctx // 2


def test_leaving_an_astream_early_interrupts_it(tctx: Context) -> None:
    async def main() -> tuple[int, StopReason]:
        async with tctx.astream("Count:", **UNTIL_FULL) as stream:
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    break
        result = await stream.result()
        return n, result.stop_reason

    n, reason = run(main())
    assert n == 3 and reason == StopReason.INTERRUPTED
    assert len(tctx.tokens()) < tctx.n_ctx // 2


def test_cancelling_the_task_iterating_an_astream_interrupts_it(tctx: Context) -> None:
    async def main() -> StopReason:
        stream = tctx.astream("Count:", **UNTIL_FULL)
        got_one = asyncio.Event()

        async def consume() -> None:
            async for _ in stream:
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return (await stream.result()).stop_reason

    assert run(main()) == StopReason.INTERRUPTED


def test_an_astream_dropped_while_it_runs_is_interrupted(tctx: Context) -> None:
    async def main() -> None:
        stream = tctx.astream("Count:", **UNTIL_FULL)
        async for _ in stream:
            break
        del stream
        gc.collect()
        await tctx.agenerate("", append=True, n_predict=1)  # runs once the interrupted one has ended

    run(main())
    assert len(tctx.tokens()) < tctx.n_ctx // 2


def test_a_loop_that_ends_while_its_request_runs_harms_nothing(tctx: Context) -> None:
    async def main() -> AsyncStream:
        return tctx.astream("Count:", n_predict=200, ignore_eos=True)  # never iterated

    stream = asyncio.run(main())  # the loop is closed while pieces still arrive for it
    stream.future.result(PATIENCE)
    assert tctx.generate("Hi", n_predict=2).n_decoded == 2


def test_errors_are_the_blocking_calls_typed_errors(tctx: Context) -> None:
    with pytest.raises(ContextOverflowError):
        run(tctx.agenerate(list(range(1, 5000)), n_predict=1))
    with pytest.raises(InvalidTokenError):
        run(tctx.agenerate([1, 10**9], n_predict=1))

    async def broken_stream() -> None:
        async for _ in tctx.astream(list(range(1, 5000)), n_predict=1):
            pass

    with pytest.raises(ContextOverflowError):
        run(broken_stream())
    assert run(tctx.agenerate("Hi", n_predict=2)).n_decoded == 2


def test_aeval_ascore_and_ascore_choices_are_their_blocking_twins(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=512, n_seq_max=2)
    try:
        want_score = ctx.score("The cat sat on the mat")
        ctx.reset()
        want_eval = ctx.eval("The cat")
        want_choices = ctx.score_choices([" sat", " ran"])
        ctx.reset()

        async def main() -> None:
            assert await ctx.ascore("The cat sat on the mat") == want_score
            ctx.reset()
            assert (await ctx.aeval("The cat")).n_past == want_eval.n_past
            got = await ctx.ascore_choices([" sat", " ran"])
            assert got == want_choices

        run(main())
    finally:
        ctx.close()


def test_agenerate_with_draft_is_generate(tctx: Context) -> None:
    prompt = "one two three four one two three four one two"
    want = tctx.generate(prompt, n_predict=16)
    got = run(tctx.agenerate_with_draft(prompt, n_predict=16))
    assert got.tokens == want.tokens


# -- branches ------------------------------------------------------------------------------------------
def test_async_branch_steps_are_the_blocking_steps(tiny: Model) -> None:
    def sync_run() -> list[list[int]]:
        ctx = tiny.new_context(n_ctx=512, n_seq_max=4)
        try:
            root = ctx.branch("Once upon a time", temperature=0.8, seed=7)
            kids = [root.fork(reseed=i) for i in range(3)]
            out: list[list[int]] = [[] for _ in kids]
            for _ in range(8):
                for i, produced in enumerate(ctx.branches.step(kids)):
                    out[i].append(produced.token)
            out.append([p.token for p in root.iterate(4)])
            return out
        finally:
            ctx.close()

    async def async_run() -> list[list[int]]:
        ctx = tiny.new_context(n_ctx=512, n_seq_max=4)
        try:
            root = await ctx.branches.acreate("Once upon a time", temperature=0.8, seed=7)
            kids = [root.fork(reseed=i) for i in range(3)]
            out: list[list[int]] = [[] for _ in kids]
            for _ in range(8):
                for i, produced in enumerate(await ctx.branches.astep(kids)):
                    out[i].append(produced.token)
            out.append([p.token async for p in root.aiterate(4)])
            return out
        finally:
            ctx.close()

    assert run(async_run()) == sync_run()


def test_async_branch_prefill_and_commit(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=512, n_seq_max=2)
    try:
        async def main() -> None:
            branch = await ctx.branches.acreate([1, 2, 3])
            await branch.aprefill([4, 5])
            assert branch.position == 5
            produced = branch.produce()
            await branch.acommit(produced.token)
            assert branch.position == 6
            child = branch.fork()
            await ctx.branches.aprefill([(branch, [7]), (child, [8, 9])])
            await ctx.branches.acommit([(branch, 10), (child, 11)])
            assert (branch.position, child.position) == (8, 9)
            assert (await child.astep()).token >= 0

        run(main())
    finally:
        ctx.close()


def test_cancelling_an_async_branch_prefill_interrupts_it_all_or_nothing(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=4096, n_seq_max=2, n_batch=32, n_ubatch=32)
    try:
        async def main() -> None:
            branch = await ctx.branches.acreate([1, 2, 3])
            started = threading.Event()
            task = asyncio.create_task(branch.aprefill(list(range(4, 4000)),
                                                      progress=lambda done, total: started.set()))
            await asyncio.to_thread(started.wait, PATIENCE)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await branch.aprefill([7])  # runs once the cancelled prefill has ended
            assert branch.position == 4  # the interrupted prefill left nothing behind

        run(main())
    finally:
        ctx.close()


# -- lifecycle ------------------------------------------------------------------------------------------
def test_an_async_pool_loads_and_closes(tiny_model: Path) -> None:
    async def main() -> Pool:
        async with Pool(1) as pool:
            model = await pool[0].aload_model(tiny_model)
            ctx = model.new_context(n_ctx=256)
            assert (await ctx.agenerate("Hi", n_predict=2)).n_decoded == 2
        return pool

    pool = run(main())
    assert pool.closed
    with pytest.raises((PoolClosedError, StaleHandleError)):
        pool[0].ping()


def test_aclose_lets_other_tasks_run(tiny_model: Path) -> None:
    async def main() -> int:
        pool = Pool(2)
        ticks = 0
        closing = asyncio.create_task(pool.aclose())
        while not closing.done():
            ticks += 1
            await asyncio.sleep(0.001)
        await closing
        assert pool.closed
        return ticks

    assert run(main()) > 0


def test_a_cancelled_model_load_frees_the_model(pool: Pool, tiny_model: Path) -> None:
    async def main() -> None:
        task = asyncio.create_task(pool[1].aload_model(tiny_model))
        await asyncio.sleep(0)  # the request is sent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    # Handles are numbered per worker: the cancelled load's model is the one before the next load's.
    model = pool[1].load_model(tiny_model)
    try:
        cancelled = model._handle - 1
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:  # the model is freed from a thread once its load has ended
            try:
                pool[1]._proc.call(p.Tokenize(model=cancelled, text="x")).result()
            except StaleHandleError:
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"model handle {cancelled} of the cancelled load is still loaded")
    finally:
        model.close()


def test_a_future_cancel_takes_nothing_back(tctx: Context) -> None:
    """concurrent.futures' cancel() on a call's future: the call was sent, so it cannot be cancelled
    (False), and the worker serves on (a cancelled pending future used to break the reader)."""
    running = tctx.generate_async("Count:", n_predict=8, ignore_eos=True)
    queued = tctx.generate_async("Count:", n_predict=4, ignore_eos=True)
    assert not queued.cancel() and not running.cancel()
    assert queued.result(PATIENCE).n_decoded == 4 and running.result(PATIENCE).n_decoded == 8
    assert tctx.generate("Hi", n_predict=2).n_decoded == 2


def test_the_readme_asyncio_example_runs_as_written(gemma_path: Path) -> None:
    out = run_section("## asyncio")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "France" in lines[0] and " | " in lines[0] and "Ital" in lines[0]
    assert lines[-2].endswith(" [timed out]")  # the stream was cut by the timeout, not by its end
    reused = int(lines[-1].split()[0])
    assert reused > 0 and lines[-1] == f"{reused} prompt tokens reused"
