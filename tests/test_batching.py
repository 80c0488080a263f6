"""Continuous batching (batching.py): independent requests on one context, one decode per step for all,
and the pool's router over the workers that hold the model. On Gemma 3 270M, in a pool of its own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from invariance import assert_same_within_invariance, reference
from readme import run_section

from lloyal_pool import (
    CallTimeoutError,
    ContextOverflowError,
    GrammarError,
    InvalidArgumentError,
    InvalidTokenError,
    Model,
    Pool,
    PoolClosedError,
    Result,
    StaleHandleError,
    StopReason,
    WorkerCrashedError,
)
from lloyal_pool.errors import BadRequestError
from lloyal_pool.params import MAX_SEED
from lloyal_pool.routing import AFFINITY_TOKENS, common_prefix

PATIENCE = 120.0  # a guard against hanging forever, never a timing assertion
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(6)] + [
    "Once upon a time, in a land far away,", "The three primary colors are"]


@pytest.fixture(scope="module")
def bpool(gemma_path: Path) -> Iterator[Pool]:
    with Pool(2) as pool:
        for inst in pool:
            inst.load_model(gemma_path)
        yield pool


@pytest.fixture(scope="module")
def model(bpool: Pool) -> Model:
    return bpool[0]._model(None)


# -- one batcher ---------------------------------------------------------------------------------------
def test_concurrent_requests_equal_each_run_alone(bpool: Pool, model: Model) -> None:
    handles = [bpool[0].submit(p, n_predict=16) for p in PROMPTS]
    results = [h.future.result(PATIENCE) for h in handles]
    compared = 0
    for prompt, result in zip(PROMPTS, results, strict=True):
        want, margins = reference(model, prompt, 16)
        compared += assert_same_within_invariance(result.tokens, want, margins)
        assert result.n_prompt == len(model.tokenize(prompt, add_special=True, parse_special=True))
        assert result.n_decoded == len(result.tokens) and result.stop_reason in ("length", "eos")
    assert compared >= len(PROMPTS)  # the comparison had something to compare


def test_one_request_alone_is_generate(bpool: Pool, model: Model) -> None:
    ctx = model.new_context(n_ctx=512)
    try:
        for prompt in PROMPTS[:3]:
            want = ctx.generate(prompt, n_predict=12)
            got = bpool[0].generate(prompt, n_predict=12)
            n = assert_same_within_invariance(got.tokens, want.tokens, reference(model, prompt, 12)[1])
            if n == len(want.tokens):
                assert got.text == want.text
    finally:
        ctx.close()


def test_a_stream_joins_to_its_result_and_stops_where_generate_stops(bpool: Pool, model: Model) -> None:
    ctx = model.new_context(n_ctx=512)
    try:
        want = ctx.generate("Count: 1, 2, 3,", n_predict=40, stop=[", 9"])
    finally:
        ctx.close()
    with bpool[0].stream("Count: 1, 2, 3,", n_predict=40, stop=[", 9"]) as stream:
        pieces = list(stream)
    got = stream.result
    assert "".join(pieces) == got.text
    assert got.stop_reason == StopReason.STOP == want.stop_reason and got.text == want.text
    assert got.tokens == want.tokens  # the token that completed the stop string is among them


def test_stop_strings_are_matched_across_tokens_and_held_back(bpool: Pool) -> None:
    pieces: list[str] = []
    got = bpool[0].generate("Count: 1, 2, 3,", n_predict=40, stop=["6, 7"], on_piece=pieces.append)
    assert got.stop_reason == StopReason.STOP and "6" not in "".join(pieces)
    assert "".join(pieces) == got.text and got.text.endswith("5, ")


@pytest.mark.parametrize("render_special", [False, True])
def test_control_tokens_and_multibyte_text_come_out_as_generate_makes_them(
        bpool: Pool, model: Model, render_special: bool) -> None:
    # The text of a batched request is made in the worker by generate's own code: a control token's text
    # shows only with render_special, and characters are whole in every piece. A bias that makes the
    # model write <start_of_turn> (a control token) every time, and a grammar that leaves it one Japanese
    # sentence, make the output the same on every CPU.
    [control] = model.tokenize("<start_of_turn>", add_special=False, parse_special=True)
    cases = [dict(n_predict=4, logit_bias={control: 50.0}),
             dict(n_predict=40, grammar='root ::= "日本語のテキストです。"')]
    ctx = model.new_context(n_ctx=512)
    texts = []
    try:
        for params in cases:
            want = ctx.generate("Write:", render_special=render_special, **params)
            pieces: list[str] = []
            got = bpool[0].generate("Write:", render_special=render_special, on_piece=pieces.append, **params)
            assert (got.text, got.tokens, got.stop_reason) == (want.text, want.tokens, want.stop_reason)
            assert "".join(pieces) == got.text and all("\ufffd" not in piece for piece in pieces)
            texts.append(got.text)
    finally:
        ctx.close()
    assert texts == ["<start_of_turn>" * 4 if render_special else "", "日本語のテキストです。"]


def test_interrupting_one_request_leaves_the_others_running(bpool: Pool) -> None:
    batcher = bpool[0]._model(None).batcher()
    long_one = bpool[0].submit("Tell me a long story.", n_predict=0, ignore_eos=True)
    others = [bpool[0].submit(p, n_predict=24, ignore_eos=True) for p in PROMPTS[:3]]
    deadline = time.monotonic() + PATIENCE
    while batcher.active < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    long_one.interrupt()
    stopped = long_one.future.result(PATIENCE)
    assert stopped.stop_reason == StopReason.INTERRUPTED
    assert stopped.n_decoded < batcher.n_ctx_slot // 2
    for h in others:
        r = h.future.result(PATIENCE)
        assert r.n_decoded == 24 and r.stop_reason == StopReason.LENGTH


def test_a_request_interrupted_while_queued_never_runs(gemma_path: Path) -> None:
    with Pool(1) as pool:
        m = pool[0].load_model(gemma_path)
        b = m.batcher(slots=1)
        first = b.submit("Once upon a time", n_predict=16, ignore_eos=True)
        queued = b.submit("Once upon a time", n_predict=16, ignore_eos=True)
        queued.interrupt()
        r = queued.future.result(PATIENCE)
        assert r.stop_reason == StopReason.INTERRUPTED and r.n_decoded == 0
        assert first.future.result(PATIENCE).n_decoded == 16


def test_more_requests_than_slots_wait_for_a_free_one(gemma_path: Path) -> None:
    with Pool(1) as pool:
        m = pool[0].load_model(gemma_path)
        b = m.batcher(slots=2, n_ctx_slot=256)
        handles = [b.submit(f"Item {i}:", n_predict=8, ignore_eos=True) for i in range(7)]
        peak_queue = max(b.queued, 0)
        results = [h.future.result(PATIENCE) for h in handles]
        assert all(r.n_decoded == 8 for r in results)
        assert peak_queue >= 1 and b.active == 0 and b.queued == 0


def test_a_prompt_that_starts_like_a_slots_last_one_reuses_its_cache(gemma_path: Path) -> None:
    with Pool(1) as pool:
        m = pool[0].load_model(gemma_path)
        b = m.batcher(slots=2)
        story = "The museum opens at nine and closes at five. It has three floors of paintings."
        first = b.generate(story + " Question: when does it open?", n_predict=4)
        assert first.n_cached == 0
        second = b.generate(story + " Question: how many floors?", n_predict=4)
        prefix = len(m.tokenize(story, add_special=True, parse_special=True))
        assert second.n_cached >= prefix - 1
        again = b.generate(story + " Question: how many floors?", n_predict=4)
        assert again.n_cached == again.n_prompt - 1 and again.tokens == second.tokens


def test_a_new_prompt_goes_in_with_the_running_tokens_one_decode_for_both(gemma_path: Path) -> None:
    # As llama-server's batches: while a prompt is prefilled chunk by chunk, each chunk's decode also
    # carries the running requests' next tokens, so they wait one decode per token, not two.
    with Pool(1) as pool:
        m = pool[0].load_model(gemma_path)
        b = m.batcher(slots=3, chunk=16)
        store = b.context.branches
        real_prefill, real_commit = store.prefill, store.commit
        calls: list[tuple[str, int, int]] = []

        def prefill(items: Any, *, commits: Any = (), progress: Any = None, lora: Any = None) -> float:
            items, commits = list(items), list(commits)
            calls.append(("prefill", sum(len(t) for _, t in items), len(commits)))
            return real_prefill(items, commits=commits, progress=progress, lora=lora)

        def commit(pairs: Any) -> float:
            calls.append(("commit", 0, len(list(pairs))))
            return real_commit(pairs)

        store.prefill, store.commit = prefill, commit  # type: ignore[method-assign]
        started = threading.Event()
        # Two running, one coming: the coming prompt goes in a chunk at a time.
        running = [b.submit(p, n_predict=48, ignore_eos=True, on_piece=lambda _: started.set())
                   for p in ("Once upon a time", "The river")]
        assert started.wait(PATIENCE)
        late = b.submit(" ".join(["river"] * 70), n_predict=4, ignore_eos=True)
        assert late.future.result(PATIENCE).n_decoded == 4
        assert [r.future.result(PATIENCE).n_decoded for r in running] == [48, 48]
        mixed = [c for c in calls if c[0] == "prefill" and c[1] > 0 and c[2] == 2]
        assert len(mixed) >= 70 // 16, calls  # every chunk of the late prompt took the running tokens along
        assert not [c for c in calls if c[0] == "commit"], calls


def test_a_prefix_shorter_than_the_affinity_is_decoded_again_not_kept(gemma_path: Path) -> None:
    # Every text prompt shares its BOS: keeping that one cell left it wherever the slot's last request had
    # put it, and a burst's prefill attended to the cache up to there (2.5% slower, bench_serving).
    with Pool(1) as pool:
        m = pool[0].load_model(gemma_path)
        b = m.batcher(slots=1)
        b.generate("Apples are red.", n_predict=2)
        short = b.generate("Apples grow on trees in the orchard.", n_predict=2)
        shared = common_prefix(m.tokenize("Apples are red.", add_special=True),
                                m.tokenize("Apples grow on trees in the orchard.", add_special=True))
        assert 1 <= shared < AFFINITY_TOKENS and short.n_cached == 0
        b.generate("ok", n_predict=1)
        again = b.generate("ok", n_predict=1)  # a whole short prompt seen before: decoded again too
        assert again.n_cached == 0


def test_each_request_keeps_its_own_grammar_params_and_limits(bpool: Pool) -> None:
    digits = bpool[0].submit("Pick a number:", n_predict=6, grammar='root ::= [0-9]+ " "')
    free = bpool[0].submit("Pick a number:", n_predict=6)
    capped = bpool[0].submit("Pick a number:", n_predict=3, ignore_eos=True)
    sampled = [bpool[0].submit("Pick a number:", n_predict=8, temperature=1.5, seed=s) for s in (1, 2, 3)]
    greedy = bpool[0].submit("Pick a number:", n_predict=8)
    d = digits.future.result(PATIENCE)
    assert d.text.strip().isdigit(), d.text
    assert free.future.result(PATIENCE).n_decoded >= 1
    assert capped.future.result(PATIENCE).n_decoded == 3
    # Sampling is each request's own: three seeds at a high temperature do not all make the greedy text.
    # (The same seed twice in one batch need not replay exactly: rows beside it move its logits a little.)
    texts = {h.future.result(PATIENCE).text for h in sampled}
    assert len(texts | {greedy.future.result(PATIENCE).text}) >= 2


def test_bad_requests_fail_alone_and_the_batcher_serves_on(bpool: Pool, model: Model) -> None:
    b = model.batcher()
    with pytest.raises(ContextOverflowError, match="n_ctx_slot"):
        bpool[0].generate(list(range(1, b.n_ctx_slot + 1)), n_predict=1)
    with pytest.raises(InvalidTokenError):
        bpool[0].generate([2, model.n_vocab], n_predict=1)
    running = bpool[0].submit("Once upon a time", n_predict=16, ignore_eos=True)
    with pytest.raises(GrammarError):
        bpool[0].generate("Hi", n_predict=2, grammar="root ::= (")
    with pytest.raises(ValueError):
        bpool[0].generate("", n_predict=2)
    # Fields the loop itself reads: a string n_predict used to stop the loop (and fail every request on it)
    # with a TypeError; each is refused at submit now, typed.
    for bad in ({"n_predict": "x"}, {"n_predict": 1.5}, {"ignore_eos": 1}, {"stop": [1]}, {"stop": 5},
                {"temperature": "hot"}, {"top_k": 2.0}, {"grammar": 5}):
        with pytest.raises(BadRequestError):
            bpool[0].generate("Hi", **bad)

    def boom(_: str) -> None:
        raise KeyError("from on_piece")

    with pytest.raises(KeyError, match="from on_piece"):
        bpool[0].generate("Hi there", n_predict=8, ignore_eos=True, on_piece=boom)
    assert running.future.result(PATIENCE).n_decoded == 16
    assert bpool[0].generate("Hi", n_predict=2, ignore_eos=True).n_decoded == 2


def test_a_timeout_interrupts_the_request(bpool: Pool) -> None:
    with pytest.raises(CallTimeoutError) as err:
        bpool[0].generate("Tell me a story.", n_predict=0, ignore_eos=True, timeout=0.3)
    partial = err.value.result
    assert isinstance(partial, Result) and partial.stop_reason == StopReason.INTERRUPTED


def test_naming_the_model(bpool: Pool, model: Model, gemma_path: Path) -> None:
    assert bpool[0]._model(gemma_path.name) is model
    assert bpool[0]._model(gemma_path.stem) is model and bpool[0]._model(str(gemma_path)) is model
    with pytest.raises(InvalidArgumentError, match="no model named"):
        bpool[0].generate("Hi", model="nonexistent", n_predict=1)
    with pytest.raises(InvalidArgumentError, match="another worker"):
        bpool[1].generate("Hi", model=model, n_predict=1)
    with pytest.raises(InvalidArgumentError, match="other options"):
        model.batcher(slots=3)


def test_a_worker_without_a_model_or_with_two_must_be_told_which(gemma_path: Path, tiny_model: Path) -> None:
    with Pool(1) as pool:
        with pytest.raises(InvalidArgumentError, match="holds 0 models"):
            pool[0].generate("Hi", n_predict=1)
        pool[0].load_model(gemma_path)
        tiny = pool[0].load_model(tiny_model)
        with pytest.raises(InvalidArgumentError, match="holds 2 models"):
            pool[0].generate("Hi", n_predict=1)
        assert pool[0].generate([1, 2, 3], model=tiny, n_predict=2, ignore_eos=True).n_decoded == 2


def test_closing_the_model_ends_its_batcher(gemma_path: Path) -> None:
    with Pool(1) as pool:
        m = pool[0].load_model(gemma_path)
        h = m.batcher().submit("Tell me a story.", n_predict=0, ignore_eos=True)
        m.close()
        with pytest.raises(StaleHandleError, match=r"model .* was closed"):
            h.future.result(PATIENCE)
        with pytest.raises(StaleHandleError):
            m.batcher()
        with pytest.raises(InvalidArgumentError, match="holds 0 models"):
            pool.generate("Hi", n_predict=1)


def test_requests_in_flight_when_the_pool_closes_raise_pool_closed(gemma_path: Path) -> None:
    pool = Pool(1)
    pool[0].load_model(gemma_path)
    h = pool.submit("Tell me a story.", n_predict=0, ignore_eos=True)
    pool.close()
    with pytest.raises(PoolClosedError):
        h.future.result(PATIENCE)
    with pytest.raises(PoolClosedError):
        pool.generate("Hi")


# -- the router -----------------------------------------------------------------------------------------
def test_the_pool_spreads_requests_over_its_workers(bpool: Pool) -> None:
    batchers = [inst._model(None).batcher() for inst in bpool]
    handles = [bpool.submit(f"Story {i}:", n_predict=32, ignore_eos=True) for i in range(4)]
    spread = [b.active + b.queued for b in batchers]  # a request counts from its submit on
    for h in handles:
        h.future.result(PATIENCE)
    assert spread == [2, 2], spread


def test_a_conversation_goes_back_to_the_worker_that_holds_its_cache(bpool: Pool) -> None:
    history = "A conversation about museums. The museum opens at nine and closes at five. " * 2
    first = bpool.generate(history + "When does it open?", n_predict=4)
    assert first.n_cached < AFFINITY_TOKENS
    for _ in range(3):  # whichever worker is less loaded, the cache decides
        follow = bpool.generate(history + "When does it close?", n_predict=4)
        assert follow.n_cached >= AFFINITY_TOKENS


def test_a_dead_workers_greedy_request_goes_on_in_another_worker_giving_nothing_twice(gemma_path: Path) -> None:
    with Pool(2) as pool:
        for inst in pool:
            inst.load_model(gemma_path)
        victim = pool[0]
        pieces: list[str] = []
        started = threading.Event()

        def on_piece(piece: str) -> None:
            pieces.append(piece)
            if len(pieces) >= 4:
                started.set()

        # Alone in a fresh batcher, here and in the other worker's: made again from the start, it makes
        # the same text, and its caller is given only what it had not had.
        h = victim.submit("Tell me a story.", n_predict=48, ignore_eos=True, on_piece=on_piece)
        assert started.wait(PATIENCE)
        victim.kill()
        result = h.future.result(PATIENCE)
        assert result.n_decoded == 48 and result.text == "".join(pieces)
        assert not victim.alive
        for _ in range(3):
            assert pool.generate("Hi", n_predict=2, ignore_eos=True).n_decoded == 2


# -- asyncio ----------------------------------------------------------------------------------------------
def test_the_asyncio_face_of_batched_requests(bpool: Pool) -> None:
    async def main() -> None:
        results = await asyncio.gather(*(bpool.agenerate(p, n_predict=8, ignore_eos=True) for p in PROMPTS[:4]))
        assert all(r.n_decoded == 8 for r in results)
        stream = bpool.astream("Count: 1, 2, 3,", n_predict=12)
        pieces = [piece async for piece in stream]
        assert "".join(pieces) == (await stream.result()).text
        task = asyncio.create_task(bpool.agenerate("Tell me a story.", n_predict=0, ignore_eos=True))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        more = await asyncio.gather(*(bpool.agenerate("Hi", n_predict=2, ignore_eos=True) for _ in range(4)))
        assert all(r.n_decoded == 2 for r in more)
        # The cancelled request was ended at the step after its cancel, long before these four ended.
        assert sum(inst._model(None).batcher().active for inst in bpool) == 0

    asyncio.run(asyncio.wait_for(main(), PATIENCE))


def test_the_readme_batching_example_runs_as_written() -> None:
    out = run_section("## Many requests at once")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 10 and all(line.startswith(f"Question {i}:") for i, line in enumerate(lines[:8]))
    assert lines[8].endswith("| stop") and ", 9" not in lines[8]
    assert lines[9].startswith("interrupted after ")


@pytest.mark.parametrize("busy", [True, False])
def test_with_recover_a_dead_worker_serves_batched_requests_again(gemma_path: Path, busy: bool) -> None:
    with Pool(2, recover=True) as pool:
        for inst in pool:
            inst.load_model(gemma_path)
        first = pool[0].generate("Hi", n_predict=2, ignore_eos=True)
        assert first.n_decoded == 2
        started = threading.Event()
        h = pool[0].submit("Tell me a story.", n_predict=0, ignore_eos=True, temperature=0.9, seed=MAX_SEED,
                           on_piece=lambda _: started.set()) if busy else None
        if h is not None:
            assert started.wait(PATIENCE)
        pool[0].kill()
        if h is not None:  # it had sampled tokens at random: made again it would write other text
            with pytest.raises(WorkerCrashedError):
                h.future.result(PATIENCE)
        # The replacement has the model again, and a fresh batcher serves on it.
        assert pool[0].generate("Hi", n_predict=3, ignore_eos=True, timeout=PATIENCE).n_decoded == 3
        assert all(pool.generate("Hi", n_predict=2, ignore_eos=True).n_decoded == 2 for _ in range(4))


def test_requests_that_had_not_started_when_the_worker_died_run_on_its_replacement(gemma_path: Path) -> None:
    with Pool(1, recover=True) as pool:
        pool[0].load_model(gemma_path).batcher(slots=1)
        started = threading.Event()
        running = pool[0].submit("Tell me a story.", n_predict=0, ignore_eos=True, temperature=0.9, seed=MAX_SEED,
                                 on_piece=lambda _: started.set())  # at random: it cannot be made again
        queued = [pool[0].submit(f"Item {i}:", n_predict=4, ignore_eos=True) for i in range(3)]
        assert started.wait(PATIENCE)
        pool[0].kill()
        with pytest.raises(WorkerCrashedError):
            running.future.result(PATIENCE)
        assert [q.future.result(PATIENCE).n_decoded for q in queued] == [4, 4, 4]
        assert pool[0].models[0].batcher().slots == 1  # made again with the options of the first


def test_closing_the_pool_ends_every_batcher_loop(gemma_path: Path) -> None:
    before = {t for t in threading.enumerate() if t.name == "lloyal-batcher"}
    with Pool(2) as pool:
        for inst in pool:
            inst.load_model(gemma_path)
            assert inst.generate("Hi", n_predict=1).n_decoded == 1  # an idle batcher per worker now
    deadline = time.monotonic() + PATIENCE
    while {t for t in threading.enumerate() if t.name == "lloyal-batcher"} - before:
        assert time.monotonic() < deadline, "a batcher loop outlived its pool"
        time.sleep(0.01)
