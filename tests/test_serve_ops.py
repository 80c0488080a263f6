"""The endpoint's operational side (lloyal_pool.serve): llama-server's /tokenize, /detokenize,
/apply-template and /props, the server-wide default cap on a reply (max_tokens), and what /metrics counts
(latency histograms, KV cells, clients that leave a stream). Structure and counts only: never the words
the model wrote, never a timing bound."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from served import PATIENCE, TEMPLATE, Served

from lloyal_pool import Model, Pool
from lloyal_pool.chat import CHAT_FORMATS
from lloyal_pool.cli import _max_tokens, build_parser
from lloyal_pool.serve import create_app, schemas

SLOTS, N_CTX_SLOT = 4, 1024
HISTOGRAMS = ("lloyal_time_to_first_token_seconds", "lloyal_inter_token_latency_seconds", "lloyal_queue_seconds")


@pytest.fixture(scope="module")
def opool(gemma_path: Path) -> Iterator[Pool]:
    with Pool(1) as pool:
        pool[0].load_model(gemma_path).batcher(slots=SLOTS, n_ctx_slot=N_CTX_SLOT)
        yield pool


@pytest.fixture(scope="module")
def served(opool: Pool) -> Iterator[Served]:
    s = Served(opool)
    yield s
    s.close()


@pytest.fixture(scope="module")
def capped(opool: Pool) -> Iterator[Served]:
    s = Served(opool, max_tokens=8)
    yield s
    s.close()


def gemma(pool: Pool) -> Model:
    return pool[0].models[0]


def no_end(model: Model) -> dict[str, int]:
    """A logit bias that bans every end-of-generation token, and every token a reply's text leaves out: a
    reply then runs to its max_tokens, and has text (a first piece) whatever the model makes of it."""
    return {str(t): -100 for t in {*model.info.eog_tokens, *model.info.hidden_tokens}}


def post(served: Served, route: str, body: object) -> httpx.Response:
    return httpx.post(served.url + route, json=body, timeout=PATIENCE)


def assert_refused(resp: httpx.Response, param: str | None) -> None:
    """A 400 in OpenAI's error shape, naming ``param``."""
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"], error


def samples(served: Served) -> dict[str, float]:
    """/metrics as {name{labels}: value}."""
    text = httpx.get(served.url + "/metrics", timeout=PATIENCE).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# -- /tokenize and /detokenize ----------------------------------------------------------------------------------
def test_tokenize_and_detokenize_are_the_models_tokenizer(served: Served, opool: Pool) -> None:
    model = gemma(opool)
    text = "Hello world, á 🦙"
    plain = post(served, "/tokenize", {"content": text}).json()
    assert plain == {"tokens": model.tokenize(text, add_special=False, parse_special=True)}
    assert model.info.add_bos  # Gemma's tokenizer adds a BOS: add_special asks for it
    special = post(served, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    assert special == [model.info.bos, *plain["tokens"]]
    pieces = post(served, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain["tokens"] and all(set(p) == {"id", "piece"} for p in pieces)
    # A piece is text, or a list of bytes where the token holds part of a character: together, the text.
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == text
    assert post(served, "/detokenize", {"tokens": plain["tokens"]}).json() == {"content": text}
    assert post(served, "/detokenize", {"tokens": []}).json() == {"content": ""}
    assert post(served, "/tokenize", {"content": ""}).json() == {"tokens": []}
    assert post(served, "/tokenize", {"content": text, "add_special": None, "with_pieces": None}).json() == plain
    # Control-token text is those tokens unless parse_special is false; detokenize writes them out.
    marker = "<start_of_turn>user"
    parsed = post(served, "/tokenize", {"content": marker}).json()["tokens"]
    literal = post(served, "/tokenize", {"content": marker, "parse_special": False}).json()["tokens"]
    assert len(parsed) < len(literal)
    assert post(served, "/detokenize", {"tokens": parsed}).json() == {"content": marker}


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": ["Hi"]}, "content"),
    ("/tokenize", {"content": "Hi", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "Hi", "add_special": 1}, "add_special"),
    ("/tokenize", {"content": "Hi", "parse_special": "no"}, "parse_special"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/tokenize", [1, 2], None),
    ("/detokenize", "tokens", None),
])
def test_tokenize_and_detokenize_refuse_bad_input(served: Served, route: str, body: object,
                                                  param: str | None) -> None:
    assert_refused(post(served, route, body), param)
    assert post(served, "/tokenize", {"content": "Hi"}).json()["tokens"]  # serves on


def test_a_body_that_is_not_json_and_a_wrong_method_are_refused(served: Served) -> None:
    for route in ("/tokenize", "/detokenize", "/apply-template"):
        assert_refused(httpx.post(served.url + route, content=b"{not json", timeout=PATIENCE), None)
        wrong = httpx.get(served.url + route, timeout=PATIENCE)
        assert wrong.status_code == 405 and "GET" in wrong.json()["error"]["message"]
    wrong = httpx.post(served.url + "/props", json={}, timeout=PATIENCE)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


# -- /apply-template ---------------------------------------------------------------------------------------------
def test_apply_template_is_the_prompt_a_chat_generates_from(served: Served, opool: Pool) -> None:
    model = gemma(opool)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = post(served, "/apply-template", {"messages": messages}).json()["prompt"]
    # The served file has no chat template: the server's format (here "gemma", as the fallback would be).
    assert prompt == model.apply_chat_template(messages, template=TEMPLATE)
    assert "Name a colour." in prompt and "Be brief." in prompt
    # The chat's prompt tokens are this prompt's, as the batcher tokenizes a prompt (one BOS).
    tokens = model.tokenize(prompt, add_special=True, parse_special=True)
    if len(tokens) > 1 and tokens[0] == tokens[1] == model.info.bos:
        tokens = tokens[1:]
    chat = served.client().chat.completions.create(model="x", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(tokens)
    # Content parts and the developer role, as a chat takes them.
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    assert post(served, "/apply-template", {"messages": parts}).json() == {"prompt": prompt}


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": [{"content": "Hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": "get_weather"}, "tools"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_apply_template_refuses_bad_input(served: Served, body: dict[str, object], param: str) -> None:
    assert_refused(post(served, "/apply-template", body), param)
    ok = post(served, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]})
    assert ok.status_code == 200 and ok.json()["prompt"]  # serves on


# -- /props ------------------------------------------------------------------------------------------------------
def test_props(served: Served, capped: Served, opool: Pool) -> None:
    model = gemma(opool)
    props = httpx.get(served.url + "/props", timeout=PATIENCE).json()
    assert props["total_slots"] == SLOTS and props["default_generation_settings"]["n_ctx"] == N_CTX_SLOT
    assert props["model_path"] == model.path and props["model_alias"] == Path(model.path).stem
    assert props["model_alias"] == served.client().models.list().data[0].id
    # The file has no template of its own: the format the server was given, by name and as Jinja source.
    assert model.info.chat_template is None
    assert props["chat_format"] == TEMPLATE and props["chat_template"] == CHAT_FORMATS[TEMPLATE]
    assert props["chat_template_origin"] == "server" and props["chat_logit_bias"] == {}
    params = props["default_generation_settings"]["params"]
    assert params["max_tokens"] == params["n_predict"] == schemas.DEFAULT_MAX_TOKENS
    assert params["completion_max_tokens"] == schemas.COMPLETION_MAX_TOKENS
    assert params["temperature"] == schemas.DEFAULT_TEMPERATURE and params["seed"] is None
    assert isinstance(props["build_info"], str) and props["build_info"]
    assert props["build_info"] == opool[0].build_info["build_info"]
    assert isinstance(props["lloyal_pool_version"], str) and props["modalities"] == {"vision": False, "audio": False}
    assert isinstance(props["bos_token"], str) and isinstance(props["eos_token"], str)
    capped_params = httpx.get(capped.url + "/props", timeout=PATIENCE).json()["default_generation_settings"]["params"]
    assert capped_params["max_tokens"] == 8 and capped_params["completion_max_tokens"] == 8


def test_the_operational_routes_need_the_api_key(opool: Pool) -> None:
    s = Served(opool, api_key="sekrit")
    try:
        for method, route, body in (("GET", "/props", None), ("POST", "/tokenize", {"content": "Hi"}),
                                    ("POST", "/detokenize", {"tokens": [1]}),
                                    ("POST", "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]})):
            refused = httpx.request(method, s.url + route, json=body, timeout=PATIENCE)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            allowed = httpx.request(method, s.url + route, json=body, timeout=PATIENCE,
                                    headers={"Authorization": "Bearer sekrit"})
            assert allowed.status_code == 200, allowed.text
    finally:
        s.close()


# -- the default cap -------------------------------------------------------------------------------------------
def test_a_chat_without_max_tokens_is_capped_by_the_server(capped: Served, opool: Pool) -> None:
    bias = no_end(gemma(opool))
    client = capped.client()
    hi = [{"role": "user", "content": "Tell me a long story."}]
    chat = client.chat.completions.create(model="x", messages=hi, temperature=0, logit_bias=bias)  # type: ignore[arg-type]
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="x", messages=hi, temperature=0, logit_bias=bias,  # type: ignore[call-overload]
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    # A completion's default is OpenAI's 16, or the cap where that is smaller.
    completion = client.completions.create(model="x", prompt="Once upon a time", logit_bias=bias)
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert completion.choices[0].finish_reason == "length"
    # The cap is a default: a request's own max_tokens (max_completion_tokens) goes past it.
    own = client.chat.completions.create(model="x", messages=hi, temperature=0, logit_bias=bias,  # type: ignore[arg-type]
                                         max_completion_tokens=12)
    assert own.usage is not None and own.usage.completion_tokens == 12 and own.choices[0].finish_reason == "length"


def test_the_default_cap_and_the_serve_option(served: Served, opool: Pool) -> None:
    bias = no_end(gemma(opool))
    completion = served.client().completions.create(model="x", prompt="Once upon a time", logit_bias=bias)
    assert completion.usage is not None and completion.usage.completion_tokens == schemas.COMPLETION_MAX_TOKENS
    assert schemas.default_max_tokens(schemas.DEFAULT_MAX_TOKENS, chat=True) == schemas.DEFAULT_MAX_TOKENS
    assert schemas.default_max_tokens(0, chat=True) == 0  # no cap but the slot's room
    assert schemas.default_max_tokens(0, chat=False) == schemas.COMPLETION_MAX_TOKENS
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_tokens"):
            create_app(opool, max_tokens=bad)  # type: ignore[arg-type]
    assert _max_tokens(build_parser().parse_args(["serve", "--max-tokens", "64"])) == {"max_tokens": 64}
    assert _max_tokens(build_parser().parse_args(["serve"])) == {}  # create_app's default
    with pytest.raises(SystemExit, match="--max-tokens"):
        _max_tokens(build_parser().parse_args(["serve", "--max-tokens", "-5"]))


# -- /metrics --------------------------------------------------------------------------------------------------
def wait_for_disconnects(served: Served, before: dict[str, float]) -> dict[str, float]:
    """/metrics once it has counted one more client that left (the request ends at its next step)."""
    deadline = time.monotonic() + PATIENCE
    while True:
        now = samples(served)
        if now["lloyal_client_disconnects_total"] > before["lloyal_client_disconnects_total"]:
            return now
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_stream_the_client_closes_is_a_disconnect_with_its_tokens(served: Served, opool: Pool, route: str) -> None:
    before = samples(served)
    body: dict[str, object] = {"max_tokens": 0, "stream": True, "logit_bias": no_end(gemma(opool))}
    body.update({"messages": [{"role": "user", "content": "Tell me a very long story."}]} if route != "completions"
                else {"prompt": "Tell me a very long story."})
    got = 0
    with httpx.stream("POST", f"{served.url}/v1/{route}", json=body, timeout=PATIENCE) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and json.loads(line.removeprefix("data: "))["choices"]:
                got += 1
                if got == 4:  # the chat's first chunk is its role alone: three or four pieces came
                    break
    after = wait_for_disconnects(served, before)
    assert after["lloyal_client_disconnects_total"] == before["lloyal_client_disconnects_total"] + 1
    left = after["lloyal_client_disconnect_tokens_total"] - before["lloyal_client_disconnect_tokens_total"]
    assert left >= 3  # every piece the client read is at least one token
    assert after["lloyal_completion_tokens_total"] - before["lloyal_completion_tokens_total"] == left
    assert after["lloyal_prompt_tokens_total"] > before["lloyal_prompt_tokens_total"]


def test_a_plain_request_whose_client_leaves_is_a_disconnect_with_its_tokens(served: Served) -> None:
    before = samples(served)
    with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and closes the connection
        httpx.post(served.url + "/v1/completions", timeout=1.5,
                   json={"prompt": "Tell me a very long story.", "max_tokens": 0, "ignore_eos": True})
    after = wait_for_disconnects(served, before)
    assert after["lloyal_client_disconnects_total"] == before["lloyal_client_disconnects_total"] + 1
    left = after["lloyal_client_disconnect_tokens_total"] - before["lloyal_client_disconnect_tokens_total"]
    assert after["lloyal_completion_tokens_total"] - before["lloyal_completion_tokens_total"] == left


def histogram(text: str, name: str) -> tuple[list[tuple[str, int]], float, int]:
    """A histogram's buckets (le, cumulative count), sum and count, checking its shape on the way."""
    lines = text.splitlines()
    assert f"# TYPE {name} histogram" in lines
    buckets = [(line.split('le="')[1].split('"')[0], int(line.rsplit(" ", 1)[1]))
               for line in lines if line.startswith(name + "_bucket{")]
    total = next(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "_sum "))
    count = next(int(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "_count "))
    return buckets, total, count


def test_latency_histograms_count_each_request_that_generated(served: Served, opool: Pool) -> None:
    bias = no_end(gemma(opool))
    text = httpx.get(served.url + "/metrics", timeout=PATIENCE).text
    counts = {name: histogram(text, name)[2] for name in HISTOGRAMS}
    client = served.client()
    client.completions.create(model="x", prompt="Count: 1, 2, 3,", max_tokens=4, logit_bias=bias)
    list(client.completions.create(model="x", prompt="Count: 1, 2, 3,", max_tokens=4, logit_bias=bias, stream=True))
    client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                   logit_bias=bias)
    list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        logit_bias=bias, stream=True))
    # A request that generates nothing (refused before it ran) is not a latency.
    assert post(served, "/v1/completions", {"prompt": "Hi", "temperature": 5}).status_code == 400
    text = httpx.get(served.url + "/metrics", timeout=PATIENCE).text
    for name in HISTOGRAMS:
        buckets, total, count = histogram(text, name)
        assert count == counts[name] + 4, name  # each request is counted once, when it ends
        assert buckets[-1] == ("+Inf", count) and total >= 0
        cumulative = [n for _, n in buckets]
        assert cumulative == sorted(cumulative)  # cumulative, as Prometheus reads them
        bounds = [float(le) for le, _ in buckets[:-1]]
        assert bounds == sorted(bounds) and len(bounds) >= 10


def test_kv_cells_per_worker(served: Served, opool: Pool) -> None:
    served.client().completions.create(model="x", prompt="Count: 1, 2, 3,", max_tokens=2)
    now = samples(served)
    worker = str(opool[0].worker_id)
    total = now[f'lloyal_kv_cells_total{{worker="{worker}"}}']
    used = now[f'lloyal_kv_cells_used{{worker="{worker}"}}']
    assert total == SLOTS * N_CTX_SLOT
    assert 0 < used <= total  # the slots keep what their last requests held, for the next prompt
