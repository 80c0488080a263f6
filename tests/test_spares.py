"""Hot spares (Pool(spares=N)): crash recovery takes a ready worker whose models are already loaded, and
another spare starts in its place."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import psutil
import pytest

from lloyal_pool import CallTimeoutError, InvalidArgumentError, Model, Pool, Result
from lloyal_pool._generation import Phase, Why
from lloyal_pool._journal import GENERATED_TOKEN_COST, Journal
from lloyal_pool.params import MAX_SEED
from lloyal_pool.spares import model_key

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def _wait(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _model_loaded_in(pid: int, name: str) -> bool:
    try:
        return any(name in m.path for m in psutil.Process(pid).memory_maps())
    except psutil.Error:
        return False


def _stream_killing_its_worker(pool: Pool, ctx: Any, after: int) -> str:
    """The text of a greedy 40-token stream of PROMPT on ctx whose worker is SIGKILLed after ``after``
    pieces (recover=True: it goes on); checks the pieces joined are its result's text."""
    pieces: list[str] = []
    with ctx.stream(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True) as stream:
        for piece in stream:
            pieces.append(piece)
            if len(pieces) == after:
                os.kill(pool[0].pid, signal.SIGKILL)
    assert "".join(pieces) == stream.result.text
    return stream.result.text


def test_recovery_takes_a_spare_with_the_model_loaded(gemma_path: Path) -> None:
    with Pool(1, recover=True, spares=1, fork_spares=False) as pool:
        assert pool._spares.mode == "cold"
        model = pool[0].load_model(gemma_path)
        ctx = model.new_context(n_ctx=1024)
        reference = ctx.generate(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True).text
        _wait(lambda: pool.spares == 1)
        spare_pids = {c.pid for c in psutil.Process().children()} - {pool[0].pid}
        # The spare loads what the pool's workers hold (on a thread of its own, after their load).
        _wait(lambda: any(_model_loaded_in(pid, gemma_path.name) for pid in spare_pids))
        assert _stream_killing_its_worker(pool, ctx, after=8) == reference
        assert pool[0].pid in spare_pids  # the spare took the dead worker's place
        _wait(lambda: pool.spares == 1)  # and another spare started
        assert ctx.generate(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True).text == reference


def _zygote_pid(pool: Pool, model: Model | None = None) -> int:
    """The pid of the zygote the pool's spares fork from, once it holds ``model`` (if given)."""
    def current() -> bool:
        zygote = pool._spares._zygote
        return pool._spares._is_current(zygote) and (model is None or model_key(model) in zygote.loaded)

    _wait(current)
    zygote = pool._spares._zygote
    assert zygote is not None
    return zygote.proc.pid


def test_forked_spares_are_ready_at_once_and_a_recovery_without_one_forks_one(gemma_path: Path) -> None:
    with Pool(1, recover=True, spares=1, fork_spares=True) as pool:
        assert pool._spares.mode == "fork"
        _wait(lambda: pool.spares == 1)
        model = pool[0].load_model(gemma_path)
        ctx = model.new_context(n_ctx=1024)
        reference = ctx.generate(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True).text
        # The spare forked before the model loaded loads it itself; the zygote is built again with it.
        zygote = _zygote_pid(pool, model)
        spare = pool._spares._ready[0].proc
        _wait(lambda: _model_loaded_in(spare.pid, gemma_path.name))
        # No spare ready when the worker dies (the spare died first, and none is let replace it):
        # recovery forks one on the spot.
        pool._spares.wanted = 0
        os.kill(spare.pid, signal.SIGKILL)
        _wait(lambda: not spare.alive and pool.spares == 0)
        assert _stream_killing_its_worker(pool, ctx, after=8) == reference
        assert psutil.Process(pool[0].pid).ppid() == zygote  # the replacement is a fork of the zygote
        assert _model_loaded_in(pool[0].pid, gemma_path.name)
        # A new spare is forked at once, the model in it from the zygote (not loaded again).
        pool._spares.wanted = 1
        pool._spares.fill()
        _wait(lambda: pool.spares == 1)
        again = pool._spares._ready[0]
        assert psutil.Process(again.proc.pid).ppid() == zygote and again.loaded[model_key(model)]
        assert ctx.generate(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True).text == reference
        # The next recovery takes it.
        assert _stream_killing_its_worker(pool, ctx, after=4) == reference and pool[0].pid == again.proc.pid


def test_a_ready_spare_that_dies_is_replaced(gemma_path: Path) -> None:
    with Pool(1, recover=True, spares=1, fork_spares=True) as pool:
        model = pool[0].load_model(gemma_path)
        zygote = _zygote_pid(pool, model)
        _wait(lambda: pool.spares == 1)
        spare = pool._spares._ready[0].proc
        os.kill(spare.pid, signal.SIGKILL)
        _wait(lambda: pool.spares == 1 and pool._spares._ready[0].proc is not spare)
        again = pool._spares._ready[0].proc
        assert again.alive and psutil.Process(again.pid).ppid() == zygote
        _wait(lambda: _model_loaded_in(again.pid, gemma_path.name))


def test_a_second_model_rebuilds_the_zygote_and_its_forks_outlive_the_old_one(gemma_path: Path,
                                                                              tiny_model: Path) -> None:
    with Pool(1, recover=True, spares=1, fork_spares=True) as pool:
        gemma = pool[0].load_model(gemma_path)
        first = _zygote_pid(pool, gemma)
        _wait(lambda: pool.spares == 1)
        ctx = gemma.new_context(n_ctx=512)
        reference = ctx.generate(PROMPT, n_predict=16, temperature=0.0, ignore_eos=True).text
        tiny = pool[0].load_model(tiny_model)
        assert _zygote_pid(pool, tiny) != first
        _wait(lambda: not psutil.pid_exists(first))  # the old zygote ended
        spare = pool._spares._ready[0]
        _wait(lambda: bool(spare.loaded.get(model_key(tiny))))  # the ready spare loaded it itself
        os.kill(pool[0].pid, signal.SIGKILL)  # recovery takes the spare, a fork of the old zygote
        assert ctx.generate(PROMPT, n_predict=16, temperature=0.0, ignore_eos=True).text == reference
        assert pool[0].pid == spare.proc.pid
        tiny_ctx = tiny.new_context(n_ctx=128)
        assert len(tiny_ctx.generate("a", n_predict=4, temperature=0.0, ignore_eos=True).tokens) == 4


def test_spares_is_a_count(gemma_path: Path) -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="spares"):
            Pool(1, spares=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="fork_spares"):
        Pool(1, spares=1, fork_spares="yes")  # type: ignore[arg-type]
    with Pool(1) as pool:
        assert pool.spares == 0


def test_a_long_journal_is_checkpointed_in_the_background(gemma_path: Path) -> None:
    with Pool(1, recover=True, checkpoint_tokens=64) as pool:
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=1024)
        ctx.generate("Hi", n_predict=2, temperature=0.0)
        journal = cast("Journal", ctx._link.journal)
        # 2 prompt tokens and 2 generated to replay, a generated one costing 16: 34 < 64, none taken.
        assert journal.checkpoint is None and journal.replay_tokens == 2 + 2 * GENERATED_TOKEN_COST
        ctx.generate(PROMPT, n_predict=60, temperature=0.0, ignore_eos=True)
        _wait(lambda: journal.checkpoint is not None)  # far more to replay: one taken after the call
        _wait(lambda: not ctx._link.state.checkpointing)
        assert journal.entries == []
        held = ctx.tokens()
        os.kill(pool[0].pid, signal.SIGKILL)  # restored from the checkpoint, nothing decoded again
        assert ctx.tokens() == held
        assert ctx.generate("", append=True, n_predict=8, temperature=0.0).n_cached == len(held)
        with pytest.raises(InvalidArgumentError, match="checkpoint_tokens"):
            Pool(1, recover=True, checkpoint_tokens=0)


def _alone(model: Model, prompt: str | list[int], *, n_ctx: int = 1024, n_ubatch: int = 512,
           **params: Any) -> Result:
    """The reference run: the same generation on a fresh context of this worker, nothing killed."""
    ctx = model.new_context(n_ctx=n_ctx, n_ubatch=n_ubatch)
    try:
        return ctx.generate(prompt, **{"temperature": 0.0, "ignore_eos": True, **params})
    finally:
        ctx.close()


LONG = ("The keeper climbed the hundred steps at dusk, trimmed the wick, wound the clockwork and wrote the "
        "weather in his log. ") * 90


@pytest.mark.parametrize("checkpoint_tokens", [None, 100_000], ids=["no checkpoints", "checkpoints on"])
def test_a_stream_paused_inside_its_prompt_survives_a_kill(gemma_path: Path, checkpoint_tokens: int | None) -> None:
    """A generation paused inside its prompt leaves part of it in the cache and nothing for the journal to
    replay: recovery restores the history before it, and resume() sends the request again, which decodes
    the prompt from there. (The journal used to be lost from such a pause until a checkpoint.)"""
    with Pool(1, recover=True, checkpoint_tokens=checkpoint_tokens) as pool:
        model = pool[0].load_model(gemma_path)
        tokens = model.tokenize(LONG)[:1000]
        expected = _alone(model, tokens, n_ubatch=128, n_predict=16).text
        ctx = model.new_context(n_ctx=1024, n_ubatch=128)
        ctx.generate("A first turn.", n_predict=4, temperature=0.0)  # a history the journal replays
        holder: list[Any] = []

        def progress(done: int, total: int) -> None:
            if len(holder) == 1:
                holder.append(done)
                holder[0].pause(wait=False)  # on the reader thread: takes effect at the next ubatch

        stream = ctx.stream(tokens, progress=progress, n_predict=16, temperature=0.0, ignore_eos=True)
        holder.append(stream)
        assert stream.pause()
        assert 0 < ctx.n_past() < len(tokens)  # inside the prompt
        journal = cast("Journal", ctx._link.journal)
        assert journal.lost is None
        os.kill(pool[0].pid, signal.SIGKILL)
        assert stream.resume()
        assert "".join(stream) == stream.result.text == expected
        assert ctx.n_past() == len(tokens) + 16


def _generated(ctx: Any, how: str, prompt: str | list[int], *, on_piece: Callable[[str], None] | None = None,
               progress: Callable[[int, int], None] | None = None, **params: Any) -> Result:
    """A generation on ctx made as the caller chose (a stream, generate(), a chat turn's send(): each
    checkpointed as it goes), its pieces passed to on_piece (not for a chat turn) and checked to join to
    its text."""
    if how == "chat":
        return cast("Result", ctx.chat().send(prompt, progress=progress, **params).result)
    pieces: list[str] = []

    def piece(text: str) -> None:
        pieces.append(text)
        if on_piece is not None:
            on_piece(text)

    if how == "generate":
        result = cast("Result", ctx.generate(prompt, on_piece=piece, progress=progress, **params))
    else:
        with ctx.stream(prompt, progress=progress, **params) as stream:
            for text in stream:
                piece(text)
        result = stream.result
    assert "".join(pieces) == result.text
    return result


CALLS = ["stream", "generate", "chat"]


@pytest.mark.parametrize("how", CALLS)
def test_a_long_prompt_killed_midway_resumes_from_its_last_checkpoint(gemma_path: Path, how: str) -> None:
    with Pool(1, recover=True, checkpoint_tokens=512) as pool:
        model = pool[0].load_model(gemma_path)
        prompt: str | list[int] = LONG if how == "chat" else model.tokenize(LONG)[:2000]
        params: dict[str, Any] = dict(n_predict=16, temperature=0.0, ignore_eos=True)
        alone = model.new_context(n_ctx=4096, n_ubatch=256)
        expected = _generated(alone, how, prompt, **params)
        alone.close()
        ctx = model.new_context(n_ctx=4096, n_ubatch=256)
        journal = cast("Journal", ctx._link.journal)
        seen: list[tuple[int, int]] = []
        checkpoints: list[int] = []
        at_kill: list[tuple[object, list[object]]] = []

        def progress(done: int, total: int) -> None:
            seen.append((done, total))
            if journal.checkpoint is not None and not checkpoints:
                checkpoints.append(done)
            if done >= 1536 and len(checkpoints) == 1:  # a checkpoint inside the prompt is behind us
                checkpoints.append(done)
                at_kill.append((journal.checkpoint, list(journal.entries)))
                os.kill(pool[0].pid, signal.SIGKILL)

        result = _generated(ctx, how, prompt, progress=progress, **params)
        assert len(checkpoints) == 2, f"no kill after a checkpoint inside the prompt: {seen}"
        assert result.text == expected.text
        assert result.n_cached == 0 and result.n_prompt == expected.n_prompt > 1536
        # The caller saw one prompt: counts that grow to the whole, whatever the pauses and the crash.
        assert [t for _, t in seen] == [expected.n_prompt] * len(seen)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == expected.n_prompt
        # What the replacement was restored from: the state inside the prompt, with nothing to replay
        # after it; the Generate sent again decoded only the rest.
        assert at_kill[0][0] is not None and at_kill[0][1] == []
        assert len(ctx.tokens()) == expected.n_prompt + 16


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, seed=3, top_k=40, repeat_penalty=1.1)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("how", ["stream", "generate"])
def test_a_generation_checkpointed_as_it_goes_survives_a_kill_from_its_last_checkpoint(
        gemma_path: Path, params: dict[str, object], how: str) -> None:
    with Pool(1, recover=True, checkpoint_tokens=8 * GENERATED_TOKEN_COST) as pool:  # every 8 tokens
        model = pool[0].load_model(gemma_path)
        expected = _alone(model, PROMPT, n_predict=40, **params).text
        ctx = model.new_context(n_ctx=1024)
        journal = cast("Journal", ctx._link.journal)
        pieces: list[str] = []
        at_kill: list[object] = []

        def on_piece(piece: str) -> None:
            pieces.append(piece)
            if len(pieces) == 21:
                at_kill.append(journal.checkpoint)
                os.kill(pool[0].pid, signal.SIGKILL)

        result = _generated(ctx, how, PROMPT, on_piece=on_piece, n_predict=40, ignore_eos=True, **params)
        assert result.text == expected
        assert result.n_decoded == 40
        assert at_kill[0] is not None  # checkpointed inside the generation: decoded again from there
        assert journal.lost is None  # its journal goes on from the checkpoint: the generation's portable form


def test_a_checkpointed_generate_is_stopped_by_its_cancelled_task_and_not_by_cancel(gemma_path: Path) -> None:
    """Its segments after the first checkpoint are other requests: cancelling the task awaiting
    agenerate() stops the generation all the same; its future, running, cannot be cancelled."""
    with Pool(1, recover=True, checkpoint_tokens=8 * GENERATED_TOKEN_COST) as pool:  # every 8 tokens
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=4096)
        fut = ctx.generate_async(PROMPT, n_predict=12, temperature=0.0, ignore_eos=True)
        assert not fut.cancel()
        assert fut.result(timeout=60).n_decoded == 12

        async def cancelled() -> None:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ctx.agenerate(PROMPT, n_predict=3000, temperature=0.0, ignore_eos=True), 3.0)

        asyncio.run(cancelled())
        # Stopped: the next call runs at once instead of queueing behind ~3,000 tokens.
        assert ctx.generate("Once", n_predict=2, timeout=30).n_decoded == 2


def test_save_state_beside_a_generation_checkpointed_every_token(gemma_path: Path) -> None:
    """A checkpoint's hold takes the link, then the worker's transfer file; save_state() and load_state()
    pass the link's gate before they take that file (before, each could wait for the other for ever
    where the worker has a transfer file of its own)."""
    with Pool(1, recover=True, checkpoint_tokens=GENERATED_TOKEN_COST) as pool:
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=1024)
        expected = _alone(ctx.model, PROMPT, n_predict=40).text
        states: list[int] = []

        def save_and_load() -> None:
            while len(states) < 20:
                data = ctx.save_state()
                states.append(len(data))

        saver = threading.Thread(target=save_and_load, daemon=True)
        fut = ctx.generate_async(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True)
        saver.start()
        assert fut.result(timeout=120).text == expected
        saver.join(120)
        assert not saver.is_alive() and len(states) == 20


def test_a_random_seed_generation_resumed_after_a_checkpoint_is_saved_instead_of_replayed(gemma_path: Path) -> None:
    """A checkpoint of a paused generation starts its journal from its hand-over; resumed, a generation
    that draws with a random seed cannot be replayed (a replay would draw anew): the pool saves the state
    instead once it has ended, so that a crash then loses nothing."""
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=1024)
        journal = cast("Journal", ctx._link.journal)
        with ctx.stream(PROMPT, n_predict=12, temperature=0.8, seed=MAX_SEED, ignore_eos=True) as stream:
            next(stream)
            assert stream.pause()
            ctx.checkpoint()
            assert journal.lost is None  # the history up to the pause is the state
            assert stream.resume()
            list(stream)
        _wait(lambda: not ctx._link.state.checkpointing and journal.lost is None and journal.entries == [])
        held = ctx.tokens()
        os.kill(pool[0].pid, signal.SIGKILL)
        assert ctx.tokens() == held


def test_interrupt_during_a_checkpoint_s_pause_ends_the_generation(gemma_path: Path) -> None:
    """Context.interrupt() stops a generation whose worker runs nothing of it for the moment, paused to be
    checkpointed (before, the interrupt found nothing running and the generation went on to its end)."""
    with Pool(1, recover=True, checkpoint_tokens=GENERATED_TOKEN_COST) as pool:  # a checkpoint every token
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=1024)
        fut = ctx.generate_async(PROMPT, n_predict=300, temperature=0.0, ignore_eos=True)
        run = ctx._link.state.gens[0]
        deadline = time.monotonic() + 60
        while not (run.phase is Phase.PAUSED and run.why is Why.CHECKPOINT):
            assert not fut.done() and time.monotonic() < deadline, "no checkpoint's pause seen"
            time.sleep(0.0005)
        ctx.interrupt()
        result = fut.result(timeout=30)
        assert result.stop_reason == "interrupted" and result.n_decoded < 300
        # generate()'s timeout interrupts it the same way, paused for a checkpoint or not.
        with pytest.raises(CallTimeoutError, match="it was interrupted") as info:
            ctx.generate(PROMPT, n_predict=300, temperature=0.0, ignore_eos=True, timeout=1.0)
        partial = cast("Result", info.value.result)
        assert partial.stop_reason == "interrupted" and 0 < partial.n_decoded < 300
        assert ctx.generate("Once", n_predict=2).n_decoded == 2  # the context is free again


def test_a_call_another_thread_makes_on_a_checkpointed_stream_s_context_waits_for_the_stream(
        gemma_path: Path) -> None:
    """A stream's own checkpoints (a pause, the state saved, a resume) let no other call on its context
    run in between: one already sent waits in the worker (no checkpoint is taken meanwhile), one made
    while a checkpoint's pause lands waits at the link. Before, either ran at the pause and ended the
    generation (the Resume after it raised ContextError)."""
    other_prompt = "The capital of France is"
    with Pool(1, recover=True, checkpoint_tokens=2 * GENERATED_TOKEN_COST) as pool:  # every 2 tokens
        model = pool[0].load_model(gemma_path)
        expected = _alone(model, PROMPT, n_predict=40).text
        expected_other = _alone(model, other_prompt, n_predict=8).text
        ctx = model.new_context(n_ctx=1024)
        journal = cast("Journal", ctx._link.journal)
        pieces: list[str] = []
        others: list[Future[Result]] = []
        with ThreadPoolExecutor(4) as ex, ctx.stream(PROMPT, n_predict=40, temperature=0.0,
                                                     ignore_eos=True) as stream:
            for piece in stream:
                pieces.append(piece)
                assert not stream.paused  # its checkpoints' pauses are not the caller's
                if len(pieces) in (5, 6, 7, 8):
                    others.append(ex.submit(ctx.generate, other_prompt, n_predict=8, temperature=0.0,
                                            ignore_eos=True))
            text = "".join(pieces)
        assert text == stream.result.text == expected
        assert journal.checkpoint is not None  # checkpointed on its way
        assert [f.result(timeout=120).text for f in others] == [expected_other] * 4


def test_a_replayed_prompt_checkpointed_on_its_way_delivers_no_piece_twice(gemma_path: Path) -> None:
    with Pool(1, recover=True, checkpoint_tokens=128) as pool:
        model = pool[0].load_model(gemma_path)
        tokens = model.tokenize(LONG)[:600]
        expected = _alone(model, tokens, n_predict=24, n_ubatch=128).text
        ctx = model.new_context(n_ctx=1024, n_ubatch=128)
        journal = cast("Journal", ctx._link.journal)
        pieces: list[str] = []
        with ctx.stream(tokens, n_predict=24, temperature=0.0, ignore_eos=True) as stream:
            for piece in stream:
                pieces.append(piece)
                if len(pieces) == 3:
                    # Checkpointed inside its prompt on the way (a pause between two ubatches, the state
                    # saved, the request sent once more, each time): recovery restores the last of them and
                    # sends the Generate again, whose 3 pieces delivered are not delivered again.
                    assert journal.checkpoint is not None
                    os.kill(pool[0].pid, signal.SIGKILL)
        assert stream.result.n_cached == 0  # what the first request reused: nothing
        assert "".join(pieces) == stream.result.text == expected


def test_a_stream_paused_by_its_caller_and_checkpointed_in_the_background_survives_a_kill(gemma_path: Path) -> None:
    # A prompt of 600 tokens, checkpoint_tokens=600: none inside the prompt or the 30 tokens generated
    # (a stream's own come every 600 / 16 = 37), but one once the caller's pause has recorded it all.
    with Pool(1, recover=True, checkpoint_tokens=600) as pool:
        model = pool[0].load_model(gemma_path)
        tokens = model.tokenize(LONG)[:600]
        expected = _alone(model, tokens, n_predict=30).text
        ctx = model.new_context(n_ctx=1024)
        journal = cast("Journal", ctx._link.journal)
        pieces: list[str] = []
        with ctx.stream(tokens, n_predict=30, temperature=0.0, ignore_eos=True) as stream:
            for piece in stream:
                pieces.append(piece)
                if len(pieces) == 2:
                    assert stream.pause()
                    # The pause made the journal long: a checkpoint in the background, with the paused
                    # generation's hand-over after it, so that the Resume is replayable.
                    _wait(lambda: journal.checkpoint is not None and not ctx._link.state.checkpointing)
                    assert journal.lost is None
                    assert stream.resume()
                if len(pieces) == 10:
                    os.kill(pool[0].pid, signal.SIGKILL)
        assert "".join(pieces) == stream.result.text == expected


def test_a_stream_without_prompt_cache_is_not_paused_inside_its_prompt(gemma_path: Path) -> None:
    # Sent again, its prompt would be decoded from the start: no checkpoint inside it (it would never end).
    with Pool(1, recover=True, checkpoint_tokens=128) as pool:
        model = pool[0].load_model(gemma_path)
        tokens = model.tokenize(LONG)[:700]
        expected = _alone(model, tokens, n_predict=8, cache_prompt=False).text
        ctx = model.new_context(n_ctx=1024)
        seen: list[int] = []
        with ctx.stream(tokens, n_predict=8, temperature=0.0, ignore_eos=True, cache_prompt=False,
                        progress=lambda done, total: seen.append(done)) as stream:
            assert "".join(stream) == expected
        assert seen[-1] == len(tokens) and seen == sorted(seen)
