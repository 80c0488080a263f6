"""Small random LoRA adapter GGUFs for tests, written with the ``gguf`` package.

An adapter pairs ``<base tensor>.lora_a`` and ``<base tensor>.lora_b`` for each tensor it adapts, and says
``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha`` and the base model's
``general.architecture`` (llama.cpp's src/llama-adapter.cpp checks all four). For a base weight of ggml
shape ``{n_in, n_out}`` llama.cpp wants ``lora_a`` as ggml ``{n_in, rank}`` and ``lora_b`` as ggml
``{rank, n_out}``, i.e. numpy ``(rank, n_in)`` and ``(n_out, rank)`` (gguf reverses numpy's shape), and
adds ``scale * alpha / rank * B @ A`` to the weight's product.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tinymodel import write_gguf

__all__ = ["attention_shapes", "write_lora"]


def attention_shapes(info: Any, layers: range | list[int], tensors: tuple[str, ...] = ("attn_q", "attn_v")
                     ) -> dict[str, tuple[int, int]]:
    """``{name: (n_in, n_out)}`` of the q/k/v projections of ``layers``, from a loaded model's ModelInfo
    (no need to read the GGUF, which for a 262k-token vocabulary takes long)."""
    arch = info.meta["general.architecture"]
    key_len = int(info.meta.get(f"{arch}.attention.key_length", info.n_embd // info.n_head))
    value_len = int(info.meta.get(f"{arch}.attention.value_length", key_len))
    out = {"attn_q": info.n_head * key_len, "attn_k": info.n_head_kv * key_len,
           "attn_v": info.n_head_kv * value_len}
    return {f"blk.{i}.{t}.weight": (info.n_embd, out[t]) for i in layers for t in tensors}


def write_lora(dst: Path | str, arch: str, shapes: Mapping[str, tuple[int, int]], *, rank: int = 4,
               alpha: float | None = None, seed: int = 0, std: float = 1.0) -> Path:
    """Write a LoRA adapter for base tensors ``{name: (n_in, n_out)}`` of an ``arch`` model; return dst.

    alpha defaults to rank (llama.cpp's factor alpha / rank is then 1). A is drawn with std 1/sqrt(n_in)
    and B with ``std``/sqrt(rank), so B @ A x has about ``std`` times the scale of x: big enough to move
    the logits of a model whose weights are of that order. The same arguments give the same bytes.
    """
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(None, arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank if alpha is None else alpha))
    for name, (n_in, n_out) in shapes.items():
        a = rng.standard_normal((rank, n_in), dtype=np.float32) / np.float32(np.sqrt(n_in))
        b = rng.standard_normal((n_out, rank), dtype=np.float32) * np.float32(std / np.sqrt(rank))
        w.add_tensor(name + ".lora_a", a)
        w.add_tensor(name + ".lora_b", b)
    return write_gguf(w, dst)
