"""Instance.load_model_from_memory (go-llama's in-memory filesystem): a GGUF held as bytes, a memoryview
of a mapping, an open descriptor or a binary file reaches the worker as a memfd (never as a frame, never
as a path) and serves as the same file loaded by path does; it loads again in a recovered worker."""

from __future__ import annotations

import mmap
import os
import signal
from pathlib import Path

import pytest

from lloyal_pool import ModelLoadError, Pool


def _greedy(model: object, n: int = 8) -> list[int]:
    ctx = model.new_context(n_ctx=128)  # type: ignore[attr-defined]
    try:
        return list(ctx.generate("Hello there", n_predict=n, temperature=0.0, ignore_eos=True).tokens)
    finally:
        ctx.close()


def test_every_form_of_memory_serves_as_the_file_does(tiny_model: Path) -> None:
    data = tiny_model.read_bytes()
    with Pool(1) as pool, open(tiny_model, "rb") as f:
        expected = _greedy(pool[0].load_model(tiny_model))
        mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        forms: dict[str, object] = {"bytes": data, "bytearray": bytearray(data), "memoryview of an mmap":
                                    memoryview(mapping), "descriptor": f.fileno(), "file object": f}
        for name, form in forms.items():
            model = pool[0].load_model_from_memory(form)  # type: ignore[arg-type]
            assert model.path == f"<memory: {len(data)} bytes>", name
            assert _greedy(model) == expected, name
            model.close()
        del forms, form, model  # the last model kept its memory while it lived
        mapping.close()


def test_memory_needs_no_path_the_sandbox_allows(tiny_model: Path, tmp_path: Path) -> None:
    # Reads are scoped to an empty directory: the file cannot be loaded by path, its bytes can.
    with Pool(1, allowed_dirs=[tmp_path]) as pool:
        with pytest.raises(ModelLoadError, match="allowed_dirs"):
            pool[0].load_model(tiny_model)
        model = pool[0].load_model_from_memory(tiny_model.read_bytes())
        assert len(_greedy(model, 4)) == 4


def test_bad_memory_is_a_clean_error_and_the_worker_serves(tiny_model: Path, tmp_path: Path) -> None:
    data = tiny_model.read_bytes()
    r, w = os.pipe()
    try:
        with Pool(1) as pool:
            with pytest.raises(ModelLoadError, match="not a GGUF"):
                pool[0].load_model_from_memory(b"not a model at all")
            with pytest.raises(ModelLoadError):
                pool[0].load_model_from_memory(data[: len(data) // 3])  # a GGUF cut short: the worker says so
            with pytest.raises(ModelLoadError, match="at offsets"):
                pool[0].load_model_from_memory(r)
            with pytest.raises(ModelLoadError):
                pool[0].load_model_from_memory(b"")
            assert len(_greedy(pool[0].load_model_from_memory(data), 2)) == 2
    finally:
        os.close(r)
        os.close(w)


def test_a_recovered_worker_loads_the_memory_again(tiny_model: Path) -> None:
    with Pool(1, recover=True) as pool:
        model = pool[0].load_model_from_memory(tiny_model.read_bytes())
        ctx = model.new_context(n_ctx=128)
        first = ctx.generate("Hello there", n_predict=6, temperature=0.0, ignore_eos=True).tokens
        os.kill(pool[0].pid, signal.SIGKILL)
        again = ctx.generate("Hello there", n_predict=6, temperature=0.0, ignore_eos=True).tokens
        assert again == first
        assert model.info.n_vocab > 0 and _greedy(model, 6) == first
