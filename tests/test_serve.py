"""The OpenAI-compatible endpoint (lloyal_pool.serve), served by uvicorn on localhost and spoken to with
the official ``openai`` package, as an application would."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from browser import Browser, find_chromium
from served import PATIENCE, TEMPLATE, Served, chat_with_the_serve_command

from lloyal_pool import Model, Pool
from lloyal_pool.batching import Batcher

INVARIANCE = 1.0  # see test_batching: batched greedy tokens equal the reference's while its margins exceed this


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
    ctx = model.new_context(n_ctx=1024)
    try:
        branch = ctx.branch(tokens)
        out: list[int] = []
        for _ in range(n):
            top2 = np.sort(branch.logits)[-2:]
            if top2[1] - top2[0] < INVARIANCE:
                break
            produced = branch.step()
            if produced.is_stop:
                break
            out.append(produced.token)
        return model.detokenize(out)
    finally:
        ctx.close()


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


def test_sixteen_concurrent_streaming_clients_all_complete(served: Served) -> None:
    def one(i: int) -> tuple[str, str | None]:
        stream = served.client().completions.create(model="x", prompt=f"Story number {i}:", max_tokens=16,
                                                    temperature=0.8, seed=i, stream=True)
        text, finish = "", None
        for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16)))
    assert all(finish == "length" and text for text, finish in results)


def assert_cut_short(batchers: list[Batcher]) -> None:
    """Every slot comes free, and no request ran on until its slot was full: it was interrupted."""
    deadline = time.monotonic() + PATIENCE
    while any(b.active for b in batchers):
        assert time.monotonic() < deadline, "the slot was never freed"
        time.sleep(0.01)
    longest = max(len(s.tokens) for b in batchers for s in b._slots)
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
    as_floats = httpx.post(served.url + "/v1/embeddings", json={"input": "a cat", "encoding_format": "float"}).json()
    assert np.allclose(as_floats["data"][0]["embedding"], vectors[0], atol=1e-6)


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


def test_the_serve_command(gemma_path: Path) -> None:
    err = chat_with_the_serve_command(["-m", str(gemma_path), "--workers", "1", "--slots", "2", "--n-ctx-slot", "512"])
    assert "has no chat template: chats use the gemma format" in err and "on 1 worker(s)" in err
