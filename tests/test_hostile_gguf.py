"""A hostile model file never hangs a worker and never reaches the parent: every broken GGUF of
tests/hostile_gguf.py (named corruptions of the tiny model, and a seeded fuzzer over its metadata) ends in
a typed error, or in a contained worker crash reported as WorkerCrashedError, and the pool goes on
loading the valid model afterwards."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile_gguf import VARIANTS, fuzz_cases, parse, set_u32, write_variants

from lloyal_pool import LloyalError, ModelLoadError, Pool, RemoteError, WorkerCrashedError

# Seconds one load may take before it counts as a hang: a tiny-model load takes well under one.
LOAD_TIMEOUT = 60.0
FUZZ_CASES = 40
FUZZ_SEED = 20261130

CRASH = "crash"
LOADS = "loads"
# The typed errors a load may raise.
_TYPED = {"ModelLoadError"}

# What each named variant does with the vendored llama.cpp: the name of the typed error, CRASH (llama.cpp
# aborts the worker: contained, reported as WorkerCrashedError) or LOADS (a corruption llama.cpp does not
# look at or repairs; the model then also generates). The block, next-token-prediction-layer and expert
# counts that llama.cpp asserts on (aborting the worker) are checked by native/model.cpp first; the rarer
# expert-group rules are not, and that variant shows the crash contained.
_BENIGN = {"key_invalid_utf8", "context_length_zero", "vocab_size_mismatch", "tokenizer_bos_out_of_range",
           "tokenizer_token_invalid_utf8"}
_CRASHES = {"expert_groups_not_below_experts"}
EXPECTED: dict[str, str] = {name: LOADS if name in _BENIGN else CRASH if name in _CRASHES else "ModelLoadError"
                            for name in VARIANTS}


@pytest.fixture(scope="module")
def hostile_pool() -> Iterator[Pool]:
    # A data cap, so that a file that talks a worker into a huge allocation fails it instead of using
    # the machine's memory.
    with Pool(1, start_timeout=120.0, memory_limit=4 << 30) as p:
        yield p


@pytest.fixture(scope="module")
def variant_paths(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_variants(tiny_model, tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def fuzz_paths(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return fuzz_cases(tiny_model, tmp_path_factory.mktemp("fuzz"), n=FUZZ_CASES, seed=FUZZ_SEED)


def _outcome(pool: Pool, path: Path) -> str:
    """Load *path* in the pool's worker: the typed error's class name, CRASH or LOADS. A load that does
    not finish in LOAD_TIMEOUT fails the test (the worker is killed and replaced first)."""
    fut = pool[0].load_model_async(path)
    try:
        model = fut.result(timeout=LOAD_TIMEOUT)
    except concurrent.futures.TimeoutError:
        pool[0].kill()
        pool.replace(0)
        pytest.fail(f"loading {path.name} hung for {LOAD_TIMEOUT} s")
    except WorkerCrashedError:
        pool.replace(0)
        return CRASH
    except LloyalError as exc:
        assert not isinstance(exc, RemoteError), f"{path.name}: an untyped error from the worker: {exc}"
        assert pool[0].alive
        return type(exc).__name__
    # A file that loads must also be usable, or fail in a contained way when used.
    try:
        ctx = model.new_context(n_ctx=64)
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2
        ctx.close()
        model.close()
    except WorkerCrashedError:
        pool.replace(0)
        return f"{LOADS}, then {CRASH}"
    except LloyalError as exc:
        assert not isinstance(exc, RemoteError), f"{path.name}: an untyped error from the worker: {exc}"
        model.close()
        return f"{LOADS}, then {type(exc).__name__}"
    return LOADS


def _serves(pool: Pool, tiny_model: Path) -> None:
    model = pool[0].load_model(tiny_model)
    try:
        ctx = model.new_context(n_ctx=64)
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2
        ctx.close()
    finally:
        model.close()


def test_there_are_enough_variants() -> None:
    assert len(VARIANTS) >= 30


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_hostile_variant(hostile_pool: Pool, variant_paths: dict[str, Path], tiny_model: Path,
                         name: str) -> None:
    outcome = _outcome(hostile_pool, variant_paths[name])
    assert outcome == EXPECTED[name]
    hostile_pool[0].ping(timeout=LOAD_TIMEOUT)


def test_fuzzed_files(hostile_pool: Pool, fuzz_paths: list[Path], tiny_model: Path) -> None:
    outcomes = {path.name: _outcome(hostile_pool, path) for path in fuzz_paths}
    for name, outcome in outcomes.items():
        last = outcome.rpartition(", then ")[2]
        assert last in (CRASH, LOADS) or last in _TYPED, f"{name}: {outcome}"
    # A fuzzer that never gets past the reader tests nothing: most mutants must fail.
    assert sum(o != LOADS for o in outcomes.values()) >= FUZZ_CASES // 2
    _serves(hostile_pool, tiny_model)


@pytest.mark.parametrize(("values", "message"), [
    ({"llama.block_count": 0}, r"llama.block_count is 0, not in \[1, 512\]"),
    ({"llama.block_count": 513}, r"llama.block_count is 513, not in \[1, 512\]"),
    ({"llama.block_count": 2**31}, r"llama.block_count is 2147483648, not in \[1, 512\]"),
    ({"llama.nextn_predict_layers": 3}, r"llama.nextn_predict_layers is 3, not in \[0, block_count 2\]"),
    ({"llama.expert_count": 1025}, r"llama.expert_count is 1025, not in \[0, 1024\]"),
    ({"llama.expert_used_count": 1}, "llama.expert_used_count is 1 with an expert_count of 0"),
    ({"llama.expert_count": 4, "llama.expert_used_count": 5}, "expert_used_count is 5 with an expert_count of 4"),
    ({"llama.expert_count": 4, "llama.expert_used_count": 0}, "expert_used_count is 0 with an expert_count of 4"),
])
def test_metadata_llama_cpp_asserts_on_is_a_typed_error(hostile_pool: Pool, tiny_model: Path, tmp_path: Path,
                                                        values: dict[str, int], message: str) -> None:
    # llama.cpp checks these with GGML_ASSERT, which would abort the worker: checked before it loads.
    g = parse(tiny_model.read_bytes())
    for key, value in values.items():
        set_u32(g, key, value)
    bad = tmp_path / "meta.gguf"
    bad.write_bytes(g.dump())
    with pytest.raises(ModelLoadError, match=message):
        hostile_pool[0].load_model(bad)
    assert hostile_pool[0].alive
    _serves(hostile_pool, tiny_model)


def test_an_error_message_that_quotes_bytes_that_are_not_utf8(hostile_pool: Pool,
                                                              variant_paths: dict[str, Path]) -> None:
    # llama.cpp's error quotes the architecture name: the message is decoded with replacement characters
    # instead of failing as a UnicodeDecodeError (a RemoteError).
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'll\ufffdma'"):
        hostile_pool[0].load_model(variant_paths["arch_invalid_utf8"])


def test_pool_serves_after_the_hostile_files(hostile_pool: Pool, tiny_model: Path) -> None:
    _serves(hostile_pool, tiny_model)

