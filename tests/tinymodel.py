"""A tiny random-weight llama-architecture GGUF for fast tests.

The model has the real 32000-token SentencePiece vocabulary of
``vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf`` (every ``tokenizer.*`` key is
copied verbatim) and random weights drawn from a seeded numpy generator, so:

* it loads and runs in llama.cpp like any llama model (2 layers, n_embd 64 by default),
* the file is small (~9 MB; token_embd/output are f16, everything else f32),
* the logits are finite and reasonably spread (std ~3), so greedy decoding is
  deterministic and produces varied tokens, and sampling is not degenerate,
* by default the output rows of special tokens (control/unknown/unused types and the
  eos/eot/eom ids) are zero: their logit is 0 while the best logit is ~10, so greedy
  decoding never stops early on an end-of-generation token.

Dimension order: numpy arrays are written as-is and gguf reverses the shape, so a
ggml tensor ``{ne0, ne1}`` is a numpy array of shape ``(ne1, ne0)``.  E.g. token_embd
is ggml ``{n_embd, n_vocab}`` = numpy ``(n_vocab, n_embd)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFValueType

__all__ = [
    "DEFAULT_VOCAB",
    "FORMAT_VERSION",
    "copy_field",
    "make_not_gguf",
    "make_tiny_model",
    "make_truncated",
    "tiny_model_path",
    "write_gguf",
]

#: Bump when the generator's output changes, so cached files are rebuilt.
FORMAT_VERSION = 1

DEFAULT_VOCAB = (
    Path(__file__).resolve().parent.parent / "vendor" / "llama.cpp" / "models" / "ggml-vocab-llama-spm.gguf"
)

ARCH = "llama"

# llama_token_type values (tokenizer.ggml.token_type)
_TT_UNKNOWN = 2
_TT_CONTROL = 3
_TT_UNUSED = 5

_EOG_ID_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)

# weight scales (std of the normal draws)
_EMBD_STD = 1.0  # token embeddings: residual stream has RMS ~1
_LAYER_STD = 0.1  # attention / FFN matrices: each block adds O(0.5) to the residual
_OUT_STD = 0.4  # lm head: logit std = 0.4 * sqrt(64) ~ 3.2 for n_embd=64


def copy_field(field: gguf.ReaderField, key: str, writer: gguf.GGUFWriter) -> None:
    """Copy one key/value of a GGUFReader to *writer*, type preserved (strings as raw bytes: an exact
    copy, no UTF-8 round trip)."""
    vtype = GGUFValueType(field.types[0])
    if vtype == GGUFValueType.ARRAY:
        sub = GGUFValueType(field.types[-1])
        if sub == GGUFValueType.STRING:
            val = [bytes(field.parts[i]) for i in field.data]
        elif sub == GGUFValueType.ARRAY:
            raise ValueError(f"nested array in {key} is not supported")
        else:
            val = field.contents()
        writer.add_key_value(key, val, vtype, sub_type=sub)
    elif vtype == GGUFValueType.STRING:
        writer.add_key_value(key, bytes(field.parts[field.data[0]]), vtype)
    else:
        writer.add_key_value(key, field.contents(), vtype)


def write_gguf(writer: gguf.GGUFWriter, dst: Path | str) -> Path:
    """Writes what *writer* holds to *dst* (its folder made if need be) and closes it."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(dst)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Copy every ``tokenizer.*`` key/value of *reader* to *writer*, types preserved."""
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            copy_field(field, key, writer)


def _special_ids(reader: gguf.GGUFReader) -> list[int]:
    ids: set[int] = set()
    tt = reader.fields.get("tokenizer.ggml.token_type")
    if tt is not None:
        types = np.asarray(tt.contents())
        ids.update(np.nonzero(np.isin(types, (_TT_UNKNOWN, _TT_CONTROL, _TT_UNUSED)))[0].tolist())
    for k in _EOG_ID_KEYS:
        f = reader.fields.get(k)
        if f is not None:
            ids.add(int(f.contents()))
    return sorted(ids)


def make_tiny_model(
    path: Path | str,
    vocab_gguf: Path | str = DEFAULT_VOCAB,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 512,
    seed: int = 0,
    suppress_special: bool = True,
    arch: str = ARCH,
    cls_labels: Sequence[str] = (),
    rerank_template: str | None = None,
) -> Path:
    """Write a random-weight llama GGUF with the tokenizer of *vocab_gguf* to *path*; return *path*.

    The vocabulary size is the number of tokens in *vocab_gguf*.  With
    *suppress_special* the lm-head rows of special/end-of-generation tokens are zero
    (see module docstring).  The same arguments always give the same bytes.

    *arch* "qwen3" writes the same network as a Qwen3 (llama plus per-head q/k norms, here
    all ones).  *cls_labels* (qwen3 only) adds a reranker's classification head: a random
    ``cls.output`` of one row per label, the labels, and pooling type "rank", which is what
    a converted Qwen3 reranker has; llama.cpp then scores a sequence as the softmax of
    ``cls.output @ h`` over the labels, h being the last token's final (normed) hidden state.
    *rerank_template* is written as ``tokenizer.chat_template.rerank`` (with ``{query}`` and
    ``{document}`` placeholders, as llama.cpp reads it).
    """
    if arch not in (ARCH, "qwen3"):
        raise ValueError(f"unsupported arch {arch!r}")
    if cls_labels and arch != "qwen3":
        raise ValueError("a classification head needs arch='qwen3'")
    path = Path(path)
    if n_embd % n_head:
        raise ValueError("n_embd must be a multiple of n_head")
    if n_head % n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    head_dim = n_embd // n_head

    reader = gguf.GGUFReader(vocab_gguf)
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{vocab_gguf}: no tokenizer.ggml.tokens")
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float, dtype: type = np.float32) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(dtype)

    w = gguf.GGUFWriter(None, arch)  # add_architecture() is done by the constructor
    w.add_name("lloyal-tiny-random")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    if cls_labels:
        w.add_classifier_output_labels(list(cls_labels))
        w.add_pooling_type(gguf.PoolingType.RANK)
    _copy_tokenizer(reader, w)
    if rerank_template is not None:
        w.add_key_value("tokenizer.chat_template.rerank", rerank_template, GGUFValueType.STRING)

    # ggml {n_embd, n_vocab} == numpy (n_vocab, n_embd)
    w.add_tensor("token_embd.weight", normal((n_vocab, n_embd), _EMBD_STD, np.float16))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", normal((n_head * head_dim, n_embd), _LAYER_STD))
        w.add_tensor(p + "attn_k.weight", normal((n_head_kv * head_dim, n_embd), _LAYER_STD))
        w.add_tensor(p + "attn_v.weight", normal((n_head_kv * head_dim, n_embd), _LAYER_STD))
        w.add_tensor(p + "attn_output.weight", normal((n_embd, n_head * head_dim), _LAYER_STD))
        if arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", normal((n_ff, n_embd), _LAYER_STD))
        w.add_tensor(p + "ffn_up.weight", normal((n_ff, n_embd), _LAYER_STD))
        w.add_tensor(p + "ffn_down.weight", normal((n_embd, n_ff), _LAYER_STD))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    out = normal((n_vocab, n_embd), _OUT_STD, np.float16)
    if suppress_special:
        out[_special_ids(reader)] = 0
    w.add_tensor("output.weight", out)
    if cls_labels:
        # ggml {n_embd, n_cls_out}; std 1 so that the label logits are spread (the hidden state is RMS-normed).
        w.add_tensor("cls.output.weight", normal((len(cls_labels), n_embd), 1.0))

    return write_gguf(w, path)


def _file_digest(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tiny_model_path(cache_dir: Path | str, vocab_gguf: Path | str = DEFAULT_VOCAB, **params) -> Path:
    """Path of a cached tiny model in *cache_dir*, building it on first use.

    *params* are passed to :func:`make_tiny_model`.  The file name is keyed by a hash
    of the parameters, the vocab file's content and :data:`FORMAT_VERSION`.  The file
    is written under a temporary name and renamed into place, so concurrent callers
    (e.g. pytest-xdist workers) never see a partial file.
    """
    cache_dir = Path(cache_dir)
    vocab_gguf = Path(vocab_gguf)
    key = json.dumps(
        {"v": FORMAT_VERSION, "vocab": _file_digest(vocab_gguf),
         "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}},
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    dst = cache_dir / f"tiny-llama-{digest}.gguf"
    if dst.is_file():
        return dst
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=cache_dir)
    os.close(fd)
    try:
        make_tiny_model(Path(tmp), vocab_gguf, **params)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst


def make_truncated(src: Path | str, dst: Path | str, nbytes: int) -> Path:
    """Write the first *nbytes* bytes of *src* to *dst* (a negative value drops that many bytes
    from the end instead); return *dst*."""
    data = Path(src).read_bytes()
    if nbytes < 0:
        nbytes = max(0, len(data) + nbytes)
    dst = Path(dst)
    dst.write_bytes(data[:nbytes])
    return dst


def make_not_gguf(dst: Path | str) -> Path:
    """Write a file that is not a GGUF (wrong magic, plain text); return *dst*."""
    dst = Path(dst)
    dst.write_bytes(b"this is not a GGUF model file\n" * 64)
    return dst
