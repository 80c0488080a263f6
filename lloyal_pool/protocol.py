"""The wire protocol between the client and a worker process. Both sides import this module.

    client                                   worker
      │  REQUEST  [2, id, [op, {fields}]] ─────▶ │
      │  ◀────── EVENT    [5, id, {...}]         │  stream pieces, load progress (0..n per request)
      │  ◀────── RESPONSE [3, id, reply]         │  exactly one of RESPONSE / ERROR per request
      │  ◀────── ERROR    [4, id, {type, message, traceback}]
      │  ◀────── HELLO    [1, 0, {...}]          │  once, after the native module loaded
      │  SHUTDOWN [6, 0, None]           ──────▶ │

A frame is a little-endian u32 length followed by that many bytes of msgpack. Only msgpack's own types
cross (nothing is ever unpickled); bulk data (logits) never rides in a frame but in the worker's shared
memory region (shm.py), and a reply names where. A frame longer than MAX_FRAME, or one that does not
decode to [kind, id, payload] with integer kind and id, is a protocol violation: the client kills the
worker and treats it as crashed (so does a reply for a request not in flight: _process.py), and a worker
exits (worker/loop.py).

Every operation is declared once, below, as a request struct: its fields, its ``op``, whether it
``decodes`` (then the client tracks it so that Context.interrupt() can stop it), and its reply type, the
parameter of ``Request[...]``. The client builds these structs and gets the reply type back from the
future (the context's core, _core.py); the worker's engine registers one handler per struct
(worker/*_handlers.py, through worker/registry.py's ``handles``) and its loop dispatches by the struct's
type. mypy checks both ends against the same declaration, and msgspec checks every field's type when a
request arrives: a request with an unknown op, an unknown field or a
field of the wrong type fails with BadRequestError, and the worker goes on serving.
"""


from __future__ import annotations

from typing import Any, TypeVar, get_args

import msgspec

from ._frames import MAX_FRAME, Kind, PeerClosed, error_payload, pack, read_frame, unpack, write_frame
from ._opbase import (
    BranchCreated,
    BranchRequest,
    BranchState,
    ChatPrompt,
    ContextCreated,
    ContextRequest,
    Decoded,
    Embedded,
    LogitsAt,
    LoraLoaded,
    ModelLoaded,
    Op,
    Pong,
    Produced,
    Reply,
    Request,
    StateLoaded,
    Stepped,
)
from .chat import ChatMessage
from .errors import BadRequestError, ProtocolError
from .params import BranchInfo, BufferMemory, Device, EvalResult, KVPressure, Result, Score

PROTOCOL_VERSION = 11
R = TypeVar("R")


# -- requests -------------------------------------------------------------------------------------------
class Ping(Request[Pong]):
    op = Op.PING


class LoadModel(Request[ModelLoaded]):
    """Progress events: {"progress": fraction}."""

    op = Op.LOAD_MODEL
    path: str
    n_gpu_layers: int = 0
    use_mmap: bool = True
    vocab_only: bool = False
    repack: bool = True  # llama.cpp's extra buffer types (repacked weights); False for batch_invariant contexts


class FreeModel(Request[None]):
    op = Op.FREE_MODEL
    model: int


class Tokenize(Request[list[int]]):
    op = Op.TOKENIZE
    model: int
    text: str
    add_special: bool = True
    parse_special: bool = False


class Detokenize(Request[str]):
    op = Op.DETOKENIZE
    model: int
    tokens: list[int]
    remove_special: bool = False
    unparse_special: bool = False


class TokenToPiece(Request[bytes]):
    op = Op.TOKEN_TO_PIECE
    model: int
    token: int
    special: bool = True


class ApplyChatTemplate(Request[str]):
    op = Op.APPLY_CHAT_TEMPLATE
    model: int
    messages: list[tuple[str, str]]  # (role, content)
    template: str | None = None  # a format name (lloyal_pool.chat.CHAT_FORMATS) or Jinja source; None: the model's
    add_generation_prompt: bool = True
    tools: str = ""  # an OpenAI-style tools array as JSON; "": none


class JsonSchemaToGrammar(Request[str]):
    op = Op.JSON_SCHEMA_TO_GRAMMAR
    schema: str


class NewContext(Request[ContextCreated]):
    op = Op.NEW_CONTEXT
    model: int
    params: dict[str, Any]  # ContextParams.to_wire(); the native side validates (ContextError)


class FreeContext(ContextRequest[None]):
    op = Op.FREE_CONTEXT


class Eval(ContextRequest[EvalResult]):
    op = Op.EVAL
    decodes = True
    tokens: list[int] | None = None
    text: str | None = None
    add_special: bool | None = None  # text only; None: BOS when the context is empty
    parse_special: bool = True
    progress: bool = False  # prompt_progress events


class Generate(ContextRequest[Result]):
    """Piece events when stream: {"piece": text}; prompt_progress events when progress; {"paused":
    portable form or None} before the reply of a generation that paused (PAUSE_BIT)."""

    op = Op.GENERATE
    decodes = True
    prompt: str | list[int]
    params: dict[str, Any]  # GenerateParams.to_wire(); the native side validates
    stream: bool = False
    append: bool = False  # the prompt continues the history instead of replacing it
    progress: bool = False


class Resume(ContextRequest[Result]):
    """Goes on with the generation paused on the context (a Generate whose request id the interrupt word
    named with PAUSE_BIT): its result is the whole generation's. Events as for Generate; ContextError
    when nothing is paused or the context changed since."""

    op = Op.RESUME
    decodes = True
    stream: bool = False
    origin: int = 0  # the id of the Generate that started it (or AdoptGeneration's origin); 0: any


class AdoptGeneration(ContextRequest[None]):
    """Takes in a paused generation from elsewhere (the ``paused`` event of a Generate or Resume, which
    carries its portable form) for the params it was generated with; the context must hold the same
    history (its state loaded). A Resume then goes on with it."""

    op = Op.ADOPT_GENERATION
    params: dict[str, Any]
    suspension: dict[str, Any]
    origin: int = 0  # what a Resume names it by


PAUSE_BIT = 1 << 63
"""Written into a context's interrupt word with a request's id: that generation pauses at its next token
boundary (and emits a ``paused`` event before its reply, whose stop_reason is "paused")."""


class GenerateWithDraft(ContextRequest[Result]):
    """Speculative generate: draft is "ngram" or the handle of a context in the same worker. Events as
    for Generate."""

    op = Op.GENERATE_WITH_DRAFT
    decodes = True
    prompt: str | list[int]
    params: dict[str, Any]
    draft: str | int
    n_draft: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    stream: bool = False
    append: bool = False
    progress: bool = False


class Logits(ContextRequest[LogitsAt]):
    op = Op.LOGITS


class Reset(ContextRequest[None]):
    op = Op.RESET


class Tokens(ContextRequest[list[int]]):
    op = Op.TOKENS


class NPast(ContextRequest[int]):
    op = Op.N_PAST


class LoadLora(Request[LoraLoaded]):
    op = Op.LOAD_LORA
    model: int
    path: str


class FreeLora(Request[None]):
    op = Op.FREE_LORA
    lora: int


class SetLora(ContextRequest[bool]):
    """The context's whole adapter configuration; True when it changed (the history was emptied)."""

    op = Op.SET_LORA
    adapters: list[tuple[int, float]]  # (lora handle, scale)


class Embed(ContextRequest[Embedded]):
    """An embedding context: the vectors of each input (text, tokenized with the model's special tokens,
    or token ids)."""

    op = Op.EMBED
    decodes = True
    inputs: list[str | list[int]]
    normalize: bool = True


class Rerank(ContextRequest[list[float]]):
    """A score per document: a rank-pooling embedding context's classifier output, or in a generation
    context the mean log-probability of the query's tokens after ``prompt`` (its {document} filled in;
    it ends with {query})."""

    op = Op.RERANK
    decodes = True
    query: str
    documents: list[str]
    prompt: str


class SaveState(ContextRequest[int]):
    """Writes the context's whole state to path (a file the worker creates or replaces, or the parent's
    transfer memfd as /proc/<pid>/fd/<n>); replies with its size. The state itself never rides in a frame:
    a long context's is gigabytes. in_place: write path directly (a transfer file) instead of a temporary
    file renamed over it."""

    op = Op.SAVE_STATE
    path: str
    in_place: bool = False


class LoadState(ContextRequest[int]):
    """Replaces the context's state with the one in path; replies with the restored n_past."""

    op = Op.LOAD_STATE
    path: str


class RenewTransfer(Request[None]):
    """The worker's transfer memfd (``fd``, the number its HELLO named) names a new, empty file from now
    on: the one it named, holding the state a SaveState just wrote, is left to the parent, which keeps it
    (a move's image) instead of copying it out."""

    op = Op.RENEW_TRANSFER
    fd: int


class ScoreText(ContextRequest[Score]):
    op = Op.SCORE
    decodes = True
    text: str | list[int]  # text: tokenized with the model's BOS, special tokens parsed
    logprobs: int | None = None  # N: each scored token's TokenLogprob with N alternatives; None: none


class ScoreChoices(ContextRequest[list[Score]]):
    op = Op.SCORE_CHOICES
    decodes = True
    choices: list[str | list[int]]  # text: tokenized without BOS, special tokens parsed


class BranchCreate(ContextRequest[BranchCreated]):
    op = Op.BRANCH_CREATE
    decodes = True  # prefills the prompt
    params: dict[str, Any]  # SamplerParams.to_wire()
    grammar: dict[str, Any] | None = None  # Grammar.to_wire()
    prompt: str | list[int] = []
    progress: bool = False


class BranchFork(BranchRequest[BranchCreated]):
    op = Op.BRANCH_FORK


class BranchAdopt(ContextRequest[BranchCreated]):
    op = Op.BRANCH_ADOPT
    decodes = True  # no decode, but a large grammar's set-up takes seconds: interruptible
    seq: int
    params: dict[str, Any]
    grammar: dict[str, Any] | None = None


class BranchPrune(BranchRequest[list[int]]):
    """Replies with the handles freed."""

    op = Op.BRANCH_PRUNE
    subtree: bool = False


class BranchRetainOnly(BranchRequest[list[int]]):
    op = Op.BRANCH_RETAIN_ONLY


class BranchDetach(BranchRequest[int]):
    """Replies with the detached sequence id."""

    op = Op.BRANCH_DETACH


class BranchInfoRequest(BranchRequest[BranchInfo]):
    op = Op.BRANCH_INFO


class BranchSetParams(BranchRequest[None]):
    op = Op.BRANCH_SET_PARAMS
    params: dict[str, Any]


class BranchSetGrammar(BranchRequest[None]):
    op = Op.BRANCH_SET_GRAMMAR
    decodes = True  # no decode, but a large grammar's set-up takes seconds: interruptible
    grammar: dict[str, Any] | None


class BranchSetLogitBias(BranchRequest[None]):
    op = Op.BRANCH_SET_LOGIT_BIAS
    bias: list[tuple[int, float]] | None


class BranchReseed(BranchRequest[None]):
    op = Op.BRANCH_RESEED
    seed: int


class BranchSetLogits(BranchRequest[None]):
    op = Op.BRANCH_SET_LOGITS
    logits: bytes  # n_vocab float32


class BranchMergeLogits(BranchRequest[None]):
    op = Op.BRANCH_MERGE_LOGITS
    experts: list[int]
    alpha: float


class Produce(ContextRequest[list[Produced]]):
    op = Op.PRODUCE
    decodes = True  # no llama_decode, but a grammar step can take seconds: interruptible all the same
    branches: list[int]


class BranchSetText(BranchRequest[None]):
    """From now on the branch makes text of what it produces, as generate makes it (ProduceText hands it
    out): these stop strings, control tokens' text left out unless render_special."""

    op = Op.BRANCH_SET_TEXT
    stop: list[str]
    render_special: bool = False
    logprobs: int = -1  # >= 0: ProduceText reports each token's logprobs with that many alternatives


# token, is_stop, final text, held text, stop string completed, logprobs (TokenLogprob's fields) or None
TextProduced = tuple[int, bool, bytes, bytes, bool, Any]


class BranchSetLogprobs(BranchRequest[None]):
    """From now on produce and step report each of the branch's tokens' logprobs, with ``logprobs``
    alternatives (-1: none again); forks inherit it."""

    op = Op.BRANCH_SET_LOGPROBS
    logprobs: int


class ProduceText(ContextRequest[list[TextProduced]]):
    """Produce, for branches that make text (BranchSetText). Per branch: token (-1: nothing allowed),
    is_stop, the text that became final with it, the text held back after that (final only if the
    generation ends here), whether a stop string completed (the text ends before it), and the token's
    logprobs (BranchSetText.logprobs; None otherwise)."""

    op = Op.PRODUCE_TEXT
    decodes = True  # as Produce: a grammar step can take seconds
    branches: list[int]


class Commit(ContextRequest[Decoded]):
    op = Op.COMMIT
    decodes = True
    pairs: list[tuple[int, int]]  # (branch, token)


class Prefill(ContextRequest[Decoded]):
    op = Op.PREFILL
    decodes = True
    items: list[tuple[int, str | list[int]]]  # (branch, tokens or text without BOS)
    progress: bool = False
    commits: list[tuple[int, int]] = []  # (branch, token), committed in the first decode beside the items
    # (LoRA handle, scale): the adapter configuration of these decodes instead of the context's; None: its own
    loras: list[tuple[int, float]] | None = None


class Step(ContextRequest[Stepped]):
    op = Op.STEP
    decodes = True
    branches: list[int]


class ClearAndReseed(ContextRequest[Decoded]):
    op = Op.CLEAR_AND_RESEED
    decodes = True
    sinks: list[int]
    tail: list[int]


class KvCopy(ContextRequest[None]):
    op = Op.KV_COPY
    src: int
    dst: int
    p0: int = 0
    p1: int = -1


class KvKeep(ContextRequest[None]):
    op = Op.KV_KEEP
    seq: int


class KvRemove(ContextRequest[bool]):
    op = Op.KV_REMOVE
    seq: int
    p0: int = 0
    p1: int = -1


class KvPosMin(ContextRequest[int]):
    op = Op.KV_POS_MIN
    seq: int


class KvPosMax(ContextRequest[int]):
    op = Op.KV_POS_MAX
    seq: int


class KvFree(ContextRequest[None]):
    op = Op.KV_FREE
    seq: int


class KvPressureRequest(ContextRequest[KVPressure]):
    op = Op.KV_PRESSURE


class RawDecode(ContextRequest[float]):
    """Reply: the ms spent decoding."""

    op = Op.RAW_DECODE
    decodes = True
    tokens: list[int]
    pos: int
    seq: int


class Sample(ContextRequest[int]):
    op = Op.SAMPLE
    decodes = True  # no decode, but a grammar step can take seconds: interruptible
    params: dict[str, Any]
    grammar: int = 0  # a grammar handle, 0: none


class GrammarNew(ContextRequest[int]):
    op = Op.GRAMMAR_NEW
    decodes = True  # a large grammar's set-up takes seconds: interruptible
    grammar: dict[str, Any]


class GrammarClone(ContextRequest[int]):
    op = Op.GRAMMAR_CLONE
    handle: int


class GrammarMask(ContextRequest[int]):
    """Reply: the offset of the handle's mask in the region (n_vocab float32)."""

    op = Op.GRAMMAR_MASK
    decodes = True  # a grammar step over the whole vocabulary: interruptible
    handle: int


class GrammarAccept(ContextRequest[None]):
    op = Op.GRAMMAR_ACCEPT
    decodes = True
    handle: int
    token: int


class GrammarFree(ContextRequest[None]):
    op = Op.GRAMMAR_FREE
    handle: int


class StateSeqSize(ContextRequest[int]):
    op = Op.STATE_SEQ_SIZE
    seq: int


class StateSeqGet(ContextRequest[bytes]):
    op = Op.STATE_SEQ_GET
    seq: int


class StateSeqSet(ContextRequest[StateLoaded]):
    op = Op.STATE_SEQ_SET
    seq: int
    data: bytes


class StateSeqSaveFile(ContextRequest[int]):
    """Replies with the bytes written."""

    op = Op.STATE_SEQ_SAVE_FILE
    seq: int
    path: str
    tokens: list[int] = []


class StateSeqLoadFile(ContextRequest[StateLoaded]):
    op = Op.STATE_SEQ_LOAD_FILE
    seq: int
    path: str


class Frozen(Reply):
    threads: int  # the zygote's threads when it froze: its own Python threads, no native ones
    region_used: int  # bytes of its shared region a fork copies


class Freeze(Request[Frozen]):
    """Makes a zygote worker a snapshot: from now on it serves only Fork, Reap and Ping."""

    op = Op.FREEZE


class Forked(Reply):
    pid: int


class Fork(Request[Forked]):
    """The zygote forks a child that serves the pipes, region, lifeline and stderr whose descriptors the
    client sent just before this frame on the zygote's control socket; the child says HELLO on them."""

    op = Op.FORK
    worker_id: int
    cwd: str  # the child's private directory (inside the zygote's, so within its Landlock scope)


class Reap(Request[int | None]):
    """A forked child's exit status (Popen's returncode convention), once it has exited within
    ``timeout`` seconds; None while it runs. The zygote is its parent: only it can reap it."""

    op = Op.REAP
    pid: int
    timeout: float = 0.0


class ChatFormat(Request[ChatPrompt]):
    op = Op.CHAT_FORMAT
    model: int
    messages: str  # OpenAI-style messages as a JSON array (tool_calls, tool_call_id, reasoning_content)
    template: str | None = None  # as ApplyChatTemplate's
    add_generation_prompt: bool = True
    tools: str = ""  # an OpenAI-style tools array as JSON; "": none
    tool_choice: str = "auto"


class ParseChatOutput(Request[ChatMessage]):
    op = Op.PARSE_CHAT_OUTPUT
    model: int
    text: str  # an assistant turn generated after messages
    messages: str = ""  # as ChatFormat's; "": one user message
    template: str | None = None
    tools: str = ""
    tool_choice: str = "auto"
    partial: bool = False  # text that stops midway


class Devices(Request[list[Device]]):
    op = Op.DEVICES


class MemoryBreakdown(ContextRequest[list[BufferMemory]]):
    op = Op.MEMORY_BREAKDOWN


class Fault(Request[Any]):
    """Test-only crash kit (worker/loop.py)."""

    op = Op.FAULT
    kind: str
    code: int = 3
    seconds: float = 3600.0
    arg: str = ""  # the probes' target: a path, or "host:port"


#: Requests that only read a context: its history, logits, state and any paused generation stay as they
#: were (one may run while a generation is paused without ending it).
READS_ONLY: frozenset[type[Request[Any]]] = frozenset(
    {Logits, Tokens, NPast, MemoryBreakdown, SaveState, KvPressureRequest, StateSeqSize})


def _request_types() -> dict[Op, type[Request[Any]]]:
    found: dict[Op, type[Request[Any]]] = {}
    todo: list[type[Any]] = [Request]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "op" in vars(cls):
            if cls.op in found:
                raise TypeError(f"{cls.__name__} and {found[cls.op].__name__} both declare {cls.op}")
            found[cls.op] = cls
    return found


REQUESTS: dict[Op, type[Request[Any]]] = _request_types()


def reply_type(request: type[Request[R]]) -> Any:
    """The R of the Request[R] that ``request`` derives from."""
    for cls in request.__mro__:
        for base in getattr(cls, "__orig_bases__", ()):
            args = get_args(base)
            if args and not isinstance(args[0], TypeVar):
                return args[0]
    raise TypeError(f"{request.__name__} does not name its reply type")


REPLIES: dict[type[Request[Any]], Any] = {cls: reply_type(cls) for cls in REQUESTS.values()}


def parse_request(payload: Any) -> Request[Any]:
    """A REQUEST frame's payload, [op, {fields}], as its request struct. BadRequestError for an unknown
    op, an unknown field, a missing one, or one of the wrong type."""
    if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[1], dict)):
        raise BadRequestError("a request payload must be [operation, {fields}]")
    try:
        cls = REQUESTS[Op(payload[0])]
    except ValueError:
        raise BadRequestError(f"unknown operation {payload[0]!r}") from None
    try:
        req: Request[Any] = msgspec.convert(payload[1], cls)
        return req
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"{cls.op.value}: {exc}") from None


def parse_reply(request: type[Request[R]], payload: Any) -> R:
    """A RESPONSE payload as the reply type of ``request``; ProtocolError when it is not one."""
    typ = REPLIES[request]
    if typ is Any:
        return payload  # type: ignore[no-any-return]
    try:
        return msgspec.convert(payload, typ)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"reply to {request.op.value} does not match its declaration: {exc}") from None


def request_payload(req: Request[Any]) -> list[Any]:
    return [req.op.value, req]


__all__ = ["MAX_FRAME", "PAUSE_BIT", "PROTOCOL_VERSION", "READS_ONLY", "REPLIES", "REQUESTS", "BranchCreated",
           "BranchRequest", "BranchState", "ChatPrompt", "ContextCreated", "ContextRequest", "Decoded", "Embedded",
           "Kind", "LogitsAt", "LoraLoaded", "ModelLoaded", "Op", "PeerClosed", "Pong", "Produced", "Reply", "Request",
           "StateLoaded", "Stepped", "error_payload", "pack", "parse_reply", "parse_request", "read_frame",
           "reply_type", "request_payload", "unpack", "write_frame"]
