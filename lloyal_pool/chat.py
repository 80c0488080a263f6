"""Chat formats by name, for models whose GGUF carries no chat template (the default model, Gemma 3 270M's
base model, is one). Each is Jinja source for llama.cpp's chat engine, written here from the format's
published description; ``Model.apply_chat_template(template="gemma")`` uses it.

    gemma   <start_of_turn>user ... <end_of_turn> turns, the assistant's role called "model", a system
            message folded into the first user turn; tools described there too, and tool calls written
            as <tool_call>{"name": ..., "arguments": ...}</tool_call>, so tool_choice works on it
    chatml  <|im_start|>role ... <|im_end|> turns
    llama3  <|start_header_id|>role<|end_header_id|> headers, <|eot_id|> after each turn

The templates write the model's BOS first, as the originals do; llama.cpp's engine takes it off the
rendered prompt when the model adds BOS itself, so the prompt starts with the first turn and a generate
adds the BOS once.

ChatMessage and ToolCall are what llama.cpp's parser for a template's format makes of a model's output
(Model.parse_chat_output, and every reply of a Session).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

# Gemma's turns have no place for tools of their own. With ``tools``, they are described after the system
# prompt in the first turn; a call is <tool_call>{"name": ..., "arguments": {...}}</tool_call> in the
# model's turn, one per call; a tool's result is a user turn in <tool_response>. llama.cpp's format analysis
# finds those markers by rendering the template and builds the tool-call grammar and parser from them.
# Without tools, tool calls or tool messages, the prompt is Gemma's plain format.
GEMMA_TOOLS = (
    "You can call these tools, each described as JSON:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "To call one, answer with <tool_call>\n{\"name\": <its name>, \"arguments\": <a JSON object>}\n"
    "</tool_call>\n\n"
)
GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = (messages[0]['content'] | trim) ~ '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% elif m['role'] == 'tool' %}{% set role = 'user' %}{% else %}{% set role = m['role'] %}{% endif %}"
    "<start_of_turn>{{ role }}\n"
    "{% if loop.first %}{{ prefix }}{% if tools %}" + GEMMA_TOOLS + "{% endif %}{% endif %}"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] | trim }}\n</tool_response>"
    "{% else %}{{ m['content'] | trim }}{% endif %}"
    "{% for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

CHATML = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

#: Format name -> Jinja source.
CHAT_FORMATS: dict[str, str] = {"gemma": GEMMA, "chatml": CHATML, "llama3": LLAMA3}


def template_source(template: str | None) -> str:
    """The Jinja source for ``template``: "" (the model's own) for None, a format of CHAT_FORMATS by name,
    else the string itself, which must then be Jinja (ValueError for an unknown name)."""
    if template is None:
        return ""
    if template in CHAT_FORMATS:
        return CHAT_FORMATS[template]
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(f"unknown chat format {template!r}: one of {sorted(CHAT_FORMATS)}, or Jinja source")


#: What ``tool_choice`` takes: "auto" (the model may call a tool: a lazy grammar waits for the format's
#: tool-call marker), "required" (the reply is tool calls: the grammar constrains it from the start) and
#: "none" (tools are described in the prompt, but the reply is not constrained or parsed for calls).
TOOL_CHOICES = ("auto", "required", "none")


class ToolCall(msgspec.Struct, frozen=True):
    """One tool call parsed from an assistant turn: the tool's ``name``, its ``arguments`` as JSON text
    (as the model wrote them, normalised by the parser), and an ``id`` ("" when the format has none)."""

    name: str
    arguments: str
    id: str = ""

    def args(self) -> Any:
        """The arguments, decoded from JSON."""
        return json.loads(self.arguments) if self.arguments else {}

    def to_message(self) -> dict[str, Any]:
        """The call as an OpenAI-style ``tool_calls`` entry, as an assistant message carries it."""
        out: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id:
            out["id"] = self.id
        return out


class ChatMessage(msgspec.Struct, frozen=True):
    """An assistant turn parsed by llama.cpp's parser for the format its template yields
    (Model.parse_chat_output): the ``content``, the ``reasoning`` (a ``<think>`` block or the format's
    own, "" when none), and the ``tool_calls``."""

    content: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = []

    def to_message(self) -> dict[str, Any]:
        """The turn as an OpenAI-style assistant message, the form a template renders again."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return out


__all__ = ["CHAT_FORMATS", "TOOL_CHOICES", "ChatMessage", "ToolCall", "template_source"]
