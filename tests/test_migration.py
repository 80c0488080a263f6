"""Pause, resume and live migration: a context's stream stops at a token boundary and goes on token for
token, in its own worker or in another one (Context.move_to, Pool.drain), through a crash of its worker
(Pool(recover=True)), and a move that fails leaves the context whole where it was.

Every comparison is with a reference run on this machine: the same context parameters and sampling,
unpaused and unmoved, in a context of the same worker kind (kernels round alike in every worker of
one machine)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lloyal_pool.migration as migration
from lloyal_pool import (
    ContextError,
    InvalidArgumentError,
    MigrationError,
    Pool,
    PoolClosedError,
    StaleHandleError,
    WorkerCrashedError,
    _image,
    _jobs,
)
from lloyal_pool import protocol as p
from lloyal_pool._machine import Kind
from lloyal_pool.context import Context
from lloyal_pool.errors import BadRequestError
from lloyal_pool.model import Model
from lloyal_pool.params import StopReason

PROMPT = "Write a short story about a lighthouse keeper and a storm."
GREEDY: dict[str, Any] = dict(temperature=0.0, n_predict=48, ignore_eos=True)
# Seeded sampling through every stage that draws or keeps state: penalties' window, XTC and dist.
SEEDED: dict[str, Any] = dict(temperature=0.9, seed=11, top_k=40, top_p=0.95, repeat_penalty=1.15,
                              xtc_probability=0.5, xtc_threshold=0.1, n_predict=48, ignore_eos=True)
CASES = [pytest.param(GREEDY, id="greedy"), pytest.param(SEEDED, id="seeded")]
N_CTX = 2048


@pytest.fixture(scope="module")
def pair(gemma_path: Path) -> Iterator[tuple[Pool, Model, Model]]:
    """Two workers with Gemma loaded in each."""
    with Pool(2) as pool:
        yield pool, pool[0].load_model(gemma_path), pool[1].load_model(gemma_path)


def _reference(model: Model, params: dict[str, Any], prompt: str = PROMPT) -> str:
    ctx = model.new_context(n_ctx=N_CTX)
    try:
        return ctx.generate(prompt, **params).text
    finally:
        ctx.close()


def _other(pool: Pool, ctx: Context) -> Any:
    return pool[1] if ctx.instance is pool[0] else pool[0]


@pytest.mark.parametrize("params", CASES)
def test_a_paused_stream_resumes_token_for_token(pair: tuple[Pool, Model, Model], params: dict[str, Any]) -> None:
    _, model, _ = pair
    reference = _reference(model, params)
    ctx = model.new_context(n_ctx=N_CTX)
    pieces: list[str] = []
    with ctx.stream(PROMPT, **params) as stream:
        for piece in stream:
            pieces.append(piece)
            if len(pieces) in (5, 20):
                assert stream.pause() and stream.paused
                assert ctx.n_past() > 0  # the context is free while paused: calls that only read run
                assert stream.resume() and not stream.paused
        result = stream.result
    assert "".join(pieces) == result.text == reference
    assert result.n_decoded == params["n_predict"] and result.stop_reason == StopReason.LENGTH


def test_pause_and_resume_from_other_threads(pair: tuple[Pool, Model, Model]) -> None:
    _, model, _ = pair
    reference = _reference(model, SEEDED)
    ctx = model.new_context(n_ctx=N_CTX)
    stream = ctx.stream(PROMPT, **SEEDED)
    paused = threading.Event()

    def pause_then_resume() -> None:
        time.sleep(0.05)
        if stream.pause():
            paused.set()
            time.sleep(0.1)
            stream.resume()

    worker = threading.Thread(target=pause_then_resume)
    worker.start()
    text = "".join(stream)
    worker.join()
    assert paused.is_set()  # 48 tokens take longer than 50 ms on any CPU this runs on
    assert text == stream.result.text == reference


def test_closing_a_paused_stream_ends_it_as_interrupted(pair: tuple[Pool, Model, Model]) -> None:
    _, model, _ = pair
    ctx = model.new_context(n_ctx=N_CTX)
    stream = ctx.stream(PROMPT, **GREEDY)
    seen = [next(stream) for _ in range(3)]
    assert stream.pause()
    stream.close()
    result = stream.result
    assert result.stop_reason == StopReason.INTERRUPTED and result.text.startswith("".join(seen))
    assert not stream.resume()  # ended: nothing to resume
    assert ctx.generate(PROMPT, **GREEDY).text == _reference(model, GREEDY)  # the context serves on


def test_another_call_drops_a_paused_generation(pair: tuple[Pool, Model, Model]) -> None:
    _, model, _ = pair
    ctx = model.new_context(n_ctx=N_CTX)
    stream = ctx.stream(PROMPT, **GREEDY)
    next(stream)
    assert stream.pause()
    ctx.generate("Something else entirely.", n_predict=4)
    with pytest.raises(ContextError, match="nothing to resume"):
        stream.resume()
        _ = stream.result
    # A second stream paused on the context: resuming the first does not take over the second's.
    first, second = ctx.stream(PROMPT, **GREEDY), None
    next(first)
    assert first.pause()
    second = ctx.stream(PROMPT, **SEEDED)
    pieces = [next(second)]
    assert second.pause()
    with pytest.raises(ContextError, match="another one"):
        first.resume()
        _ = first.result
    assert second.resume()
    assert "".join([*pieces, *second]) == _reference(model, SEEDED)


def test_pausing_a_batched_stream_is_refused(pair: tuple[Pool, Model, Model]) -> None:
    _, model, _ = pair
    stream = model.instance.stream(PROMPT, n_predict=4)
    with pytest.raises(ContextError, match="only a context's stream"):
        stream.pause()
    assert "".join(stream) == stream.result.text


@pytest.mark.parametrize("params", CASES)
def test_a_moved_stream_writes_what_an_unmoved_one_does(pair: tuple[Pool, Model, Model],
                                                        params: dict[str, Any]) -> None:
    pool, model, _ = pair
    reference = _reference(model, params)
    ctx = model.new_context(n_ctx=N_CTX)
    pieces: list[str] = []
    workers = []
    with ctx.stream(PROMPT, **params) as stream:
        for piece in stream:
            pieces.append(piece)
            if len(pieces) in (6, 25):
                ctx.move_to(_other(pool, ctx))
                workers.append(ctx.instance.worker_id)
        result = stream.result
    assert workers == [pool[1].worker_id, pool[0].worker_id]
    assert "".join(pieces) == result.text == reference
    assert result.n_decoded == params["n_predict"]


def test_a_checkpointed_generate_moves_as_a_stream_does(gemma_path: Path) -> None:
    """With Pool(checkpoint_tokens) generate() runs as a stream: a move pauses it, hands it over and
    resumes it in the target; its Result is the unmoved run's."""
    with Pool(2, recover=True, checkpoint_tokens=100_000) as pool:
        model = pool[0].load_model(gemma_path)
        pool[1].load_model(gemma_path)
        reference = _reference(model, SEEDED)
        ctx = model.new_context(n_ctx=N_CTX)
        sixth = threading.Event()
        pieces: list[str] = []

        def on_piece(piece: str) -> None:
            pieces.append(piece)
            if len(pieces) == 6:
                sixth.set()

        fut = ctx.generate_async(PROMPT, on_piece=on_piece, **SEEDED)
        assert sixth.wait(60)
        ctx.move_to(pool[1])
        assert not fut.done()  # moved halfway
        result = fut.result(timeout=120)
        assert ctx.instance is pool[1] and result.n_decoded == SEEDED["n_predict"]
        assert "".join(pieces) == result.text == reference


def test_a_paused_stream_moves_paused_and_resumes_in_the_target(pair: tuple[Pool, Model, Model]) -> None:
    pool, model, _ = pair
    reference = _reference(model, SEEDED)
    ctx = model.new_context(n_ctx=N_CTX)
    stream = ctx.stream(PROMPT, **SEEDED, logprobs=2)
    pieces = [next(stream) for _ in range(8)]
    assert stream.pause()
    ctx.move_to(_other(pool, ctx))
    assert stream.paused and ctx.instance is pool[1]
    assert stream.resume()
    pieces += list(stream)
    result = stream.result
    assert "".join(pieces) == result.text == reference
    assert result.logprobs is not None and len(result.logprobs) == len(result.tokens)  # none lost on the way


def test_a_moved_context_scores_and_continues_like_the_unmoved_one(pair: tuple[Pool, Model, Model]) -> None:
    pool, model, _ = pair
    moved, kept = model.new_context(n_ctx=N_CTX), model.new_context(n_ctx=N_CTX)
    for ctx in (moved, kept):
        ctx.generate(PROMPT, **GREEDY)
    before = moved.logits(copy=True)
    moved.move_to(pool[1])
    assert moved.instance is pool[1] and moved.model.instance is pool[1]
    assert moved.tokens() == kept.tokens()
    assert (moved.logits(copy=True) == before).all()
    choices = [" The storm", " Once more", " And then the light went out."]
    assert [s.nll for s in moved.score_choices(choices)] == [s.nll for s in kept.score_choices(choices)]
    assert moved.generate("", append=True, n_predict=16).text == kept.generate("", append=True, n_predict=16).text
    moved.move_to(pool[0])  # and back
    assert moved.score(PROMPT).nll == pytest.approx(kept.score(PROMPT).nll, abs=0.0)


def test_an_empty_context_and_a_conversation_move(pair: tuple[Pool, Model, Model]) -> None:
    pool, model, _ = pair
    empty = model.new_context(n_ctx=N_CTX)
    empty.move_to(pool[1])
    assert empty.n_past() == 0 and empty.generate(PROMPT, **GREEDY).text == _reference(model, GREEDY)
    chat = model.new_context(n_ctx=N_CTX).chat(temperature=0.0, n_predict=12)
    reference = model.new_context(n_ctx=N_CTX).chat(temperature=0.0, n_predict=12)
    assert chat.send("Hi there.").result.tokens == reference.send("Hi there.").result.tokens
    chat.context.move_to(pool[1])
    moved = chat.send("Tell me a fact.").result
    assert moved.tokens == reference.send("Tell me a fact.").result.tokens and moved.n_cached > 0


def test_bad_moves_are_typed_errors_and_lose_nothing(pair: tuple[Pool, Model, Model], tiny_model: Path) -> None:
    pool, model, _ = pair
    ctx = model.new_context(n_ctx=N_CTX)
    ctx.generate(PROMPT, **GREEDY)
    held = ctx.tokens()
    with pytest.raises(InvalidArgumentError, match="already lives"):
        ctx.move_to(ctx.instance)
    with pytest.raises(BadRequestError):
        ctx.move_to("worker 1")  # type: ignore[arg-type]
    with Pool(1) as other:
        other[0].load_model(tiny_model)
        with pytest.raises(InvalidArgumentError, match="has not loaded"):
            ctx.move_to(other[0])  # a worker with another model only
        closed = other[0]
    with pytest.raises(PoolClosedError):
        ctx.move_to(closed)
    branched = model.new_context(n_ctx=N_CTX, n_seq_max=2)
    branched.branch(PROMPT)
    with pytest.raises(ContextError, match="branches"):
        branched.move_to(pool[1])
    assert ctx.tokens() == held and ctx.instance is pool[0]  # nothing moved, nothing lost
    gone = model.new_context(n_ctx=N_CTX)
    gone.close()
    with pytest.raises(StaleHandleError):
        gone.move_to(pool[1])


def _kill_and_see(proc: Any) -> None:
    """SIGKILLs a worker and waits until its death is seen."""
    os.kill(proc.pid, signal.SIGKILL)
    while proc.alive:
        time.sleep(0.005)


def _kill_before(monkeypatch: pytest.MonkeyPatch, step: str, pool: Pool, index: int) -> None:
    """A move's ``step`` starts by SIGKILLing pool[index] and waiting until its death is seen: a kill at a
    known point of the move. "save": the source's SaveState (its streams paused, the context held);
    "build": the target making the context (migration._build)."""
    proc = pool[index]._proc
    if step == "build":
        original = migration._build

        def killed_first(*args: Any) -> Any:
            _kill_and_see(proc)
            return original(*args)

        monkeypatch.setattr(migration, "_build", killed_first)
        return
    transfer = _jobs.transfer

    def killed_before_the_save(core: Any, call: Any) -> None:
        if call.kind is Kind.MOVE_SAVE:
            _kill_and_see(proc)
        transfer(core, call)

    monkeypatch.setattr(_jobs, "transfer", killed_before_the_save)


def test_a_target_killed_during_the_move_leaves_the_stream_serving_in_its_source(
        gemma_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Pool(2) as pool:
        model = pool[0].load_model(gemma_path)
        pool[1].load_model(gemma_path)
        reference = _reference(model, SEEDED)
        ctx = model.new_context(n_ctx=N_CTX)
        _kill_before(monkeypatch, "build", pool, 1)
        pieces: list[str] = []
        with ctx.stream(PROMPT, **SEEDED) as stream:
            for piece in stream:
                pieces.append(piece)
                if len(pieces) == 10:
                    with pytest.raises(MigrationError) as caught:
                        ctx.move_to(pool[1])
                    assert isinstance(caught.value.__cause__, WorkerCrashedError)
                    assert ctx.instance is pool[0]
        assert "".join(pieces) == stream.result.text == reference


def test_a_source_killed_during_the_move_loses_nothing_with_recovery(
        gemma_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Pool(2, recover=True) as pool:
        model = pool[0].load_model(gemma_path)
        pool[1].load_model(gemma_path)
        reference = _reference(model, SEEDED)
        ctx = model.new_context(n_ctx=N_CTX)
        _kill_before(monkeypatch, "save", pool, 0)
        stream = ctx.stream(PROMPT, **SEEDED)
        pieces = [next(stream) for _ in range(10)]
        with pytest.raises(WorkerCrashedError):
            ctx.move_to(pool[1])
        # The source's crash is a crash like any other: recovery restores the context from its journal
        # (the generation up to its pause), and the paused stream goes on from its portable form.
        pieces += list(stream)
        assert "".join(pieces) == stream.result.text == reference
        assert ctx.instance is pool[0] and pool[0].alive


def test_a_paused_stream_survives_a_crash_with_recovery(gemma_path: Path) -> None:
    with Pool(1, recover=True) as pool:
        model = pool[0].load_model(gemma_path)
        reference = _reference(model, SEEDED)
        ctx = model.new_context(n_ctx=N_CTX)
        stream = ctx.stream(PROMPT, **SEEDED)
        pieces = [next(stream) for _ in range(12)]
        assert stream.pause()
        first = pool[0].pid
        os.kill(first, signal.SIGKILL)
        assert stream.resume()
        pieces += list(stream)
        assert "".join(pieces) == stream.result.text == reference
        assert pool[0].pid != first


def test_drain_moves_every_context_to_a_fresh_worker(gemma_path: Path) -> None:
    with Pool(1) as pool:
        model = pool[0].load_model(gemma_path)
        reference = _reference(model, GREEDY)
        idle, busy = model.new_context(n_ctx=N_CTX), model.new_context(n_ctx=N_CTX)
        idle.generate(PROMPT, **GREEDY)
        held = idle.tokens()
        old = pool[0]
        stream = busy.stream(PROMPT, **GREEDY)
        pieces = [next(stream) for _ in range(5)]
        fresh = pool.drain(0)
        assert pool[0] is fresh and not old.alive and fresh.alive
        assert idle.instance is fresh and busy.instance is fresh and idle.tokens() == held
        pieces += list(stream)
        assert "".join(pieces) == reference
        assert [os.path.basename(m.path) for m in fresh.models] == [os.path.basename(gemma_path)]
        assert pool.generate(PROMPT, **GREEDY).text == reference  # batched calls go to the fresh worker


def test_a_resumed_stream_killed_midway_completes_with_recovery(gemma_path: Path) -> None:
    with Pool(1, recover=True) as pool:
        model = pool[0].load_model(gemma_path)
        reference = _reference(model, SEEDED)
        ctx = model.new_context(n_ctx=N_CTX)
        stream = ctx.stream(PROMPT, **SEEDED)
        pieces = [next(stream) for _ in range(6)]
        assert stream.pause() and stream.resume()
        pieces += [next(stream) for _ in range(10)]
        first = pool[0].pid
        os.kill(first, signal.SIGKILL)  # under the Resume: the pieces it streamed since the pause are not repeated
        pieces += list(stream)
        assert "".join(pieces) == stream.result.text == reference
        assert pool[0].pid != first


def test_a_moved_stream_survives_a_crash_of_its_new_worker_with_recovery(gemma_path: Path) -> None:
    with Pool(2, recover=True) as pool:
        model = pool[0].load_model(gemma_path)
        pool[1].load_model(gemma_path)
        reference = _reference(model, SEEDED)
        ctx = model.new_context(n_ctx=N_CTX)
        stream = ctx.stream(PROMPT, **SEEDED)
        pieces = [next(stream) for _ in range(6)]
        ctx.move_to(pool[1])
        pieces += [next(stream) for _ in range(8)]
        os.kill(pool[1].pid, signal.SIGKILL)  # the moved context's journal: the state it arrived with, the hand-over
        pieces += list(stream)
        assert "".join(pieces) == stream.result.text == reference
        assert ctx.instance is pool[1] and pool[1].alive
        # After the stream, the context's history is restorable again: a second crash loses nothing.
        held = ctx.tokens()
        os.kill(pool[1].pid, signal.SIGKILL)
        assert ctx.tokens() == held


def test_a_chat_turn_pauses_and_moves(pair: tuple[Pool, Model, Model]) -> None:
    pool, model, _ = pair
    chat = model.new_context(n_ctx=N_CTX).chat(temperature=0.0, n_predict=24, ignore_eos=True)
    reference = model.new_context(n_ctx=N_CTX).chat(temperature=0.0, n_predict=24, ignore_eos=True)
    stream = chat.stream("Tell me about lighthouses.")
    pieces = [next(stream) for _ in range(4)]
    assert stream.pause()
    chat.context.move_to(_other(pool, chat.context))
    assert stream.resume()
    pieces += list(stream)
    expected = reference.send("Tell me about lighthouses.")
    assert stream.reply.result.tokens == expected.result.tokens and "".join(pieces) == expected.result.text
    assert chat.send("And then?").result.tokens == reference.send("And then?").result.tokens


LONG_PROMPT = ("The keeper climbed the hundred steps at dusk, trimmed the wick, wound the clockwork and wrote "
               "the weather in his log. ") * 60


@pytest.mark.parametrize("move", [False, True], ids=["in place", "moved"])
def test_a_stream_paused_inside_its_prompt_goes_on_from_there(pair: tuple[Pool, Model, Model], move: bool) -> None:
    pool, model, _ = pair
    tokens = model.tokenize(LONG_PROMPT)[:800]
    reference = model.new_context(n_ctx=N_CTX, n_ubatch=128)
    expected = reference.generate(tokens, **GREEDY)
    reference.close()
    ctx = model.new_context(n_ctx=N_CTX, n_ubatch=128)
    seen: list[int] = []
    holder: list[Any] = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if len(seen) == 1:
            holder[0].pause(wait=False)  # on the reader thread: takes effect at the next ubatch

    stream = ctx.stream(tokens, progress=progress, **GREEDY)
    holder.append(stream)
    assert stream.pause()  # already asked: waits for it
    held = ctx.n_past()
    assert 0 < held < len(tokens)  # stopped inside the prompt, every ubatch decoded kept
    if move:
        ctx.move_to(_other(pool, ctx))
        assert ctx.n_past() == held
    assert stream.resume()
    text = "".join(stream)
    assert text == stream.result.text == expected.text
    assert stream.result.n_cached == 0 and stream.result.n_prompt == len(tokens)
    assert seen == sorted(seen) and seen[-1] == len(tokens)
    ctx.close()


def test_moves_and_drains_from_many_threads_keep_every_context_whole(tiny_model: Path) -> None:
    """Threads move the same contexts about and drain the workers they live on, all at once: each move
    starts from where the context is when its hold is taken, two drains of one slot take turns, and at
    the end every context holds what it held, in a worker of the pool."""
    with Pool(3) as pool:
        models = [inst.load_model(tiny_model) for inst in pool]
        contexts = [models[k % 3].new_context(n_ctx=256) for k in range(6)]
        for k, ctx in enumerate(contexts):
            ctx.eval([1 + k, 2 + k, 3 + k])
        held = [ctx.tokens() for ctx in contexts]
        errors: list[BaseException] = []

        def churn(seed: int) -> None:
            import random

            rng = random.Random(seed)
            try:
                for _ in range(25):
                    if rng.random() < 0.2:
                        pool.drain(rng.randrange(len(pool)))
                        continue
                    ctx = rng.choice(contexts)
                    others = [i for i in pool.instances if i is not ctx.instance]
                    try:
                        ctx.move_to(rng.choice(others))
                    except (MigrationError, PoolClosedError, InvalidArgumentError):
                        pass  # its target was drained, or it got there first by another thread's move
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not errors, errors
        assert all(ctx.instance in pool.instances for ctx in contexts)
        assert [ctx.tokens() for ctx in contexts] == held
        assert len(pool.instances) == 3 and all(inst.alive for inst in pool.instances)
        with pytest.raises(InvalidArgumentError):
            pool.drain(3)
        gone = pool.instances[0]
        pool.drain(gone)
        with pytest.raises(InvalidArgumentError, match="not in the pool"):
            pool.drain(gone)


def test_a_drain_moves_what_can_move_before_it_raises_what_cannot(tiny_model: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with Pool(1) as pool:
        model = pool[0].load_model(tiny_model)
        stuck, free = model.new_context(n_ctx=256, n_seq_max=2), model.new_context(n_ctx=256)
        free.eval([5, 6, 7])
        root = stuck.branch([1, 2, 3])  # branches do not move
        old = pool[0]
        listed = old.drain_contexts  # a set's order: the refused one is made to come first
        monkeypatch.setattr(old, "drain_contexts", lambda: sorted(listed(), key=lambda c: c is not stuck))
        assert old.drain_contexts() == [stuck, free]
        with pytest.raises(ContextError, match="branches"):
            pool.drain(0)
        assert free.instance is pool[0] is not old and free.tokens() == [5, 6, 7]
        assert stuck.instance is old and old.alive and old not in pool.instances
        root.prune()
        stuck.move_to(pool[0])  # once pruned it moves; the old worker is then empty
        old.close()
        assert stuck.instance is pool[0] and free.tokens() == [5, 6, 7]


@pytest.mark.parametrize("sandbox", [True, False], ids=["confined", "unconfined"])
def test_a_move_hands_over_the_saved_file_and_leaves_no_descriptor(tiny_model: Path, sandbox: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's transfer file becomes the move's image, not a copy of it (a confined worker is given a
    new one: RenewTransfer); twenty moves leave every byte of the state as it was, and no descriptor."""

    def copied(*args: Any) -> None:
        raise AssertionError("a move copied its state out of the source's transfer file")

    monkeypatch.setattr(_image.StateFile, "fill", copied)
    with Pool(2, sandbox=sandbox) as pool:
        models = [inst.load_model(tiny_model) for inst in pool]
        ctx = models[0].new_context(n_ctx=256)
        ctx.eval(list(range(3, 120)))
        state = ctx.save_state()
        ctx.move_to(pool[1])
        ctx.move_to(pool[0])
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(10):
            ctx.move_to(pool[1])
            ctx.move_to(pool[0])
        assert len(os.listdir("/proc/self/fd")) == fds
        assert ctx.save_state() == state
        transfer = pool[1]._proc._transfer
        assert (transfer is not None) is sandbox  # a confined worker's own memfd, emptied after each use
        if transfer is not None:
            assert os.fstat(transfer.fd).st_size == 0
            with pytest.raises(BadRequestError, match="not this worker's transfer file"):
                pool[1]._proc.call(p.RenewTransfer(fd=0)).result()  # its stdin: refused, nothing swapped
            ctx.move_to(pool[1])  # which still serves, its transfer file and all
            ctx.generate("", append=True, n_predict=4, ignore_eos=True)
            assert ctx.n_past() == 117 + 4


def test_a_source_killed_once_its_state_was_saved_still_moves(tiny_model: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between its SaveState's reply and renewing its transfer file: the state is read out of the
    file all the same (the parent holds it), so the move commits in the target with all of it."""
    with Pool(2) as pool:
        models = [inst.load_model(tiny_model) for inst in pool]
        ctx = models[0].new_context(n_ctx=256)
        ctx.eval(list(range(3, 120)))
        tokens = ctx.tokens()
        proc = pool[0]._proc
        take = type(proc).take_transfer

        def killed_first(self: Any, f: Any) -> Any:
            if self is proc:
                _kill_and_see(proc)
            return take(self, f)

        monkeypatch.setattr(type(proc), "take_transfer", killed_first)
        ctx.move_to(pool[1])
        assert ctx.instance is pool[1] and ctx.tokens() == tokens
        ctx.generate("", append=True, n_predict=4, ignore_eos=True)
        assert ctx.n_past() == len(tokens) + 4
