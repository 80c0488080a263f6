"""Does lloyal_pool serve your model? A short run of what holds for every model, on the model that
LLOYAL_POOL_TEST_MODEL names (go-llama's GO_LLAMA_TEST_MODEL; the default model otherwise):

    LLOYAL_POOL_TEST_MODEL=/path/to/model.gguf .venv/bin/python -m pytest tests/test_your_model.py

Every assertion compares the model with itself on this machine, never with words it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TEST_MODEL_ENV, your_model_path

from lloyal_pool import Context, Model, Pool, SamplerParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    with Pool(1) as pool:
        yield pool[0].load_model(your_model_path())


@pytest.fixture
def ctx(model: Model) -> Iterator[Context]:
    c = model.new_context(n_ctx=256, n_seq_max=3)
    yield c
    c.close()


def test_text_goes_through_the_tokenizer_and_back(model: Model) -> None:
    text = "Hello, world: 1, 2, 3."
    assert model.detokenize(model.tokenize(text, add_special=False)) == text


def test_greedy_generation_is_one_answer(model: Model, ctx: Context) -> None:
    first = ctx.generate(PROMPT, n_predict=16, temperature=0.0)
    pieces = list(stream := ctx.stream(PROMPT, n_predict=16, temperature=0.0))
    assert "".join(pieces) == first.text == stream.result.text
    other = model.new_context(n_ctx=256)
    try:
        assert other.generate(PROMPT, n_predict=16, temperature=0.0).tokens == first.tokens
    finally:
        other.close()


def test_the_low_level_loop_is_generate(ctx: Context, model: Model) -> None:
    toks = model.tokenize(PROMPT)
    expected = ctx.generate(toks, n_predict=8, temperature=0.0, ignore_eos=True).tokens
    ctx.reset()
    ctx.decode(toks, 0, 0)
    out: list[int] = []
    for _ in range(8):
        out.append(ctx.sample())
        ctx.decode([out[-1]], len(toks) + len(out) - 1, 0)
    assert out == expected


def test_forks_with_one_seed_draw_alike(ctx: Context) -> None:
    root = ctx.branch(PROMPT, SamplerParams(temperature=0.9, seed=7))
    a = root.fork()
    b = root.fork()
    assert [p.token for p in a.iterate(8)] == [p.token for p in b.iterate(8)]


def test_state_round_trip_and_score(ctx: Context, model: Model) -> None:
    ctx.eval(PROMPT)
    state = ctx.save_state()
    expected = ctx.generate("", append=True, n_predict=8, temperature=0.0, ignore_eos=True).tokens
    ctx.reset()
    ctx.load_state(state)
    assert ctx.generate("", append=True, n_predict=8, temperature=0.0, ignore_eos=True).tokens == expected
    ctx.reset()
    s = ctx.score(PROMPT + " there was a model")
    assert s.n_scored > 0 and s.nll >= 0.0 and s.perplexity >= 1.0


def test_the_environment_variable_chooses_the_model(tiny_model: Path, tmp_path: Path) -> None:
    if os.environ.get(TEST_MODEL_ENV):
        pytest.skip("already running on a chosen model")  # the run below is this file on another model
    here = Path(__file__)
    run = [sys.executable, "-m", "pytest", str(here), "-p", "no:cacheprovider", "-k", "not environment"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=here.parent.parent,
                         env={**os.environ, TEST_MODEL_ENV: str(tiny_model)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"({TEST_MODEL_ENV}): {tiny_model}" in out.stdout and " passed" in out.stdout
    missing = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=here.parent.parent,
                             env={**os.environ, TEST_MODEL_ENV: str(tmp_path / "nope.gguf")})
    assert missing.returncode != 0 and "is not a file" in missing.stdout + missing.stderr
