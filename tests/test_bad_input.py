"""Bad input gets a typed error and the worker keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodel import make_not_gguf, make_truncated

from lloyal_pool import (
    ContextError,
    ContextOverflowError,
    GenerateParams,
    GrammarError,
    InvalidTokenError,
    Model,
    ModelLoadError,
    Pool,
    StaleHandleError,
)


def _still_serving(model: Model) -> None:
    ctx = model.new_context(n_ctx=64)
    try:
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2
    finally:
        ctx.close()


def test_missing_model_file(pool: Pool, tiny: Model, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        pool[1].load_model(tmp_path / "nope.gguf")
    _still_serving(tiny)


def test_file_that_is_not_gguf(pool: Pool, tiny: Model, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        pool[1].load_model(make_not_gguf(tmp_path / "junk.gguf"))
    _still_serving(tiny)


@pytest.mark.parametrize("keep", [4, 64, 4096, "most"])
def test_truncated_gguf(pool: Pool, tiny: Model, tiny_model: Path, tmp_path: Path, keep: int | str) -> None:
    size = tiny_model.stat().st_size
    nbytes = size - 1000 if keep == "most" else int(keep)
    with pytest.raises(ModelLoadError):
        pool[1].load_model(make_truncated(tiny_model, tmp_path / "cut.gguf", nbytes))
    _still_serving(tiny)


@pytest.mark.parametrize("params", [{"n_ctx": -1}, {"n_batch": 0}, {"n_ubatch": -5}, {"n_seq_max": 0},
                                    {"n_threads": -2}, {"type_k": "not-a-type"},
                                    {"n_batch": 2, "n_seq_max": 5}])
def test_invalid_context_params(tiny: Model, params: dict[str, int]) -> None:
    with pytest.raises(ContextError):
        tiny.new_context(**params)
    _still_serving(tiny)


@pytest.mark.parametrize("bad", [-1, 32000, 10**7])
def test_token_ids_out_of_range(tiny: Model, bad: int) -> None:
    ctx = tiny.new_context(n_ctx=64)
    try:
        with pytest.raises(InvalidTokenError):
            ctx.generate([1, bad], n_predict=2)
        with pytest.raises(InvalidTokenError):
            ctx.eval([bad])
        with pytest.raises(InvalidTokenError):
            tiny.detokenize([bad])
        assert ctx.tokens() == []
    finally:
        ctx.close()
    _still_serving(tiny)


def test_prompt_longer_than_the_context(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=64)
    try:
        with pytest.raises(ContextOverflowError):
            ctx.generate(" word" * 200, n_predict=4)
        assert ctx.tokens() == []  # nothing was decoded
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2
    finally:
        ctx.close()


def test_invalid_grammar(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=64)
    try:
        with pytest.raises(GrammarError):
            ctx.generate("Hi", n_predict=4, grammar='root ::= "a" | ( ')
        assert ctx.tokens() == []
        ok = ctx.generate("Hi", n_predict=4, grammar='root ::= "yes" | "no"')
        assert ok.text in ("yes", "no")
    finally:
        ctx.close()
    with pytest.raises(GrammarError):
        tiny.instance.json_schema_to_grammar('{"type": "object", "properties": 7}')


def test_invalid_params_fail_before_the_worker() -> None:
    with pytest.raises(ValueError, match="seed"):
        GenerateParams(seed=2**32 - 1)
    with pytest.raises(ValueError):
        GenerateParams(temperature=float("nan"))
    with pytest.raises(TypeError, match="unknown GenerateParams field"):
        GenerateParams.of(None, {"n_predcit": 3})


def test_closed_handles_are_stale(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=64)
    ctx.close()
    ctx.close()
    with pytest.raises(StaleHandleError):
        ctx.generate("Hi", n_predict=1)
