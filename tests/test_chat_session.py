"""Chat sessions (Context.chat): every turn formats the whole conversation and reuses the cache, so a warm
session holds exactly the cold path's tokens and prefills only the new turn; replies end at the model's
end-of-generation token; streamed turns join the conversation; tool calls come through llama.cpp's
tool-call grammar and parser; grammars that start with the generation prompt accept it first."""

from __future__ import annotations

from typing import Any

import pytest
from chatformats import HERMES, WEATHER

from lloyal_pool import (
    ChatStream,
    Context,
    ContextOverflowError,
    GenerateParams,
    Grammar,
    GrammarError,
    Model,
    Result,
    Session,
    StopReason,
    TemplateError,
)
from lloyal_pool.chat import GEMMA
from lloyal_pool.session import BASE_MODEL_END_BIAS

pytestmark = pytest.mark.gemma

# Gemma 3 270M is a base model: it ranks <end_of_turn> tens of thousands of places down and would never end
# a turn on its own. A logit bias on that token lets it end its turns where it would start a new one.
EOT_BIAS = 12.0
TURNS = ["Hello, I am Ada.", "How are you?", "Do you remember my name?", "Bye!"]


def _eot(model: Model) -> int:
    (eot,) = model.tokenize("<end_of_turn>", add_special=False, parse_special=True)
    return eot


@pytest.fixture(scope="module")
def four_turns(gemma: Model) -> dict[str, Any]:
    """A 4-turn session on the default model, with the context's history after each turn."""
    ctx = gemma.new_context(n_ctx=1024)
    try:
        session = ctx.chat(template="gemma", n_predict=16, logit_bias={_eot(gemma): EOT_BIAS})
        replies, histories = [], []
        for text in TURNS:
            replies.append(session.send(text))
            histories.append(ctx.tokens())
        return {"replies": replies, "histories": histories, "messages": session.messages}
    finally:
        ctx.close()


def test_a_warm_session_holds_the_cold_tokens_and_prefills_only_new_turns(gemma: Model,
                                                                         four_turns: dict[str, Any]) -> None:
    messages = four_turns["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 4
    previous: list[int] = []
    for i, (reply, history) in enumerate(zip(four_turns["replies"], four_turns["histories"], strict=True)):
        # The conversation up to this turn's user message, formatted and tokenized from scratch.
        cold_prompt = gemma.tokenize(gemma.apply_chat_template(messages[:2 * i + 1], template="gemma"),
                                     parse_special=True)
        assert history == cold_prompt + reply.result.tokens
        result: Result = reply.result
        assert result.n_prompt == len(cold_prompt)
        if i:
            # Everything the context held after the last turn is reused; only the new tokens are decoded.
            assert cold_prompt[:len(previous)] == previous
            assert result.n_cached == len(previous) and result.n_prompt - result.n_cached < 20
        previous = history
    # The last turn from a cold, fresh context: the same tokens, the same reply.
    fresh = gemma.new_context(n_ctx=1024)
    try:
        last = four_turns["replies"][-1].result
        prompt = gemma.apply_chat_template(messages[:-1], template="gemma")
        cold = fresh.generate(prompt, n_predict=16, logit_bias={_eot(gemma): EOT_BIAS})
        assert cold.n_cached == 0 and cold.tokens == last.tokens
        assert fresh.tokens() == four_turns["histories"][-1]
    finally:
        fresh.close()


def test_turn_three_is_generated_from_a_conversation_that_holds_turn_one(gemma: Model,
                                                                        four_turns: dict[str, Any]) -> None:
    # Whether the model then says the name is the model's (and its CPU's) business; that it sees it is ours.
    assert "Ada" not in TURNS[2] and "Ada" in TURNS[0]
    third = four_turns["replies"][2].result
    seen = four_turns["histories"][2][:len(four_turns["histories"][2]) - len(third.tokens)]
    assert "Hello, I am Ada." in gemma.detokenize(seen)
    fresh = gemma.new_context(n_ctx=1024)
    try:
        prompt = gemma.apply_chat_template(four_turns["messages"][:5], template="gemma")
        assert fresh.generate(prompt, n_predict=16, logit_bias={_eot(gemma): EOT_BIAS}).tokens == third.tokens
    finally:
        fresh.close()


def test_replies_end_at_the_end_of_turn_token_which_is_not_in_them(gemma: Model,
                                                                  four_turns: dict[str, Any]) -> None:
    eot = _eot(gemma)
    assert gemma.is_eog(eot)  # the vocabulary's end-of-generation set covers <end_of_turn>
    # Where the model ends a free reply differs from CPU to CPU: each reply ends at an end-of-generation
    # token or at n_predict, and the token is in neither the reply nor the history.
    for reply, history in zip(four_turns["replies"], four_turns["histories"], strict=True):
        result = reply.result
        assert result.stop_reason in (StopReason.EOS, StopReason.LENGTH)
        assert result.stop_reason is StopReason.EOS or result.n_decoded == 16
        assert eot not in result.tokens and history[-1] != eot
        assert "<end_of_turn>" not in reply.text and reply.text == result.text
    for m in four_turns["messages"][1::2]:
        assert "<end_of_turn>" not in m["content"]
    # A grammar that ends after a fixed reply leaves the model only its end-of-generation tokens: an end on
    # every CPU.
    ctx = gemma.new_context(n_ctx=1024)
    try:
        session = ctx.chat(template="gemma", n_predict=16, logit_bias={eot: EOT_BIAS})
        for text, answer in (("Hello, I am Ada.", "Hello Ada!"), ("How are you?", "Fine, thanks.")):
            reply = session.send(text, grammar=f'root ::= "{answer}"')
            assert reply.result.stop_reason is StopReason.EOS and reply.text == answer
            assert not set(reply.result.tokens) & set(gemma.info.eog_tokens) and ctx.tokens()[-1] != eot
            assert session.messages[-1] == {"role": "assistant", "content": answer}
    finally:
        ctx.close()


def test_a_streamed_turn_joins_the_conversation_and_an_interrupted_one_is_kept(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        session = ctx.chat("Answer briefly.", template="gemma", n_predict=16, logit_bias={_eot(gemma): EOT_BIAS})
        stream = session.stream(TURNS[0])
        assert isinstance(stream, ChatStream)
        pieces = list(stream)
        # The turn's end (its end-of-turn token, or n_predict) is the model's, which the CPU's kernels can sway.
        assert "".join(pieces) == stream.reply.text and stream.reply.result.stop_reason in (StopReason.EOS,
                                                                                          StopReason.LENGTH)
        assert session.messages[-1] == {"role": "assistant", "content": stream.reply.text}
        # Reading result also ends the turn.
        quick = session.stream("Thanks.")
        assert quick.result.n_decoded > 0 and session.messages[-1]["content"] == quick.reply.text
        assert len(session.messages) == 5
        # A long reply closed after its first piece: what it got to is the turn.
        with session.stream("Tell me a long story.", n_predict=400, logit_bias={}) as long:
            first = next(long)
        assert long.reply.result.interrupted and long.reply.text.startswith(first)
        assert session.messages[-1]["content"] == long.reply.text
        assert len(session.messages) == 7
        # The next turn reuses all of it.
        held = ctx.tokens()
        after = session.send(TURNS[1])
        assert after.result.n_cached == len(held)
    finally:
        ctx.close()


def test_a_turns_prompt_reports_its_progress(gemma: Model) -> None:
    # A long pasted text in a chat: send and stream follow its prefill as generate does.
    ctx = gemma.new_context(n_ctx=2048, n_batch=64)
    try:
        session = ctx.chat(template="gemma", n_predict=2)
        pasted = "Summarize this: " + " ".join(["the quick brown fox jumps over the lazy dog"] * 30)
        seen: list[tuple[int, int]] = []
        reply = session.send(pasted, progress=lambda done, total: seen.append((done, total)))
        total = reply.result.n_prompt - reply.result.n_cached
        assert len(seen) > 1 and seen[-1] == (total, total) and seen == sorted(seen)
        streamed: list[tuple[int, int]] = []
        with session.stream(pasted, progress=lambda done, total: streamed.append((done, total))) as stream:
            list(stream)
        assert streamed and streamed[-1][0] == streamed[-1][1]
    finally:
        ctx.close()


def test_a_stopped_turn_can_be_taken_back(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        session = ctx.chat("Answer briefly.", template="gemma", n_predict=400)
        with session.stream("Tell me a long story.") as stream:
            next(stream)  # the Stop button after the first piece
        assert stream.reply.result.interrupted and len(session.messages) == 3
        assert session.pop()["role"] == "assistant" and session.pop() == {"role": "user",
                                                                          "content": "Tell me a long story."}
        assert session.messages == [{"role": "system", "content": "Answer briefly."}]
        assert session.send("Hi", n_predict=2).result.n_decoded == 2 and len(session.messages) == 3
        session.pop(), session.pop(), session.pop()
        with pytest.raises(IndexError):
            session.pop()
    finally:
        ctx.close()


def test_a_model_without_a_template_falls_back_and_says_so(gemma: Model, caplog: pytest.LogCaptureFixture) -> None:
    # Gemma 3 270M's file has no chat template: a session uses the Gemma format, with the bias that makes
    # a base model end its turns, as `lloyal-pool chat` does; the caller's own bias on that token wins.
    [eot] = gemma.tokenize("<end_of_turn>", add_special=False, parse_special=True)
    ctx = gemma.new_context(n_ctx=512)
    try:
        with caplog.at_level("WARNING", logger="lloyal_pool"):
            session = ctx.chat(n_predict=4)
        assert session.template == "gemma" and session.fallback is not None
        assert dict(session.defaults.logit_bias) == {eot: BASE_MODEL_END_BIAS}
        assert "has no chat template: the session uses the gemma format, with +12 on <end_of_turn>" in caplog.text
        assert session.send("Hello").result.n_decoded > 0
        assert dict(ctx.chat(logit_bias={eot: 1.0}).defaults.logit_bias) == {eot: 1.0}
        chosen = ctx.chat(template="chatml")
        assert chosen.fallback is None and dict(chosen.defaults.logit_bias) == {}
    finally:
        ctx.close()


def test_the_formats_extra_stop_strings_end_a_reply(gemma: Model) -> None:
    # llama.cpp's format analysis adds "</assistant>" as a stop string for templates of the Laguna family,
    # which it recognises by this name in the source.
    laguna_like = "{# laguna_glm_thinking #}" + GEMMA
    ctx = gemma.new_context(n_ctx=1024)
    try:
        # A grammar makes the model write the stop string on any CPU.
        says = 'root ::= "Hello, I am Ada </assistant> and you?"'
        session = ctx.chat(template=laguna_like, n_predict=24, grammar=says)
        reply = session.send("Hello, I am Ada </assistant> and you?")
        assert reply.result.stop_reason is StopReason.STOP and reply.text == "Hello, I am Ada "
        plain = ctx.chat(template="gemma", n_predict=24, grammar=says)
        assert plain.send("Hello, I am Ada </assistant> and you?").text == "Hello, I am Ada </assistant> and you?"
    finally:
        ctx.close()


def _call(i: int, city: str) -> list[dict[str, Any]]:
    return [{"type": "function", "id": f"call_{i}",
             "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}]


def _few_shot(session: Session) -> None:
    session.add("user", "What is the weather in Rome?")
    session.add("assistant", "", tool_calls=_call(1, "Rome"))
    session.add("user", "What is the weather in Berlin?")
    session.add("assistant", "", tool_calls=_call(2, "Berlin"))


def test_a_tool_call_comes_through_the_lazy_grammar_and_the_parser(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=2048)
    try:
        # The examples call get_weather; the only tool offered now is get_time. The model, copying the
        # examples, would write get_weather: once it starts a call, the lazy grammar holds it to get_time.
        time_tool = [{"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                                       "parameters": {"type": "object", "properties": {
                                                           "city": {"type": "string"}}, "required": ["city"]}}}]
        session = ctx.chat(template=HERMES, tools=time_tool, n_predict=28, stop=["<|im_end|>"])
        _few_shot(session)
        free = ctx.generate(session.prompt("What is the weather in Paris?"), n_predict=28)
        assert free.text.startswith('<tool_call>\n{"name": "get_weather"')  # what it writes unconstrained
        reply = session.send("What is the weather in Paris?")
        assert reply.result.text.startswith("<tool_call>")
        assert reply.tool_calls and reply.tool_calls[0].name == "get_time"
        assert reply.tool_calls[0].args() == {"city": "Paris"}
        assert reply.text == ""
        last = session.messages[-1]
        assert last["role"] == "assistant" and last["tool_calls"][0]["function"]["name"] == "get_time"
        # The tool's result goes back, and the model answers from the conversation as it is.
        session.add("tool", "Noon", tool_call_id=reply.tool_calls[0].id)
        again = session.send(None)
        assert again.result.n_decoded > 0 and session.messages[-2] == {"role": "tool", "content": "Noon",
                                                                       "tool_call_id": ""}
    finally:
        ctx.close()


def test_a_tool_call_parsed_from_the_session_matches_the_weather_schema(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=2048)
    try:
        session = ctx.chat(template=HERMES, tools=WEATHER, n_predict=28, stop=["<|im_end|>"])
        _few_shot(session)
        reply = session.send("What is the weather in Paris?")
        assert reply.tool_calls[0].name == "get_weather" and reply.tool_calls[0].args() == {"city": "Paris"}
    finally:
        ctx.close()


def test_call_markers_that_are_control_tokens_reach_the_parser(gemma: Model) -> None:
    # <unused0> and <unused1> are control tokens of Gemma's vocabulary, which text leaves out by default.
    markers = HERMES.replace("<tool_call>\n", "<unused0>").replace("\n</tool_call>", "<unused1>")
    ctx = gemma.new_context(n_ctx=2048)
    try:
        session = ctx.chat(template=markers, tools=WEATHER, n_predict=28, stop=["<|im_end|>"])
        session.add("user", "What is the weather in Rome?")
        session.add("assistant", "", tool_calls=_call(1, "Rome"))
        session.add("user", "What is the weather in Berlin?")
        session.add("assistant", "", tool_calls=_call(2, "Berlin"))
        reply = session.send("What is the weather in Paris?")
        (unused0,) = gemma.tokenize("<unused0>", add_special=False, parse_special=True)
        assert reply.result.tokens[0] == unused0 and reply.result.text.startswith("<unused0>")
        assert reply.tool_calls[0].name == "get_weather" and reply.tool_calls[0].args() == {"city": "Paris"}
    finally:
        ctx.close()


def test_a_required_tool_call_grammar_starts_after_the_generation_prompt(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        session = ctx.chat(template=HERMES, tools=WEATHER, tool_choice="required", n_predict=6)
        assert session.prompt("What is the weather in Paris?").endswith("<|im_start|>assistant\n")
        reply = session.send("What is the weather in Paris?")
        # The grammar begins with "<|im_start|>assistant\n"; without its prefill it would make the model
        # write that again.
        assert reply.result.n_decoded == 6 and not reply.result.text.startswith("<|im_start|>")
    finally:
        ctx.close()


def test_a_grammar_prefill_is_accepted_before_the_first_token(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256)
    try:
        g = Grammar(gbnf='root ::= "Hello" " world" "!"', prefill="Hello")
        r = ctx.generate("Say hello:", n_predict=8, grammar=g)
        assert r.text == " world!" and r.stop_reason is StopReason.EOS
        # A branch's grammar takes a prefill the same way.
        branch_ctx = gemma.new_context(n_ctx=256)
        try:
            branch = branch_ctx.branch("Say hello:", grammar=g)
            assert "".join(t.text for t in branch.iterate(8)) == " world!"
        finally:
            branch_ctx.close()
        with pytest.raises(GrammarError, match="does not accept its prefill"):
            ctx.generate("Say hello:", n_predict=8, grammar=Grammar(gbnf='root ::= "Hi"', prefill="Bye"))
        with pytest.raises(GrammarError, match="end-of-generation"):
            ctx.generate("Say hello:", n_predict=8,
                         grammar=Grammar(gbnf='root ::= "Hi"', prefill="<end_of_turn>"))
        with pytest.raises(ValueError, match="not lazy"):
            Grammar(gbnf='root ::= "Hi"', lazy=True, trigger_words=["x"], prefill="Hi")
        assert ctx.generate("Say hello:", n_predict=2).n_decoded > 0  # still serving
    finally:
        ctx.close()


def test_a_session_refuses_what_cannot_work(tiny: Model) -> None:
    ctx: Context = tiny.new_context(n_ctx=256)
    try:
        with pytest.raises(ValueError, match="tool_choice"):
            ctx.chat(tool_choice="maybe")
        with pytest.raises(TypeError, match="unknown GenerateParams"):
            ctx.chat(n_tokens=3)
        # The tiny model's file has no template: a session falls back (issue 25), and one whose template
        # does not parse refuses its turn, which is not recorded.
        assert ctx.chat().fallback is not None
        session = ctx.chat(template="{% if %}")
        with pytest.raises(TemplateError):
            session.send("Hi")
        assert session.messages == []
        tools = ctx.chat(template=HERMES, tools=WEATHER, grammar='root ::= "x"')
        with pytest.raises(ValueError, match="tool-call grammar"):
            tools.send("Hi")
        ok = ctx.chat(template="chatml", n_predict=2)
        # A streamed turn that fails (the prompt does not fit) is not recorded, read or not.
        failed = ok.stream("word " * 300)
        assert ok.messages == []
        with pytest.raises(ContextOverflowError):
            failed.reply  # noqa: B018
        assert ok.send("Hi").result.n_decoded == 2 and len(ok.messages) == 2
        # params replaces the session's defaults for one turn; keyword overrides apply on top.
        assert ok.send("Hi", GenerateParams(n_predict=1)).result.n_decoded == 1
        assert ok.send("Hi", n_predict=3).result.n_decoded == 3 and len(ok.messages) == 6
    finally:
        ctx.close()
