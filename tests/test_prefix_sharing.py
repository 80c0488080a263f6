"""Cross-slot prefix sharing in the batcher (Scheduler.admit, Batcher._place): a prompt whose prefix another
slot holds copies those cells (llama_memory_seq_cp) instead of decoding them, and a burst with one preamble
decodes it once. On Gemma 3 270M; outputs are compared with each prompt run alone on the same machine,
within the batch invariance tests/invariance.py describes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from invariance import LOGPROB_INVARIANCE, log_softmax, rows

from lloyal_pool import Context, Model, Pool, Result
from lloyal_pool.batching import Batcher
from lloyal_pool.routing import common_prefix

PATIENCE = 120.0  # a guard against hanging forever, never a timing assertion
PREAMBLE = ("You are a careful assistant for a museum. The museum opens at nine and closes at five, every day "
            "but Monday. It has three floors: paintings on the first, sculpture on the second, and a cafe with "
            "a view of the river on the third. Tickets cost twelve euros; children under twelve go free. ")
QUESTIONS = ["When does it open?", "What is on the second floor?", "How much is a ticket?", "Is it open on Monday?"]


@pytest.fixture(scope="module")
def model(gemma_path: Path) -> Iterator[Model]:
    with Pool(1) as pool:
        yield pool[0].load_model(gemma_path)


@pytest.fixture(scope="module")
def alone(model: Model) -> Iterator[Context]:
    ctx = model.new_context(n_ctx=1024)
    yield ctx
    ctx.close()


def assert_as_alone(alone: Context, prompt: list[int], result: Result) -> None:
    """Every step of result is the step of its prompt decoded alone (teacher-forced on its own tokens), within
    the batch-invariance bound: cells copied from another slot are the cells this prompt would have made.
    A copy of the wrong cells (another prompt's, a missing range) moves the log-probabilities by far more."""
    assert result.logprobs is not None and len(result.logprobs) == len(result.tokens) > 0
    for lp, z in zip(result.logprobs, rows(alone, prompt, result.tokens), strict=True):
        want = log_softmax(z)
        assert lp.logprob == pytest.approx(want[lp.token], abs=LOGPROB_INVARIANCE)
        assert all(v == pytest.approx(want[t], abs=LOGPROB_INVARIANCE) for t, v, _ in lp.top)


class Prefills:
    """Counts the prompt tokens each decode of a batcher takes (its prefill calls), per call."""

    def __init__(self, batcher: Batcher) -> None:
        store = batcher.context.branches
        real = store.prefill
        self.calls: list[int] = []

        def prefill(items: Any, *, commits: Any = (), progress: Any = None, lora: Any = None) -> float:
            items = list(items)
            self.calls.append(sum(len(t) for _, t in items))
            return real(items, commits=commits, progress=progress, lora=lora)

        store.prefill = prefill  # type: ignore[method-assign]


def test_a_burst_with_one_preamble_decodes_it_once_and_each_answer_is_its_own(model: Model, alone: Context) -> None:
    b = model.batcher(slots=4, n_ctx_slot=512)
    try:
        prefills = Prefills(b)
        prompts = [PREAMBLE + "Question: " + q + " Answer:" for q in QUESTIONS]
        tokens = [b.tokens(p) for p in prompts]
        shared = min(common_prefix(tokens[0], t) for t in tokens[1:])
        assert shared > 50
        results = [h.future.result(PATIENCE)
                   for h in [b.submit(p, n_predict=12, ignore_eos=True, logprobs=5) for p in prompts]]
        # The first request decodes its whole prompt; the others copy the preamble's cells from its slot.
        assert results[0].n_cached == 0
        assert all(r.n_cached >= shared for r in results[1:]), [r.n_cached for r in results]
        assert sum(prefills.calls) == sum(len(t) - r.n_cached for t, r in zip(tokens, results, strict=True))
        assert sum(prefills.calls) < len(tokens[0]) + sum(len(t) - shared for t in tokens[1:]) + 4
        for t, result in zip(tokens, results, strict=True):
            assert_as_alone(alone, t, result)
    finally:
        b.close()


def test_a_request_copies_the_prefix_a_running_request_holds_and_keeps_it_when_that_slot_moves_on(
        model: Model, alone: Context) -> None:
    # Copied cells are shared, not moved: when the source slot's request ends and the slot takes an unrelated
    # prompt (dropping its cells), the copy keeps its own and its answer stays the prompt's answer alone.
    b = model.batcher(slots=2, n_ctx_slot=512)
    try:
        started = threading.Event()
        source_prompt = PREAMBLE + "Tell me everything about the museum."
        source = b.submit(source_prompt, n_predict=8, ignore_eos=True, on_piece=lambda _: started.set())
        assert started.wait(PATIENCE)
        prompt = PREAMBLE + "Question: " + QUESTIONS[2] + " Answer:"
        shared = common_prefix(b.tokens(source_prompt), b.tokens(prompt))
        late = b.submit(prompt, n_predict=40, ignore_eos=True, logprobs=5)
        assert source.future.result(PATIENCE).n_decoded == 8
        other = b.generate("A completely different prompt about the weather in spring", n_predict=4)
        assert other.n_cached == 0 and not late.future.done()  # the source slot dropped its cells meanwhile
        result = late.future.result(PATIENCE)
        assert result.n_cached >= shared > 50  # copied from the busy slot: its own slot held nothing
        assert_as_alone(alone, b.tokens(prompt), result)
    finally:
        b.close()
