"""Shared fixtures: real models (a tiny random one the suite makes itself, and Gemma 3 270M), pools that
always close, and llama.cpp's own reference programs built from the same vendored tree."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "llama.cpp"
MODELS_DIR = VENDOR / "models"
CACHE = ROOT / ".cache" / "test-models"

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "scripts"))

from gemmadraft import gemma_draft_path as _gemma_draft_path  # noqa: E402
from reference_tools import tool  # noqa: E402
from tinymodel import tiny_model_path  # noqa: E402

from lloyal_pool import Pool, default_model_path  # noqa: E402

TEST_MODEL_ENV = "LLOYAL_POOL_TEST_MODEL"


def your_model_path() -> Path:
    """The model tests/test_your_model.py runs on: LLOYAL_POOL_TEST_MODEL=/path/to.gguf (go-llama's
    GO_LLAMA_TEST_MODEL), else the default model."""
    chosen = os.environ.get(TEST_MODEL_ENV)
    if not chosen:
        return default_model_path()
    path = Path(chosen).expanduser().resolve()
    if not path.is_file():
        raise pytest.UsageError(f"{TEST_MODEL_ENV}={chosen!r} is not a file")
    return path


def pytest_report_header() -> str:
    return f"model of test_your_model.py ({TEST_MODEL_ENV}): {os.environ.get(TEST_MODEL_ENV) or 'the default model'}"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return tiny_model_path(CACHE)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def gemma_draft_path(gemma_path: Path) -> Path:
    """Gemma 3 270M's first 4 of 18 blocks (tests/gemmadraft.py): a draft model with Gemma's vocabulary,
    written once into the cache (about 200 MB, most of it the shared token embeddings)."""
    return _gemma_draft_path(CACHE, gemma_path, n_layers=4)


@pytest.fixture(scope="session")
def llama_simple() -> Path:
    return tool("llama-simple")


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """A shared two-worker pool for tests that do not break workers. Its workers may write beneath the
    tests' temporary directories (state files); everything else is the default sandbox."""
    with Pool(2, writable_dirs=[tmp_path_factory.getbasetemp()]) as p:
        yield p


@pytest.fixture(scope="session")
def gemma(pool: Pool, gemma_path: Path):  # type: ignore[no-untyped-def]
    return pool[0].load_model(gemma_path)


@pytest.fixture(scope="session")
def tiny(pool: Pool, tiny_model: Path):  # type: ignore[no-untyped-def]
    return pool[1].load_model(tiny_model)


@pytest.fixture
def fresh_pool() -> Iterator[Pool]:
    """A private pool with fault injection enabled, for tests that kill or break workers."""
    with Pool(2, env={"LLOYAL_POOL_TEST_FAULTS": "1"}) as p:
        yield p
