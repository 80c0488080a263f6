"""Typed parameters and results of the public API. Both sides of the process boundary import this
module: the results are the reply types of protocol.py.

GenerateParams follows go-llama's Params rule: every field means what it says. The defaults are the zero
values, and a zero is a decision (temperature 0 is greedy, top_k 0 is no top-k, seed 0 is a fixed seed),
never "use some default buried in the engine". So a default GenerateParams() is greedy, unlimited and
reproducible.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

import msgspec
import numpy as np

from .errors import BadRequestError, ContextError, GrammarError, InvalidArgumentError, InvalidTokenError

#: The largest seed SamplerParams takes: llama.cpp reads 0xFFFFFFFF as "pick a random seed".
MAX_SEED = 0xFFFFFFFE

#: How Context.rerank puts a document before the query for a causal LM, which scores the query's tokens.
RERANK_PROMPT = "Passage: {document}\nPlease write a question based on this passage.\nQuestion: {query}"


class StopReason(str, enum.Enum):
    """Why a generation ended (Result.stop_reason): ``EOS``, an end-of-generation token (or no token that
    the grammar and logit bias allow); ``LENGTH``, n_predict tokens or a full context; ``STOP``, a stop
    string; ``INTERRUPTED``, interrupt() or a closed Stream; ``PAUSED``, only on the wire: a segment of
    a paused stream (Stream.pause), never a stream's result. A str, so it equals its value ("eos", ...)."""

    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    INTERRUPTED = "interrupted"
    PAUSED = "paused"

    # "stop", not "StopReason.STOP", wherever it is printed (str(), f-strings, format()).
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


#: Token ids are 32-bit (llama_token): no vocabulary reaches this, whatever the model.
TOKEN_ID_LIMIT = 2**31


def token_id(value: object, n_vocab: int | None = None, what: str = "token id") -> int:
    """``value`` as a token id: an int (Python or numpy, not a bool) in [0, n_vocab), or [0, 2**31)
    when the vocabulary is not known here. InvalidTokenError otherwise: a float such as 818.9 is refused,
    never truncated."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTokenError(f"a {what} is an integer, got {value!r} ({type(value).__name__})")
    t = int(value)
    limit = TOKEN_ID_LIMIT if n_vocab is None else n_vocab
    if not 0 <= t < limit:
        raise InvalidTokenError(f"{what} {t} is outside [0, {limit})" + (" (the model's n_vocab)" if n_vocab else ""))
    return t


def token_ids(values: object, n_vocab: int | None = None, what: str = "token ids") -> list[int]:
    """``values`` (a sequence or iterable of ints, or a 1-D integer numpy array) as a list of token ids,
    each checked as token_id() does. BadRequestError for something that is not a sequence of ids (a str,
    bytes, a mapping, a set, a number); InvalidTokenError for an element that is not an id."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise BadRequestError(f"{what} must be a 1-D array, got shape {values.shape}")
        if values.dtype.kind not in "iu":
            raise InvalidTokenError(f"{what} are integers, got an array of {values.dtype}")
        out: list[int] = values.tolist()
    elif (isinstance(values, (str, bytes, bytearray, memoryview, Mapping, AbstractSet))
          or not isinstance(values, Iterable)):
        raise BadRequestError(f"{what} must be a sequence of ints, got {type(values).__name__}")
    else:
        out = list(values)
        if not all(type(t) is int for t in out):  # the common case costs one pass
            out = [token_id(t, n_vocab, f"{what[:-1] if what.endswith('s') else what} (at index {i})")
                   for i, t in enumerate(out)]
    limit = TOKEN_ID_LIMIT if n_vocab is None else n_vocab
    if out and (min(out) < 0 or max(out) >= limit):
        i = next(i for i, t in enumerate(out) if not 0 <= t < limit)
        token_id(out[i], n_vocab, f"{what[:-1] if what.endswith('s') else what} (at index {i})")
    return out


def whole(value: object, name: str) -> int:
    """``value`` as an int argument (a sequence id, a position, a count, a seed): a Python or numpy
    integer, not a bool, never a float truncated. BadRequestError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BadRequestError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def wire_prompt(prompt: object, n_vocab: int | None = None) -> str | list[int]:
    """A prompt as a request carries it: text as it is, token ids checked (token_ids). BadRequestError for
    bytes (decode them to text first: bytes are not token ids) and anything else that is neither."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise BadRequestError("a prompt is text (str) or token ids, not bytes: decode it to text first "
                              "(data.decode('utf-8'))")
    if prompt is None or not isinstance(prompt, (Iterable, np.ndarray)):
        raise BadRequestError(f"a prompt is text (str) or a sequence of token ids, got {type(prompt).__name__}")
    return token_ids(prompt, n_vocab, "prompt token ids")


def logit_bias_pairs(bias: object, n_vocab: int | None = None) -> list[tuple[int, float]]:
    """A logit bias ({token id: bias}) as (token, bias) pairs. BadRequestError for something that is not a
    mapping or a bias that is not a number, InvalidTokenError for a key that is not a token id,
    InvalidArgumentError for NaN or +inf (-inf bans the token; +inf would make the distribution NaN)."""
    if not isinstance(bias, Mapping):
        raise BadRequestError(f"logit_bias is a mapping of token id -> bias (e.g. {{13: -5.0}}), got "
                              f"{type(bias).__name__}")
    out: list[tuple[int, float]] = []
    for key, value in bias.items():
        tok = token_id(key, n_vocab, "logit_bias token id")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise BadRequestError(f"logit_bias[{tok}] must be a number, got {value!r} ({type(value).__name__})")
        b = float(value)
        if math.isnan(b) or b == math.inf:
            raise InvalidArgumentError(f"logit_bias[{tok}] must be finite, or -inf to ban the token; got {b}")
        out.append((tok, b))
    return out


P = TypeVar("P", bound="SamplerParams")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
                 "dry_multiplier", "dry_base", "repeat_penalty", "presence_penalty", "frequency_penalty",
                 "mirostat_tau", "mirostat_eta")
_INT_FIELDS = ("top_k", "dry_allowed_length", "dry_penalty_last_n", "repeat_last_n", "seed", "mirostat")


def _real(value: object, name: str) -> float:
    """A float field's value: a real number, not a bool (BadRequestError naming the field)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadRequestError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _flag(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise BadRequestError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def _strings(value: object, name: str) -> None:
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(s, str) for s in value):
        raise BadRequestError(f"{name} must be a sequence of strings, got {value!r} ({type(value).__name__})")
    for s in value:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no text the worker could match
            raise InvalidArgumentError(f"{name}: {s!r} is not Unicode text ({exc.reason})") from None


@dataclass(frozen=True)
class SamplerParams:
    """How tokens are chosen: every sampler llama.cpp has, in llama.cpp's order (penalties, DRY,
    top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature, then a draw with ``seed``). Branches
    take these; GenerateParams adds what a whole generation needs."""

    temperature: float = 0.0  # <= 0: greedy, and the truncation samplers below are skipped
    top_k: int = 0
    top_p: float = 0.0  # 0 or >= 1: off
    min_p: float = 0.0
    typical_p: float = 0.0  # 0 or >= 1: off
    top_n_sigma: float = 0.0  # 0: off
    xtc_probability: float = 0.0  # 0: off
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0  # 0: DRY off
    dry_base: float = 0.0  # 0: 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context, 0: off
    dry_sequence_breakers: Sequence[str] = ("\n", ":", '"', "*")
    repeat_penalty: float = 0.0  # 0 or 1: off
    repeat_last_n: int = 0  # how many recent tokens the penalties look at
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0  # a fixed seed: the same params replay the same text
    mirostat: int = 0  # 0 off, 1 v1, 2 v2; replaces top_k/top_p/min_p/typical_p when on
    mirostat_tau: float = 0.0  # 0: 5.0
    mirostat_eta: float = 0.0  # 0: 0.1

    def __post_init__(self) -> None:
        # The worker's native code checks every value (ranges included: sampling.hpp declares the fields
        # and their rules once); here the types, which the batcher's loop reads too (a string n_predict
        # compared there would stop the loop for every request on it), and what is cheaper to refuse
        # before a request is sent.
        for name in _INT_FIELDS:
            whole(getattr(self, name), name)
        if not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgumentError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        for name in _FLOAT_FIELDS:
            value = _real(getattr(self, name), name)
            if not math.isfinite(value):
                raise InvalidArgumentError(f"{name} must be finite, got {value}")
        if isinstance(self.dry_sequence_breakers, str):
            raise BadRequestError("dry_sequence_breakers must be a sequence of strings, not a string")
        _strings(self.dry_sequence_breakers, "dry_sequence_breakers")

    def to_wire(self) -> dict[str, Any]:
        """The fields as the plain dict a request carries to the worker."""
        out = asdict(self)
        out["dry_sequence_breakers"] = list(self.dry_sequence_breakers)
        return out

    @classmethod
    def of(cls: type[P], params: P | None, overrides: Mapping[str, Any]) -> P:
        """params with keyword overrides applied (BadRequestError, a TypeError, for a name that is not a
        field or params of another class)."""
        if params is not None and not isinstance(params, cls):
            raise BadRequestError(f"params is a {cls.__name__}, got {type(params).__name__}")
        if not overrides:
            return params or cls()
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise BadRequestError(f"unknown {cls.__name__} field(s): {', '.join(sorted(unknown))}")
        base = {f.name: getattr(params, f.name) for f in fields(params)} if params is not None else {}
        return cls(**{**base, **overrides})


@dataclass(frozen=True)
class GenerateParams(SamplerParams):
    """What a generate() or stream() does: the sampler (SamplerParams) plus how long to go, what stops it,
    the constraints, and what of the context's cache to reuse. Pass one, or its fields as keyword
    arguments (``ctx.generate(prompt, n_predict=64, temperature=0.8)``)."""

    n_predict: int = 0  # <= 0: until the context is full
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: Grammar | str = ""  # GBNF text or a Grammar (JSON schema, lazy triggers); "" none
    stop: Sequence[str] = ()
    # Reuse the part of the context's cache that matches the prompt's start (Context.generate).
    cache_prompt: bool = True
    # ... but only what leaves the logits bit-identical to decoding the prompt afresh: back to the start
    # of the micro-batch the shared prefix ends in (llama.cpp's CPU kernels are not batch-invariant).
    cache_bit_exact: bool = False
    # Text shows control tokens and markers such as <start_of_image>; Result.tokens has them either way.
    render_special: bool = False
    # N in [0, 20]: Result.logprobs gives each generated token's log-probability and its N most likely
    # alternatives (TokenLogprob); None: none.
    logprobs: int | None = None
    # Batched requests (Batcher, Instance/Pool.generate): lower values are admitted to a slot first, equal
    # ones in order of arrival; a running request is never preempted. A context's own generate has no
    # queue and ignores it.
    priority: int = 0
    # Batched requests: the LoRA adapters this request runs under, by name (an adapter its model loaded:
    # path, file name or stem) and scale; {}: none. Requests on different adapters share a batcher, decoded
    # in turns. A context applies its own (Context.set_lora); its generate refuses this field.
    lora: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        whole(self.n_predict, "n_predict")
        whole(self.priority, "priority")
        if not isinstance(self.lora, Mapping):
            raise BadRequestError(f"lora maps adapter names to scales, got {type(self.lora).__name__}")
        for name, scale in self.lora.items():
            if not isinstance(name, str) or not name:
                raise BadRequestError(f"lora maps adapter names (non-empty str) to scales, got the key {name!r}")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise InvalidArgumentError(f"the scale of LoRA adapter {name!r} must be a finite number, got {scale!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidArgumentError(f"logprobs is an int in [0, {MAX_LOGPROBS}] (alternatives per token) or "
                                       f"None, got {self.logprobs!r}")
        for name in ("ignore_eos", "cache_prompt", "cache_bit_exact", "render_special"):
            _flag(getattr(self, name), name)
        if isinstance(self.stop, str):
            raise BadRequestError("stop must be a sequence of strings, not a string")
        _strings(self.stop, "stop")
        if not isinstance(self.grammar, (str, Grammar)):
            raise BadRequestError(f"grammar is GBNF text or a Grammar, got {type(self.grammar).__name__}")
        if any(not s for s in self.stop):
            raise InvalidArgumentError("stop strings must be non-empty")
        logit_bias_pairs(self.logit_bias)  # refused here, not when the request is built

    def to_wire(self) -> dict[str, Any]:
        """The fields as the plain dict a request carries to the worker (the grammar as GBNF text or
        Grammar.to_wire())."""
        out = super().to_wire()
        del out["priority"]  # the client's queue: the worker never sees it
        if out.pop("lora"):
            raise InvalidArgumentError("GenerateParams.lora chooses adapters for batched requests (Batcher, "
                                       "Instance/Pool.generate); a context applies its own with set_lora")
        out["logit_bias"] = dict(logit_bias_pairs(self.logit_bias))
        out["stop"] = list(self.stop)
        out["grammar"] = self.grammar.to_wire() if isinstance(self.grammar, Grammar) else self.grammar
        return out


@dataclass(frozen=True)
class Grammar:
    """A grammar for a branch: GBNF text, or a JSON schema (converted by llama.cpp's own converter in the
    worker). A lazy grammar leaves sampling free until a trigger fires (a word, a regex pattern matched
    against the whole generated text, or a token), then constrains what follows. ``prefill``: text the
    prompt already ends with, which a grammar that is not lazy accepts before the first sampled token
    (llama.cpp's tool-call grammars start with the assistant's generation prompt)."""

    gbnf: str | None = None
    json_schema: str | Mapping[str, Any] | None = None
    lazy: bool = False
    trigger_words: Sequence[str] = ()
    trigger_patterns: Sequence[str] = ()
    trigger_tokens: Sequence[int] = ()
    root: str = "root"
    prefill: str = ""

    def __post_init__(self) -> None:
        if (self.gbnf is None) == (self.json_schema is None):
            raise GrammarError("a Grammar needs exactly one of gbnf and json_schema")
        for name in ("trigger_words", "trigger_patterns"):
            if isinstance(getattr(self, name), str):
                raise BadRequestError(f"{name} must be a sequence of strings, not a string")
        if self.lazy and not (self.trigger_words or self.trigger_patterns or self.trigger_tokens):
            raise GrammarError("a lazy grammar needs at least one trigger (word, pattern or token)")
        if self.lazy and self.prefill:
            raise GrammarError("a prefill applies to a grammar that is not lazy")
        token_ids(self.trigger_tokens, what="trigger_tokens")

    def to_wire(self) -> dict[str, Any]:
        """The grammar as the plain dict a request carries to the worker (a JSON schema as JSON text)."""
        out: dict[str, Any] = {"root": self.root, "lazy": self.lazy, "trigger_words": list(self.trigger_words),
                               "trigger_patterns": list(self.trigger_patterns),
                               "trigger_tokens": token_ids(self.trigger_tokens, what="trigger_tokens")}
        if self.prefill:
            out["prefill"] = self.prefill
        if self.gbnf is not None:
            out["gbnf"] = self.gbnf
        else:
            schema = self.json_schema
            out["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
        return out


@dataclass(frozen=True)
class ContextParams:
    """Per-context settings. None leaves a value to llama.cpp (n_batch, n_ubatch) or the worker (threads:
    the CPUs it may use). n_ctx 0 asks for the model's training length.

    ``embeddings=True`` makes an embedding context (Context.embed, and Context.rerank with
    ``pooling="rank"``), which cannot generate. ``pooling``: "none" (a vector per token), "mean", "cls",
    "last" or "rank"; None is the model's own, or "mean" when the model declares none. In an embedding
    context a decode is one ubatch (n_batch and n_ubatch default to 512 together, or both to the one
    given) and n_seq_max, the texts one decode takes, defaults to 16; elsewhere n_seq_max defaults to 1."""

    n_ctx: int = 4096
    n_batch: int | None = None
    n_ubatch: int | None = None
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_seq_max: int | None = None
    embeddings: bool = False
    pooling: str | None = None  # "none" | "mean" | "cls" | "last" | "rank"; embedding contexts only
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    type_k: str | None = None
    type_v: str | None = None
    swa_full: bool = True  # full-size sliding-window cache, so any part of a sequence can be removed
    flash_attn: str | None = None  # "auto" | "on" | "off"
    # Compute with fewer threads while other processes hold the cores (docs/RELIABILITY.md, "A busy machine");
    # False keeps the thread count fixed. CPU builds only.
    adapt_threads: bool = True
    # A row's logits do not depend on what is decoded beside it: ggml's reference CPU kernels and flash
    # attention (ContextError with flash_attn "off", a model loaded with repack=True, or a GPU). Slower.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        # None is how the other fields leave a choice to llama.cpp; n_ctx has a value of its own for that (0).
        if isinstance(self.n_ctx, bool) or not isinstance(self.n_ctx, (int, np.integer)):
            raise ContextError(f"n_ctx must be an int (0: the model's training length), got {self.n_ctx!r}")

    def to_wire(self) -> dict[str, Any]:
        """The fields as the plain dict a request carries to the worker; None values are left out, so
        that the worker or llama.cpp chooses them."""
        return {k: v for k, v in asdict(self).items() if v is not None}


#: The most alternatives per token GenerateParams.logprobs asks for (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A generated token's log-probability (natural log) and the ``top`` most likely tokens at its step,
    best first, each (token, logprob, piece). The model's own distribution: log-softmax of the raw logits,
    before temperature, penalties, logit bias or grammar (what OpenAI and llama-server report), so the
    chosen token may be one that is not among ``top``, or one the sampler made likely. ``piece``: the
    token's bytes, control tokens shown."""

    token: int
    logprob: float
    piece: bytes
    top: list[tuple[int, float, bytes]]


class Result(msgspec.Struct, frozen=True):
    """What a generate() produced. ``tokens`` are the generated tokens (an end-of-generation token that
    ended it is not among them; the token that completed a stop string is); ``text`` is their text, cut
    before a stop string. ``n_cached``: tokens the cache kept that this call did not decode again: the
    prompt's prefix it reused (cache_prompt), or with append=True the whole history it continued."""

    text: str
    tokens: list[int]
    n_prompt: int
    n_decoded: int
    n_cached: int
    stop_reason: StopReason
    prompt_ms: float
    decode_ms: float
    n_drafted: int = 0  # generate_with_draft: tokens the drafter proposed
    n_accepted: int = 0  # ... and of those, the ones the target's sampler chose too
    n_threads: int = 0  # the threads its last decode computed with: fewer than asked while the machine was busy
    logprobs: list[TokenLogprob] | None = None  # GenerateParams.logprobs: one per token of ``tokens``

    @property
    def interrupted(self) -> bool:
        """Whether interrupt() (or closing its Stream) ended the generation."""
        return self.stop_reason is StopReason.INTERRUPTED

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens per second of generation (prompt evaluation not counted)."""
        return self.n_decoded / (self.decode_ms / 1000.0) if self.decode_ms > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """generate_with_draft: the share of drafted tokens the target kept (0.0 when none were drafted)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


class Score(msgspec.Struct, frozen=True):
    """A teacher-forced score (Context.score / score_choices): ``nll`` is the sum over the ``n_scored``
    predicted tokens of -log p(token | everything before it), in nats, and ``perplexity`` is
    exp(nll / n_scored). ``n_tokens`` counts the tokens of the text (of the choice, for score_choices).
    ``logprobs`` (Context.score(logprobs=N)): each scored token's TokenLogprob, the text's tokens after
    the first, in order: a prompt's log-probabilities (a completion's ``echo``)."""

    n_tokens: int
    n_scored: int
    nll: float
    perplexity: float
    logprobs: list[TokenLogprob] | None = None

    @property
    def mean_nll(self) -> float:
        """nll per scored token (nats)."""
        return self.nll / self.n_scored if self.n_scored else float("nan")


class EvalResult(msgspec.Struct, frozen=True):
    """What an eval() decoded: ``n_tokens`` of the prompt are in the cache now (fewer when interrupted),
    which holds ``n_past`` tokens in all."""

    n_tokens: int
    n_past: int
    interrupted: bool
    prompt_ms: float
    n_threads: int = 0  # the threads its last decode computed with: fewer than asked while the machine was busy


class ModelInfo(msgspec.Struct, frozen=True):
    """A loaded model's metadata, as llama.cpp reports it. Token ids are -1 when the vocabulary has none."""

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
    eog_tokens: list[int] = []  # every end-of-generation token (eos, eot, ...)
    # Tokens generate's text leaves out unless render_special (control tokens, markers such as <start_of_image>).
    hidden_tokens: list[int] = []
    meta: dict[str, str] = {}

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain dict (e.g. for JSON)."""
        return msgspec.structs.asdict(self)


class BranchInfo(msgspec.Struct, frozen=True):
    """Everything the worker knows about one branch (Branch.info())."""

    handle: int
    seq: int
    position: int
    fork_head: int
    parent: int  # 0: a root
    children: list[int]
    has_logits: bool
    n_accepted: int
    perplexity: float  # inf before the first committed token
    sampling_perplexity: float
    last_token: int


class KVPressure(msgspec.Struct, frozen=True):
    """How full a context's KV cache is (KV.pressure())."""

    n_ctx: int
    cells_used: int  # shared prefixes counted once
    remaining: int
    n_seq_max: int
    seqs_leased: int  # by branches and detached sequences
    seqs_free: int


class Device(msgspec.Struct, frozen=True):
    """One device ggml's backend registry holds in a worker (Instance.devices()): ``name`` ("CPU",
    "CUDA0", ...), ``description`` (the CPU or GPU model), ``backend`` (the backend that registered it:
    "CPU", "CUDA", ...), ``type`` ("cpu", "gpu", "igpu" or "accel"), its memory in bytes as the backend
    reports it (for the CPU: the host's), and ``kernels``: for the CPU the level of ggml's kernels the
    worker chose ("haswell", "sapphirerapids", ...; Instance.cpu_kernels), for a GPU its backend."""

    name: str
    description: str
    backend: str
    type: str
    memory_free: int
    memory_total: int
    kernels: str = ""

    @property
    def is_gpu(self) -> bool:
        """A discrete or integrated GPU."""
        return self.type in ("gpu", "igpu")


class BufferMemory(msgspec.Struct, frozen=True):
    """The bytes a context and its model hold in one ggml buffer type (Context.memory_breakdown()):
    ``model`` (weights), ``context`` (the KV cache), ``compute`` (compute buffers). ``buffer`` is the
    buffer type ("CPU", "CPU_Mapped", "CUDA0", "CUDA_Host", ...), ``device`` the device it belongs to
    ("" when ggml names none), ``host`` whether it lives in host memory."""

    buffer: str
    device: str
    host: bool
    model: int
    context: int
    compute: int
