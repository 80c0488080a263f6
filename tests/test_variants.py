"""Choosing the native variant: LLOYAL_POOL_VARIANT (and its strict twin), the CPU fallback of a GPU
backend that is installed but cannot serve, and variants.probe(), which says what loads here. No GPU
backend is built on the machines the suite runs on, so the backends that "exist" here are planted for
the length of a test: a file that is no library, and a real library that is no GPU backend."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from lloyal_pool import Pool, WorkerStartupError, variants


@pytest.fixture
def planted() -> Iterator[Path]:
    """Where the worker looks for libggml-<variant>.so; whatever a test plants there goes afterwards."""
    directory = variants.backend_dir()
    assert directory is not None
    target = directory / "libggml-vulkan.so"
    assert not target.exists(), "a Vulkan backend is installed: these tests plant their own"
    try:
        yield target
    finally:
        target.unlink(missing_ok=True)


def _cpu_library() -> Path:
    directory = variants.backend_dir()
    assert directory is not None
    return next(directory.glob("libggml-cpu*.so"))


@pytest.mark.parametrize("kind", ["not a library", "no GPU device"])
def test_an_installed_backend_that_cannot_serve_falls_back_to_the_cpu(
        planted: Path, kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    if kind == "not a library":
        planted.write_bytes(b"\x7fELF but not really" * 64)
        reason = "did not load"
    else:
        shutil.copyfile(_cpu_library(), planted)  # loads, registers a CPU device: no GPU
        reason = "sees no GPU device"
    monkeypatch.setenv(variants.ENV_VARIANT, "vulkan")
    with caplog.at_level(logging.WARNING, logger="lloyal_pool"), Pool(1) as pool:
        assert pool[0].variant == "cpu"
        assert pool[0].ping(timeout=30) < 5.0
    warned = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert warned and "vulkan" in warned[0] and reason in warned[0], warned
    probed = {v.name: v for v in variants.probe()}
    assert not probed["vulkan"].loads and reason in probed["vulkan"].detail
    monkeypatch.setenv(variants.ENV_STRICT, "1")
    with pytest.raises(WorkerStartupError, match=reason):
        Pool(1)


def test_the_environment_names_the_variant_and_an_argument_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variants.ENV_VARIANT, "vulkan")
    monkeypatch.setenv(variants.ENV_STRICT, "1")
    with pytest.raises(WorkerStartupError, match="vulkan"):
        Pool(1)
    with Pool(1, variant="cpu") as pool:
        assert pool[0].variant == "cpu"
    monkeypatch.setenv(variants.ENV_VARIANT, "metal")
    with pytest.raises(ValueError, match="unknown native variant 'metal'"):
        Pool(1)


def test_the_probe_says_what_a_worker_runs() -> None:
    probed = variants.probe()
    assert [v.name for v in probed] == ["cpu", *[k for k in variants.KNOWN if k != "cpu"]]
    assert probed[0].loads
    with Pool(1) as pool:
        assert probed[0].detail == f"CPU kernels {pool[0].cpu_kernels}"
    # Whatever this machine has, a worker asked (strictly) for a variant starts on it exactly when the
    # probe says it loads.
    for v in probed[1:]:
        if v.loads:
            with Pool(1, variant=v.name, strict_variant=True) as pool:
                assert pool[0].variant == v.name
        else:
            assert v.detail
            with pytest.raises(WorkerStartupError):
                Pool(1, variant=v.name, strict_variant=True)
