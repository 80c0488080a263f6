"""A deterministic batcher (Model.batcher(deterministic=True), ContextParams.batch_invariant): a request's
tokens and log-probabilities are bit for bit those it gets alone, whatever else is in the batch: prompts
decoded beside each other, beside running requests, chunk by chunk, or on cells its slot kept. On Gemma 3
270M loaded with repack=False, compared with runs on this machine only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from served import Served, chat_with_the_serve_command

from lloyal_pool import ContextError, Model, Pool, Result

PATIENCE = 120.0  # a guard against hanging forever, never a timing assertion
PREAMBLE = "You answer questions about a small museum that opens at nine and closes at five. "
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(4)] + [
    "Once upon a time, in a land far away,", "The three primary colors are",
    PREAMBLE + "Question: when does it open?", PREAMBLE + "Question: when does it close?"]
N = 24


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    with Pool(1) as p:
        yield p


@pytest.fixture(scope="module")
def model(pool: Pool, gemma_path: Path) -> Model:
    return pool[0].load_model(gemma_path, repack=False)


def same(a: Result, b: Result) -> bool:
    """Same tokens and the same log-probabilities to the last bit (top alternatives included)."""
    return a.tokens == b.tokens and a.logprobs == b.logprobs


def test_every_request_is_bit_for_bit_what_it_is_alone(model: Model) -> None:
    b = model.batcher(slots=8, n_ctx_slot=256, chunk=16, deterministic=True)
    try:
        alone = [b.generate(p, n_predict=N, ignore_eos=True, logprobs=3) for p in PROMPTS]
        # All at once: the prompts decoded side by side, then every step a batch of eight.
        together = [h.future.result(PATIENCE)
                    for h in [b.submit(p, n_predict=N, ignore_eos=True, logprobs=3) for p in PROMPTS]]
        assert [same(t, a) for t, a in zip(together, alone, strict=True)] == [True] * len(PROMPTS)
        # Half of them arrive while the others generate: their prompts go in 16 tokens at a time, beside
        # running requests' tokens; and the preamble questions reuse the cells their slots kept.
        started = threading.Event()
        first = [b.submit(p, n_predict=N, ignore_eos=True, logprobs=3, on_piece=lambda _: started.set())
                 for p in PROMPTS[::2]]
        assert started.wait(PATIENCE)
        second = [b.submit(p, n_predict=N, ignore_eos=True, logprobs=3) for p in PROMPTS[1::2]]
        staggered = [h.future.result(PATIENCE) for h in first + second]
        want = alone[::2] + alone[1::2]
        assert [same(s, a) for s, a in zip(staggered, want, strict=True)] == [True] * len(PROMPTS)
        assert staggered[-1].n_cached > 0  # the last preamble question reused cells (its own or copied)
    finally:
        b.close()


def test_sampled_requests_replay_their_seeds_exactly_in_any_company(model: Model) -> None:
    b = model.batcher(slots=4, n_ctx_slot=256, deterministic=True)
    try:
        params = {"n_predict": 16, "temperature": 0.9, "top_k": 40, "seed": 7, "logprobs": 0}
        alone = b.generate(PROMPTS[5], **params)
        crowd = [b.submit(p, n_predict=16, ignore_eos=True) for p in PROMPTS[:3]]
        again = b.submit(PROMPTS[5], **params).future.result(PATIENCE)
        assert same(again, alone)
        for h in crowd:
            h.future.result(PATIENCE)
    finally:
        b.close()


def test_a_request_paused_for_a_higher_priority_one_goes_on_bit_for_bit(model: Model) -> None:
    # One slot runs; a second one is for preemption (Batcher(preempt_slots=1)).
    b = model.batcher(slots=1, n_ctx_slot=256, deterministic=True, preempt_slots=1)
    try:
        low_params = {"n_predict": 48, "ignore_eos": True, "temperature": 0.9, "top_k": 40, "seed": 5,
                      "repeat_penalty": 1.1, "logprobs": 2, "priority": 5}
        high_params = {"n_predict": 12, "ignore_eos": True, "logprobs": 2, "priority": 0}
        low_alone = b.generate(PROMPTS[4], **low_params)
        high_alone = b.generate(PROMPTS[5], **high_params)
        started = threading.Event()
        seen_paused: list[int] = []
        low = b.submit(PROMPTS[4], on_piece=lambda _: started.set(), **low_params)
        assert started.wait(PATIENCE)
        high = b.submit(PROMPTS[5], on_piece=lambda _: seen_paused.append(b.paused), **high_params)
        high_result = high.future.result(PATIENCE)
        assert not low.future.done()  # the urgent one ended first: the other waited, paused
        assert seen_paused and set(seen_paused) == {1}
        # Each is what it is alone: the paused one went on with its cache, sampler and penalty window.
        assert same(high_result, high_alone) and same(low.future.result(PATIENCE), low_alone)
        assert b.paused == 0 and b.active == 0
    finally:
        b.close()


def test_what_a_batch_invariant_context_needs_is_said_and_the_worker_serves_on(pool: Pool, model: Model,
                                                                            gemma_path: Path) -> None:
    repacked = pool[0].load_model(gemma_path)  # repack=True, the default
    try:
        with pytest.raises(ContextError, match="repack=False"):
            repacked.new_context(n_ctx=256, batch_invariant=True)
        with pytest.raises(ContextError, match="repack=False"):
            repacked.batcher(slots=2, n_ctx_slot=128, deterministic=True)
        with pytest.raises(ContextError, match="flash attention"):
            model.new_context(n_ctx=256, batch_invariant=True, flash_attn="off")
        ctx = model.new_context(n_ctx=512, n_seq_max=2, batch_invariant=True)
        assert ctx.generate("Hello", n_predict=2, ignore_eos=True).n_decoded == 2
        # Each sequence has a cache stream of its own there: llama.cpp copies between streams whole (it
        # aborts the process on a part); a part is refused.
        ctx.reset()
        ctx.decode(model.tokenize("One two three four"), 0, 1)
        with pytest.raises(ContextError, match="whole sequences"):
            ctx.kv.copy(1, 0, 0, 2)
        ctx.kv.free(1)
        assert ctx.generate("Hello", n_predict=2, ignore_eos=True).n_decoded == 2
        ctx.close()
    finally:
        repacked.close()


def test_the_serve_command_s_deterministic_flag() -> None:
    err = chat_with_the_serve_command(["--deterministic", "--slots", "2", "--n-ctx-slot", "256",
                                       "--preempt-slots", "1"])
    assert "deterministic" in err and "1 slot(s) for preemption" in err


def test_the_endpoint_on_a_deterministic_batcher_answers_each_request_as_alone(pool: Pool, model: Model) -> None:
    model.batcher(slots=4, n_ctx_slot=256, deterministic=True)
    served = Served(pool)
    try:
        client = served.client()

        def ask(prompt: str) -> tuple[str, list[float]]:
            c = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
            lp = c.choices[0].logprobs
            assert lp is not None and lp.token_logprobs is not None
            return c.choices[0].text, [float(x) for x in lp.token_logprobs]

        alone = [ask(p) for p in PROMPTS[:4]]
        with ThreadPoolExecutor(4) as ex:
            together = list(ex.map(ask, PROMPTS[:4]))
        assert together == alone
    finally:
        served.close()
