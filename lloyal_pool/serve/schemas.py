"""OpenAI's request and response shapes at the edge of the server: a request body becomes GenerateParams
(validated by the library's own checks), a Result becomes a completion, an error becomes OpenAI's error
object with the status code its kind deserves. Nothing here knows HTTP or the pool."""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from ..chat import ChatMessage
from ..errors import (
    BadRequestError,
    ContextOverflowError,
    GrammarError,
    InvalidArgumentError,
    InvalidTokenError,
    LloyalError,
    PoolClosedError,
    StaleHandleError,
    TemplateError,
    WorkerCrashedError,
)
from ..params import MAX_LOGPROBS, MAX_SEED, GenerateParams, Grammar, Result, StopReason, TokenLogprob

#: OpenAI's own defaults where its API has one (max_tokens of a completion is 16; of a chat, unlimited).
COMPLETION_MAX_TOKENS = 16
#: The server-wide cap on a reply whose request gives no max_tokens (``lloyal-pool serve --max-tokens``,
#: create_app's ``max_tokens``; 0: none but the slot's room). llama-server (-n -1) and vLLM (the context's
#: room) let such a reply run until the context is full: 2,037 tokens of a small model's chat took 95 s.
DEFAULT_MAX_TOKENS = 1024
DEFAULT_TEMPERATURE = 1.0
# Request fields OpenAI defines that change what comes back, which this server cannot honour: refused by
# name (a 400), never ignored, since a client that asks for them would read an answer that lacks them.
UNSUPPORTED: dict[str, dict[str, tuple[object, ...]]] = {
    "chat": {"audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,)},
    "completions": {"suffix": (None,)},
}


class APIError(Exception):
    """A request the API refuses: its HTTP status, OpenAI error type, message and the parameter at fault."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(exc: BaseException) -> APIError:
    """The APIError a library error (or any other) answers with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, (InvalidArgumentError, InvalidTokenError, BadRequestError, GrammarError, TemplateError,
                        ValueError, TypeError)):
        return APIError(400, str(exc))
    if isinstance(exc, (WorkerCrashedError, PoolClosedError, StaleHandleError)):
        return APIError(503, f"the model's worker is not available: {exc}", "server_error")
    if isinstance(exc, LloyalError):
        return APIError(500, str(exc), "server_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise APIError(400, f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}", param=name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, got {value!r}", param=name)
    return value


def default_max_tokens(server_max_tokens: int, *, chat: bool) -> int:
    """The max_tokens of a request that gives none, on a server whose cap is ``server_max_tokens`` (0: no
    cap): a chat's is the cap; a completion's is OpenAI's 16, or the cap where that is smaller. 0: until
    the slot is full or the reply ends."""
    if chat:
        return server_max_tokens
    return min(COMPLETION_MAX_TOKENS, server_max_tokens) if server_max_tokens > 0 else COMPLETION_MAX_TOKENS


def generate_params(body: Mapping[str, Any], *, chat: bool,
                    server_max_tokens: int = DEFAULT_MAX_TOKENS) -> GenerateParams:
    """The GenerateParams an OpenAI request body asks for: max_tokens (max_completion_tokens; without
    either, default_max_tokens of ``server_max_tokens``), temperature, top_p, seed, stop, logit_bias,
    presence_penalty and frequency_penalty (over the whole reply), response_format (a JSON schema, or any
    JSON object, as a grammar), priority (vLLM's: lower is admitted to a slot first). How many choices:
    choices_of."""
    for name, allowed in UNSUPPORTED["chat" if chat else "completions"].items():
        if body.get(name) not in allowed:
            raise APIError(400, f"{name} is not supported by this server", param=name)
    max_tokens = _integer(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens(server_max_tokens, chat=chat)
    if max_tokens < 0:
        raise APIError(400, f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    seed = _integer(body, "seed")
    priority = _integer(body, "priority")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = tuple(stop)
    else:
        raise APIError(400, "stop is a string or a list of up to 4 strings", param="stop")
    bias_in = body.get("logit_bias") or {}
    if not isinstance(bias_in, Mapping):
        raise APIError(400, "logit_bias maps token ids to biases in [-100, 100]", param="logit_bias")
    bias: dict[int, float] = {}
    for key, value in bias_in.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias[{key}] must be a number in [-100, 100]", param="logit_bias")
        # OpenAI's -100 bans the token; ours is -inf.
        bias[token] = float("-inf") if value <= -100 else float(value)
    grammar: Grammar | str = ""
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, Mapping) else None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if not isinstance(schema, Mapping):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                               param="response_format")
            grammar = Grammar(json_schema=dict(schema))
        elif kind == "json_object":
            grammar = Grammar(json_schema={"type": "object"})
        elif kind != "text":
            raise APIError(400, "response_format.type is text, json_object or json_schema", param="response_format")
    logprobs = _logprobs(body, chat=chat)
    ignore_eos = body.get("ignore_eos", False)  # llama-server's extension, for benchmarks
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "ignore_eos is true or false", param="ignore_eos")
    try:
        # top_p 0 is OpenAI's "only the likeliest token"; ours would mean no top-p at all, hence top_k 1.
        return GenerateParams(n_predict=max_tokens, temperature=temperature, top_p=top_p if 0.0 < top_p < 1.0 else 0.0,
                              top_k=1 if top_p == 0.0 else 0, presence_penalty=presence, frequency_penalty=frequency,
                              repeat_last_n=-1 if presence or frequency else 0,
                              # any integer OpenAI takes is a seed; folded into the sampler's range
                              seed=secrets.randbits(31) if seed is None else seed % (MAX_SEED + 1),
                              stop=stops, logit_bias=bias, grammar=grammar, ignore_eos=ignore_eos, logprobs=logprobs,
                              priority=priority or 0)
    except LloyalError as exc:
        raise api_error(exc) from exc


@dataclass(frozen=True)
class ServedLora:
    """A LoRA adapter the server serves (create_app's ``lora``, ``lloyal-pool serve --lora``): ``id``, its
    place in that list (what a request's ``lora`` field names, as llama-server's ids), ``name`` (what a
    request's ``model`` names, and /v1/models lists) and ``path`` (absolute: what GenerateParams.lora
    names it by)."""

    id: int
    name: str
    path: str


def lora_of(body: Mapping[str, Any], model_name: str, adapters: Sequence[ServedLora]) -> tuple[dict[str, float], str]:
    """The adapters a generating request runs under (GenerateParams.lora, by path) and the model its reply
    names. ``model``: the served model (``model_name``), or an adapter's name, which runs that adapter at
    scale 1 (vLLM's LoRA modules); on a server without adapters, any name is the model. ``lora``:
    llama-server's ``[{"id": i, "scale": s}, ...]``, ids indexing ``adapters``; an adapter neither field
    names runs at scale 0, and the list's entry wins over ``model``'s for the same adapter. APIError (400) for an
    unknown model (code model_not_found), an unknown or repeated id, or a scale that is not a finite
    number."""
    scales: dict[int, float] = {}
    shown = model_name
    requested = body.get("model")
    if adapters and requested is not None and requested != model_name:
        named = next((a for a in adapters if a.name == requested), None)
        if named is None:
            known = ", ".join(repr(a.name) for a in adapters)
            raise APIError(400, f"the model {requested!r} does not exist: this server serves {model_name!r} and its "
                                f"LoRA adapters {known}", param="model", code="model_not_found")
        scales[named.id] = 1.0
        shown = named.name
    field = body.get("lora")
    if field is not None:
        shape = 'lora is a list of {"id": adapter id, "scale": number} (GET /lora-adapters lists the ids)'
        if not isinstance(field, list):
            raise APIError(400, shape, param="lora")
        listed: set[int] = set()
        for entry in field:
            if not isinstance(entry, Mapping):
                raise APIError(400, shape, param="lora")
            i, scale = entry.get("id"), entry.get("scale")
            if isinstance(i, bool) or not isinstance(i, int):
                raise APIError(400, f"lora: an adapter's id is an integer, got {i!r}", param="lora")
            if not 0 <= i < len(adapters):
                held = f"ids 0 to {len(adapters) - 1}" if adapters else "no LoRA adapters"
                raise APIError(400, f"lora: no adapter has the id {i}; this server has {held}", param="lora")
            if i in listed:
                raise APIError(400, f"lora: the adapter id {i} is listed twice", param="lora")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise APIError(400, f"lora: the scale of adapter {i} must be a finite number, got {scale!r}",
                               param="lora")
            listed.add(i)
            scales[i] = float(scale)
    return {adapters[i].path: s for i, s in sorted(scales.items()) if s != 0}, shown


def choices_of(body: Mapping[str, Any], *, chat: bool) -> tuple[int, int]:
    """How many choices a request returns (``n``, default 1) and generates (a completion's ``best_of``,
    default n; the n whose tokens have the highest mean log-probability are returned). A chat has no
    best_of. best_of above n cannot be streamed (the choices are picked once they have ended), as
    OpenAI's. Their upper bound, one worker's slots, is check_slots'."""
    n = _integer(body, "n")
    if n is None:
        n = 1
    if n < 1:
        raise APIError(400, f"n must be at least 1, got {n}", param="n")
    best_of = None if chat else _integer(body, "best_of")
    if best_of is None:
        return n, n
    if best_of < n:
        raise APIError(400, f"best_of must be at least n ({n}), got {best_of}", param="best_of")
    if best_of > n and body.get("stream"):
        raise APIError(400, "best_of cannot be streamed: its choices are picked once they have ended",
                       param="best_of")
    return n, best_of


def check_slots(n: int, best_of: int, slots: int) -> None:
    """APIError unless a request's choices (choices_of) fit the ``slots`` of one worker: they run side by
    side on one batcher, which decodes their prompt once."""
    for name, value in (("n", n), ("best_of", best_of)):
        if value > slots:
            raise APIError(400, f"{name}={value} choices run side by side in one worker's slots; this server's "
                                f"workers have {slots} each", param=name)


def _logprobs(body: Mapping[str, Any], *, chat: bool) -> int | None:
    """GenerateParams.logprobs of a request: a chat's logprobs (true/false) and top_logprobs (0-20), a
    completion's logprobs (alternatives, 0-20; OpenAI's legacy limit is 5, llama-server's none)."""
    if chat:
        wanted = body.get("logprobs")
        if wanted not in (None, True, False):
            raise APIError(400, "logprobs is true or false", param="logprobs")
        top = _integer(body, "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
        if top is not None and not wanted:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (top or 0) if wanted else None
    n = _integer(body, "logprobs")
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {n}", param="logprobs")
    return n


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's choice.logprobs of a chat completion (or of the tokens one streamed chunk carries): per
    token its text, log-probability, bytes and the most likely tokens at its step (the raw model
    distribution, as llama-server reports it)."""
    if logprobs is None:
        return None
    return {"content": [{"token": _token_text(lp.piece), "logprob": lp.logprob, "bytes": list(lp.piece),
                         "top_logprobs": [{"token": _token_text(piece), "logprob": value, "bytes": list(piece)}
                                          for _, value, piece in lp.top]}
                        for lp in logprobs],
            "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob] | None, start: int = 0) -> dict[str, Any] | None:
    """OpenAI's legacy choice.logprobs of a completion (or of the tokens one streamed chunk carries):
    tokens, token_logprobs, top_logprobs (a mapping of token text to log-probability per step) and
    text_offset (where each token starts in the text; the first at ``start``)."""
    if logprobs is None:
        return None
    return _legacy_logprobs([lp.piece for lp in logprobs], logprobs, start)


def _legacy_logprobs(pieces: Sequence[bytes], logprobs: Sequence[TokenLogprob | None], start: int) -> dict[str, Any]:
    # The legacy shape of tokens ``pieces``, each with its TokenLogprob (None: a token nothing predicts).
    texts = [_token_text(piece) for piece in pieces]
    offsets = list(accumulate((len(t) for t in texts), initial=start))[:len(texts)]
    return {"tokens": texts,
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp is None else {_token_text(p): v for _, v, p in lp.top} for lp in logprobs],
            "text_offset": offsets}


@dataclass(frozen=True)
class Echo:
    """A completion prompt as ``echo`` shows it: its text, and per token of it (a BOS the server added
    is not part of the text and not shown) its bytes and log-probability given the tokens before it
    (None for a first token nothing precedes; all None when the request asked no logprobs)."""

    text: str
    pieces: list[bytes]
    logprobs: list[TokenLogprob | None]
    n_prompt: int = 0  # the prompt's tokens, a BOS included (what usage counts)


def echo_logprobs(echo: Echo) -> dict[str, Any]:
    """completion_logprobs of the prompt's tokens (no log-probability or alternatives for one without)."""
    return _legacy_logprobs(echo.pieces, echo.logprobs, 0)


def joined_logprobs(head: dict[str, Any] | None, tail: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completion_logprobs one after the other (the echoed prompt's, then the reply's)."""
    if head is None or tail is None:
        return head or tail
    return {k: [*head[k], *tail[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def include_usage(body: Mapping[str, Any]) -> bool:
    """Whether a stream ends with a usage chunk (stream_options.include_usage). APIError for a
    stream_options that is not an object."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise APIError(400, "stream_options is an object", param="stream_options")
    return options is not None and options.get("include_usage") is True


def finish_reason(result: Result, tool_calls: bool = False) -> str:
    """OpenAI's finish_reason for how a generation ended. A reply cut off by max_tokens says "length" even
    when what came so far parses as a tool call: its arguments may be cut short."""
    if result.stop_reason == StopReason.LENGTH:
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(results: Sequence[Result]) -> dict[str, int]:
    """The token counts of a completion: the choices of one prompt (or best_of's candidates, all that was
    generated) count their tokens together and the prompt once."""
    prompt = results[0].n_prompt
    completion = sum(r.n_decoded for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def new_id(prefix: str) -> str:
    """A completion's id."""
    return f"{prefix}-{secrets.token_hex(12)}"


class Reply:
    """What every object of one response shares: its id, creation time and model."""

    def __init__(self, prefix: str, model: str) -> None:
        self.id, self.created, self.model = new_id(prefix), int(time.time()), model

    def head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def usage_chunk(self, object_: str, results: Sequence[Result]) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage (stream_options.include_usage): no choices."""
        return {**self.head(object_), "choices": [], "usage": usage(results)}


def completion(results: Sequence[Result], reply: Reply, generated: Sequence[Result] | None = None,
               echo: Echo | None = None, logprobs: bool = False) -> dict[str, Any]:
    """A /v1/completions response: choice i is results[i]. ``generated``: what usage counts (best_of's
    candidates), if not the results. ``echo``: each choice starts with the prompt (and its tokens'
    ``logprobs`` when asked)."""
    head = echo_logprobs(echo) if echo is not None and logprobs else None
    start = len(echo.text) if echo is not None else 0
    return {**reply.head("text_completion"),
            "choices": [{"index": i, "text": (echo.text if echo is not None else "") + r.text,
                         "logprobs": joined_logprobs(head, completion_logprobs(r.logprobs, start)),
                         "finish_reason": finish_reason(r)} for i, r in enumerate(results)],
            "usage": usage(generated or results)}


def completion_chunk(text: str, reply: Reply, finish: str | None = None,
                     logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """One streamed piece of choice ``index`` of a completion (``logprobs``: completion_logprobs of the
    tokens it carries)."""
    return {**reply.head("text_completion"),
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_message(message: ChatMessage) -> dict[str, Any]:
    """An assistant message as OpenAI shows it (tool calls with ids)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id or new_id("call"), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in message.tool_calls]
    elif out["content"] is None:
        out["content"] = ""
    return out


def chat_delta(message: ChatMessage) -> dict[str, Any]:
    """A whole assistant message as one streamed delta: no role (the first chunk said it), and each tool
    call with the index a streaming client groups its pieces by."""
    delta = chat_message(message)
    delta.pop("role")
    for i, call in enumerate(delta.get("tool_calls", ())):
        call["index"] = i
    return delta


def chat_completion(messages: Sequence[ChatMessage], results: Sequence[Result], reply: Reply) -> dict[str, Any]:
    """A /v1/chat/completions response: choice i is messages[i], parsed from results[i]."""
    return {**reply.head("chat.completion"),
            "choices": [{"index": i, "message": chat_message(m), "finish_reason": finish_reason(r, bool(m.tool_calls)),
                         "logprobs": chat_logprobs(r.logprobs)}
                        for i, (m, r) in enumerate(zip(messages, results, strict=True))],
            "usage": usage(results)}


def chat_chunk(delta: dict[str, Any], reply: Reply, finish: str | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """One streamed delta of choice ``index`` of a chat completion (``logprobs``: chat_logprobs of the
    tokens it carries)."""
    return {**reply.head("chat.completion.chunk"),
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation of a chat request, text content parts joined (any other part, an image or audio,
    is refused: the model would answer as if it had not been sent). OpenAI's "developer" role, which
    newer clients send in place of "system", is the system prompt to a chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise APIError(400, "each message is an object with a role", param="messages")
        msg = dict(m)
        if msg["role"] == "developer":
            msg["role"] = "system"
        content = msg.get("content")
        if isinstance(content, list):
            bad = [part for part in content if not (isinstance(part, Mapping) and part.get("type") == "text"
                                                    and isinstance(part.get("text"), str))]
            if bad:
                kind = bad[0].get("type") if isinstance(bad[0], Mapping) else type(bad[0]).__name__
                raise APIError(400, f"only text content parts are supported, got {kind!r}", param="messages")
            msg["content"] = "".join(part["text"] for part in content)
        elif content is None:
            msg["content"] = ""
        elif not isinstance(content, str):
            raise APIError(400, "a message's content is a string or a list of content parts", param="messages")
        out.append(msg)
    return out


def tools_of(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, str]:
    """A chat request's tools and tool_choice ("auto", "none", "required"). A named tool
    ({"type": "function", "function": {"name": ...}}) is "required" over that tool alone. With "none" the
    tools are not offered at all (no tools: the prompt does not describe them, and nothing constrains or
    parses the reply for calls), as OpenAI's model does not call them. A forced call (required or named)
    without tools is refused."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise APIError(400, "tools must be a list of tool objects", param="tools")
    tools = list(tools) if tools else None
    choice = body.get("tool_choice", "auto")
    if choice is None:
        choice = "auto"
    if choice == "required" and not tools:
        raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice")
    if choice == "none":
        return None, "none"
    if isinstance(choice, Mapping):
        wanted = choice.get("function")
        name = wanted.get("name") if isinstance(wanted, Mapping) else None
        named = [t for t in tools or () if isinstance(t.get("function"), Mapping) and t["function"].get("name") == name]
        if choice.get("type") != "function" or not isinstance(name, str) or not named:
            raise APIError(400, "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": N}} "
                                "with N one of the request's tools", param="tool_choice")
        return named, "required"
    if not isinstance(choice, str) or choice not in ("auto", "none", "required"):
        raise APIError(400, 'tool_choice is "auto", "none", "required" or a named function', param="tool_choice")
    return tools, choice


def parallel_tool_calls(body: Mapping[str, Any]) -> bool:
    """A chat request's parallel_tool_calls (default true, as OpenAI's): whether a reply may make more than
    one tool call. APIError for a value that is not a boolean."""
    value = body.get("parallel_tool_calls")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise APIError(400, "parallel_tool_calls is true or false", param="parallel_tool_calls")
    return value
