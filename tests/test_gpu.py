"""GPU backends: what a worker's ggml sees (Instance.devices), where weights and caches sit
(Context.memory_breakdown, n_gpu_layers), the real CUDA backend's fallback on a machine without a GPU, and
the ``gpu``-marked tests that need the CUDA backend built (scripts/build-variant cuda) and a visible GPU.

Whether the CUDA backend is built and sees a GPU is decided by loading it in a child process: a backend
that sees no GPU device is unloaded again and says why, so a load that reports devices means a GPU."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from lloyal_pool import BufferMemory, GenerateParams, Pool, WorkerStartupError, variants

BUILD_HINT = "bash scripts/build-variant cuda --arch <sm>"


@cache
def cuda_status() -> tuple[bool, bool, str]:
    """(built, loads, why): whether libggml-cuda.so is installed, whether it sees a GPU, and why not."""
    directory = variants.backend_dir()
    if directory is None or not (directory / "libggml-cuda.so").exists():
        return False, False, f"the CUDA backend is not built here ({BUILD_HINT})"
    script = "import json, lloyal_pool.worker._native as n; print(json.dumps(n.load_gpu_backend('cuda')))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return True, False, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else str(proc.returncode)
    n_devices, why = json.loads(proc.stdout.strip().splitlines()[-1])
    return True, n_devices > 0, why


def needs_gpu() -> None:
    built, loads, why = cuda_status()
    if not built:
        pytest.skip(why)
    if not loads:
        pytest.skip(f"the CUDA backend is built but sees no GPU: {why}")


def gpu_model_bytes(rows: list[BufferMemory], gpu_names: set[str]) -> int:
    return sum(r.model for r in rows if r.device in gpu_names)


# -- every machine: the CPU ---------------------------------------------------------------------------
def test_devices_lists_the_cpu(pool: Pool) -> None:
    devices = pool[0].devices()
    cpus = [d for d in devices if d.type == "cpu"]
    assert len(cpus) == 1, devices
    cpu = cpus[0]
    assert cpu.name == "CPU" and cpu.backend == "CPU" and cpu.description
    assert 0 < cpu.memory_free <= cpu.memory_total
    assert not cpu.is_gpu and cpu.kernels == pool[0].cpu_kernels
    # A worker that was not asked for a GPU backend loads none.
    assert pool[0].variant == "cpu" and not [d for d in devices if d.is_gpu]


def test_n_gpu_layers_without_a_gpu_backend_keeps_everything_on_the_cpu(pool: Pool, tiny_model: Path) -> None:
    # A CPU worker accepts any n_gpu_layers (llama.cpp has no GPU device to give layers to): the model
    # loads, every buffer is the CPU's, and the output is the same as with n_gpu_layers=0.
    texts = []
    for n_gpu_layers in (99, -1, 0):
        model = pool[1].load_model(tiny_model, n_gpu_layers=n_gpu_layers)
        try:
            ctx = model.new_context()
            rows = ctx.memory_breakdown()
            assert rows and all(r.device in ("", "CPU") for r in rows), rows
            assert sum(r.model for r in rows) >= model.info.size
            assert sum(r.context for r in rows) > 0  # the KV cache
            texts.append(ctx.generate("Once upon a time", GenerateParams(n_predict=8)).text)
        finally:
            model.close()
    assert texts[0] == texts[1] == texts[2]


def test_memory_breakdown_of_an_embedding_context(pool: Pool, tiny_model: Path) -> None:
    model = pool[1].load_model(tiny_model)
    try:
        ctx = model.new_context(embeddings=True)
        rows = ctx.memory_breakdown()
        assert sum(r.model for r in rows) >= model.info.size
    finally:
        model.close()


def test_real_cuda_build_without_a_gpu_falls_back_unless_strict(caplog: pytest.LogCaptureFixture) -> None:
    built, loads, why = cuda_status()
    if not built:
        pytest.skip(why)
    if loads:
        pytest.skip("a GPU is visible here: the CUDA build loads (the gpu-marked tests cover this machine)")
    assert "sees no GPU device" in why
    with caplog.at_level(logging.WARNING, logger="lloyal_pool"), Pool(1, variant="cuda") as pool:
        assert pool[0].variant == "cpu"
        assert [d.type for d in pool[0].devices()] == ["cpu"]
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert warnings and "cuda" in warnings[0] and "sees no GPU device" in warnings[0], warnings
    with pytest.raises(WorkerStartupError, match="sees no GPU device"):
        Pool(1, variant="cuda", strict_variant=True)


# -- a GPU machine with the CUDA backend built -----------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_pool() -> Iterator[Pool]:
    needs_gpu()
    with Pool(1, variant="cuda", strict_variant=True) as p:
        yield p


@pytest.mark.gpu
def test_gpu_devices_lists_the_gpu(cuda_pool: Pool) -> None:
    inst = cuda_pool[0]
    assert inst.variant == "cuda"
    gpus = [d for d in inst.devices() if d.is_gpu]
    assert gpus, inst.devices()
    for gpu in gpus:
        assert gpu.backend == "CUDA" and gpu.name.startswith("CUDA") and gpu.description
        assert 0 < gpu.memory_free <= gpu.memory_total
    assert inst.build_info["supports_gpu_offload"]


@pytest.mark.gpu
def test_gpu_n_gpu_layers_offloads_the_weights(cuda_pool: Pool, gemma_path: Path) -> None:
    inst = cuda_pool[0]
    gpu_names = {d.name for d in inst.devices() if d.is_gpu}
    on_gpu = {}
    for n_gpu_layers in (0, 99):
        model = inst.load_model(gemma_path, n_gpu_layers=n_gpu_layers)
        try:
            rows = model.new_context().memory_breakdown()
            on_gpu[n_gpu_layers] = gpu_model_bytes(rows, gpu_names)
        finally:
            model.close()
    assert on_gpu[0] == 0
    # Every repeating layer and the output layer go to the GPU; only the input embedding stays behind.
    assert on_gpu[99] > 0


@pytest.mark.gpu
def test_gpu_greedy_agrees_with_the_cpu(cuda_pool: Pool, pool: Pool, gemma_path: Path) -> None:
    prompt = "The capital of France is"
    results = []
    for inst, n_gpu_layers in ((pool[0], 0), (cuda_pool[0], 99)):
        model = inst.load_model(gemma_path, n_gpu_layers=n_gpu_layers)
        try:
            ctx = model.new_context()
            ctx.eval(prompt)
            logits = ctx.logits(copy=True)
            ctx.reset()
            text = ctx.generate(prompt, GenerateParams(n_predict=8)).text
            results.append((logits, text))
        finally:
            model.close()
    (cpu_logits, cpu_text), (gpu_logits, gpu_text) = results
    # Different kernels, so not bit-identical: the same greedy pick and nearly the same distribution.
    assert int(np.argmax(cpu_logits)) == int(np.argmax(gpu_logits))
    assert float(np.corrcoef(cpu_logits, gpu_logits)[0, 1]) > 0.99
    assert gpu_text.split()[:1] == cpu_text.split()[:1], (cpu_text, gpu_text)
