"""A draft model for speculative decoding tests: Gemma 3 270M cut down to its first N blocks.

``make_truncated_gemma`` reads the Gemma GGUF with the ``gguf`` package and writes a copy that keeps every
metadata key (tokenizer included, byte for byte) and every tensor outside the blocks, plus blocks
0..N-1; ``<arch>.block_count`` says N. Quantized tensors are copied as raw bytes with their type, so
nothing is requantized: the draft's first N blocks compute exactly what the full model's do. It shares
the full model's vocabulary, which is what a draft for speculative decoding needs; its predictions are
worse (it skips the later blocks), which is what a draft is.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import gguf
from tinymodel import copy_field, write_gguf

__all__ = ["FORMAT_VERSION", "gemma_draft_path", "make_truncated_gemma"]

#: Bump when the output changes, so cached files are rebuilt.
FORMAT_VERSION = 1

_BLOCK = re.compile(r"^blk\.(\d+)\.")
# Written by GGUFWriter itself (the constructor, the header), never copied.
_OWN_KEYS = {"general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def make_truncated_gemma(src: Path | str, dst: Path | str, n_layers: int) -> Path:
    """Write ``src`` (a Gemma 3 GGUF) with only its first ``n_layers`` blocks to ``dst``; return ``dst``."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    count_key = f"{arch}.block_count"
    n_total = int(reader.fields[count_key].contents())
    if not 1 <= n_layers <= n_total:
        raise ValueError(f"n_layers must be in [1, {n_total}], got {n_layers}")

    writer = gguf.GGUFWriter(None, arch)
    for key, field in reader.fields.items():
        if key in _OWN_KEYS:
            continue
        if key == count_key:
            writer.add_uint32(count_key, n_layers)
        elif key == "general.alignment":
            writer.data_alignment = int(field.contents())
            copy_field(field, key, writer)
        else:
            copy_field(field, key, writer)
    for tensor in reader.tensors:
        block = _BLOCK.match(tensor.name)
        if block is not None and int(block.group(1)) >= n_layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)

    return write_gguf(writer, dst)


def gemma_draft_path(cache_dir: Path | str, src: Path | str, n_layers: int = 4) -> Path:
    """A cached truncated copy of ``src`` in ``cache_dir``, written on first use (under a temporary name,
    then renamed, so a concurrent caller never sees half a file). Keyed by the source's name, size and
    mtime, ``n_layers`` and FORMAT_VERSION: hashing a 250 MB model on every run would cost more."""
    src = Path(src)
    st = src.stat()
    dst = Path(cache_dir) / f"{src.stem}-{n_layers}blk-{st.st_size}-{st.st_mtime_ns}-v{FORMAT_VERSION}.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        make_truncated_gemma(src, tmp, n_layers)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst
