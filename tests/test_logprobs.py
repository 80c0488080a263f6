"""Log-probabilities of generated tokens (GenerateParams.logprobs -> Result.logprobs), on Gemma 3 270M: the
log-softmax of the raw logits each token was sampled from, and the most likely tokens at that step, as
OpenAI and llama-server report them. Checked against numpy on the logits of the same steps decoded the
same way on this machine (generate), and within the batch-invariance bound for batched requests."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from invariance import LOGPROB_INVARIANCE, log_softmax, rows

from lloyal_pool import Context, GenerateParams, InvalidArgumentError, Model, SamplerParams

PROMPT = "The three most interesting facts about octopuses are"


@pytest.fixture
def ctx(gemma: Model) -> Iterator[Context]:
    c = gemma.new_context(n_ctx=512, n_seq_max=4)
    yield c
    c.close()


@pytest.mark.parametrize("params", [GenerateParams(), GenerateParams(temperature=0.9, top_k=40, seed=5)],
                         ids=["greedy", "sampled"])
def test_generate_reports_the_log_softmax_of_each_step(ctx: Context, other_ctx: Context,
                                                       params: GenerateParams) -> None:
    prompt = ctx.model.tokenize(PROMPT)
    r = ctx.generate(prompt, params, n_predict=10, ignore_eos=True, logprobs=5)
    assert r.logprobs is not None and [lp.token for lp in r.logprobs] == r.tokens
    for lp, z in zip(r.logprobs, rows(other_ctx, prompt, r.tokens), strict=True):
        want = log_softmax(z)
        assert lp.logprob == pytest.approx(want[lp.token], abs=1e-3)
        assert lp.piece == ctx.model.token_to_piece(lp.token)
        assert len(lp.top) == 5 and [t for t, _, _ in lp.top] == sorted(
            [t for t, _, _ in lp.top], key=lambda t: -want[t])  # best first
        order = np.argsort(-want, kind="stable")
        assert [t for t, _, _ in lp.top] == order[:5].tolist()
        for t, value, piece in lp.top:
            assert value == pytest.approx(want[t], abs=1e-3) and piece == ctx.model.token_to_piece(t)
    # Not asked: none; zero alternatives: the chosen token's alone.
    assert ctx.generate(prompt, n_predict=2).logprobs is None
    lone = ctx.generate(prompt, n_predict=3, ignore_eos=True, logprobs=0)
    assert lone.logprobs is not None and all(lp.top == [] for lp in lone.logprobs)


@pytest.fixture
def other_ctx(gemma: Model) -> Iterator[Context]:
    c = gemma.new_context(n_ctx=512)
    yield c
    c.close()


def test_a_stream_and_an_ending_token(ctx: Context) -> None:
    with ctx.stream("Say hi.", n_predict=64, logprobs=2) as stream:
        text = "".join(stream)
    r = stream.result
    assert r.logprobs is not None and len(r.logprobs) == len(r.tokens)  # an end token that stopped it: none
    assert text == r.text


def test_batched_requests_report_them_too(gemma: Model, other_ctx: Context) -> None:
    prompts = [PROMPT, "Water boils at"]
    batcher = gemma.batcher(slots=2)
    try:
        reqs = [batcher.submit(p, n_predict=8, ignore_eos=True, logprobs=3) for p in prompts]
        results = [r.future.result(timeout=300) for r in reqs]
    finally:
        batcher.close()
    for prompt, r in zip(prompts, results, strict=True):
        assert r.logprobs is not None and [lp.token for lp in r.logprobs] == r.tokens
        for lp, z in zip(r.logprobs, rows(other_ctx, gemma.tokenize(prompt), r.tokens), strict=True):
            want = log_softmax(z)
            # Rows decoded beside another request move by up to the invariance bound.
            assert lp.logprob == pytest.approx(want[lp.token], abs=LOGPROB_INVARIANCE)
            assert len(lp.top) == 3 and all(v == pytest.approx(want[t], abs=LOGPROB_INVARIANCE) for t, v, _ in lp.top)


def test_logprobs_out_of_range_are_refused(ctx: Context) -> None:
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="logprobs"):
            ctx.generate("Hi", n_predict=1, logprobs=bad)
    with pytest.raises(InvalidArgumentError, match="speculative"):
        ctx.generate_with_draft("Hi", draft="ngram", n_predict=2, logprobs=1)
    assert ctx.generate("Hi", n_predict=1, logprobs=20).logprobs is not None  # still serving


def test_a_scored_prompt_reports_each_token_s_log_probability(ctx: Context, other_ctx: Context, gemma: Model) -> None:
    # Context.score(logprobs=N): what a completion's echo shows of its prompt. Each scored token against the
    # log-softmax of the row before it (that row decoded token by token on another context: within the
    # invariance bound), and their sum is the score's own nll.
    tokens = gemma.tokenize(PROMPT, add_special=True)
    score = ctx.score(tokens, logprobs=3)
    assert score.logprobs is not None and [lp.token for lp in score.logprobs] == tokens[1:]
    assert -sum(lp.logprob for lp in score.logprobs) == pytest.approx(score.nll, rel=1e-5)
    for lp, z in zip(score.logprobs, rows(other_ctx, tokens[:1], tokens[1:]), strict=True):
        want = log_softmax(z)
        assert lp.logprob == pytest.approx(want[lp.token], abs=LOGPROB_INVARIANCE)
        assert len(lp.top) == 3 and all(v == pytest.approx(want[t], abs=LOGPROB_INVARIANCE) for t, v, _ in lp.top)
    assert ctx.score(tokens).logprobs is None
    with pytest.raises(InvalidArgumentError):
        ctx.score(tokens, logprobs=21)


def test_a_branch_reports_its_tokens_log_probabilities_once_asked(ctx: Context, gemma: Model) -> None:
    # Branch.set_logprobs(N): Produced.logprobs from the row each token was sampled from (the branch's
    # logits before the step, read here), forks inherit it, None stops it.
    root = ctx.branches.create(PROMPT, SamplerParams(temperature=0.9, seed=3))
    assert root.produce().logprobs is None
    root.set_logprobs(3)
    for _ in range(4):
        want = log_softmax(np.array(root.logits, copy=True))
        produced = root.step()
        lp = produced.logprobs
        assert lp is not None and lp.token == produced.token and lp.piece == produced.piece
        assert lp.logprob == pytest.approx(want[produced.token], abs=1e-3)
        assert [t for t, _, _ in lp.top] == list(np.argsort(-want)[:3])
    child = root.fork()
    assert child.step().logprobs is not None
    child.set_logprobs(None)
    assert child.step().logprobs is None and root.produce().logprobs is not None
    with pytest.raises(InvalidArgumentError):
        root.set_logprobs(21)
    child.prune()
    root.prune()
