"""Per-request LoRA in the batcher (GenerateParams.lora): requests on different adapters share one batcher,
decoded in turns (one configuration per decode, Scheduler.decode), and each request's steps are those of a
context that runs its adapter alone. On Gemma 3 270M with random adapters (tests/loras.py), in a pool of its
own; compared within the batch invariance tests/invariance.py describes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from invariance import INVARIANCE, LOGPROB_INVARIANCE, log_softmax, rows
from loras import attention_shapes, write_lora

from lloyal_pool import Context, InvalidArgumentError, LoraAdapter, LoraError, Model, Pool, Result

PATIENCE = 120.0  # a guard against hanging forever, never a timing assertion
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "My favourite colour is",
           "The three primary colours are"]


@pytest.fixture(scope="module")
def pool(gemma_path: Path) -> Iterator[Pool]:
    with Pool(2) as p:
        yield p


@pytest.fixture(scope="module")
def model(pool: Pool, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """Gemma in worker 0 with two random adapters on q and v of its first six layers: style-a, style-b. Small
    ones (std 0.6): an adapter with large weights makes llama.cpp's rounding beside other rows drift by
    several nats (3.2 at std 2.0, measured on one context alone), past the invariance bound."""
    m = pool[0].load_model(gemma_path)
    d = tmp_path_factory.mktemp("batched-lora")
    shapes = attention_shapes(m.info, range(6))
    for name, seed in (("style-a", 11), ("style-b", 12)):
        m.load_lora(write_lora(d / f"{name}.gguf", "gemma3", shapes, rank=8, seed=seed, std=0.6))
    return m


def assert_as_alone(alone: Context, config: list[tuple[LoraAdapter, float]], prompt: list[int],
                    result: Result) -> np.ndarray:
    """Every step of result is that of its prompt on a context running ``config`` alone (teacher-forced on
    its own tokens), within the batch-invariance bound. Returns the first step's log-probabilities."""
    alone.set_lora(config)
    assert result.logprobs is not None and len(result.logprobs) == len(result.tokens) > 0
    want_rows = [log_softmax(z) for z in rows(alone, prompt, result.tokens)]
    for lp, want in zip(result.logprobs, want_rows, strict=True):
        assert lp.logprob == pytest.approx(want[lp.token], abs=LOGPROB_INVARIANCE)
        assert all(v == pytest.approx(want[t], abs=LOGPROB_INVARIANCE) for t, v, _ in lp.top)
    return want_rows[0]


def test_requests_on_different_adapters_batch_together_and_each_runs_as_its_adapter_alone(model: Model) -> None:
    a, b = model.loras
    configs: list[dict[str, float]] = [{"style-a": 1.0}, {"style-b.gguf": 1.0}, {}, {b.path: 0.5}]
    batcher = model.batcher(slots=4, n_ctx_slot=256)
    store = batcher.context.branches
    real = store.prefill
    seen: list[Any] = []

    def prefill(items: Any, *, commits: Any = (), progress: Any = None, lora: Any = None) -> float:
        seen.append(None if lora is None else sorted((x.path, s) for x, s in lora))
        return real(items, commits=commits, progress=progress, lora=lora)

    store.prefill = prefill  # type: ignore[method-assign]
    alone = model.new_context(n_ctx=512)
    try:
        handles = [batcher.submit(p, n_predict=10, ignore_eos=True, logprobs=5, lora=c)
                   for p, c in zip(PROMPTS, configs, strict=True)]
        results = [h.future.result(PATIENCE) for h in handles]
        firsts = [assert_as_alone(alone, [(model.lora(n), s) for n, s in c.items()], batcher.tokens(p), r)
                  for p, c, r in zip(PROMPTS, configs, results, strict=True)]
        # Every configuration had decodes of its own, in turns; none mixed two (prefill takes one).
        assert {None, ((a.path, 1.0),), ((b.path, 1.0),), ((b.path, 0.5),)} == {
            None if s is None else tuple(s) for s in seen}
        # The adapters matter here (the test would pass on an adapter ignored otherwise): the same prompt's
        # first step moves by far more than the invariance bound under each of them.
        base = log_softmax(rows(_reset(alone), batcher.tokens(PROMPTS[0]), [results[0].tokens[0]])[0])
        assert np.abs(firsts[0] - base).max() > 5 * INVARIANCE
    finally:
        alone.close()
        batcher.close()


def _reset(ctx: Context) -> Context:
    ctx.set_lora([])
    return ctx


def test_cells_are_not_shared_across_adapters(model: Model) -> None:
    batcher = model.batcher(slots=2, n_ctx_slot=256)
    alone = model.new_context(n_ctx=512)
    try:
        prompt = "A long and careful description of the old lighthouse on the northern cliffs, its keeper and the"
        first = batcher.generate(prompt, n_predict=4, lora={"style-a": 1.0})
        again = batcher.generate(prompt, n_predict=4, ignore_eos=True, logprobs=3)
        assert first.n_cached == 0 and again.n_cached == 0  # the slot's cells were made under style-a
        assert_as_alone(alone, [], batcher.tokens(prompt), again)
        same = batcher.generate(prompt, n_predict=4, lora={"style-a": 1.0})
        assert same.n_cached == same.n_prompt - 1  # within one configuration, kept as ever
    finally:
        alone.close()
        batcher.close()


def test_bad_adapters_fail_their_request_and_the_batcher_serves_on(model: Model, tmp_path: Path) -> None:
    batcher = model.batcher(slots=1, n_ctx_slot=256)
    try:
        with pytest.raises(InvalidArgumentError, match="no LoRA adapter named 'nope'"):
            batcher.submit("Hello", lora={"nope": 1.0})
        with pytest.raises(InvalidArgumentError, match="finite"):
            batcher.submit("Hello", lora={"style-a": float("nan")})
        ctx = model.new_context(n_ctx=64)
        with pytest.raises(InvalidArgumentError, match="set_lora"):
            ctx.generate("Hello", n_predict=1, lora={"style-a": 1.0})
        ctx.close()
        # An adapter closed while its request waits for the slot: that request fails, the others are served.
        shapes = attention_shapes(model.info, range(6))
        extra = model.load_lora(write_lora(tmp_path / "style-c.gguf", "gemma3", shapes, rank=8, seed=13, std=0.6))
        busy = batcher.submit("Once upon a time", n_predict=20, ignore_eos=True)
        doomed = batcher.submit("Tell me a story", n_predict=20, ignore_eos=True, lora={"style-c": 1.0})
        extra.close()
        with pytest.raises(LoraError, match="was closed"):
            doomed.future.result(PATIENCE)
        assert busy.future.result(PATIENCE).n_decoded == 20
        assert batcher.generate("Hello", n_predict=2, ignore_eos=True, lora={"style-b": 1.0}).n_decoded == 2
    finally:
        batcher.close()


def test_the_pool_routes_a_request_to_a_worker_that_loaded_its_adapter(pool: Pool, model: Model,
                                                                        gemma_path: Path) -> None:
    other = pool[1].load_model(gemma_path)  # no adapter loaded there
    try:
        for _ in range(4):
            r = pool.generate("The capital of France is", n_predict=2, lora={"style-a": 1.0})
            assert r.n_decoded == 2
        assert model.batcher().load == 0 and other._batcher is None  # every one went to worker 0
        with pytest.raises(InvalidArgumentError, match="style-c"):
            pool.generate("Hello", n_predict=1, lora={"style-c": 1.0})
        ctx = model.new_context(n_ctx=64)
        ctx.set_lora([(model.lora("style-a"), 1.0)])
        with pytest.raises(LoraError):  # the adapter a context applies cannot be closed under it
            model.lora("style-a").close()
        ctx.close()
    finally:
        other.close()
