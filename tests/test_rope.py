"""RoPE overrides of a context (ContextParams.rope_freq_base, rope_freq_scale) on Gemma 3 270M: an override
equal to the model's own value changes nothing, a different one changes every position but the first,
and generation and scoring keep working under one. Every assertion compares with a reference run in
this same worker, never with the words the model wrote.

What llama.cpp does with the overrides on this model (vendor/llama.cpp/src/models/gemma3.cpp and
llama_model::get_rope_freq_base/scale): Gemma 3 interleaves five sliding-window layers with one global
layer (3 of its 18 layers are global), and the sliding-window layers keep their own RoPE (base 10000,
scale 1) whatever the context asks; the override reaches the global layers only. The GGUF names no
scaling type, so llama.cpp reads it as "linear" and rope_freq_scale is applied (a type "none" would
force it back to 1). The model has no YaRN metadata, and ContextParams exposes no YaRN field."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pytest

from lloyal_pool import Context, ContextParams, Model, StopReason

# Letters in order: the next one (" N") leads its runner-up by 5 logits, far more than any override below
# moves a logit, so a mild override may be asserted to keep it (test_mild_scale_keeps_the_greedy_token).
PROMPT = "A B C D E F G H I J K L M"
TEXT = "The quick brown fox jumps over the lazy dog while the farmer watches from the porch."
N_CTX = 256
# On every CPU the reference and the override run in the same worker, with the same batch shapes; only
# the thread count could differ between two contexts (adapt_threads lowers it on a busy machine, and a
# reduction split differently rounds differently), so it is held fixed, and "unchanged" still allows
# 1e-4 of rounding.
SAME = 1e-4
# The smallest change of an override below measured here was 1.39 (freq_scale 0.9); rounding differences
# between CPUs are around 1e-3. 0.1 tells "changed" from "rounded differently" with a wide margin on both
# sides.
CHANGED = 0.1

# Overrides that differ from the model's own values: a base 100 times lower (the sliding-window layers'
# own base: it still changes the global layers) and twice higher, linear position interpolation mild and
# strong, and both fields together.
OVERRIDES: list[dict[str, float]] = [
    {"rope_freq_base": 10_000.0}, {"rope_freq_base": 2_000_000.0}, {"rope_freq_scale": 0.9},
    {"rope_freq_scale": 0.5}, {"rope_freq_base": 2_000_000.0, "rope_freq_scale": 0.5},
]


@dataclass(frozen=True)
class Run:
    first: np.ndarray  # logits after the first token alone (position 0, BOS)
    last: np.ndarray  # logits after the rest of the prompt (position n - 1)


def _context(model: Model, **rope: float) -> Context:
    return model.new_context(None, n_ctx=N_CTX, adapt_threads=False, **rope)


def _run(model: Model, **rope: float) -> Run:
    """The prompt decoded the same way for every override: position 0 alone, then the rest in one eval,
    so that both logit rows come from the same batch shapes as the reference's."""
    tokens = model.tokenize(PROMPT)
    ctx = _context(model, **rope)
    try:
        ctx.eval(tokens[:1])
        first = ctx.logits(copy=True)
        ctx.eval(tokens[1:])
        return Run(first, ctx.logits(copy=True))
    finally:
        ctx.close()


def _max_change(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def _name(rope: dict[str, Any]) -> str:
    return ",".join(f"{k.removeprefix('rope_')}={v:g}" for k, v in rope.items())


@pytest.fixture(scope="module")
def reference(gemma: Model) -> Run:
    return _run(gemma)


@pytest.fixture(scope="module")
def own_freq_base(gemma: Model) -> float:
    """The model's own base, from the GGUF metadata the worker reports (every key of the file; reading
    the file here with gguf.GGUFReader would parse all its tensors too, 8 s on 2 cores)."""
    meta = gemma.info.meta
    base = float(meta[f"{meta['general.architecture']}.rope.freq_base"])
    assert base == 1_000_000.0
    # No scaling metadata: the model's own scale is 1, and no YaRN context length.
    assert not [k for k in meta if ".rope.scaling." in k]
    return base


def test_context_params_rope_fields() -> None:
    # The fields this file covers. A new RoPE or YaRN field (yarn_ext_factor, yarn_orig_ctx, ...) needs a
    # success path here, not only the refusals of test_bad_input.py.
    rope = {f.name for f in fields(ContextParams) if "rope" in f.name or "yarn" in f.name}
    assert rope == {"rope_freq_base", "rope_freq_scale"}


@pytest.mark.parametrize("which", ["base", "scale", "both"])
def test_override_with_the_models_own_value_changes_nothing(gemma: Model, reference: Run, own_freq_base: float,
                                                            which: str) -> None:
    rope = {"base": {"rope_freq_base": own_freq_base}, "scale": {"rope_freq_scale": 1.0},
            "both": {"rope_freq_base": own_freq_base, "rope_freq_scale": 1.0}}[which]
    run = _run(gemma, **rope)
    np.testing.assert_allclose(run.first, reference.first, rtol=0, atol=SAME)
    np.testing.assert_allclose(run.last, reference.last, rtol=0, atol=SAME)


@pytest.mark.parametrize("rope", OVERRIDES, ids=_name)
def test_override_changes_later_positions_not_the_first(gemma: Model, reference: Run, rope: dict[str, float]) -> None:
    run = _run(gemma, **rope)
    # RoPE rotates a query or key by position * frequency: at position 0 every angle is 0, whatever the
    # base or scale, and attention there sees only the token itself.
    np.testing.assert_allclose(run.first, reference.first, rtol=0, atol=SAME)
    # Later positions attend to earlier ones with relative angles the override changes (max abs change
    # measured here: base 1e4 2.18, base 2e6 1.57, scale 0.9 1.39, scale 0.5 2.39, both 2.09).
    assert np.isfinite(run.last).all()
    assert _max_change(run.last, reference.last) > CHANGED, rope


@pytest.mark.parametrize("rope", OVERRIDES, ids=_name)
def test_generation_and_score_under_override(gemma: Model, rope: dict[str, float]) -> None:
    ctx = _context(gemma, **rope)
    try:
        result = ctx.generate(PROMPT, n_predict=8, ignore_eos=True)
        assert len(result.tokens) == 8
        assert result.stop_reason is StopReason.LENGTH
        score = ctx.score(TEXT)
    finally:
        ctx.close()
    assert score.n_scored == score.n_tokens - 1 > 8
    assert math.isfinite(score.nll) and score.nll > 0
    assert math.isfinite(score.perplexity)


def test_mild_scale_keeps_the_greedy_token(gemma: Model, reference: Run) -> None:
    mild = _run(gemma, rope_freq_scale=0.9)
    top2 = np.sort(reference.last)[-2:]
    gap = float(top2[1] - top2[0])
    change = _max_change(mild.last, reference.last)
    # The leader keeps its place when no logit moves by half the gap. Measured: gap 5.01, change 1.39;
    # the 1.0 of slack covers any CPU's rounding many times over. If this fails the prompt no longer has
    # the margin, and the assertion below would no longer follow from it.
    assert gap > 2 * change + 1.0, (gap, change)
    assert int(mild.last.argmax()) == int(reference.last.argmax())
    # ... and a greedy generation (the default GenerateParams) picks it first.
    ctx = _context(gemma, rope_freq_scale=0.9)
    try:
        first = ctx.generate(PROMPT, n_predict=1, ignore_eos=True).tokens
    finally:
        ctx.close()
    assert first == [int(reference.last.argmax())]
