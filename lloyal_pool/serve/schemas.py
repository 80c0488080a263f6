"""OpenAI's request and response shapes at the edge of the server: a request body becomes GenerateParams
(validated by the library's own checks), a Result becomes a completion, an error becomes OpenAI's error
object with the status code its kind deserves. Nothing here knows HTTP or the pool."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
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
from ..params import GenerateParams, Grammar, Result, StopReason

#: OpenAI's own defaults where its API has one (max_tokens of a completion is 16; of a chat, unlimited).
COMPLETION_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0


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


def generate_params(body: Mapping[str, Any], *, chat: bool) -> GenerateParams:
    """The GenerateParams an OpenAI request body asks for: max_tokens (max_completion_tokens), temperature,
    top_p, seed, stop, logit_bias, response_format (a JSON schema, or any JSON object, as a grammar)."""
    n = body.get("n")
    if n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    max_tokens = _integer(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is None:
        max_tokens = 0 if chat else COMPLETION_MAX_TOKENS
    if max_tokens < 0:
        raise APIError(400, f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    seed = _integer(body, "seed")
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
    ignore_eos = body.get("ignore_eos", False)  # llama-server's extension, for benchmarks
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "ignore_eos is true or false", param="ignore_eos")
    try:
        return GenerateParams(n_predict=max_tokens, temperature=temperature, top_p=top_p if top_p < 1.0 else 0.0,
                              seed=seed if seed is not None else secrets.randbits(31), stop=stops, logit_bias=bias,
                              grammar=grammar, ignore_eos=ignore_eos)
    except LloyalError as exc:
        raise api_error(exc) from exc


def finish_reason(result: Result, tool_calls: bool = False) -> str:
    """OpenAI's finish_reason for how a generation ended."""
    if tool_calls:
        return "tool_calls"
    return "length" if result.stop_reason == StopReason.LENGTH else "stop"


def usage(result: Result) -> dict[str, int]:
    """The token counts of a completion."""
    return {"prompt_tokens": result.n_prompt, "completion_tokens": result.n_decoded,
            "total_tokens": result.n_prompt + result.n_decoded}


def new_id(prefix: str) -> str:
    """A completion's id."""
    return f"{prefix}-{secrets.token_hex(12)}"


def completion(result: Result, model: str, id_: str) -> dict[str, Any]:
    """A /v1/completions response."""
    return {"id": id_, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result)}],
            "usage": usage(result)}


def completion_chunk(text: str, model: str, id_: str, finish: str | None = None) -> dict[str, Any]:
    """One streamed piece of a completion."""
    return {"id": id_, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


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


def chat_completion(message: ChatMessage, result: Result, model: str, id_: str) -> dict[str, Any]:
    """A /v1/chat/completions response."""
    return {"id": id_, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": chat_message(message),
                         "finish_reason": finish_reason(result, bool(message.tool_calls)), "logprobs": None}],
            "usage": usage(result)}


def chat_chunk(delta: dict[str, Any], model: str, id_: str, finish: str | None = None) -> dict[str, Any]:
    """One streamed delta of a chat completion."""
    return {"id": id_, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation of a chat request, content parts joined to text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise APIError(400, "each message is an object with a role", param="messages")
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            msg["content"] = "".join(part.get("text", "") for part in content
                                     if isinstance(part, Mapping) and part.get("type") == "text")
        elif content is None:
            msg["content"] = ""
        elif not isinstance(content, str):
            raise APIError(400, "a message's content is a string or a list of content parts", param="messages")
        out.append(msg)
    return out


def tools_of(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, str]:
    """A chat request's tools and tool_choice ("auto", "none", "required")."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise APIError(400, "tools must be a list of tool objects", param="tools")
    choice = body.get("tool_choice", "auto")
    if not isinstance(choice, str) or choice not in ("auto", "none", "required"):
        raise APIError(400, 'tool_choice is "auto", "none" or "required"', param="tool_choice")
    return (list(tools) if tools else None), choice
