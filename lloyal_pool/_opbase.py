"""The operations' names and the bases of the request and reply structs (protocol.py declares each)."""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from .params import ModelInfo


class Op(str, enum.Enum):
    """Request operations: the wire names of the request structs below."""

    PING = "ping"
    LOAD_MODEL = "load_model"
    FREE_MODEL = "free_model"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    TOKEN_TO_PIECE = "token_to_piece"
    APPLY_CHAT_TEMPLATE = "apply_chat_template"
    JSON_SCHEMA_TO_GRAMMAR = "json_schema_to_grammar"
    NEW_CONTEXT = "new_context"
    FREE_CONTEXT = "free_context"
    EVAL = "eval"
    GENERATE = "generate"
    GENERATE_WITH_DRAFT = "generate_with_draft"
    RESUME = "resume"
    ADOPT_GENERATION = "adopt_generation"
    LOGITS = "logits"
    RESET = "reset"
    TOKENS = "tokens"
    N_PAST = "n_past"
    # LoRA adapters (client.LoraAdapter, Context.set_lora).
    LOAD_LORA = "load_lora"
    FREE_LORA = "free_lora"
    SET_LORA = "set_lora"
    EMBED = "embed"
    RERANK = "rerank"
    SAVE_STATE = "save_state"
    LOAD_STATE = "load_state"
    RENEW_TRANSFER = "renew_transfer"
    SCORE = "score"
    SCORE_CHOICES = "score_choices"
    # Branches (branches.Branch / BranchStore), all on one context.
    BRANCH_CREATE = "branch_create"
    BRANCH_FORK = "branch_fork"
    BRANCH_ADOPT = "branch_adopt"
    BRANCH_PRUNE = "branch_prune"
    BRANCH_RETAIN_ONLY = "branch_retain_only"
    BRANCH_DETACH = "branch_detach"
    BRANCH_INFO = "branch_info"
    BRANCH_SET_PARAMS = "branch_set_params"
    BRANCH_SET_GRAMMAR = "branch_set_grammar"
    BRANCH_SET_LOGIT_BIAS = "branch_set_logit_bias"
    BRANCH_RESEED = "branch_reseed"
    BRANCH_SET_LOGITS = "branch_set_logits"
    BRANCH_MERGE_LOGITS = "branch_merge_logits"
    PRODUCE = "produce"
    BRANCH_SET_TEXT = "branch_set_text"
    BRANCH_SET_LOGPROBS = "branch_set_logprobs"
    PRODUCE_TEXT = "produce_text"
    COMMIT = "commit"
    PREFILL = "prefill"
    STEP = "step"
    CLEAR_AND_RESEED = "clear_and_reseed"
    # Raw KV-cache sequences (branches.KV).
    KV_COPY = "kv_copy"
    KV_KEEP = "kv_keep"
    KV_REMOVE = "kv_remove"
    KV_POS_MIN = "kv_pos_min"
    KV_POS_MAX = "kv_pos_max"
    KV_FREE = "kv_free"
    KV_PRESSURE = "kv_pressure"
    # lloyal.node's low-level loop (Context.decode / sample) and grammar handles (sampler.Sampler).
    RAW_DECODE = "raw_decode"
    SAMPLE = "sample"
    GRAMMAR_NEW = "grammar_new"
    GRAMMAR_CLONE = "grammar_clone"
    GRAMMAR_MASK = "grammar_mask"
    GRAMMAR_ACCEPT = "grammar_accept"
    GRAMMAR_FREE = "grammar_free"
    STATE_SEQ_SIZE = "state_seq_size"
    STATE_SEQ_GET = "state_seq_get"
    STATE_SEQ_SET = "state_seq_set"
    STATE_SEQ_SAVE_FILE = "state_seq_save_file"
    STATE_SEQ_LOAD_FILE = "state_seq_load_file"
    # A snapshot's zygote (snapshot.py, worker/zygote.py).
    FREEZE = "freeze"
    FORK = "fork"
    REAP = "reap"
    # Chat (client.Model.parse_chat_output, session.Session).
    CHAT_FORMAT = "chat_format"
    PARSE_CHAT_OUTPUT = "parse_chat_output"
    DEVICES = "devices"
    MEMORY_BREAKDOWN = "memory_breakdown"
    FAULT = "_fault"  # test-only, refused unless the worker runs with LLOYAL_POOL_TEST_FAULTS=1


R = TypeVar("R")


class Request(msgspec.Struct, Generic[R], kw_only=True, forbid_unknown_fields=True):
    """One operation's request; R is its reply type."""

    op: ClassVar[Op]
    # Runs llama_decode or other long native work: interruptible, tracked per context by the client.
    decodes: ClassVar[bool] = False


class ContextRequest(Request[R]):
    """A request about one context."""

    context: int


class BranchRequest(ContextRequest[R]):
    """A request about one branch of a context."""

    branch: int


# -- replies that are not public result types ------------------------------------------------------------
class Reply(msgspec.Struct):
    """Base of the reply structs that only the client library reads."""


class Pong(Reply):
    pid: int


class ModelLoaded(Reply):
    model: int
    info: ModelInfo


class ContextCreated(Reply):
    context: int
    interrupt_slot: int
    logits_offset: int
    n_vocab: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_threads: int
    pooling: str | None = None  # an embedding context's pooling; None: a generation context


class LoraLoaded(Reply):
    lora: int
    alpha: float  # adapter.lora.alpha (0.0: absent)
    meta: dict[str, str]


class LogitsAt(Reply):
    """n_vocab float32 at this offset of the worker's shared region."""

    offset: int
    count: int


class Embedded(Reply):
    """float32 rows at this offset of the worker's shared region, ``width`` floats each: rows[i] of them
    for input i, one input after the other. The block stays the context's until its next embed call."""

    offset: int
    rows: list[int]
    width: int


class BranchState(Reply):
    """What a branch's client handle caches: sent back by every call that changes it."""

    branch: int
    position: int
    n_accepted: int
    perplexity: float
    sampling_perplexity: float


class BranchCreated(Reply):
    logits_offset: int
    state: BranchState
    parent: int = 0  # 0: a root


class Decoded(Reply):
    """A decoding branch call: the time spent inside llama_decode, and the branches it changed."""

    decode_ms: float
    states: list[BranchState]


#: What produce and step report per branch: (token, piece, is_stop, logprobs), token -1 when nothing is
#: allowed, logprobs a TokenLogprob's fields for a branch that reports them (BranchSetLogprobs), else None.
Produced = tuple[int, bytes, bool, Any]


class Stepped(Decoded):
    produced: list[Produced]


class StateLoaded(Reply):
    tokens: list[int]
    n_bytes: int
    states: list[BranchState]  # the branch that took the loaded cells, if one did


class ChatPrompt(Reply):
    """A conversation formatted for the assistant's next turn (common/chat): the prompt, and with tools the
    grammar of the format's tool calls (lazy: free until a trigger) and what else generating needs."""

    prompt: str
    format: str
    grammar: str  # GBNF; "": none
    grammar_lazy: bool
    trigger_words: list[str]
    trigger_patterns: list[str]
    trigger_tokens: list[int]
    preserved_tokens: list[str]
    additional_stops: list[str]
    generation_prompt: str
