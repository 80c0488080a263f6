"""Speculative decoding (Context.generate_with_draft): every token is the target sampler's choice, whatever
the drafter ("ngram" prompt lookup, or a draft context with the same vocabulary) proposed."""

from __future__ import annotations

import math
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lloyal_pool import ContextError, Model, Pool, Result, StaleHandleError, StopReason

REPEATS = "The capital of France is"  # Gemma's base model repeats itself after this: ngram drafts hit
# llama.cpp's CPU kernels are not batch-invariant: a row computed in a batch of 9 differs from the same row
# computed alone by up to ~0.7 in a logit on Gemma Q4_K_M (measured), so greedy choices at a near tie may
# differ between a speculative and a plain run. A divergence must be such a tie.
NEAR_TIE = 1.0


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _assert_same_greedy(model: Model, prompt: str, plain: Result, spec: Result) -> None:
    k = _first_divergence(plain.tokens, spec.tokens)
    if k is None:
        assert plain.tokens == spec.tokens and plain.text == spec.text
        return
    # The plain run's logits where the two went different ways: the two choices are its top two, within
    # the batch non-invariance of each other.
    ctx = model.new_context(n_ctx=1024)
    try:
        ctx.generate(prompt, n_predict=k, cache_prompt=False) if k else ctx.eval(prompt)
        z = ctx.logits(copy=True)
    finally:
        ctx.close()
    top2 = [int(t) for t in np.argsort(z)[::-1][:2]]
    assert {plain.tokens[k], spec.tokens[k]} == set(top2), (k, top2, plain.tokens[k], spec.tokens[k])
    assert z[top2[0]] - z[top2[1]] < NEAR_TIE, (k, z[top2[0]] - z[top2[1]])


def _ngram_draft(history: list[int], n: int, n_min: int, n_max: int) -> list[int]:
    """What the "ngram" drafter proposes after history (speculative.cpp, written again here)."""
    for k in range(min(n_max, len(history) - 1), n_min - 1, -1):
        key = history[len(history) - k:]
        for i in range(len(history) - k - 1, -1, -1):
            if history[i:i + k] == key:
                out: list[int] = []
                for j in range(i + k, i + k + n):
                    out.append(history[j] if j < len(history) else out[j - len(history)])
                return out
    return []


def _ngram_counts(prompt: list[int], out: list[int], n_draft: int, n_predict: int, n_min: int = 2,
                  n_max: int = 4) -> tuple[int, int]:
    """(drafted, accepted) of a speculative run with the ngram drafter that emitted ``out``: every draft
    depends only on the tokens before it, and is accepted while it agrees with what was emitted."""
    history, k, drafted, accepted = list(prompt), 0, 0, 0
    while k < len(out):
        history.append(out[k])  # a token the target chose
        k += 1
        drafts = _ngram_draft(history, min(n_draft, n_predict - k), n_min, n_max)
        drafted += len(drafts)
        for d in drafts:
            if k == len(out):
                break
            history.append(out[k])
            k += 1
            if out[k - 1] != d:
                break  # rejected: the target's own choice was decoded instead
            accepted += 1
    return drafted, accepted


@pytest.mark.gemma
def test_ngram_drafts_keep_greedy_output(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        plain = ctx.generate(REPEATS, n_predict=96, cache_prompt=False)
        spec = ctx.generate_with_draft(REPEATS, draft="ngram", n_draft=8, n_predict=96, cache_prompt=False)
    finally:
        ctx.close()
    assert spec.n_decoded == 96 and spec.stop_reason is StopReason.LENGTH
    # How many drafts hit depends on what the model wrote, which each CPU's kernels sway: the counts must be
    # those the drafter yields on this very output, and a text that repeats itself must have hits.
    drafted, accepted = _ngram_counts(gemma.tokenize(REPEATS), spec.tokens, n_draft=8, n_predict=96)
    assert (spec.n_drafted, spec.n_accepted) == (drafted, accepted)
    assert spec.n_accepted > 0 and spec.acceptance_rate == accepted / drafted
    _assert_same_greedy(gemma, REPEATS, plain, spec)


@pytest.mark.gemma
def test_a_draft_context_of_the_same_model_is_accepted_almost_always(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    draft = gemma.new_context(n_ctx=1024)
    try:
        prompt = "Here is a short story about a robot who learns to paint."
        plain = ctx.generate(prompt, n_predict=48, cache_prompt=False)
        spec = ctx.generate_with_draft(prompt, draft=draft, n_draft=4, n_predict=48, cache_prompt=False)
        # The draft context keeps its history: a second call reuses it.
        again = ctx.generate_with_draft(prompt, draft=draft, n_draft=4, n_predict=48)
    finally:
        ctx.close()
        draft.close()
    assert spec.n_drafted > 20 and spec.acceptance_rate > 0.8, (spec.n_drafted, spec.n_accepted)
    _assert_same_greedy(gemma, prompt, plain, spec)
    assert again.n_decoded == 48


@pytest.mark.gemma
def test_a_truncated_gemma_drafter_changes_nothing_but_the_speed(gemma: Model, pool: Pool,
                                                                  gemma_draft_path: Path) -> None:
    # Gemma's first 4 blocks share its vocabulary but were never trained to predict from there: most
    # drafts are rejected, and the output must still be the target's own.
    small = pool[0].load_model(gemma_draft_path)
    ctx = gemma.new_context(n_ctx=512)
    draft = small.new_context(n_ctx=512)
    try:
        plain = ctx.generate(REPEATS, n_predict=32, cache_prompt=False)
        spec = ctx.generate_with_draft(REPEATS, draft=draft, n_draft=4, n_predict=32, cache_prompt=False)
    finally:
        ctx.close()
        draft.close()
        small.close()
    assert spec.n_drafted > 0 and spec.n_decoded == 32
    _assert_same_greedy(gemma, REPEATS, plain, spec)


def test_tiny_model_speculation_is_exact(tiny: Model) -> None:
    # The tiny model's logits are well spread (no near ties): here greedy output is identical.
    ctx = tiny.new_context(n_ctx=512)
    draft = tiny.new_context(n_ctx=512)
    try:
        prompt = [1, 450, 4996, 17354, 1701, 29916]
        plain = ctx.generate(prompt, n_predict=64, cache_prompt=False)
        by_model = ctx.generate_with_draft(prompt, draft=draft, n_predict=64, cache_prompt=False)
        by_ngram = ctx.generate_with_draft(prompt, draft="ngram", ngram_min=1, n_predict=64, cache_prompt=False)
        history = ctx.tokens()
    finally:
        ctx.close()
        draft.close()
    assert by_model.tokens == plain.tokens and by_ngram.tokens == plain.tokens
    assert by_model.n_drafted > 0 and by_ngram.n_drafted > 0
    assert history == prompt + plain.tokens  # rejected drafts left nothing behind in the cache


def _chi_square_same(a: Counter[int], b: Counter[int]) -> tuple[float, float]:
    """Two-sample chi-square statistic over the categories with enough counts, and its 0.1% critical value
    (Wilson-Hilferty approximation of the chi-square quantile)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest_a = n_a - sum(a[k] for k in keys)
    rest_b = n_b - sum(b[k] for k in keys)
    rows = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = 0.0
    for x, y in rows:
        total = x + y
        ea, eb = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = max(len(rows) - 1, 1)
    z = 3.09  # one-sided 0.1%
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


@pytest.mark.gemma
def test_sampled_tokens_have_the_targets_distribution(gemma: Model) -> None:
    # A repetitive prompt, so that ngram drafts are proposed from the first token on and the second token
    # is chosen from a verified batch row. Its distribution over many seeds must match plain generate's.
    prompt = "one two three four one two three four one two three four one two"
    # With ngram_min=1 a draft is proposed exactly when the first token occurs in the prompt; the test
    # compares the second token's distribution given that event, in plain and speculative runs.
    in_prompt = set(gemma.tokenize(prompt))
    ctx = gemma.new_context(n_ctx=256)
    n = 200
    plain: Counter[int] = Counter()
    spec: Counter[int] = Counter()
    try:
        for seed in range(n):
            r = ctx.generate(prompt, n_predict=2, temperature=1.5, seed=seed, ignore_eos=True)
            if r.tokens[0] in in_prompt:
                plain[r.tokens[1]] += 1
            s = ctx.generate_with_draft(prompt, n_predict=2, temperature=1.5, seed=10_000 + seed, ignore_eos=True,
                                        ngram_min=1)
            assert (s.n_drafted > 0) == (s.tokens[0] in in_prompt)
            if s.n_drafted:
                spec[s.tokens[1]] += 1  # chosen from the row of a drafted batch
    finally:
        ctx.close()
    assert sum(plain.values()) > n // 3 and sum(spec.values()) > n // 3
    assert len(plain) > 3 and len(spec) > 3  # a real distribution, not a forced token
    stat, crit = _chi_square_same(plain, spec)
    assert stat < crit, (stat, crit, plain.most_common(8), spec.most_common(8))


@pytest.mark.gemma
def test_stops_streams_and_interrupts_work_as_in_generate(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        pieces: list[str] = []
        r = ctx.generate_with_draft(REPEATS, n_predict=60, on_piece=pieces.append)
        assert "".join(pieces) == r.text and r.n_decoded == 60
        full = r.text
        stop = "largest"
        if stop in full:
            cut = ctx.generate_with_draft(REPEATS, n_predict=60, stop=[stop])
            assert cut.stop_reason is StopReason.STOP and stop not in cut.text and cut.text == full[:len(cut.text)]
        started = threading.Event()
        got: list[str] = []

        def on_piece(piece: str) -> None:
            got.append(piece)
            if len(got) >= 10:
                started.set()

        fut = ctx.generate_with_draft_async(REPEATS, n_predict=900, ignore_eos=True, n_draft=4, on_piece=on_piece)
        assert started.wait(120)
        ctx.interrupt()
        res = fut.result(timeout=120)
        assert res.interrupted and res.n_decoded < 900
        # Consistent afterwards: the history is the prompt and what was emitted (the last maybe undecoded).
        n = len(gemma.tokenize(REPEATS)) + len(res.tokens)
        assert len(ctx.tokens()) in (n, n - 1)
    finally:
        ctx.close()


@pytest.mark.gemma
def test_bad_drafts_are_refused_and_the_worker_serves_on(gemma: Model, tiny: Model, pool: Pool,
                                                         tiny_model: Path) -> None:
    ctx = gemma.new_context(n_ctx=256)
    other_worker = tiny.new_context(n_ctx=256)  # the tiny fixture lives in the pool's other worker
    tiny_here = pool[0].load_model(tiny_model)  # same worker as gemma, another vocabulary
    tctx = tiny_here.new_context(n_ctx=256)
    try:
        with pytest.raises(ContextError, match="vocabulary"):
            ctx.generate_with_draft("Hi", draft=tctx, n_predict=4)
        with pytest.raises(ValueError, match="same worker"):
            ctx.generate_with_draft("Hi", draft=other_worker, n_predict=4)
        with pytest.raises(ValueError, match="another context"):
            ctx.generate_with_draft("Hi", draft=ctx, n_predict=4)
        with pytest.raises(ValueError, match="n_draft"):
            ctx.generate_with_draft("Hi", n_draft=0, n_predict=4)
        with pytest.raises(ValueError, match="ngram"):
            ctx.generate_with_draft("Hi", ngram_min=3, ngram_max=2, n_predict=4)
        with pytest.raises(ValueError, match="draft must be"):
            ctx.generate_with_draft("Hi", draft="lookahead", n_predict=4)  # type: ignore[arg-type]
        window = gemma.new_context(n_ctx=256, swa_full=False)
        with pytest.raises(ContextError, match="swa_full"):
            window.generate_with_draft("Hi", n_predict=4)
        window.close()
        closed = gemma.new_context(n_ctx=256)
        closed.close()
        with pytest.raises(StaleHandleError):
            ctx.generate_with_draft("Hi", draft=closed, n_predict=4)
        assert ctx.generate_with_draft("Hi", n_predict=3).n_decoded == 3
    finally:
        ctx.close()
        other_worker.close()
        tctx.close()
        tiny_here.close()


@pytest.mark.gemma
def test_the_ngram_drafter_defaults_are_the_documented_ones(gemma: Model) -> None:
    """n_draft 8, ngram_min 2, ngram_max 4 unless given: the defaults behave as those values do, and these
    texts tell each of them apart from its neighbours (drafted and accepted counts)."""
    ctx = gemma.new_context(n_ctx=1024)
    texts = [REPEATS, "1 2 3 1 2 3 1 2 3 1 2 4 1 2 3", "a b c d a b c e a b c d a b c"]

    def drafted(**options: int) -> list[tuple[int, int]]:
        runs = [ctx.generate_with_draft(t, n_predict=64, cache_prompt=False, **options) for t in texts]
        return [(r.n_drafted, r.n_accepted) for r in runs]

    try:
        default = drafted()
        assert default == drafted(n_draft=8, ngram_min=2, ngram_max=4)
        for options in ({"n_draft": 7}, {"n_draft": 9}, {"ngram_min": 1}, {"ngram_min": 3}, {"ngram_max": 3},
                        {"ngram_max": 5}):
            assert drafted(**options) != default, options
    finally:
        ctx.close()
