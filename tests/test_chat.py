"""Chat prompts through llama.cpp's Jinja engine: the formats by name against reference strings, Jinja
source, tools, and typed errors for templates that cannot be used; model output parsed by the parser of
the template's format (content, reasoning, tool calls)."""

from __future__ import annotations

import pytest
from chatformats import HERMES, WEATHER

from lloyal_pool import ChatMessage, Model, TemplateError, ToolCall

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a colour."},
]


@pytest.mark.gemma
def test_gemma_format(gemma: Model) -> None:
    got = gemma.apply_chat_template(MESSAGES, template="gemma")
    assert got == ("<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
                   "<start_of_turn>model\nHello!<end_of_turn>\n"
                   "<start_of_turn>user\nName a colour.<end_of_turn>\n"
                   "<start_of_turn>model\n")
    no_prompt = gemma.apply_chat_template(MESSAGES, template="gemma", add_generation_prompt=False)
    assert no_prompt == got[:-len("<start_of_turn>model\n")]
    # Special tokens in the prompt are the model's own tokens when tokenized with parse_special.
    toks = gemma.tokenize(got, add_special=False, parse_special=True)
    assert toks[0] != gemma.info.bos and gemma.tokenize("<start_of_turn>", add_special=False,
                                                        parse_special=True)[0] in toks


@pytest.mark.gemma
def test_chatml_format(gemma: Model) -> None:
    assert gemma.apply_chat_template(MESSAGES, template="chatml") == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_llama3_format(tiny: Model) -> None:
    assert tiny.apply_chat_template(MESSAGES, template="llama3") == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_jinja_source_and_tools(tiny: Model) -> None:
    src = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
           "{% if add_generation_prompt %}>{% endif %}")
    assert tiny.apply_chat_template(MESSAGES[1:3], template=src) == "[user]Hi[assistant]Hello!>"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    with_tools = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ messages[0]['content'] }}"
    out = tiny.apply_chat_template(MESSAGES[1:2], template=with_tools, tools=tools)
    assert "get_weather;" in out and out.endswith("Hi")


def test_templates_that_cannot_be_used_are_typed_errors(tiny: Model) -> None:
    with pytest.raises(TemplateError, match="no chat template"):
        tiny.apply_chat_template(MESSAGES)  # the tiny model's GGUF has none
    with pytest.raises(TemplateError):
        tiny.apply_chat_template(MESSAGES, template="{% for m in messages %}{{ m['content'] }")
    with pytest.raises(TemplateError):
        tiny.apply_chat_template(MESSAGES, template="{{ raise_exception('no system messages') }}")
    with pytest.raises(ValueError, match="unknown chat format"):
        tiny.apply_chat_template(MESSAGES, template="vicuna-ish")
    assert tiny.apply_chat_template(MESSAGES[:1], template="chatml").startswith("<|im_start|>system")


@pytest.mark.gemma
def test_a_formatted_prompt_generates_with_one_bos(gemma: Model) -> None:
    prompt = gemma.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       template="gemma")
    assert not prompt.startswith("<bos>")  # the engine leaves the BOS to the tokenizer
    prompt = "<bos>" + prompt  # as a hand-written prompt might: still one BOS
    ctx = gemma.new_context(n_ctx=256)
    try:
        r = ctx.generate(prompt, n_predict=12, stop=["<end_of_turn>"])
        history = ctx.tokens()
    finally:
        ctx.close()
    assert history[0] == gemma.info.bos and history[1] != gemma.info.bos
    assert r.n_decoded > 0


@pytest.mark.gemma
def test_gemma_output_parses_as_plain_content(gemma: Model) -> None:
    prompt = gemma.apply_chat_template([{"role": "user", "content": "Hello, I am Ada."}], template="gemma")
    ctx = gemma.new_context(n_ctx=256)
    try:
        r = ctx.generate(prompt, n_predict=8)
    finally:
        ctx.close()
    assert r.text.strip()
    msg = gemma.parse_chat_output(r.text, template="gemma")
    assert msg == ChatMessage(content=r.text)  # Gemma's format has no reasoning or tool-call markers


def test_a_tool_call_and_content_are_parsed_apart(tiny: Model) -> None:
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    msg = tiny.parse_chat_output(text, template=HERMES, tools=WEATHER)
    assert msg.content == "Let me look." and msg.reasoning == ""
    assert msg.tool_calls == [ToolCall(name="get_weather", arguments='{"city": "Paris"}')]
    assert msg.tool_calls[0].args() == {"city": "Paris"}
    # Without tools the same text is content: nothing is parsed as a call.
    plain = tiny.parse_chat_output(text, template=HERMES)
    assert plain.tool_calls == [] and plain.content == text


def test_parse_chat_output_takes_the_text_by_keyword_and_the_rest_only_so(tiny: Model) -> None:
    assert tiny.parse_chat_output(text="Hello.", template=HERMES).content == "Hello."
    with pytest.raises(TypeError):
        tiny.parse_chat_output("Hello.", HERMES)  # type: ignore[misc]  # a template passed by place


def test_a_reasoning_block_is_parsed_apart(tiny: Model) -> None:
    msg = tiny.parse_chat_output("<think>\nParis is in France.\n</think>\nIt is sunny.", template=HERMES)
    assert msg.reasoning.strip() == "Paris is in France." and msg.content == "It is sunny."
    assert msg.to_message() == {"role": "assistant", "content": "It is sunny.", "reasoning_content": msg.reasoning}


def test_output_the_format_cannot_parse_is_a_typed_error(tiny: Model) -> None:
    with pytest.raises(TemplateError, match="chat output"):
        tiny.parse_chat_output('<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
                               template=HERMES, tools=WEATHER)
    with pytest.raises(TemplateError):
        tiny.parse_chat_output("Hi", template=HERMES, tools=[{"type": "function"}])  # no function in it
    with pytest.raises(TemplateError, match="no chat template"):
        tiny.parse_chat_output("Hi")
    assert tiny.parse_chat_output("Still serving.", template=HERMES).content == "Still serving."
