"""The OpenAI-compatible endpoint (lloyal_pool.serve), served by uvicorn on localhost and spoken to with
the official ``openai`` package, as an application would."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from browser import Browser, find_chromium
from chatformats import HERMES, WEATHER
from invariance import INVARIANCE, LOGPROB_INVARIANCE, log_softmax, reference
from served import PATIENCE, TEMPLATE, Served, chat_with_the_serve_command

from lloyal_pool import Model, Pool, Result, StopReason
from lloyal_pool.batching import Batcher
from lloyal_pool.serve import schemas


@pytest.fixture(scope="module")
def spool(gemma_path: Path) -> Iterator[Pool]:
    with Pool(2) as pool:
        for inst in pool:
            inst.load_model(gemma_path).batcher(slots=8, n_ctx_slot=1024)
        yield pool


@pytest.fixture(scope="module")
def served(spool: Pool) -> Iterator[Served]:
    s = Served(spool)
    yield s
    s.close()


def stable_text(model: Model, tokens: list[int], n: int) -> str:
    """The greedy text after ``tokens`` (decoded alone) up to the first choice closer than INVARIANCE:
    what any batched run must reproduce."""
    out, margins = reference(model, tokens, n)
    return model.detokenize(out[:next((i for i, m in enumerate(margins) if m < INVARIANCE), len(out))])


def test_models_and_health(served: Served, spool: Pool) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [Path(spool[0].models[0].path).stem]
    health = httpx.get(served.url + "/health").json()
    assert health == {"status": "ok", "workers": 2, "workers_alive": 2}


def test_a_greedy_completion_is_generate(served: Served, spool: Pool) -> None:
    model = spool[0].models[0]
    prompt = "Count: 1, 2, 3,"
    want = stable_text(model, model.tokenize(prompt, add_special=True, parse_special=True), 12)
    assert len(want) >= 8  # the reference is stable far enough to compare
    got = served.client().completions.create(model="anything", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text.startswith(want)
    assert got.usage is not None and got.usage.completion_tokens == 12 and got.choices[0].finish_reason == "length"


def test_streamed_deltas_join_to_the_text(served: Served, spool: Pool) -> None:
    model = spool[0].models[0]
    prompt = "Count: 1, 2, 3,"
    want = stable_text(model, model.tokenize(prompt, add_special=True, parse_special=True), 12)
    pieces = [c.choices[0].text for c in served.client().completions.create(
        model="x", prompt=prompt, max_tokens=12, temperature=0, stream=True)]
    assert "".join(pieces).startswith(want) and len(pieces) > 2
    whole = served.client().completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text.startswith(want)


def test_a_greedy_chat_is_generate_on_the_formatted_conversation(served: Served, spool: Pool) -> None:
    model = spool[0].models[0]
    messages = [{"role": "user", "content": "Count from one to ten: one, two, three,"}]
    prompt = model.apply_chat_template(messages, template=TEMPLATE)
    tokens = model.tokenize(prompt, add_special=True, parse_special=True)
    if len(tokens) > 1 and tokens[0] == tokens[1]:
        tokens = tokens[1:]
    want = stable_text(model, tokens, 16)
    got = served.client().chat.completions.create(model="x", messages=messages,  # type: ignore[arg-type]
                                                   max_tokens=16, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert (got.choices[0].message.content or "").startswith(want)
    chunks = list(served.client().chat.completions.create(model="x", messages=messages,  # type: ignore[arg-type]
                                                          max_tokens=16, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith(want)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sixteen_concurrent_streaming_clients_all_complete(served: Served, spool: Pool) -> None:
    # End-of-generation tokens are banned: a sampled story may end early on some CPU's kernels, but then
    # every one runs to max_tokens on any. (Its text may still be empty: control tokens are left out.)
    no_end = {str(t): -100 for t in spool[0].models[0].info.eog_tokens}

    def one(i: int) -> tuple[str | None, int]:
        stream = served.client().completions.create(model="x", prompt=f"Story number {i}:", max_tokens=16,
                                                    temperature=0.8, seed=i, stream=True, logit_bias=no_end,
                                                    stream_options={"include_usage": True})
        finish, tokens = None, -1
        for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16)))
    assert results == [("length", 16)] * 16, results


def assert_cut_short(batchers: list[Batcher]) -> None:
    """Every slot comes free, and no request ran on until its slot was full: it was interrupted."""
    deadline = time.monotonic() + PATIENCE
    while any(b.active for b in batchers):
        assert time.monotonic() < deadline, "the slot was never freed"
        time.sleep(0.01)
    longest = max(len(s.tokens) for b in batchers for s in b._plan.slots)
    assert longest < batchers[0].n_ctx_slot // 2


def test_a_client_that_disconnects_frees_its_slot(served: Served, spool: Pool) -> None:
    batchers = [inst.models[0].batcher() for inst in spool]
    with httpx.stream("POST", served.url + "/v1/completions", timeout=PATIENCE,
                      json={"prompt": "Tell me a very long story.", "max_tokens": 0, "stream": True,
                            "logit_bias": {str(t): -100 for t in spool[0].models[0].info.eog_tokens}}) as resp:
        lines = resp.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
    # The response is closed: the server notices at its next piece and interrupts the generation.
    assert_cut_short(batchers)


def test_a_client_that_gives_up_on_a_plain_request_frees_its_slot(served: Served, spool: Pool) -> None:
    batchers = [inst.models[0].batcher() for inst in spool]
    with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and closes the connection
        httpx.post(served.url + "/v1/completions", timeout=1.5,
                   json={"prompt": "Tell me a very long story.", "max_tokens": 0, "ignore_eos": True})
    assert_cut_short(batchers)
    assert 'lloyal_client_disconnects_total 0' not in httpx.get(served.url + "/metrics").text


def test_response_format_json_schema_makes_json(served: Served) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    got = served.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "What is 2 + 2? Reply in JSON."}], temperature=0,
        max_tokens=48, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    data = json.loads(got.choices[0].message.content or "")
    assert set(data) == {"answer"} and isinstance(data["answer"], int)


def test_logit_bias_and_stop_apply(served: Served, spool: Pool) -> None:
    model = spool[0].models[0]
    four = model.tokenize("4", add_special=False)
    assert len(four) == 1  # digits are tokens of their own in Gemma's vocabulary
    plain = served.client().completions.create(model="x", prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0)
    assert "4" in plain.choices[0].text
    got = served.client().completions.create(model="x", prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0,
                                             logit_bias={str(four[0]): -100})
    assert "4" not in got.choices[0].text
    stopped = served.client().completions.create(model="x", prompt="Count: 1, 2, 3,", max_tokens=30,
                                                 temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text


def test_embeddings(served: Served, spool: Pool) -> None:
    got = served.client().embeddings.create(model="x", input=["a cat", "a dog", "a stock market"])
    vectors = [np.array(d.embedding) for d in got.data]
    assert len(vectors) == 3 and all(v.shape == (spool[0].models[0].info.n_embd,) for v in vectors)
    assert got.usage.prompt_tokens > 3
    # The same batch as floats: the same numbers (a batch of another size may round apart, by the CPU's kernels).
    as_floats = httpx.post(served.url + "/v1/embeddings", timeout=PATIENCE, json={
        "input": ["a cat", "a dog", "a stock market"], "encoding_format": "float"}).json()
    assert np.allclose([d["embedding"] for d in as_floats["data"]], vectors, atol=1e-6)
    alone = served.client().embeddings.create(model="x", input="a cat").data[0].embedding
    assert float(np.dot(alone, vectors[0])) > 0.999  # unit vectors: the same direction
    # An input is one ubatch of the embedding context (512 tokens); a longer one is refused whole, not cut.
    with pytest.raises(openai.BadRequestError, match="512") as err:
        served.client().embeddings.create(model="x", input=[[5] * 513])
    assert err.value.code == "context_length_exceeded"
    assert len(served.client().embeddings.create(model="x", input=[[5] * 512]).data) == 1


def test_errors_have_openai_shape_and_status(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="x", prompt="Hi", temperature=5)
    assert err.value.status_code == 400 and "temperature" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="n_ctx_slot") as err:
        client.completions.create(model="x", prompt=[5] * 2000, max_tokens=1)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="x", prompt=[10**9], max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[], max_tokens=1)
    raw = httpx.post(served.url + "/v1/completions", content=b"{not json")
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model="x", prompt="Hi", max_tokens=2).usage is not None  # serves on


def test_a_stream_that_asks_for_usage_ends_with_it_and_its_chunks_share_one_id(served: Served) -> None:
    client = served.client()
    completion = list(client.completions.create(model="x", prompt="Count: 1, 2, 3,", max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    chat = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
    for chunks in (completion, chat):
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 6
        assert last.usage.total_tokens == last.usage.prompt_tokens + 6 > 6
        assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
        assert len({(c.id, c.created) for c in chunks}) == 1
    plain = list(client.completions.create(model="x", prompt="Hi", max_tokens=2, stream=True))
    assert plain[-1].choices and plain[-1].choices[0].finish_reason == "length"  # no usage unless asked
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model="x", prompt="Hi", max_tokens=2, stream=True,
                                  extra_body={"stream_options": "yes"})


def test_a_stream_says_not_to_buffer_it(served: Served) -> None:
    with httpx.stream("POST", served.url + "/v1/completions", timeout=PATIENCE,
                      json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache" and resp.headers["x-accel-buffering"] == "no"
        assert list(resp.iter_lines())[-2:] == ["data: [DONE]", ""]


def test_an_error_the_worker_finds_is_a_400_or_in_a_stream_an_error_event_then_done(served: Served) -> None:
    # A token id past the vocabulary is found by the worker, once a stream's response has begun.
    with pytest.raises(openai.BadRequestError, match="999999999"):
        served.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, logit_bias={"999999999": 5})
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=PATIENCE,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True,
                            "logit_bias": {"999999999": 5}}) as resp:
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and "999999999" in error["message"], error


def test_an_error_after_a_stream_began_is_an_error_event_then_done(tiny_model: Path) -> None:
    with Pool(1) as pool:
        pool[0].load_model(tiny_model).batcher(slots=2, n_ctx_slot=512)
        served = Served(pool)
        try:
            with httpx.stream("POST", served.url + "/v1/completions", timeout=PATIENCE,
                              json={"prompt": "Hello", "max_tokens": 0, "ignore_eos": True, "stream": True}) as resp:
                assert resp.status_code == 200
                events: list[str] = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        if len(events) == 3:
                            os.kill(pool[0].pid, signal.SIGKILL)
        finally:
            served.close()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "SIGKILL" in error["message"], error


@pytest.mark.parametrize(("route", "field", "value"), [
    ("chat", "audio", {"voice": "alloy"}), ("completions", "suffix", "end"),
])
def test_what_the_server_cannot_give_is_refused_by_name(served: Served, route: str, field: str, value: object) -> None:
    # Ignored, these would answer without what was asked for (logprobs None where a client reads them).
    body: dict[str, object] = {"max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if route == "chat" else {"prompt": "Hi"})
    got = httpx.post(f"{served.url}/v1/{'chat/' if route == 'chat' else ''}completions", json=body, timeout=PATIENCE)
    assert got.status_code == 400 and got.json()["error"]["param"] == field, got.text
    quiet = {**body, field: None}  # null, as clients send what they leave unset, passes
    again = httpx.post(f"{served.url}/v1/{'chat/' if route == 'chat' else ''}completions", json=quiet, timeout=PATIENCE)
    assert again.status_code == 200, again.text


def test_echo_shows_the_prompt_and_its_tokens_log_probabilities(served: Served, spool: Pool) -> None:
    # What evaluation harnesses send to score a text: echo, logprobs, max_tokens 0. The prompt's tokens (the
    # BOS the server adds is not shown) against Context.score of the same tokens on a context of its own
    # (within the invariance bound), their text offsets into the echoed text, and then the reply's tokens.
    client = served.client()
    model = spool[0].models[0]
    text = "The capital of France is Paris, and the capital of Italy is"
    tokens = model.tokenize(text, add_special=True)
    ctx = model.new_context(n_ctx=256)
    try:
        want = ctx.score(tokens, logprobs=2).logprobs
    finally:
        ctx.close()
    assert want is not None
    scored = client.completions.create(model="x", prompt=text, echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == text and "".join(lp.tokens) == text and scored.usage.completion_tokens == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert len(lp.token_logprobs) == len(want) == len(tokens) - 1
    for got, top, w in zip(lp.token_logprobs, lp.top_logprobs, want, strict=True):
        assert got == pytest.approx(w.logprob, abs=LOGPROB_INVARIANCE) and len(top) <= 2
    # With a reply: the prompt, then its tokens, offsets running on; streamed, the prompt comes first.
    both = client.completions.create(model="x", prompt=text, echo=True, logprobs=1, max_tokens=4, temperature=0)
    lp = both.choices[0].logprobs
    assert both.choices[0].text.startswith(text) and len(lp.tokens) == len(tokens) - 1 + 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert "".join(lp.tokens) == both.choices[0].text
    parts = [c.choices[0] for c in client.completions.create(model="x", prompt=text, echo=True, max_tokens=4,
                                                                 temperature=0, stream=True)]
    assert parts[0].text == text and "".join(p.text for p in parts) == both.choices[0].text
    plain = client.completions.create(model="x", prompt=text, echo=True, max_tokens=2, temperature=0)
    assert plain.choices[0].text.startswith(text) and plain.choices[0].logprobs is None
    got = httpx.post(f"{served.url}/v1/completions", json={"prompt": "Hi", "echo": "yes"}, timeout=PATIENCE)
    assert got.status_code == 400 and got.json()["error"]["param"] == "echo"


def test_logprobs_in_chat_and_completions(served: Served, spool: Pool) -> None:
    client = served.client()
    chat = client.chat.completions.create(model="x", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                          messages=[{"role": "user", "content": "Name a colour."}])
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content or "")
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes or []).decode("utf-8", "replace") == t.token
        values = [a.logprob for a in t.top_logprobs]
        assert values == sorted(values, reverse=True) and t.logprob <= values[0] + 1e-6
    plain = client.chat.completions.create(model="x", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert plain.choices[0].logprobs is None
    # A completion's legacy shape, checked against the log-softmax of the prompt's next-token logits: the
    # first token's step is the prompt decoded alone, on a context of its own (within the invariance bound).
    model = spool[0].models[0]
    comp = client.completions.create(model="x", prompt="The capital of France is", max_tokens=4, temperature=0,
                                     logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0
    ctx = model.new_context(n_ctx=128)
    try:
        ctx.eval("The capital of France is")
        want = log_softmax(ctx.logits(copy=True))
    finally:
        ctx.close()
    first = model.tokenize(lp.tokens[0], add_special=False)
    assert len(first) == 1 and lp.token_logprobs[0] == pytest.approx(want[first[0]], abs=LOGPROB_INVARIANCE)
    # Streamed: each chunk carries the tokens handed out with its piece (the last, any held back), and
    # together they are the tokens of the same request unstreamed (both run alone, one after the other).
    ask = {"model": "x", "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2,
           "messages": [{"role": "user", "content": "Count to five."}]}
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed) >= 2
    assert [(t.token, t.logprob) for part in streamed for t in part] == [(t.token, t.logprob) for t in whole]
    parts = [c.choices[0] for c in client.completions.create(model="x", prompt="Count: 1, 2,", max_tokens=8,
                                                                 temperature=0, logprobs=1, stream=True)]
    tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
    offsets = [o for p in parts if p.logprobs for o in p.logprobs.text_offset]
    assert len([p for p in parts if p.logprobs]) >= 2 and len(tokens) == 8
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert "".join(tokens) == "".join(p.text for p in parts)
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}, {"logprobs": "yes"}):
        got = httpx.post(f"{served.url}/v1/chat/completions", timeout=PATIENCE,
                         json={"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], **bad})
        assert got.status_code == 400 and got.json()["error"]["param"] in ("logprobs", "top_logprobs"), got.text
    got = httpx.post(f"{served.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 21},
                     timeout=PATIENCE)
    assert got.status_code == 400 and got.json()["error"]["param"] == "logprobs"


def test_content_parts_other_than_text_are_refused_and_developer_is_the_system_prompt(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model="x", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    parts = client.chat.completions.create(model="x", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Count to three: "}, {"type": "text", "text": "one,"}]}])
    whole = client.chat.completions.create(model="x", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Count to three: one,"}])
    assert parts.choices[0].message.content == whole.choices[0].message.content
    question = {"role": "user", "content": "Who are you?"}
    as_system = client.chat.completions.create(model="x", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "You are a pirate."}, question])  # type: ignore[list-item]
    as_developer = client.chat.completions.create(model="x", max_tokens=12, temperature=0, messages=[
        {"role": "developer", "content": "You are a pirate."}, question])  # type: ignore[list-item]
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content


def test_top_p_zero_is_the_likeliest_token_and_any_integer_is_a_seed(served: Served) -> None:
    client = served.client()
    greedy = client.completions.create(model="x", prompt="Once upon a time", max_tokens=12, temperature=0)
    for seed in (1, 2):
        top = client.completions.create(model="x", prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                        top_p=0, seed=seed)
        assert top.choices[0].text == greedy.choices[0].text
    big = [client.completions.create(model="x", prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                     seed=seed).choices[0].text for seed in (-(2**40), -(2**40), 2**62)]
    assert big[0] == big[1]


def test_presence_and_frequency_penalties_apply(served: Served) -> None:
    client = served.client()
    prompt = "The cat sat on the mat. The cat sat on the mat."
    plain = client.completions.create(model="x", prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert plain.startswith(" The cat sat on the mat. The cat")  # the greedy continuation repeats
    for field in ("presence_penalty", "frequency_penalty"):
        penalised = client.completions.create(model="x", prompt=prompt, max_tokens=16, temperature=0,
                                              **{field: 2.0}).choices[0].text  # type: ignore[arg-type]
        assert penalised != plain, field
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model="x", prompt=prompt, max_tokens=1, **{field: 2.5})  # type: ignore[arg-type]


def test_unknown_routes_and_models_answer_in_openais_error_shape(served: Served, spool: Pool) -> None:
    missing = httpx.get(served.url + "/v1/no-such-route")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    wrong = httpx.get(served.url + "/v1/completions")
    assert wrong.status_code == 405 and "GET" in wrong.json()["error"]["message"]
    name = Path(spool[0].models[0].path).stem
    assert served.client().models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as err:
        served.client().models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found"


@pytest.fixture(scope="module")
def tool_served(spool: Pool) -> Iterator[Served]:
    s = Served(spool, chat_template=HERMES)
    yield s
    s.close()


def _weather_examples(question: str) -> list[dict[str, object]]:
    """Two worked calls, then the question: what a base model copies into a call of its own."""
    out: list[dict[str, object]] = []
    for i, city in enumerate(("Rome", "Berlin")):
        call = {"type": "function", "id": f"call_{i}",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        out += [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    return [*out, {"role": "user", "content": question}]


def test_streamed_tool_calls_have_their_index_and_a_cut_off_reply_says_length(tool_served: Served) -> None:
    # The base model copies the examples' calls until max_tokens: two calls of get_weather in 64 tokens.
    chunks = list(tool_served.client().chat.completions.create(
        model="x", messages=_weather_examples("What is the weather in Paris?"), tools=WEATHER,  # type: ignore[arg-type]
        max_tokens=64, temperature=0, stop=["<|im_end|>"], stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [(tc.index, tc.function.name) for tc in calls if tc.function] == [(0, "get_weather"), (1, "get_weather")]
    assert json.loads(calls[0].function.arguments or "") == {"city": "Paris"}  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "length"  # its last call's arguments may be cut short


def test_finish_reason_is_tool_calls_only_for_a_reply_that_ended_itself() -> None:
    def ended(reason: StopReason) -> Result:
        return Result(text="", tokens=[], n_prompt=1, n_decoded=1, n_cached=0, stop_reason=reason, prompt_ms=0,
                      decode_ms=0)

    assert schemas.finish_reason(ended(StopReason.EOS), tool_calls=True) == "tool_calls"
    assert schemas.finish_reason(ended(StopReason.STOP), tool_calls=True) == "tool_calls"
    assert schemas.finish_reason(ended(StopReason.LENGTH), tool_calls=True) == "length"
    assert schemas.finish_reason(ended(StopReason.EOS)) == "stop"


def test_a_named_tool_choice_calls_that_tool(tool_served: Served) -> None:
    time_tool = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string"}}, "required": ["city"]}}}
    client = tool_served.client()
    got = client.chat.completions.create(
        model="x", messages=_weather_examples("What is the weather in Paris?"),  # type: ignore[arg-type]
        tools=[*WEATHER, time_tool], tool_choice={"type": "function", "function": {"name": "get_time"}},  # type: ignore[list-item]
        max_tokens=40, temperature=0, stop=["<|im_end|>"])
    call = (got.choices[0].message.tool_calls or [])[0]
    assert call.function.name == "get_time" and "city" in json.loads(call.function.arguments)  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], tools=WEATHER,  # type: ignore[arg-type]
                                       tool_choice={"type": "function", "function": {"name": "get_stock"}})


def test_an_api_key_is_required_when_set(spool: Pool) -> None:
    s = Served(spool, api_key="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.client("sekrit").models.list().data
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key
    finally:
        s.close()


def test_metrics_count_requests_and_tokens(served: Served) -> None:
    served.client().completions.create(model="x", prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(served.url + "/metrics").text
    assert 'lloyal_requests_total{endpoint="completions"}' in text
    completion = next(line for line in text.splitlines() if line.startswith("lloyal_completion_tokens_total "))
    assert int(completion.split()[1]) >= 3
    assert 'lloyal_worker_alive{worker="' in text and "lloyal_slots_active" in text


def test_the_chat_page_is_served(served: Served) -> None:
    page = httpx.get(served.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/v1/chat/completions" in page.text and "<script" in page.text
    assert 'src="http' not in page.text and 'href="http' not in page.text  # no external assets


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_chat_page_streams_a_reply_in_a_browser(served: Served, tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:  # scripts/test installs it wherever it may run apt-get
        pytest.skip("no headless Chromium (Debian: apt-get install chromium-headless-shell)")
    browser = Browser(binary, width=900, height=900, timeout=PATIENCE)
    try:
        browser.navigate(served.url + "/")
        # Count the reply's updates as they land: more than one means the page showed it streaming.
        browser.evaluate("""window.updates = 0;
            new MutationObserver(() => { window.updates++; }).observe(document.getElementById("log"),
                {childList: true, characterData: true, subtree: true}); true""")
        browser.evaluate("""document.getElementById("input").value = "Name three colors.";
            document.getElementById("form").requestSubmit(); true""")
        browser.wait_for("document.querySelector('.msg.assistant[data-done], .msg.error') !== null")
        reply = browser.evaluate("""(() => { const m = document.querySelectorAll(".msg");
            return {user: m[0].textContent, cls: m[1].className, text: m[1].textContent, updates: window.updates,
                    bottom: m[1].getBoundingClientRect().bottom, sendable: !document.getElementById("send").disabled};
            })()""")
        shot = browser.screenshot()
    finally:
        browser.close()
    (tmp_path / "chat_page.png").write_bytes(shot)
    assert reply["cls"] == "msg assistant", reply["text"]
    assert reply["user"] == "Name three colors." and reply["text"].strip() and reply["sendable"]
    assert reply["updates"] >= 4  # the two bubbles, then the reply piece by piece
    assert png_size(shot) == (900, 900) and reply["bottom"] <= 900  # the reply is in the picture
    assert len(shot) > 5000  # text and colours, not a blank page


def test_a_chat_logit_bias_applies_to_chats_and_a_requests_own_bias_wins(spool: Pool, served: Served) -> None:
    # What `lloyal-pool serve` passes for a model without a template (the bias that ends a base model's
    # turns), shown with a bias no reply could miss.
    [banana] = spool[0].models[0].tokenize(" banana", add_special=False)
    s = Served(spool, chat_logit_bias={banana: 50.0})
    try:
        client = s.client()
        hi = [{"role": "user", "content": "Hi"}]
        biased = client.chat.completions.create(model="m", messages=hi, max_tokens=3, temperature=0)  # type: ignore[arg-type]
        assert biased.choices[0].message.content == " banana banana banana"
        own = client.chat.completions.create(model="m", messages=hi, max_tokens=3, temperature=0,  # type: ignore[arg-type]
                                             logit_bias={str(banana): -100})
        assert "banana" not in (own.choices[0].message.content or "")
        plain = client.completions.create(model="m", prompt="Hi", max_tokens=3, temperature=0)
        unbiased = served.client().completions.create(model="m", prompt="Hi", max_tokens=3, temperature=0)
        assert plain.choices[0].text == unbiased.choices[0].text  # chats only
    finally:
        s.close()


def test_the_serve_command(gemma_path: Path) -> None:
    err = chat_with_the_serve_command(["-m", str(gemma_path), "--workers", "1", "--slots", "2", "--n-ctx-slot", "512"])
    assert "has no chat template: chats use the gemma format, with +12 on <end_of_turn>" in err
    assert "on 1 worker(s)" in err


# -- several choices (n, best_of) and priority -------------------------------------------------------------
def no_end(spool: Pool) -> dict[str, int]:
    """A logit_bias that bans the model's end-of-generation tokens: every choice runs to max_tokens."""
    return {str(t): -100 for t in spool[0].models[0].info.eog_tokens}


def mean_logprob(values: list[float]) -> float:
    return sum(values) / len(values)


def test_a_chat_with_n_choices_returns_each_and_counts_their_tokens(served: Served, spool: Pool) -> None:
    client = served.client()
    ask = [{"role": "user", "content": "Write a line about the sea."}]
    kw = dict(model="x", messages=ask, max_tokens=8, temperature=0.8, seed=42, logit_bias=no_end(spool))
    got = client.chat.completions.create(n=3, **kw)  # type: ignore[call-overload]
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in got.choices)
    texts = [c.message.content for c in got.choices]
    assert len(set(texts)) > 1  # seeds 42, 43, 44: choices of their own
    one = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert got.usage is not None and one.usage is not None
    assert got.usage.completion_tokens == 3 * 8 and got.usage.prompt_tokens == one.usage.prompt_tokens  # once
    assert got.usage.total_tokens == got.usage.prompt_tokens + 24
    assert one.choices[0].message.content == texts[0]  # choice 0 draws with the request's own seed
    again = client.chat.completions.create(n=3, **kw)  # type: ignore[call-overload]
    assert [c.message.content for c in again.choices] == texts  # seeded: the same call replays them


def test_streamed_choices_carry_their_index_and_join_to_the_plain_replys(served: Served, spool: Pool) -> None:
    client = served.client()
    kw = dict(model="x", prompt="Once upon a time", max_tokens=10, temperature=0.8, seed=7, n=2,
              logit_bias=no_end(spool))
    plain = client.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in plain.choices] == [0, 1] and plain.usage is not None
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},  # type: ignore[call-overload]
                                            **kw))
    texts, finished = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert choice.index in (0, 1) and choice.index not in finished  # nothing after a choice's last chunk
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert [texts[0], texts[1]] == [c.text for c in plain.choices]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 20
    assert usage.usage.prompt_tokens == plain.usage.prompt_tokens
    # A chat, raw: each choice opens with its role and ends with its finish_reason; [DONE] once, at the end.
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=PATIENCE, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 3, "stream": True,
            "logit_bias": no_end(spool), "stream_options": {"include_usage": True}}) as resp:
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    data = [json.loads(e) for e in events[:-1]]
    assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == 12
    parts = [c for d in data[:-1] for c in d["choices"]]
    for i in range(3):
        mine = [c for c in parts if c["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in mine[:-1])


def test_best_of_returns_the_candidate_with_the_highest_mean_logprob(served: Served, spool: Pool) -> None:
    client = served.client()
    kw = dict(model="x", prompt="The weather today is", max_tokens=8, temperature=0.9, seed=3, logprobs=1,
              logit_bias=no_end(spool))
    every = client.completions.create(n=3, **kw)  # type: ignore[call-overload]
    means = [mean_logprob(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(best_of=3, **kw)  # type: ignore[call-overload]
    (choice,) = best.choices
    assert choice.index == 0 and choice.text == every.choices[means.index(max(means))].text
    assert mean_logprob(choice.logprobs.token_logprobs) == pytest.approx(max(means), abs=1e-3)
    assert best.usage is not None and best.usage.completion_tokens == 3 * 8  # every candidate was generated
    quiet = client.completions.create(**{**kw, "logprobs": None}, best_of=3)  # type: ignore[call-overload]
    assert quiet.choices[0].logprobs is None and quiet.choices[0].text == choice.text  # ranked all the same


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("completions", {"n": 9}, "n"),  # the spool's batchers have 8 slots
    ("chat", {"n": 9}, "n"),
    ("completions", {"n": 0}, "n"),
    ("chat", {"n": "2"}, "n"),
    ("completions", {"n": 2, "best_of": 1}, "best_of"),
    ("completions", {"best_of": 9}, "best_of"),
    ("completions", {"best_of": 2, "stream": True}, "best_of"),
    ("chat", {"priority": "high"}, "priority"),
    ("completions", {"priority": 1.5}, "priority"),
])
def test_bad_choices_and_priorities_are_refused_in_openais_shape(served: Served, route: str,
                                                                  fields: dict[str, object], param: str) -> None:
    body: dict[str, object] = {"max_tokens": 2, **fields}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if route == "chat" else {"prompt": "Hi"})
    url = f"{served.url}/v1/{'chat/' if route == 'chat' else ''}completions"
    got = httpx.post(url, json=body, timeout=PATIENCE)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"], error
    fine = {k: v for k, v in body.items() if k not in fields}
    assert httpx.post(url, json={**fine, "priority": -1}, timeout=PATIENCE).status_code == 200  # it serves on


def test_the_openai_client_reads_n_and_best_of_errors(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(model="x", prompt="Hi", max_tokens=2, n=9)
    assert err.value.status_code == 400 and err.value.param == "n"
    got = served.client().completions.create(model="x", prompt="Hi", max_tokens=2, n=8, best_of=8)
    assert len(got.choices) == 8  # as many as a worker's slots


def test_a_client_that_disconnects_from_several_streamed_choices_frees_their_slots(served: Served,
                                                                                    spool: Pool) -> None:
    batchers = [inst.models[0].batcher() for inst in spool]
    with httpx.stream("POST", served.url + "/v1/completions", timeout=PATIENCE,
                      json={"prompt": "Tell me a very long story.", "max_tokens": 0, "stream": True, "n": 3,
                            "logit_bias": no_end(spool)}) as resp:
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 6:
                    break
    assert_cut_short(batchers)  # every choice interrupted


def test_langchain_chat_openai_with_n_gets_n_generations(served: Served) -> None:
    import langchain_openai
    from langchain_core.messages import HumanMessage

    llm = langchain_openai.ChatOpenAI(base_url=served.url + "/v1", api_key="x", model="gemma",  # type: ignore[arg-type,call-arg]
                                      temperature=0.8, n=2, max_tokens=6, max_retries=0, timeout=PATIENCE)
    out = llm.generate([[HumanMessage("Name a fruit.")]])
    assert len(out.generations) == 1 and len(out.generations[0]) == 2
    assert all(isinstance(g.text, str) for g in out.generations[0])
