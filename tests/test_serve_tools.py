"""Tool calls that obey tool_choice (issue 26): the default model, Gemma 3 270M, whose file has no chat
template, served as ``lloyal-pool serve`` serves it (the fallback format and its end-of-turn bias,
session.chat_fallback), spoken to with the official ``openai`` package and with LangChain. The tests
check the shape of what comes back (calls, names, arguments against the tool's schema), never the words
the model chose."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from chatformats import HERMES
from served import PATIENCE, Served

from lloyal_pool import GenerateParams, Grammar, Model, Pool, StopReason
from lloyal_pool.session import call_opener, chat_fallback, formatted_params

pytestmark = pytest.mark.gemma

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "hours_ahead": {"type": "integer"}}, "required": ["city"]}}}
TOOLS: list[dict[str, Any]] = [WEATHER, TIME]
QUESTION = "What is the weather like in Paris right now?"
ASK: list[Any] = [{"role": "user", "content": QUESTION}]


def check_call(name: str, arguments: str, tools: list[dict[str, Any]] = TOOLS) -> dict[str, Any]:
    """The call's arguments, decoded, after checking them against the schema of the tool it names: an
    object with the required keys, no others, and values of the declared types."""
    (tool,) = [t for t in tools if t["function"]["name"] == name]
    schema = tool["function"]["parameters"]
    args = json.loads(arguments)
    assert isinstance(args, dict)
    assert set(schema["required"]) <= set(args) <= set(schema["properties"]), args
    for key, value in args.items():
        spec = schema["properties"][key]
        if spec["type"] == "string":
            assert isinstance(value, str), (key, value)
        elif spec["type"] == "integer":
            assert isinstance(value, int) and not isinstance(value, bool), (key, value)
        if "enum" in spec:
            assert value in spec["enum"], (key, value)
    return args


def client_of(served: Served) -> Any:
    """The served app's openai client (typed loosely: the tests send OpenAI's request shapes as dicts)."""
    return served.client()


@pytest.fixture(scope="module")
def spool(gemma_path: Path) -> Iterator[Pool]:
    with Pool(1) as pool:
        pool[0].load_model(gemma_path).batcher(slots=4, n_ctx_slot=2048)
        yield pool


@pytest.fixture(scope="module")
def model(spool: Pool) -> Model:
    return spool[0].models[0]


@pytest.fixture(scope="module")
def served(spool: Pool, model: Model) -> Iterator[Served]:
    # What `lloyal-pool serve` does for a model without a chat template (cli._serve_template).
    assert model.info.chat_template is None
    fallback = chat_fallback(lambda text: model.tokenize(text, add_special=False, parse_special=True))
    assert fallback.template == "gemma"
    s = Served(spool, chat_template=fallback.template, chat_logit_bias=fallback.logit_bias)
    yield s
    s.close()


def test_required_makes_the_reply_a_call_of_one_of_the_tools(served: Served) -> None:
    client = client_of(served)
    got = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                         tool_choice="required", temperature=0, max_tokens=128)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        check_call(call.function.name, call.function.arguments)
    # Sampled replies are calls too: the grammar holds every token, whatever the sampler draws.
    for seed in range(3):
        sampled = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                                 tool_choice="required", temperature=0.8, seed=seed,
                                                 max_tokens=128)
        assert sampled.choices[0].finish_reason == "tool_calls", sampled
        for call in sampled.choices[0].message.tool_calls or []:
            check_call(call.function.name, call.function.arguments)


def test_a_named_tool_choice_calls_that_tool(served: Served) -> None:
    got = client_of(served).chat.completions.create(
        model="x", messages=ASK, tools=TOOLS, temperature=0, max_tokens=128,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert got.choices[0].finish_reason == "tool_calls"
    calls = got.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "get_time" for c in calls)
    for call in calls:
        check_call("get_time", call.function.arguments)


def test_none_leaves_the_tools_out_of_the_prompt_and_the_reply(served: Served) -> None:
    client = client_of(served)

    def ask(**tools: Any) -> Any:
        return client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=8, **tools)

    plain, none, auto = ask(), ask(tools=TOOLS, tool_choice="none"), ask(tools=TOOLS)
    message = none.choices[0].message
    assert message.tool_calls is None and isinstance(message.content, str)
    assert none.choices[0].finish_reason in ("stop", "length")
    # The prompt is the one without tools; "auto" describes them.
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    # Streamed, the content comes piece by piece, with no call.
    chunks = list(client.chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                                 tool_choice="none", temperature=0, max_tokens=8, stream=True))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_streamed_required_reply_assembles_into_a_call(served: Served) -> None:
    client = client_of(served)
    with client.chat.completions.stream(model="x", messages=ASK, tools=TOOLS,
                                        tool_choice="required", temperature=0, max_tokens=128) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    calls = final.choices[0].message.tool_calls or []
    assert calls
    for call in calls:
        check_call(call.function.name, call.function.arguments)
    # The raw chunks, as a client without the helper reads them: each call's pieces under its index.
    chunks = list(client.chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                                 tool_choice="required", temperature=0, max_tokens=128,
                                                 stream=True))
    joined: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = joined.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function:
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    assert joined and chunks[-1].choices[0].finish_reason == "tool_calls"
    for entry in joined.values():
        check_call(entry["name"], entry["arguments"])


def test_parallel_tool_calls_false_gives_one_call(served: Served) -> None:
    # Worked examples of replies with two calls: a base model copies them.
    def two_calls(i: int, a: str, b: str) -> list[dict[str, Any]]:
        return [{"type": "function", "id": f"call_{i}{n}", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}
            for n, city in enumerate((a, b))]

    messages: list[Any] = [
        {"role": "user", "content": "What is the weather in Rome and in Berlin?"},
        {"role": "assistant", "content": "", "tool_calls": two_calls(0, "Rome", "Berlin")},
        {"role": "tool", "tool_call_id": "call_00", "content": "Sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_01", "content": "Rain, 12 C"},
        {"role": "assistant", "content": "Rome is sunny; Berlin has rain."},
        {"role": "user", "content": "What is the weather in Oslo and in Madrid?"}]
    client = client_of(served)
    many = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=160)
    one = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, tool_choice="required",
                                         temperature=0, max_tokens=160, parallel_tool_calls=False)
    assert many.choices[0].finish_reason == one.choices[0].finish_reason == "tool_calls"
    assert len(many.choices[0].message.tool_calls or []) >= 2  # the format has several calls in one reply
    assert len(one.choices[0].message.tool_calls or []) == 1
    for call in [*(many.choices[0].message.tool_calls or []), *(one.choices[0].message.tool_calls or [])]:
        check_call(call.function.name, call.function.arguments)


def test_forced_calls_that_cannot_be_made_are_refused_and_the_server_goes_on(served: Served, spool: Pool) -> None:
    client = client_of(served)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert err.value.status_code == 400 and err.value.param == "tool_choice"
    assert err.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="x", messages=ASK, tool_choice="required")
    assert err.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                       parallel_tool_calls="yes")
    assert err.value.param == "parallel_tool_calls"
    # A format without tool calls (ChatML, as written in lloyal_pool.chat) cannot force one: refused.
    chatml = Served(spool, chat_template="chatml")
    try:
        with pytest.raises(openai.BadRequestError, match="tool calls") as err:
            client_of(chatml).chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                                    tool_choice="required", max_tokens=4)
        assert err.value.param == "tool_choice"
    finally:
        chatml.close()
    # The server goes on serving.
    again = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=128)
    assert again.choices[0].finish_reason == "tool_calls"


def test_the_gemma_format_offers_tools_only_when_given(model: Model) -> None:
    plain = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]
    # Without tools, Gemma's plain format, as before.
    assert model.apply_chat_template(plain, template="gemma") == (
        "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n")
    offered = model.apply_chat_template(plain, template="gemma", tools=TOOLS)
    first_turn = offered.split("<end_of_turn>")[0]
    assert first_turn.startswith("<start_of_turn>user\nYou are terse.\n\n") and first_turn.endswith("Hi")
    assert all(json.dumps(t["function"]["name"]) in first_turn for t in TOOLS)
    # A call and its result in the conversation: the call in the model's turn, the result in a user turn.
    call = {"type": "function", "id": "call_1",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "unit": "celsius"})}}
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    prompt = model._format_chat(history, template="gemma", tools=TOOLS).prompt
    assert ('<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
            '"unit": "celsius"}}\n</tool_call><end_of_turn>\n'
            '<start_of_turn>user\n<tool_response>\nSunny\n</tool_response><end_of_turn>\n') in prompt
    # "auto": a lazy grammar from the call marker on; "required": not lazy, the prompt ending with the marker,
    # one call or several back to back (parallel) or exactly one.
    auto = model._format_chat(ASK, template="gemma", tools=TOOLS, tool_choice="auto")
    required = model._format_chat(ASK, template="gemma", tools=TOOLS, tool_choice="required")
    assert auto.grammar_lazy and auto.trigger_words == ["<tool_call>\n"]
    assert required.grammar and not required.grammar_lazy
    opener = call_opener(required, lambda: auto)
    assert opener == "<tool_call>\n"
    for parallel, rule in ((True, "tool-calls ::= tool-call+ space"), (False, "tool-calls ::= tool-call space")):
        grammar = formatted_params(required, GenerateParams(), opener, parallel).grammar
        assert isinstance(grammar, Grammar) and not grammar.lazy
        assert grammar.prefill == required.generation_prompt + opener and rule in (grammar.gbnf or "").splitlines()
    parsed = model.parse_chat_output('<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>',
                                     template="gemma", tools=TOOLS)
    assert [(c.name, c.args()) for c in parsed.tool_calls] == [("get_time", {"city": "Rome"})]


def test_a_required_call_in_a_hermes_style_format(model: Model) -> None:
    ctx = model.new_context(n_ctx=2048)
    try:
        session = ctx.chat(template=HERMES, tools=TOOLS, tool_choice="required", n_predict=128, temperature=0)
        reply = session.send(QUESTION)
        assert reply.result.stop_reason is StopReason.EOS and reply.tool_calls
        for call in reply.tool_calls:
            check_call(call.name, call.arguments)
    finally:
        ctx.close()


def test_a_session_with_required_tool_choice_answers_with_a_call(model: Model) -> None:
    ctx = model.new_context(n_ctx=2048)
    try:
        session = ctx.chat(tools=TOOLS, tool_choice="required", n_predict=128, temperature=0)
        assert session.fallback is not None and session.template == "gemma"
        reply = session.send(QUESTION)
        assert reply.result.stop_reason is not StopReason.LENGTH and reply.tool_calls
        for call in reply.tool_calls:
            check_call(call.name, call.arguments)
        assert session.messages[-1]["tool_calls"]
        # A streamed turn: the pieces are what was generated after the call marker; the reply parses whole.
        session.add("tool", "Sunny, 21 C", tool_call_id=reply.tool_calls[0].id)
        with session.stream("And the time there?") as stream:
            pieces = "".join(stream)
        assert pieces == stream.result.text and stream.reply.tool_calls
        for call in stream.reply.tool_calls:
            check_call(call.name, call.arguments)
    finally:
        ctx.close()


def test_langchain_structured_output_and_bound_tools(served: Served) -> None:
    import langchain_openai  # the test extra brings it: a client nobody here wrote
    from langchain_core.messages import AIMessage
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather to look up."""

        city: str = Field(description="The city's name")
        unit: Literal["celsius", "fahrenheit"]

    llm = langchain_openai.ChatOpenAI(base_url=served.url + "/v1", api_key="x", model="gemma", temperature=0,
                                      max_retries=0, timeout=PATIENCE)
    # tool_choice names the function (parallel_tool_calls false): the reply is that call, parsed.
    got = llm.with_structured_output(Weather, method="function_calling").invoke(QUESTION)
    assert isinstance(got, Weather)
    # tool_choice="any" is sent as "required".
    message = llm.bind_tools(TOOLS, tool_choice="any").invoke(QUESTION)
    assert isinstance(message, AIMessage) and message.tool_calls
    for call in message.tool_calls:
        assert isinstance(call["args"], Mapping)
        check_call(call["name"], json.dumps(call["args"]))
