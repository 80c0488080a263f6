"""Teacher-forced scoring: Context.score (a whole text) and Context.score_choices (continuations of what
the context holds), checked against a numpy log-softmax over logits read one token at a time.

llama.cpp's CPU kernels are not batch-invariant: a row computed in a ubatch of 4 or more rows goes through
the repacked Q4_K GEMM, a row alone through the GEMV, and their logits differ by a few 1e-3 of a nat. The
exact checks (1e-4 relative) therefore score in contexts with n_ubatch 1, where every row is computed as
the one-token reference computes it (llama.cpp still gets up to n_batch rows per llama_decode). With the
default batching the same scores agree within 1e-2 (a whole text) to 5e-2 (a few tokens of a choice)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lloyal_pool import (
    ContextError,
    ContextOverflowError,
    InterruptedByClient,
    InvalidTokenError,
    Model,
    Score,
)

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide."
PREFIX = "The capital of France is"


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max()
    return z - m - math.log(np.exp(z - m).sum())


def reference_nll(model: Model, prefix: list[int], continuation: list[int]) -> float:
    """Sum of -log p(token) over continuation, each from the logits after evaluating one token at a time."""
    ctx = model.new_context(n_ctx=256)
    try:
        total = 0.0
        for t in prefix:
            ctx.eval([t])
        for t in continuation:
            total -= float(log_softmax(ctx.logits())[t])
            ctx.eval([t])
        return total
    finally:
        ctx.close()


def test_score_matches_a_numpy_log_softmax_token_by_token(gemma: Model) -> None:
    toks = gemma.tokenize(TEXT)  # with BOS, as score() tokenizes text
    ctx = gemma.new_context(n_ctx=256, n_batch=8, n_ubatch=1)  # several rows per decode, each computed alone
    ctx.eval("Something else the context held before")
    s = ctx.score(TEXT)
    assert isinstance(s, Score)
    assert s.n_tokens == len(toks)
    assert s.n_scored == len(toks) - 1
    want = reference_nll(gemma, toks[:1], toks[1:])
    assert s.nll == pytest.approx(want, rel=1e-4)
    assert s.perplexity == pytest.approx(math.exp(s.nll / s.n_scored), rel=1e-12)
    assert ctx.tokens() == toks  # the text replaced the history, and stays
    assert ctx.score(toks).nll == pytest.approx(s.nll, rel=1e-6)  # token ids score the same
    batched = gemma.new_context(n_ctx=256).score(TEXT)  # one decode of every row
    assert batched.n_scored == s.n_scored
    assert batched.nll == pytest.approx(want, rel=1e-2)


def test_score_in_many_chunks(gemma: Model) -> None:
    # A small n_batch splits the text into many decodes (each row still belongs to its position).
    text = TEXT * 3
    a = gemma.new_context(n_ctx=256, n_batch=8, n_ubatch=8).score(text)
    b = gemma.new_context(n_ctx=256).score(text)
    assert a.n_tokens == b.n_tokens == len(gemma.tokenize(text))
    assert a.n_scored == b.n_scored == a.n_tokens - 1
    assert a.nll == pytest.approx(b.nll, rel=1e-2)


def test_paris_scores_better_than_banana(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256, n_seq_max=4)
    ctx.eval(PREFIX)
    paris, banana = ctx.score_choices([" Paris", " Banana"])
    assert paris.nll < banana.nll
    assert paris.n_scored == paris.n_tokens == len(gemma.tokenize(" Paris", add_special=False))


def test_score_choices_match_the_reference(gemma: Model) -> None:
    prefix = gemma.tokenize(PREFIX)
    choices = [" Paris, of course.", " Lyon", " a city in the north of the country with a long history"]
    exact = gemma.new_context(n_ctx=256, n_batch=1, n_ubatch=1)  # n_seq_max 1: one choice at a time
    exact.eval(prefix)
    batched = gemma.new_context(n_ctx=256, n_seq_max=4)  # all three in one decode
    batched.eval(prefix)
    for choice, e, b in zip(choices, exact.score_choices(choices), batched.score_choices(choices), strict=True):
        toks = gemma.tokenize(choice, add_special=False)
        want = reference_nll(gemma, prefix, toks)
        assert e.n_tokens == e.n_scored == b.n_tokens == b.n_scored == len(toks)
        assert e.nll == pytest.approx(want, rel=1e-4)
        # The batched context computed the prefix and the choices in ubatches (GEMM rows): a few
        # hundredths of a nat per token away on this small quantized model.
        assert b.nll == pytest.approx(want, rel=5e-2)


@pytest.mark.parametrize("n_seq_max", [1, 2, 4])
def test_score_choices_batched_or_one_at_a_time_agree(gemma: Model, n_seq_max: int) -> None:
    # n_ubatch 1: llama.cpp computes each row alone (as the reference does) while one llama_decode still
    # carries up to n_batch rows of several sequences, so the batching itself is checked exactly.
    choices = [" Paris", " Lyon and Marseille", [236743], " Berlin", " the largest city"]
    prefix = gemma.tokenize(PREFIX)
    want = [reference_nll(gemma, prefix, c if isinstance(c, list) else gemma.tokenize(c, add_special=False))
            for c in choices]
    ctx = gemma.new_context(n_ctx=256, n_seq_max=n_seq_max, n_batch=4, n_ubatch=1)
    ctx.eval(prefix)
    got = ctx.score_choices(choices)  # more choices than sequences: in groups
    assert len(got) == len(choices)
    assert [s.nll for s in got] == pytest.approx(want, rel=1e-4)
    assert got[2].n_tokens == got[2].n_scored == 1


@pytest.mark.parametrize("n_seq_max", [1, 3])
def test_score_choices_leave_the_context_as_it_was(gemma: Model, n_seq_max: int) -> None:
    ctx = gemma.new_context(n_ctx=256, n_seq_max=n_seq_max)
    twin = gemma.new_context(n_ctx=256, n_seq_max=n_seq_max)
    ctx.eval(PREFIX)
    twin.eval(PREFIX)
    tokens, logits = ctx.tokens(), ctx.logits(copy=True)
    ctx.score_choices([" Paris", " a very long answer that takes many more tokens than the others", " Rome"])
    assert ctx.tokens() == tokens
    after = ctx.logits()
    assert np.array_equal(after, logits)  # the next greedy token is unchanged
    nxt = int(np.argmax(after))
    ctx.eval([nxt])
    twin.eval([nxt])
    assert int(np.argmax(ctx.logits())) == int(np.argmax(twin.logits()))
    assert np.allclose(ctx.logits(), twin.logits(), atol=1e-2)


def test_score_errors(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=32, n_seq_max=2)
    with pytest.raises(ValueError, match="at least two tokens"):
        ctx.score("")  # BOS alone: nothing to predict
    with pytest.raises(ValueError, match="at least two tokens"):
        ctx.score([])
    with pytest.raises(InvalidTokenError):
        ctx.score([1, 10**9])
    with pytest.raises(ContextOverflowError):
        ctx.score(TEXT * 5)
    with pytest.raises(ContextError, match="holds nothing"):
        ctx.score_choices([" Paris"])
    ctx.eval(PREFIX)
    with pytest.raises(ValueError, match="at least one choice"):
        ctx.score_choices([])
    with pytest.raises(ValueError, match="no tokens"):
        ctx.score_choices([" Paris", ""])
    with pytest.raises(TypeError):
        ctx.score_choices(" Paris")
    with pytest.raises(ContextOverflowError):
        ctx.score_choices([" Paris", TEXT * 3])
    assert ctx.tokens() == gemma.tokenize(PREFIX)
    assert len(ctx.score_choices([" Paris"])) == 1  # still serving

    branched = gemma.new_context(n_ctx=64, n_seq_max=2)
    branched.branch("Hello")
    with pytest.raises(ContextError, match="branches"):
        branched.score(TEXT)
    with pytest.raises(ContextError, match="branches"):
        branched.score_choices([" Paris"])


def test_scoring_can_be_interrupted(gemma: Model) -> None:
    # An interrupt right after the call reaches the request before or while it runs (the word names it).
    ctx = gemma.new_context(n_ctx=512, n_seq_max=2)
    ctx.eval(PREFIX)
    tokens, logits = ctx.tokens(), ctx.logits(copy=True)
    fut = ctx.score_choices_async([" Paris, the capital" * 20, " Rome, the eternal city" * 20])
    ctx.interrupt()
    with pytest.raises(InterruptedByClient):
        fut.result()
    assert ctx.tokens() == tokens
    assert np.array_equal(ctx.logits(), logits)

    fut2 = ctx.score_async(TEXT * 4)
    ctx.interrupt()
    with pytest.raises(InterruptedByClient):
        fut2.result()
    kept = ctx.tokens()
    assert kept == gemma.tokenize(TEXT * 4)[:len(kept)]
    assert ctx.score(TEXT).n_scored == len(gemma.tokenize(TEXT)) - 1  # serving


def test_score_choices_on_a_sliding_window_cache_without_swa_full(gemma: Model) -> None:
    # Gemma 3 has sliding-window layers: without swa_full, sequence 0 never takes a choice.
    choices = [" Paris, of course", " Banana bread", " Lyon"]
    one = gemma.new_context(n_ctx=256, swa_full=False)
    one.eval(PREFIX)
    with pytest.raises(ContextError, match="swa_full"):
        one.score_choices(choices)
    assert one.score(TEXT).n_scored == len(gemma.tokenize(TEXT)) - 1  # still serving
    # n_ubatch 1 (see the module's docstring): the grouping cannot change a row's numerics.
    ctx = gemma.new_context(n_ctx=256, swa_full=False, n_seq_max=2, n_batch=4, n_ubatch=1)  # on sequence 1
    ctx.eval(PREFIX)
    tokens, logits = ctx.tokens(), ctx.logits(copy=True)
    got = ctx.score_choices(choices)
    ref = gemma.new_context(n_ctx=256, n_seq_max=2, n_batch=4, n_ubatch=1)  # swa_full: sequences 0 and 1
    ref.eval(PREFIX)
    want = [s.nll for s in ref.score_choices(choices)]
    assert [s.nll for s in got] == pytest.approx(want, rel=1e-4)
    assert got[0].nll < got[1].nll
    assert ctx.tokens() == tokens
    assert np.array_equal(ctx.logits(), logits)


def test_score_choices_takes_its_arguments_by_name(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256)
    try:
        ctx.eval("The capital of France is")
        assert ctx.score_choices(choices=[" Paris"], timeout=60) == ctx.score_choices([" Paris"])
    finally:
        ctx.close()
