"""Typed parameters and results of the public API.

GenerateParams follows go-llama's Params rule: every field means what it says. The defaults are the zero
values, and a zero is a decision (temperature 0 is greedy, top_k 0 is no top-k, seed 0 is a fixed seed),
never "use some default buried in the engine". So a default GenerateParams() is greedy, unlimited and
reproducible.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MAX_SEED = 0xFFFFFFFE  # llama.cpp reads 0xFFFFFFFF as "pick a random seed"


class StopReason(str, enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class GenerateParams:
    n_predict: int = 0  # <= 0: until the context is full
    temperature: float = 0.0  # <= 0: greedy, and the truncation samplers below are skipped
    top_k: int = 0
    top_p: float = 0.0  # 0 or >= 1: off
    min_p: float = 0.0
    typical_p: float = 0.0  # 0 or >= 1: off
    repeat_penalty: float = 0.0  # 0 or 1: off
    repeat_last_n: int = 0  # how many recent tokens the penalties look at
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0  # a fixed seed: the same params replay the same text
    mirostat: int = 0  # 0 off, 1 v1, 2 v2; replaces top_k/top_p/min_p/typical_p when on
    mirostat_tau: float = 0.0  # 0: 5.0
    mirostat_eta: float = 0.0  # 0: 0.1
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: str = ""  # GBNF; "" none
    stop: Sequence[str] = ()
    cache_prompt: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        if self.mirostat not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0, 1 or 2, got {self.mirostat}")
        if self.top_k < 0 or self.repeat_last_n < 0:
            raise ValueError("top_k and repeat_last_n must be >= 0")
        for name in ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", "mirostat_tau", "mirostat_eta"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        if self.repeat_penalty < 0:
            raise ValueError("repeat_penalty must be >= 0")
        if isinstance(self.stop, str):
            raise TypeError("stop must be a sequence of strings, not a string")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    def to_wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        out["stop"] = list(self.stop)
        return out

    @classmethod
    def of(cls, params: GenerateParams | None, overrides: Mapping[str, Any]) -> GenerateParams:
        if not overrides:
            return params or cls()
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
        base = asdict(params) if params is not None else {}
        return cls(**{**base, **overrides})


@dataclass(frozen=True)
class ContextParams:
    """Per-context settings. None leaves a value to llama.cpp (n_batch, n_ubatch) or the worker (threads:
    the CPUs it may use). n_ctx 0 asks for the model's training length."""

    n_ctx: int = 4096
    n_batch: int | None = None
    n_ubatch: int | None = None
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_seq_max: int = 1
    embeddings: bool = False
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    type_k: str | None = None
    type_v: str | None = None
    swa_full: bool = True  # full-size sliding-window cache, so any part of a sequence can be removed
    flash_attn: str | None = None  # "auto" | "on" | "off"

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]
    n_prompt: int
    n_decoded: int
    n_cached: int
    stop_reason: StopReason
    prompt_ms: float
    decode_ms: float

    @property
    def interrupted(self) -> bool:
        return self.stop_reason is StopReason.INTERRUPTED

    @property
    def decode_tokens_per_second(self) -> float:
        return self.n_decoded / (self.decode_ms / 1000.0) if self.decode_ms > 0 else 0.0

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Result:
        return cls(text=d["text"], tokens=list(d["tokens"]), n_prompt=int(d["n_prompt"]),
                   n_decoded=int(d["n_decoded"]), n_cached=int(d.get("n_cached", 0)),
                   stop_reason=StopReason(d["stop_reason"]), prompt_ms=float(d.get("prompt_ms", 0.0)),
                   decode_ms=float(d.get("decode_ms", 0.0)))


@dataclass(frozen=True)
class EvalResult:
    n_tokens: int
    n_past: int
    interrupted: bool
    prompt_ms: float

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> EvalResult:
        return cls(n_tokens=int(d["n_tokens"]), n_past=int(d["n_past"]),
                   interrupted=bool(d.get("interrupted", False)), prompt_ms=float(d.get("prompt_ms", 0.0)))


@dataclass(frozen=True)
class ModelInfo:
    desc: str
    n_params: int
    size: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    has_encoder: bool
    has_decoder: bool
    bos: int
    eos: int
    add_bos: bool
    chat_template: str | None
    n_swa: int = 0
    meta: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ModelInfo:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
