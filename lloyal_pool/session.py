"""Multi-turn chat on one context (Context.chat).

A Session keeps the conversation as OpenAI-style messages. Each turn formats the WHOLE conversation with
the template (llama.cpp's common/chat) and generates with the prompt cache: the context already holds
every earlier turn, so the tokens of the formatted prompt match its history up to the new turn, and only
the new turn is decoded. The context then holds exactly what a fresh context would hold after the same
conversation formatted from scratch. The reply ends at the model's end-of-generation token (Gemma's
<end_of_turn>), which is not part of it, and is parsed by llama.cpp's parser for the template's format
(content, reasoning, tool calls) before it joins the conversation.

    session = ctx.chat("You are terse.", template="gemma", n_predict=128)
    print(session.send("Name a colour.").text)
    with session.stream("And another?") as stream:
        for piece in stream:
            print(piece, end="", flush=True)
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from . import protocol as p
from ._futures import PromptProgress
from ._owners import InstanceLike, ModelLike
from .chat import TOOL_CHOICES, ChatMessage, ToolCall
from .errors import BadRequestError, InvalidArgumentError, LloyalError
from .params import GenerateParams, Grammar, Result, StopReason
from .stream import Stream

if TYPE_CHECKING:
    from ._core import ContextCore

_log = logging.getLogger("lloyal_pool")


class ChatModel(ModelLike, Protocol):
    """The model a session's context runs on (a Model): the chat formatting and parsing a turn asks it for,
    besides what every handle's user reaches through ``.model``."""

    def _format_chat(self, messages: Sequence[Mapping[str, Any]], *, template: str | None,
                     tools: Sequence[Mapping[str, Any]] | None, tool_choice: str = "auto") -> p.ChatPrompt: ...
    def _parse_chat(self, text: str, *, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
                    messages: Sequence[Mapping[str, Any]] | None = None, tool_choice: str = "auto",
                    partial: bool = False) -> ChatMessage: ...


class SessionOwner(Protocol):
    """The context a session runs on (a Context, which makes it: Context.chat): what a turn uses of it, and
    what a user reaches through ``session.context`` to look at the conversation's cache or work on it."""

    @property
    def model(self) -> ChatModel: ...
    @property
    def instance(self) -> InstanceLike: ...
    @property
    def _link(self) -> ContextCore: ...
    @property
    def n_ctx(self) -> int: ...
    @property
    def handle(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 append: bool = False, on_piece: Callable[[str], None] | None = None,
                 progress: PromptProgress | None = None, timeout: float | None = None, **overrides: Any) -> Result: ...
    def stream(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               append: bool = False, progress: PromptProgress | None = None, timeout: float | None = None,
               **overrides: Any) -> Stream: ...
    def _start_stream(self, s: ChatStream, prompt: str | Sequence[int], params: GenerateParams, *, append: bool,
                      progress: PromptProgress | None) -> ChatStream: ...
    def tokens(self) -> list[int]: ...
    def n_past(self) -> int: ...
    def reset(self) -> None: ...
    def save_state(self) -> bytes: ...
    def load_state(self, data: bytes | bytearray | memoryview) -> int: ...
    def close(self) -> None: ...


C = TypeVar("C", bound=SessionOwner)


@dataclass(frozen=True)
class ChatReply:
    """One assistant turn of a Session: the parsed ``message`` (content, reasoning, tool calls) and the
    generation's ``result`` (tokens, n_cached, stop_reason, timings)."""

    message: ChatMessage
    result: Result

    @property
    def text(self) -> str:
        """The reply's content (reasoning and tool calls apart)."""
        return self.message.content

    @property
    def reasoning(self) -> str:
        """The reply's reasoning, where the format has one ("" otherwise)."""
        return self.message.reasoning

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The tool calls the reply made (tools offered, and a format that has calls)."""
        return list(self.message.tool_calls)

    def __str__(self) -> str:
        return self.text


#: The rule of llama.cpp's tool-call grammar for a format with one marker per call (Gemma's and Hermes'
#: ``<tool_call>``): any number of calls, whitespace after each.
_CALLS_RULE = "tool-calls ::= (tool-call space)+"


def _forced_calls(gbnf: str, parallel: bool) -> str:
    """A tool-call grammar that is not lazy (the reply must be calls), with the calls of a format with one
    marker per call written back to back and whitespace only after the last: after whitespace the reply
    can only end. The grammar as llama.cpp makes it lets another call follow whitespace, and a small model
    (Gemma 3 270M) writes call after call until max_tokens. ``parallel`` false: one call. Any other
    grammar is returned as it is."""
    if _CALLS_RULE not in gbnf.splitlines():
        return gbnf
    rule = "tool-calls ::= tool-call+ space" if parallel else "tool-calls ::= tool-call space"
    return "\n".join(rule if line == _CALLS_RULE else line for line in gbnf.split("\n"))


def formatted_params(fmt: p.ChatPrompt, gen: GenerateParams, opener: str = "",
                     parallel: bool = True) -> GenerateParams:
    """gen with what a formatted conversation needs to generate its next turn: the format's extra stops,
    its tool-call grammar and the rendering of its markers. ``opener``: the call marker the prompt ends
    with when the reply must be a tool call (call_opener). ``parallel``: whether such a reply may make
    more than one call, where the format has several."""
    changes: dict[str, Any] = {}
    if fmt.additional_stops:
        changes["stop"] = tuple(dict.fromkeys([*gen.stop, *fmt.additional_stops]))
    if fmt.grammar:
        if gen.grammar:
            raise InvalidArgumentError("a grammar= cannot apply together with the tool-call grammar of tools=")
        # Lazy (tool_choice "auto"): free text until the format's tool-call marker. Otherwise the grammar
        # starts with the generation prompt (and the opener), which the prompt already holds: the grammar
        # accepts it first.
        gbnf = fmt.grammar if fmt.grammar_lazy else _forced_calls(fmt.grammar, parallel)
        changes["grammar"] = Grammar(gbnf=gbnf, lazy=fmt.grammar_lazy, trigger_words=fmt.trigger_words,
                                     trigger_patterns=fmt.trigger_patterns, trigger_tokens=fmt.trigger_tokens,
                                     prefill="" if fmt.grammar_lazy else fmt.generation_prompt + opener)
    if fmt.preserved_tokens and fmt.grammar:  # tools offered: the reply may hold their markers
        # The format's markers (<tool_call>, ...) may be control tokens: the parser needs to see them.
        changes["render_special"] = True
    return replace(gen, **changes) if changes else gen


def call_opener(fmt: p.ChatPrompt, lazy: Callable[[], p.ChatPrompt]) -> str:
    """The text a reply that must be tool calls starts with: the format's call marker (Gemma's and Hermes'
    ``<tool_call>``), or "". llama.cpp's grammar for tool_choice "required" lets free text come before the
    first call, and a small model writes text and never reaches one; a prompt that ends with the marker,
    which the grammar then accepts after the generation prompt, has the reply be a call from its first
    token. ``fmt``: the turn formatted with "required" (a grammar that is not lazy, else there is nothing
    to do); ``lazy``: formats it with "auto", whose lazy grammar's trigger word is the marker. "" where the
    format has no such word: its grammar is used as llama.cpp made it. The reply's text is then the
    opener followed by what was generated."""
    if not fmt.grammar or fmt.grammar_lazy:
        return ""
    auto = lazy()
    if not auto.grammar_lazy or not auto.trigger_words:
        return ""
    opener = auto.trigger_words[0]
    return opener if opener.strip() and opener.strip() in fmt.grammar else ""


class ChatStream(Stream):
    """A Session turn as a Stream: iterate it for the raw pieces of the reply as they are decoded, then
    read ``reply``, the parsed turn, which joins the conversation when the generation ends (at the end of
    the iteration, on reading ``reply`` or ``result``, or at the session's next turn). ``close()`` or
    ``interrupt()`` stops the reply where it is; what was generated so far is the turn."""

    def __init__(self, session: Session[Any], turn: list[dict[str, Any]], opener: str = "") -> None:
        super().__init__(session.context._link.interrupt_future)
        self._session = session
        self._turn = turn
        self._opener = opener  # the prompt's call marker (call_opener), which the pieces do not repeat
        self._reply: ChatReply | None = None
        self._reply_lock = threading.Lock()

    def __next__(self) -> str:
        try:
            return super().__next__()
        except StopIteration:
            self.reply  # noqa: B018 - the turn joins the conversation as soon as the reply has ended
            raise

    def __enter__(self) -> ChatStream:
        return self

    @property
    def result(self) -> Result:
        """The reply's Result (blocks until the generation ends; the turn then joins the conversation)."""
        return self.reply.result

    @property
    def reply(self) -> ChatReply:
        """The parsed turn (blocks until the generation ends); raises the generation's error, if any."""
        with self._reply_lock:
            if self._reply is None:
                self._reply = self._session._finish(self, self._turn, self.future.result(), self._opener)
            return self._reply


#: The bias a chat puts on the format's end-of-turn token when a model without a chat template falls back to
#: a format: a base model (Gemma 3 270M) ranks that token tens of thousands of places down and would not end
#: a turn on its own.
BASE_MODEL_END_BIAS = 12.0


@dataclass(frozen=True)
class ChatFallback:
    """What a chat uses for a model without a chat template of its own: the format its vocabulary suggests
    (``template``), and ``logit_bias`` on that format's end-of-turn token, without which a base model does
    not end its turns. Session, ``lloyal-pool chat`` and ``lloyal-pool serve`` apply it, and say so."""

    template: str
    end: str  # the end-of-turn token's text
    end_token: int | None
    end_bias: float = BASE_MODEL_END_BIAS

    @property
    def logit_bias(self) -> dict[int, float]:
        """The bias to add to a chat's own (empty where the format has no single end-of-turn token)."""
        return {} if self.end_token is None or not self.end_bias else {self.end_token: self.end_bias}

    def __str__(self) -> str:
        bias = f", with {self.end_bias:+g} on {self.end} so that a base model ends its turns" if self.logit_bias else ""
        return f"the {self.template} format{bias}"


def chat_fallback(tokenize: Callable[[str], list[int]], end_bias: float = BASE_MODEL_END_BIAS) -> ChatFallback:
    """The fallback for a model without a chat template: Gemma's format when its vocabulary has
    <end_of_turn> as one token, else ChatML. ``tokenize``: text to token ids, special tokens parsed."""
    for template, end in (("gemma", "<end_of_turn>"), ("chatml", "<|im_end|>")):
        ids = tokenize(end)
        if len(ids) == 1:
            return ChatFallback(template, end, ids[0], end_bias)
    return ChatFallback("chatml", "<|im_end|>", None, end_bias)


class Session(Generic[C]):
    """A multi-turn conversation on one context: ``send`` and ``stream`` add a user turn and generate the
    assistant's reply, ``add`` appends any message (a tool's result, say), ``messages`` is the
    conversation so far. Create it with Context.chat. One turn at a time: a new turn first waits for the
    last streamed reply to end. A turn whose generation or parse fails is not recorded (the error is
    raised to whoever waits for it); the session stays as it was before that turn. ``context`` is the
    Context it runs on (to a type checker too: Context.chat makes a ``Session[Context]``)."""

    def __init__(self, context: C, system: str | None = None, *, template: str | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str = "auto",
                 params: GenerateParams | None = None, **defaults: Any) -> None:
        if tool_choice not in TOOL_CHOICES:
            raise InvalidArgumentError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}; got {tool_choice!r}")
        self.context: C = context
        self.tools: list[dict[str, Any]] | None = [dict(t) for t in tools] if tools else None
        self.tool_choice = tool_choice
        self.defaults = GenerateParams.of(params, defaults)
        #: What the session falls back to when neither ``template`` nor the model names a chat template.
        self.fallback: ChatFallback | None = None
        model = context.model
        if template is None and model.info.chat_template is None:
            self.fallback = chat_fallback(lambda text: model.tokenize(text, add_special=False, parse_special=True))
            template = self.fallback.template
            # The caller's own bias on that token, if any, wins.
            self.defaults = replace(self.defaults, logit_bias={**self.fallback.logit_bias, **self.defaults.logit_bias})
            _log.warning("%s has no chat template: the session uses %s (template= to choose another)",
                         os.path.basename(model.path), self.fallback)
        self.template = template
        self._messages: list[dict[str, Any]] = []
        if system is not None:
            self._messages.append({"role": "system", "content": system})
        self._pending: ChatStream | None = None

    def __repr__(self) -> str:
        return f"<Session {len(self._messages)} messages on {self.context!r}>"

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far, as OpenAI-style messages (a copy)."""
        self._settle()
        return [dict(m) for m in self._messages]

    def add(self, role: str, content: str, **fields: Any) -> None:
        """Appends a message without generating: a tool's result (``add("tool", result,
        tool_call_id=call.id)``), or a turn written by hand. ``send(None)`` then generates the reply."""
        self._settle()
        if not isinstance(role, str) or not isinstance(content, str):
            raise BadRequestError(f"a message's role and content are str, got {type(role).__name__} and "
                                  f"{type(content).__name__}")
        self._messages.append({"role": role, "content": content, **fields})

    def pop(self) -> dict[str, Any]:
        """Removes the last message of the conversation and returns it: a turn that was stopped, or one
        to take back (pop() twice removes a reply and the user's turn before it). IndexError when there
        is none. The context keeps its cache; the next turn reuses what it still shares with it."""
        self._settle()
        return self._messages.pop()

    def prompt(self, text: str | None = None) -> str:
        """The prompt the next turn would decode (the whole conversation, with ``text`` as the user's turn
        when given), as the template formats it. With tool_choice "required", the turn adds the format's
        call marker to it (call_opener)."""
        self._settle()
        return self._format(self._turn(text)).prompt

    def send(self, text: str | None, params: GenerateParams | None = None, *,
             progress: PromptProgress | None = None, **overrides: Any) -> ChatReply:
        """Adds ``text`` as the user's turn (None: none, e.g. after a tool's result) and generates the
        assistant's reply, which joins the conversation. ``params`` replaces the session's generate
        defaults for this turn; keyword overrides are GenerateParams fields. ``progress(done, total)``
        follows the turn's prompt tokens as they are decoded (a long pasted text), as in generate()."""
        self._settle()
        turn = self._turn(text)
        prompt, gen, opener = self._prepare(turn, params, overrides)
        return self._finish(None, turn, self.context.generate(prompt, gen, progress=progress), opener)

    def stream(self, text: str | None, params: GenerateParams | None = None, *,
               progress: PromptProgress | None = None, **overrides: Any) -> ChatStream:
        """send() piece by piece: returns at once with a ChatStream of the reply's raw text."""
        self._settle()
        turn = self._turn(text)
        prompt, gen, opener = self._prepare(turn, params, overrides)
        stream = self.context._start_stream(ChatStream(self, turn, opener), prompt, gen, append=False,
                                            progress=progress)
        self._pending = stream
        return stream

    # -- internals -----------------------------------------------------------------------------------------
    def _turn(self, text: str | None) -> list[dict[str, Any]]:
        if text is not None and not isinstance(text, str):
            raise BadRequestError(f"a turn's text is a str (or None to generate without one), got "
                                  f"{type(text).__name__}")
        return [{"role": "user", "content": text}] if text is not None else []

    def _format(self, turn: list[dict[str, Any]], tool_choice: str | None = None) -> p.ChatPrompt:
        return self.context.model._format_chat(self._messages + turn, template=self.template, tools=self.tools,
                                               tool_choice=tool_choice or self.tool_choice)

    def _prepare(self, turn: list[dict[str, Any]], params: GenerateParams | None,
                 overrides: Mapping[str, Any]) -> tuple[str, GenerateParams, str]:
        """The turn's prompt, its GenerateParams, and the call marker the prompt ends with (call_opener)."""
        gen = GenerateParams.of(params if params is not None else self.defaults, overrides)
        fmt = self._format(turn)
        opener = call_opener(fmt, lambda: self._format(turn, "auto")) if self.tool_choice == "required" else ""
        return fmt.prompt + opener, formatted_params(fmt, gen, opener), opener

    def _finish(self, stream: ChatStream | None, turn: list[dict[str, Any]], result: Result,
                opener: str = "") -> ChatReply:
        if stream is not None and self._pending is stream:
            self._pending = None
        messages = self._messages + turn
        # A reply cut short (n_predict, interrupt) may stop inside a tool call: parse it as partial.
        partial = result.stop_reason in (StopReason.LENGTH, StopReason.INTERRUPTED)
        message = self.context.model._parse_chat(opener + result.text, template=self.template, tools=self.tools,
                                                 messages=messages, tool_choice=self.tool_choice, partial=partial)
        self._messages = [*messages, message.to_message()]
        return ChatReply(message, result)

    def _settle(self) -> None:
        stream = self._pending
        if stream is not None:
            try:
                stream.reply  # noqa: B018 - waits for the streamed turn and records it
            except LloyalError:
                self._pending = None  # that turn failed and is not recorded; its reader got the error


__all__ = ["BASE_MODEL_END_BIAS", "ChatFallback", "ChatReply", "ChatStream", "Session", "call_opener",
           "chat_fallback", "formatted_params"]
