"""Hostile GGUF files made from a valid one: named corruptions aimed at the checks of llama.cpp's GGUF
reader and model loader, and a seeded fuzzer over the header and key/value region.

The valid file is parsed into its parts (header, key/value pairs as raw bytes, tensor infos, data
section) by our own small reader; a variant edits those parts and writes them back (``_Gguf.dump``
re-pads the data section to the file's alignment), or edits the bytes of the written file directly
where the point is a field that no longer parses.  Everything is deterministic: the same valid file and
seed always give the same bytes.

GGUF layout (little-endian): magic ``GGUF``, u32 version, i64 tensor count, i64 key/value count; each
key/value is a string key (u64 length + bytes), a u32 value type and the value (arrays: u32 element
type, u64 count, elements); each tensor info is a string name, u32 n_dims, n_dims i64 dimensions, i32
ggml type and u64 offset into the data section, which starts at the next multiple of the alignment
(``general.alignment``, default 32).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["VARIANTS", "fuzz_cases", "parse", "set_u32", "write_variants"]

# gguf value types
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_SCALAR_SIZE = {_U8: 1, _I8: 1, _U16: 2, _I16: 2, _U32: 4, _I32: 4, _F32: 4, _BOOL: 1, _U64: 8, _I64: 8,
                _F64: 8}
_DEFAULT_ALIGNMENT = 32
_GGML_TYPE_COUNT = 43  # vendor/llama.cpp/ggml/include/ggml.h
_GGML_F32, _GGML_F16, _GGML_Q4_2_REMOVED = 0, 1, 4


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@dataclass
class _KV:
    key: bytes
    vtype: int
    payload: bytes  # the value as written after the type (arrays: element type, count, elements)


@dataclass
class _Tensor:
    name: bytes
    dims: list[int]
    ttype: int
    offset: int


@dataclass
class _Gguf:
    magic: bytes
    version: int
    kvs: list[_KV]
    tensors: list[_Tensor]
    data: bytes
    n_tensors: int | None = None  # header counts when they should not match the lists
    n_kv: int | None = None
    alignment: int = _DEFAULT_ALIGNMENT  # the padding dump() writes before the data section
    extra: dict[str, int] = field(default_factory=dict)

    def dump(self) -> bytes:
        out = bytearray(self.magic + struct.pack("<I", self.version))
        out += struct.pack("<q", len(self.tensors) if self.n_tensors is None else self.n_tensors)
        out += struct.pack("<q", len(self.kvs) if self.n_kv is None else self.n_kv)
        for kv in self.kvs:
            out += _s(kv.key) + struct.pack("<I", kv.vtype) + kv.payload
        for t in self.tensors:
            out += _s(t.name) + struct.pack("<I", len(t.dims))
            out += b"".join(struct.pack("<q", d) for d in t.dims)
            out += struct.pack("<iQ", t.ttype, t.offset)
        out += bytes(-len(out) % self.alignment)
        return bytes(out + self.data)

    def kv(self, key: str) -> _KV:
        return next(kv for kv in self.kvs if kv.key == key.encode())

    def tensor(self, name: str) -> _Tensor:
        return next(t for t in self.tensors if t.name == name.encode())

    def copy(self) -> _Gguf:
        return replace(self, kvs=[replace(kv) for kv in self.kvs],
                       tensors=[replace(t, dims=list(t.dims)) for t in self.tensors])


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ValueError("truncated GGUF")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str) -> int:
        return int(struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0])

    def string(self) -> bytes:
        return self.take(self.unpack("<Q"))

    def skip_value(self, vtype: int) -> None:
        if vtype == _STR:
            self.string()
        elif vtype == _ARR:
            sub, n = self.unpack("<I"), self.unpack("<Q")
            for _ in range(n) if sub in (_STR, _ARR) else ():
                self.skip_value(sub)
            if sub not in (_STR, _ARR):
                self.take(_SCALAR_SIZE[sub] * n)
        else:
            self.take(_SCALAR_SIZE[vtype])


def parse(buf: bytes) -> _Gguf:
    """The parts of a valid GGUF file (raises ValueError when it is not one this reader understands)."""
    c = _Cursor(buf)
    magic, version = c.take(4), c.unpack("<I")
    n_tensors, n_kv = c.unpack("<q"), c.unpack("<q")
    kvs = []
    for _ in range(n_kv):
        key, vtype = c.string(), c.unpack("<I")
        start = c.pos
        c.skip_value(vtype)
        kvs.append(_KV(key, vtype, buf[start:c.pos]))
    tensors = []
    for _ in range(n_tensors):
        name, n_dims = c.string(), c.unpack("<I")
        dims = [c.unpack("<q") for _ in range(n_dims)]
        tensors.append(_Tensor(name, dims, c.unpack("<i"), c.unpack("<Q")))
    g = _Gguf(magic, version, kvs, tensors, b"")
    align = next((struct.unpack("<I", kv.payload)[0] for kv in kvs if kv.key == b"general.alignment"),
                 _DEFAULT_ALIGNMENT)
    g.alignment = align
    g.data = buf[c.pos + (-c.pos % align):]
    if g.dump() != buf:
        raise ValueError("the GGUF does not round-trip through parse/dump")
    return g


# -- the named variants ---------------------------------------------------------------------------------
# Each takes the parsed valid file (a private copy) and its bytes and returns the hostile bytes.
Variant = Callable[[_Gguf, bytes], bytes]


def _patch(buf: bytes, offset: int, new: bytes) -> bytes:
    return buf[:offset] + new + buf[offset + len(new):]


def _kv_offset(g: _Gguf, key: str) -> int:
    """File offset of *key*'s key/value pair (its key length field)."""
    pos = 24
    for kv in g.kvs:
        if kv.key == key.encode():
            return pos
        pos += 8 + len(kv.key) + 4 + len(kv.payload)
    raise KeyError(key)


def set_u32(g: _Gguf, key: str, value: int, vtype: int = _U32) -> bytes:
    """The file with *key* set (added if absent) to the 32-bit *value* (or of type *vtype*)."""
    kv = next((kv for kv in g.kvs if kv.key == key.encode()), None)
    fmt = {_U32: "<I", _I32: "<i", _U64: "<Q"}[vtype]
    if kv is None:
        g.kvs.append(_KV(key.encode(), vtype, struct.pack(fmt, value)))
    else:
        kv.vtype, kv.payload = vtype, struct.pack(fmt, value)
    return g.dump()


def _set_str(g: _Gguf, key: str, value: bytes) -> bytes:
    kv = g.kv(key)
    kv.vtype, kv.payload = _STR, _s(value)
    return g.dump()


def _array_header(kv: _KV) -> tuple[int, int]:
    sub, n = struct.unpack_from("<IQ", kv.payload)
    return int(sub), int(n)


def _shorten_array(g: _Gguf, key: str, by: int) -> bytes:
    kv = g.kv(key)
    sub, n = _array_header(kv)
    if sub == _STR:
        c = _Cursor(kv.payload)
        c.pos = 12
        for _ in range(n - by):
            c.string()
        body = kv.payload[12:c.pos]
    else:
        body = kv.payload[12:12 + (n - by) * _SCALAR_SIZE[sub]]
    kv.payload = struct.pack("<IQ", sub, n - by) + body
    return g.dump()


def _tokens_as_u32(g: _Gguf, b: bytes) -> bytes:
    kv = g.kv("tokenizer.ggml.tokens")
    _, n = _array_header(kv)
    kv.payload = struct.pack("<IQ", _U32, n) + bytes(4 * n)
    return g.dump()


def _scores_as_strings(g: _Gguf, b: bytes) -> bytes:
    kv = g.kv("tokenizer.ggml.scores")
    _, n = _array_header(kv)
    kv.payload = struct.pack("<IQ", _STR, n) + _s(b"x") * n
    return g.dump()


def _first_tensor_offset(g: _Gguf) -> int:
    """File offset of the first tensor info."""
    return 24 + sum(8 + len(kv.key) + 4 + len(kv.payload) for kv in g.kvs)


def _with_tensor(g: _Gguf, tensor: str, **changes: object) -> bytes:
    t = g.tensor(tensor)
    for k, v in changes.items():
        setattr(t, k, v)
    return g.dump()


def _consistent_offsets(g: _Gguf) -> None:
    """Recompute every tensor offset from the shapes and types (f32/f16 only), as a writer would."""
    pos = 0
    for t in g.tensors:
        t.offset = pos
        n = 1
        for d in t.dims:
            n *= d
        pos += n * (4 if t.ttype == _GGML_F32 else 2)
        pos += -pos % g.alignment


def _f16_to_f32_consistent(g: _Gguf, b: bytes) -> bytes:
    # Offsets that agree with the new types: the reader is satisfied, the data section is too short.
    g.tensor("output.weight").ttype = _GGML_F32
    _consistent_offsets(g)
    return g.dump()


def _duplicate_key(g: _Gguf, b: bytes) -> bytes:
    g.kvs.append(replace(g.kv("general.name")))
    return g.dump()


def _duplicate_tensor(g: _Gguf, b: bytes) -> bytes:
    g.tensors[1].name = g.tensors[0].name
    return g.dump()


def _drop_tensor(g: _Gguf, b: bytes) -> bytes:
    g.tensors = [t for t in g.tensors if t.name != b"output_norm.weight"]
    _consistent_offsets(g)
    return g.dump()


def _key_invalid_utf8(g: _Gguf, b: bytes) -> bytes:
    g.kv("general.name").key = b"general.\xff\xfe\xc3"
    return g.dump()


def _token_invalid_utf8(g: _Gguf, b: bytes) -> bytes:
    # token 1000's text replaced by bytes that are not UTF-8 (same length keeps every other field in place)
    kv = g.kv("tokenizer.ggml.tokens")
    c = _Cursor(kv.payload)
    c.pos = 12
    for _ in range(1000):
        c.string()
    n = struct.unpack_from("<Q", kv.payload, c.pos)[0]
    kv.payload = _patch(kv.payload, c.pos + 8, b"\xff" * n)
    return g.dump()


def _nested_array(g: _Gguf, b: bytes) -> bytes:
    g.kv("tokenizer.ggml.scores").payload = struct.pack("<IQ", _ARR, 1) + struct.pack("<IQ", _U8, 0)
    return g.dump()


def _array_count_patch(key: str, count: int) -> Variant:
    def make(g: _Gguf, b: bytes) -> bytes:
        pos = _kv_offset(g, key) + 8 + len(key) + 4 + 4
        return _patch(b, pos, struct.pack("<Q", count))
    return make


def _token_len_patch(count: int) -> Variant:
    def make(g: _Gguf, b: bytes) -> bytes:
        key = "tokenizer.ggml.tokens"
        pos = _kv_offset(g, key) + 8 + len(key) + 4 + 12  # the first token's length field
        return _patch(b, pos, struct.pack("<Q", count))
    return make


def _tensor_field_patch(field_name: str, value: bytes) -> Variant:
    """Patch a field of the first tensor info in place (name length, n_dims, first dimension)."""
    def make(g: _Gguf, b: bytes) -> bytes:
        pos = _first_tensor_offset(g)
        name_len = len(g.tensors[0].name)
        at = {"name_len": pos, "n_dims": pos + 8 + name_len, "dim0": pos + 8 + name_len + 4}[field_name]
        return _patch(b, at, value)
    return make


def _header(offset: int, value: bytes) -> Variant:
    return lambda g, b: _patch(b, offset, value)


def _edit(fn: Callable[[_Gguf], object]) -> Variant:
    def make(g: _Gguf, b: bytes) -> bytes:
        fn(g)
        return g.dump()
    return make


_Q = struct.Struct("<q").pack
_I = struct.Struct("<I").pack

VARIANTS: dict[str, Variant] = {
    # header
    "magic_wrong": _header(0, b"GGUX"),
    "magic_lowercase": _header(0, b"gguf"),
    "version_0": _header(4, _I(0)),
    "version_1": _header(4, _I(1)),
    "version_4": _header(4, _I(4)),
    "version_huge": _header(4, _I(0xFFFFFFFF)),
    "version_byteswapped": _header(4, _I(0x03000000)),
    "tensor_count_negative": _header(8, _Q(-1)),
    "tensor_count_2_62": _header(8, _Q(2**62)),
    "tensor_count_past_file": lambda g, b: _patch(b, 8, _Q(len(g.tensors) + 100_000)),
    "tensor_count_zero": _header(8, _Q(0)),
    "kv_count_negative": _header(16, _Q(-1)),
    "kv_count_2_62": _header(16, _Q(2**62)),
    "kv_count_plus_one": lambda g, b: _patch(b, 16, _Q(len(g.kvs) + 1)),
    "kv_count_zero": _header(16, _Q(0)),
    "header_only": lambda g, b: b[:24],
    # key/value pairs
    "key_length_past_eof": lambda g, b: _patch(b, 24, struct.pack("<Q", len(b))),
    "key_length_2_63": _header(24, struct.pack("<Q", 2**63)),
    "key_empty": _edit(lambda g: setattr(g.kv("general.name"), "key", b"")),
    "key_invalid_utf8": _key_invalid_utf8,
    "key_duplicate": _duplicate_key,
    "value_type_13": lambda g, b: _patch(b, _kv_offset(g, "general.name") + 8 + len(b"general.name"), _I(13)),
    "value_type_negative": lambda g, b: _patch(b, _kv_offset(g, "general.name") + 8 + len(b"general.name"),
                                               _I(0xFFFFFFFF)),
    "array_of_arrays": _nested_array,
    "array_length_2_62": _array_count_patch("tokenizer.ggml.scores", 2**62),
    "array_length_past_eof": _array_count_patch("tokenizer.ggml.tokens", 2**29),
    "string_length_past_eof": _token_len_patch(2**40),
    "string_length_2_63": _token_len_patch(2**63),
    "truncated_in_kv": lambda g, b: b[:_kv_offset(g, "tokenizer.ggml.scores") + 100],
    "truncated_after_tensor_info": lambda g, b: b[:len(b) - len(g.data)],
    "truncated_data": lambda g, b: b[:len(b) - 1000],
    # alignment
    "alignment_zero": lambda g, b: set_u32(g, "general.alignment", 0),
    "alignment_not_power_of_2": lambda g, b: set_u32(g, "general.alignment", 48),
    "alignment_2_31": lambda g, b: set_u32(g, "general.alignment", 2**31),
    "alignment_wrong_type": lambda g, b: set_u32(g, "general.alignment", 32, _U64),
    # tensor infos
    "tensor_name_too_long": lambda g, b: _with_tensor(g, g.tensors[0].name.decode(), name=b"t" * 200),
    "tensor_name_length_past_eof": _tensor_field_patch("name_len", struct.pack("<Q", 2**40)),
    "tensor_duplicate_name": _duplicate_tensor,
    "tensor_n_dims_0": _tensor_field_patch("n_dims", _I(0)),
    "tensor_n_dims_5": _tensor_field_patch("n_dims", _I(5)),
    "tensor_n_dims_huge": _tensor_field_patch("n_dims", _I(0xFFFFFFFF)),
    "tensor_dim_0": _tensor_field_patch("dim0", _Q(0)),
    "tensor_dim_negative": _tensor_field_patch("dim0", _Q(-5)),
    "tensor_dim_2_63": _tensor_field_patch("dim0", struct.pack("<Q", 2**63)),
    "tensor_dims_overflow": lambda g, b: _with_tensor(g, "output.weight", dims=[2**32, 2**32]),
    "tensor_dims_huge_consistent": lambda g, b: _with_tensor(g, "output.weight", dims=[64, 2**40]),
    "tensor_type_out_of_range": lambda g, b: _with_tensor(g, "output_norm.weight", ttype=_GGML_TYPE_COUNT),
    "tensor_type_negative": lambda g, b: _with_tensor(g, "output_norm.weight", ttype=-1),
    "tensor_type_removed": lambda g, b: _with_tensor(g, "output_norm.weight", ttype=_GGML_Q4_2_REMOVED),
    "tensor_type_f16_to_f32": lambda g, b: _with_tensor(g, "output.weight", ttype=_GGML_F32),
    "tensor_type_f16_to_f32_offsets_fixed": _f16_to_f32_consistent,
    "tensor_offset_past_eof": lambda g, b: _with_tensor(g, "output.weight", offset=2**62),
    "tensor_offset_misaligned": lambda g, b: _with_tensor(g, "output.weight",
                                                          offset=g.tensor("output.weight").offset + 1),
    "tensor_missing": _drop_tensor,
    # model metadata the loader reads
    "arch_unknown": lambda g, b: _set_str(g, "general.architecture", b"llamb"),
    "arch_wrong_type": lambda g, b: set_u32(g, "general.architecture", 7),
    "arch_invalid_utf8": lambda g, b: _set_str(g, "general.architecture", b"ll\xffma"),
    "block_count_huge": lambda g, b: set_u32(g, "llama.block_count", 2**31),
    "block_count_zero": lambda g, b: set_u32(g, "llama.block_count", 0),
    "head_count_zero": lambda g, b: set_u32(g, "llama.attention.head_count", 0),
    "head_count_kv_zero": lambda g, b: set_u32(g, "llama.attention.head_count_kv", 0),
    "embedding_length_mismatch": lambda g, b: set_u32(g, "llama.embedding_length", 65),
    "context_length_zero": lambda g, b: set_u32(g, "llama.context_length", 0),
    "vocab_size_mismatch": lambda g, b: set_u32(g, "llama.vocab_size", 100),
    "nextn_layers_over_block_count": lambda g, b: set_u32(g, "llama.nextn_predict_layers", 3),
    "expert_count_huge": lambda g, b: set_u32(g, "llama.expert_count", 5000),
    "expert_used_without_experts": lambda g, b: set_u32(g, "llama.expert_used_count", 2),
    "expert_used_over_expert_count": _edit(lambda g: (set_u32(g, "llama.expert_count", 4),
                                                      set_u32(g, "llama.expert_used_count", 8))),
    "expert_groups_not_below_experts": _edit(lambda g: (set_u32(g, "llama.expert_count", 4),
                                                        set_u32(g, "llama.expert_used_count", 2),
                                                        set_u32(g, "llama.expert_group_count", 4))),
    # tokenizer
    "tokenizer_model_unknown": lambda g, b: _set_str(g, "tokenizer.ggml.model", b"gpt9"),
    "tokenizer_tokens_wrong_type": _tokens_as_u32,
    "tokenizer_tokens_short": lambda g, b: _shorten_array(g, "tokenizer.ggml.tokens", 100),
    "tokenizer_scores_short": lambda g, b: _shorten_array(g, "tokenizer.ggml.scores", 100),
    "tokenizer_scores_wrong_type": _scores_as_strings,
    "tokenizer_token_type_short": lambda g, b: _shorten_array(g, "tokenizer.ggml.token_type", 100),
    "tokenizer_bos_out_of_range": lambda g, b: set_u32(g, "tokenizer.ggml.bos_token_id", 10**6),
    "tokenizer_token_invalid_utf8": _token_invalid_utf8,
}


def write_variants(valid: Path, out_dir: Path) -> dict[str, Path]:
    """Write every named variant of *valid* into *out_dir*; return name -> path."""
    buf = valid.read_bytes()
    g = parse(buf)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, make in VARIANTS.items():
        data = make(g.copy(), buf)
        if data == buf:
            raise AssertionError(f"variant {name} left the file unchanged")
        path = out_dir / f"{name}.gguf"
        path.write_bytes(data)
        paths[name] = path
    return paths


# -- the fuzzer ------------------------------------------------------------------------------------------
_INTERESTING = [b"\x00" * 8, b"\xff" * 8, struct.pack("<Q", 2**31), struct.pack("<Q", 2**62),
                struct.pack("<Q", 2**63), struct.pack("<I", 13), struct.pack("<I", 0x7FFFFFFF)]


def fuzz_cases(valid: Path, out_dir: Path, n: int = 40, seed: int = 0) -> list[Path]:
    """Write *n* mutants of *valid* into *out_dir*: 1 to 3 random edits each (bit flips, overwrites with
    boundary values, deletions, insertions, a truncation) inside the header, key/value and tensor-info
    region, drawn from ``random.Random(seed)`` so that the files are the same on every run."""
    buf = valid.read_bytes()
    g = parse(buf)
    meta_end = len(buf) - len(g.data)
    # Most of the metadata is the tokenizer's 32000 strings; aim half the edits at the first 4 KiB and
    # the tensor infos (the counts, types and lengths that steer the reader), half anywhere.
    ti = _first_tensor_offset(g)
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        data = bytearray(buf)
        for _ in range(rng.randint(1, 3)):
            region = rng.random()
            if region < 0.3:
                pos = rng.randrange(0, 4096)
            elif region < 0.6:
                pos = rng.randrange(ti, meta_end)
            else:
                pos = rng.randrange(0, meta_end)
            op = rng.randrange(5)
            if op == 0:
                data[pos] ^= 1 << rng.randrange(8)
            elif op == 1:
                val = rng.choice(_INTERESTING)
                data[pos:pos + len(val)] = val
            elif op == 2:
                del data[pos:pos + rng.randint(1, 16)]
            elif op == 3:
                data[pos:pos] = rng.randbytes(rng.randint(1, 16))
            else:
                data[pos] = rng.randrange(256)
        if rng.random() < 0.1:
            del data[rng.randrange(24, meta_end):]
        if bytes(data) == buf:
            data[4] ^= 0x40
        path = out_dir / f"fuzz-{seed}-{i:03d}.gguf"
        path.write_bytes(bytes(data))
        paths.append(path)
    return paths
