"""lloyal.node's low-level entry points, on Gemma 3 270M: decode(tokens, pos, seq) and sample() on a
context, grammar handles (Context.sampler), raw KV sequences (copy, keep, pos_min) on their success
paths, a standalone perplexity tracker, and the guard on a logits() view. Every comparison is with a
run on this machine (never with the words a model wrote)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from lloyal_pool import (
    BranchError,
    Context,
    ContextError,
    ContextOverflowError,
    GrammarError,
    InvalidArgumentError,
    LloyalError,
    Model,
    SamplerParams,
    StaleHandleError,
    metrics,
)

PROMPT = "The three most interesting facts about octopuses are"
WARM = SamplerParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1234)
# Rows computed in one batch shape by two code paths: equal up to the batch-invariance bound.
ATOL = 1e-3


@pytest.fixture
def ctx(gemma: Model) -> Iterator[Context]:
    c = gemma.new_context(n_ctx=512, n_seq_max=4)
    yield c
    c.close()


@pytest.fixture
def other(gemma: Model) -> Iterator[Context]:
    c = gemma.new_context(n_ctx=512, n_seq_max=4)
    yield c
    c.close()


def _loop(ctx: Context, prompt: list[int], n: int, params: SamplerParams, seq: int = 0) -> list[int]:
    """lloyal.node's loop: decode the prompt, then sample a token and decode it, n times."""
    ctx.decode(prompt, 0, seq)
    out: list[int] = []
    for _ in range(n):
        tok = ctx.sample(params)
        out.append(tok)
        ctx.decode([tok], len(prompt) + len(out) - 1, seq)
    return out


# -- decode and sample --------------------------------------------------------------------------------
def test_decode_gives_the_logits_eval_gives(ctx: Context, other: Context) -> None:
    toks = ctx.model.tokenize(PROMPT)
    ms = ctx.decode(toks, 0, 0)
    assert ms > 0
    raw = ctx.logits(copy=True)
    other.eval(toks)
    np.testing.assert_allclose(raw, other.logits(copy=True), rtol=0, atol=ATOL)


def test_greedy_loop_is_generate(ctx: Context, other: Context) -> None:
    toks = ctx.model.tokenize(PROMPT)
    expected = other.generate(toks, n_predict=12, temperature=0.0, ignore_eos=True).tokens
    assert _loop(ctx, toks, 12, SamplerParams()) == expected


def test_seeded_sampling_keeps_its_chain_across_calls(ctx: Context, other: Context) -> None:
    # The chain lives between sample() calls while the params stay the same (its PRNG goes on): the
    # loop draws what a branch with the same params draws from the same logits.
    toks = ctx.model.tokenize(PROMPT)
    branch = other.branch(toks, WARM)
    expected = [p.token for p in branch.iterate(12)]
    assert _loop(ctx, toks, 12, WARM) == expected
    # New params (another seed) start a new chain: the first draw is that seed's first draw.
    ctx.reset()
    first = _loop(ctx, toks, 1, SamplerParams(temperature=0.8, top_k=40, seed=99))
    ctx.reset()
    assert _loop(ctx, toks, 1, SamplerParams(temperature=0.8, top_k=40, seed=99)) == first


def test_decode_at_a_position_of_another_sequence(ctx: Context, other: Context) -> None:
    prefix = ctx.model.tokenize(PROMPT)
    suffix = ctx.model.tokenize(" the fact that they", add_special=False)
    ctx.decode(prefix, 0, 0)
    ctx.kv.copy(0, 2)  # a free sequence is leased by the copy, as lloyal.node's kvSeqCopy(0, 2)
    assert ctx.kv.pos_min(2) == 0 and ctx.kv.pos_max(2) == len(prefix) - 1
    ctx.decode(suffix, len(prefix), 2)
    continued = ctx.logits(copy=True)
    # The reference in the same batch shapes (llama.cpp's kernels round by shape), on cells of its own.
    other.decode(prefix, 0, 1)
    other.decode(suffix, len(prefix), 1)
    np.testing.assert_allclose(continued, other.logits(copy=True), rtol=0, atol=ATOL)
    # seq 0 still ends where it did, and decodes on from there
    assert ctx.kv.pos_max(0) == len(prefix) - 1
    ctx.decode(suffix, len(prefix), 0)
    np.testing.assert_allclose(ctx.logits(copy=True), continued, rtol=0, atol=ATOL)


def test_kv_keep_and_pos_min(ctx: Context) -> None:
    toks = ctx.model.tokenize(PROMPT)
    ctx.decode(toks, 0, 0)
    ctx.kv.copy(0, 1)
    ctx.kv.copy(0, 3, 0, 4)  # only positions [0, 4)
    assert (ctx.kv.pos_min(3), ctx.kv.pos_max(3)) == (0, 3)
    ctx.kv.keep(1)
    assert ctx.kv.pos_max(0) == ctx.kv.pos_max(3) == -1 and ctx.kv.pos_min(0) == -1
    assert (ctx.kv.pos_min(1), ctx.kv.pos_max(1)) == (0, len(toks) - 1)
    assert ctx.kv.pressure().cells_used == len(toks)


def test_decode_refuses_what_cannot_work_and_changes_nothing(ctx: Context, gemma: Model) -> None:
    toks = ctx.model.tokenize(PROMPT)
    ctx.decode(toks, 0, 0)
    with pytest.raises(InvalidArgumentError, match=f"goes on at {len(toks)}"):
        ctx.decode([5], 3, 0)
    with pytest.raises(ContextOverflowError):
        ctx.decode([5] * 600, len(toks), 0)
    with pytest.raises(InvalidArgumentError):
        ctx.decode([5], 0, 4)  # outside n_seq_max
    assert ctx.kv.pos_max(0) == len(toks) - 1
    branch = ctx.branch(toks)
    with pytest.raises(BranchError, match="belongs to branch"):
        ctx.decode([5], len(toks), branch.info().seq)
    plain = gemma.new_context(n_ctx=128)
    try:
        plain.eval(toks)
        with pytest.raises(ContextError, match="history"):
            plain.decode([5], 0, 0)
    finally:
        plain.close()
    with pytest.raises(LloyalError, match="no logits to sample from"):
        ctx.sample()  # the branch's prefill decoded since: its logits are the branch's
    branch.prune()
    ctx.decode([5], len(toks), 0)
    assert ctx.sample() >= 0  # still serving


# -- grammar handles ----------------------------------------------------------------------------------
YES_NO = 'root ::= "yes" | "no"'


def _allowed(mask: np.ndarray) -> set[int]:
    assert set(np.unique(mask)) <= {0.0, -np.inf}
    return set(np.flatnonzero(mask == 0.0).tolist())


def test_a_grammar_handle_masks_any_logits_and_moves_on(ctx: Context) -> None:
    model = ctx.model
    with ctx.sampler(YES_NO) as s:
        allowed = _allowed(s.mask())
        pieces = {t: model.detokenize([t]) for t in allowed}
        assert all(p and ("yes".startswith(p) or "no".startswith(p)) for p in pieces.values()), pieces
        yes, no = model.tokenize("yes", add_special=False)[0], model.tokenize("no", add_special=False)[0]
        assert {yes, no} <= allowed
        # apply() works on any row: here a random one, and the context's own.
        row = np.random.default_rng(0).normal(size=model.n_vocab).astype(np.float32)
        out = s.apply(row)
        assert set(np.flatnonzero(np.isfinite(out)).tolist()) == allowed
        assert np.array_equal(out[sorted(allowed)], row[sorted(allowed)])
        fork = s.clone()
        s.accept(no)
        done = _allowed(s.mask())
        assert done and done <= set(model.eog_tokens)  # the grammar is complete: only an end may follow
        with pytest.raises(GrammarError, match="not allowed"):
            s.accept(yes)  # "noyes" is not in the language; nothing changes
        assert _allowed(fork.mask()) == allowed  # the clone went on from where it was
        fork.accept(yes)
        assert _allowed(fork.mask()) == done
        fork.close()
        with pytest.raises(StaleHandleError):
            fork.mask()
    with pytest.raises(StaleHandleError):
        s.accept(no)


def test_sample_under_a_grammar_handle(ctx: Context) -> None:
    model = ctx.model
    toks = model.tokenize("Is the sky blue? Answer yes or no:")
    ctx.decode(toks, 0, 0)
    s = ctx.sampler(YES_NO)
    out: list[int] = []
    for _ in range(8):
        allowed = _allowed(s.mask())
        tok = ctx.sample(sampler=s)
        if model.is_eog(tok):
            break
        assert tok in allowed
        out.append(tok)
        ctx.decode([tok], len(toks) + len(out) - 1, 0)
    assert model.detokenize(out) in ("yes", "no")
    other = ctx.model.new_context(n_ctx=64)
    try:
        with pytest.raises(InvalidArgumentError, match="another context"):
            other.sample(sampler=s)
    finally:
        other.close()
    with pytest.raises(GrammarError):
        ctx.sampler("root ::= (")


# -- a standalone perplexity tracker ------------------------------------------------------------------
def test_perplexity_tracker_follows_a_branch_and_its_fork(ctx: Context) -> None:
    root = ctx.branch(ctx.model.tokenize(PROMPT), WARM)
    tracker = metrics.PerplexityTracker()
    assert tracker.perplexity == root.perplexity == float("inf")

    def step(branch: object, t: metrics.PerplexityTracker) -> None:
        z = branch.logits.copy()  # type: ignore[attr-defined]
        tok = branch.produce().token  # type: ignore[attr-defined]
        t.add_logits(z, tok)
        branch.commit(tok)  # type: ignore[attr-defined]

    for _ in range(6):
        step(root, tracker)
    assert tracker.count == 6
    assert tracker.perplexity == pytest.approx(root.perplexity, rel=1e-4)
    kid, kid_tracker = root.fork(), tracker.clone()
    kid.reseed_sampler(7)
    for _ in range(5):
        step(kid, kid_tracker)
        step(root, tracker)
    assert tracker.perplexity == pytest.approx(root.perplexity, rel=1e-4)
    assert kid_tracker.perplexity == pytest.approx(kid.perplexity, rel=1e-4)
    with pytest.raises(ValueError):
        tracker.add(float("nan"))


# -- the logits() view --------------------------------------------------------------------------------
def test_a_logits_view_goes_stale_when_the_row_is_written_again(ctx: Context, gemma: Model) -> None:
    toks = ctx.model.tokenize(PROMPT)
    ctx.decode(toks, 0, 0)
    kept = ctx.logits(copy=True)
    view = ctx.logits()
    head = view[:10]
    best = int(view.argmax())
    assert np.array_equal(np.asarray(view), kept) and best == int(np.argmax(kept)) and float(view.max()) > 0
    ctx.decode([best], len(toks), 0)
    fresh = ctx.logits()
    for read in (lambda: view.max(), lambda: view[3], lambda: np.argmax(view), lambda: view + 1.0,
                 lambda: head.sum(), lambda: view.copy(), lambda: list(view), lambda: float(view[0])):
        with pytest.raises(StaleHandleError, match="stale"):
            read()
    assert not np.array_equal(fresh.copy(), kept)  # the row moved on; the copy did not
    c = gemma.new_context(n_ctx=64)
    c.eval(toks)
    last = c.logits()
    c.close()
    with pytest.raises(StaleHandleError):
        last.argmax()
