"""Several choices of one prompt (OpenAI's ``n`` and ``best_of``: BatchedCalls.generate, Batcher.submit_many)
and request priority in the batcher's queue. On Gemma 3 270M, in a pool of its own; greedy outputs are
compared with the prompt decoded alone on the same machine, within the batch invariance tests/invariance.py
describes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from invariance import assert_same_within_invariance, reference

from lloyal_pool import InvalidArgumentError, Model, Pool, Result
from lloyal_pool.batching import Batcher

PATIENCE = 120.0  # a guard against hanging forever, never a timing assertion
# Long enough (>= 40 tokens) that its choices share its cells rather than each decode it.
PROMPT = ("The museum opens at nine and closes at five, every day but Monday. It has three floors: paintings on "
          "the first, sculpture on the second, and a cafe with a view of the river on the third. Question: when "
          "does it open? Answer:")
# The same preamble, then a count: a greedy reply with no near tie in its first 16 tokens (margins above 2
# logits, measured), so every choice can be compared whole.
COUNT = PROMPT.rsplit("Question", 1)[0] + "Counting the visitors: 1, 2, 3, 4, 5, 6,"


@pytest.fixture(scope="module")
def cpool(gemma_path: Path) -> Iterator[Pool]:
    with Pool(1) as pool:
        pool[0].load_model(gemma_path).batcher(slots=4, n_ctx_slot=512)
        yield pool


@pytest.fixture(scope="module")
def model(cpool: Pool) -> Model:
    return cpool[0].models[0]


def mean_logprob(result: Result) -> float:
    assert result.logprobs
    return sum(t.logprob for t in result.logprobs) / len(result.logprobs)


def test_n_choices_are_results_of_their_own_that_share_the_prompts_cells(cpool: Pool) -> None:
    results = cpool.generate(PROMPT, n=3, temperature=0.9, seed=5, n_predict=12, ignore_eos=True)
    assert len(results) == 3 and all(isinstance(r, Result) for r in results)
    assert all(r.n_decoded == 12 == len(r.tokens) for r in results)
    assert len({tuple(r.tokens) for r in results}) > 1  # seeds 5, 6, 7: the choices differ
    # The prompt was decoded once: the other choices copied its cells (all but the last token, decoded
    # again for the logits of each one's first choice).
    assert results[0].n_prompt >= 40
    assert [r.n_cached for r in results[1:]] == [results[0].n_prompt - 1] * 2, [r.n_cached for r in results]
    again = cpool.generate(PROMPT, n=3, temperature=0.9, seed=5, n_predict=12, ignore_eos=True)
    assert [r.text for r in again] == [r.text for r in results]  # seeded: the same call replays them


def test_greedy_choices_are_the_prompts_greedy_reply(cpool: Pool, model: Model) -> None:
    choices = cpool.generate(COUNT, n=3, temperature=0, n_predict=16)
    alone = cpool.generate(COUNT, temperature=0, n_predict=16)
    assert [len(r.tokens) for r in choices] == [16] * 3
    # The first choice's first token comes from the prompt's prefill, the others' from their last prompt
    # token decoded again beside it: equal to a reply decoded alone up to a near tie (none on this CPU).
    want, margins = reference(model, COUNT, 16)
    compared = [assert_same_within_invariance(r.tokens, want, margins) for r in [*choices, alone]]
    assert min(compared) >= 8  # the reference is stable far enough to compare


def test_best_of_returns_the_choices_with_the_highest_mean_logprob(cpool: Pool) -> None:
    kw = dict(temperature=0.9, seed=11, n_predict=10, ignore_eos=True)
    every = cpool.generate(PROMPT, n=3, logprobs=0, **kw)
    best = cpool.generate(PROMPT, n=2, best_of=3, **kw)
    assert len(best) == 2 and all(r.logprobs is None for r in best)  # not asked for: not kept
    ranked = sorted(every, key=mean_logprob, reverse=True)
    assert [r.tokens for r in best] == [r.tokens for r in ranked[:2]]
    asked = cpool.generate(PROMPT, n=2, best_of=3, logprobs=0, **kw)
    assert mean_logprob(asked[0]) >= mean_logprob(asked[1])
    assert [r.tokens for r in asked] == [r.tokens for r in best]
    with pytest.raises(InvalidArgumentError, match="best_of"):
        cpool.generate(PROMPT, n=2, best_of=1, **kw)


def test_more_choices_than_slots_are_refused(cpool: Pool, model: Model) -> None:
    slots = model.batcher().slots
    with pytest.raises(InvalidArgumentError, match="slots"):
        cpool.generate(PROMPT, n=slots + 1, n_predict=2)
    with pytest.raises(InvalidArgumentError):
        model.batcher().submit_many(PROMPT, None, 0)
    assert len(cpool.generate(PROMPT, n=slots, n_predict=2)) == slots  # and it serves on


def test_a_lower_priority_value_is_admitted_first(model: Model) -> None:
    b = Batcher(model, slots=1, n_ctx_slot=512)
    try:
        started = threading.Event()
        first: dict[str, float] = {}

        def stamp(name: str) -> Callable[[str], None]:
            def on_piece(_piece: str) -> None:
                first.setdefault(name, time.monotonic())

            return on_piece

        busy = b.submit("Tell me a long story.", n_predict=24, ignore_eos=True, on_piece=lambda _: started.set())
        assert started.wait(PATIENCE)  # the one slot is taken: the next two wait in the queue
        normal = b.submit("Count: 1, 2, 3,", n_predict=4, ignore_eos=True, on_piece=stamp("normal"))
        urgent = b.submit("Name a colour:", n_predict=4, ignore_eos=True, priority=-1, on_piece=stamp("urgent"))
        for h in (busy, normal, urgent):
            assert h.future.result(PATIENCE).n_decoded > 0
        assert first["urgent"] < first["normal"], first  # submitted second, admitted first
    finally:
        b.close()
