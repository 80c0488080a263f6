"""Per-request LoRA at the endpoint (create_app's ``lora``, ``lloyal-pool serve --lora``): a request's
``model`` names an adapter, or llama-server's ``lora`` field lists adapters by id with scales; /v1/models
lists the adapters and GET /lora-adapters shows them as llama-server does. On Gemma 3 270M with two random
adapters (tests/loras.py), served from a pool of two workers by uvicorn and spoken to with the official
``openai`` package. Each reply's log-probabilities are checked, step by step, against a context that runs
the request's adapters alone (teacher-forced on the reply's tokens), within the batch invariance
tests/invariance.py describes."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from invariance import INVARIANCE, LOGPROB_INVARIANCE, log_softmax
from loras import attention_shapes, write_lora
from served import Served, chat_with_the_serve_command

from lloyal_pool import Context, LoraError, Model, Pool, cli
from lloyal_pool.serve import create_app

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "My favourite colour is",
           "The three primary colours are", "Once upon a time, in a small village,", "The best way to learn is"]


@pytest.fixture(scope="module")
def lpool(gemma_path: Path) -> Iterator[Pool]:
    with Pool(2) as pool:
        for inst in pool:
            inst.load_model(gemma_path).batcher(slots=8, n_ctx_slot=512)
        yield pool


@pytest.fixture(scope="module")
def adapters(lpool: Pool, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two random adapters on q and v of Gemma's first six layers. Smaller than tests/test_batched_lora.py's
    (std 0.6, not 2): under adapters that large the model is so sensitive that the CPU kernels' rounding,
    which differs with a decode's shape (its other sequences, a prompt split in two), moves a top token's
    log-probability by up to 3 (measured), past the invariance bound; at 0.6 by at most 1.01 (measured over
    the x64-to-zen4 kernel levels, 3 runs each of the concurrent test), while the first step still moves by
    9 or more from the base model's."""
    d = tmp_path_factory.mktemp("serve-lora")
    shapes = attention_shapes(lpool[0].models[0].info, range(6))
    return [write_lora(d / f"{name}.gguf", "gemma3", shapes, rank=8, seed=seed, std=0.6)
            for name, seed in (("style-a", 11), ("style-b", 12))]


@pytest.fixture(scope="module")
def served(lpool: Pool, adapters: list[Path]) -> Iterator[Served]:
    """The endpoint with adapter 0 named by its file's stem (style-a) and adapter 1 named terse."""
    s = Served(lpool, lora=[adapters[0], ("terse", adapters[1])])
    yield s
    s.close()


@pytest.fixture(scope="module")
def alone(lpool: Pool) -> Iterator[Context]:
    ctx = lpool[0].models[0].new_context(n_ctx=512)
    yield ctx
    ctx.close()


class Reference:
    """Teacher-forced log-probabilities of worker 0's model on a context of its own, under one adapter
    configuration, for a completion's legacy logprobs (which carry token texts, not ids)."""

    def __init__(self, model: Model, ctx: Context) -> None:
        self.model, self.ctx = model, ctx
        self._pieces: dict[int, str] = {}

    def piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self.model.token_to_piece(token).decode("utf-8", "replace")
        return self._pieces[token]

    def check(self, config: Mapping[Path, float], prompt: str | list[int], logprobs: Any) -> np.ndarray:
        """Every step of a greedy completion's ``logprobs`` equals the reference's within LOGPROB_INVARIANCE:
        its token's log-probability and each of its top alternatives. Each step's token is the one of the
        returned text among those the reference puts within 2 x INVARIANCE of its best (what a greedy step
        whose logits moved by at most INVARIANCE can take); the next step is decoded after it. Returns the
        first step's reference log-probabilities."""
        tokens = self.model.batcher().tokens(prompt)
        assert logprobs is not None and len(logprobs.tokens) > 0
        self.ctx.set_lora([(self.model.lora(str(path)), scale) for path, scale in config.items()])
        self.ctx.decode(tokens, 0, 0)
        first: np.ndarray | None = None
        try:
            for i, (text, value, top) in enumerate(zip(logprobs.tokens, logprobs.token_logprobs,
                                                       logprobs.top_logprobs, strict=True)):
                z = self.ctx.logits(copy=True)
                want = log_softmax(z)
                first = want if first is None else first
                near = [int(t) for t in np.flatnonzero(z >= z.max() - 2 * INVARIANCE)]
                chosen = [t for t in near if self.piece(t) == text]
                assert chosen, (i, text, [self.piece(t) for t in near])
                token = max(chosen, key=lambda t: z[t])
                assert value == pytest.approx(want[token], abs=LOGPROB_INVARIANCE), (i, text)
                for alt, v in top.items():  # an alternative's text, at a reference token close in value
                    close = np.flatnonzero(np.abs(want - v) <= LOGPROB_INVARIANCE)
                    assert any(self.piece(int(t)) == alt for t in close), (i, alt, v, prompt, dict(config))
                self.ctx.decode([token], len(tokens) + i, 0)
        finally:
            self.ctx.reset()
        assert first is not None
        return first


@pytest.fixture(scope="module")
def ref(lpool: Pool, alone: Context) -> Reference:
    return Reference(lpool[0].models[0], alone)


def base_name(served: Served) -> str:
    """The served model's name: with adapters served, a request's model must be it or an adapter's."""
    name: str = served.app.state.server.model_name
    return name


def complete(served: Served, prompt: str | list[int], **fields: Any) -> Any:
    """A greedy completion of 8 tokens with 5 alternatives per step, on the base model unless ``fields``
    say otherwise."""
    return served.client().completions.create(prompt=prompt, max_tokens=8, temperature=0, logprobs=5,
                                              **{"model": base_name(served), **fields})


def moved(a: Any, b: Any) -> float:
    """How far apart two greedy completions' logprobs are: infinite where their tokens differ, else the
    largest difference of a token's log-probability or of an alternative both list at a step."""
    if a.tokens != b.tokens:
        return math.inf
    return max(max(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs, strict=True)),
               max((abs(ta[k] - tb[k]) for ta, tb in zip(a.top_logprobs, b.top_logprobs, strict=True)
                    for k in ta.keys() & tb.keys()), default=0.0))


def test_a_model_that_names_an_adapter_runs_it(served: Served, ref: Reference, adapters: list[Path],
                                               lpool: Pool) -> None:
    base = base_name(served)
    for prompt in (PROMPTS[0], lpool[0].models[0].tokenize(PROMPTS[1])):  # text, and token ids
        styled = complete(served, prompt, model="style-a")
        assert styled.model == "style-a"
        styled_first = ref.check({adapters[0]: 1.0}, prompt, styled.choices[0].logprobs)
        plain = complete(served, prompt)
        assert plain.model == base
        base_first = ref.check({}, prompt, plain.choices[0].logprobs)
        # The adapter matters (the checks above would pass on an adapter ignored otherwise): the reply
        # differs from the base model's (its text, or the same tokens at log-probabilities well apart),
        # and its first step moves by far more than the invariance bound.
        assert moved(styled.choices[0].logprobs, plain.choices[0].logprobs) > 2 * INVARIANCE
        assert np.abs(styled_first - base_first).max() > 5 * INVARIANCE


def test_the_lora_field_runs_adapters_by_id(served: Served, ref: Reference, adapters: list[Path]) -> None:
    by_id = complete(served, PROMPTS[2], extra_body={"lora": [{"id": 1, "scale": 1.0}]})
    ref.check({adapters[1]: 1.0}, PROMPTS[2], by_id.choices[0].logprobs)
    by_name = complete(served, PROMPTS[2], model="terse")
    assert by_name.choices[0].text == by_id.choices[0].text
    # Both fields: the model's adapter and the list's; the list's entry wins for the same adapter.
    both = complete(served, PROMPTS[3], model="style-a", extra_body={"lora": [{"id": 1, "scale": 0.5}]})
    ref.check({adapters[0]: 1.0, adapters[1]: 0.5}, PROMPTS[3], both.choices[0].logprobs)
    overridden = complete(served, PROMPTS[3], model="style-a",
                          extra_body={"lora": [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0}]})
    ref.check({adapters[0]: 0.5}, PROMPTS[3], overridden.choices[0].logprobs)
    # An adapter at scale 0 is not applied: the base model.
    zero = complete(served, PROMPTS[3], extra_body={"lora": [{"id": 0, "scale": 0}]})
    ref.check({}, PROMPTS[3], zero.choices[0].logprobs)


def test_a_chat_runs_its_adapter(served: Served) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    client = served.client()
    base = client.chat.completions.create(model=base_name(served), messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                          temperature=0)
    styled = client.chat.completions.create(model="style-a", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=8, temperature=0)
    assert styled.model == "style-a"
    assert styled.choices[0].message.content != base.choices[0].message.content
    streamed = client.chat.completions.create(model="style-a", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=8, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == styled.choices[0].message.content
    assert {c.model for c in chunks} == {"style-a"}
    # No model at all (as the chat page at / sends): the base model.
    unnamed = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 8, "temperature": 0}).json()
    assert unnamed["model"] == base_name(served)
    assert unnamed["choices"][0]["message"]["content"] == base.choices[0].message.content


def test_concurrent_requests_on_different_adapters_each_run_as_alone(served: Served, ref: Reference,
                                                                     adapters: list[Path]) -> None:
    cases: list[tuple[str, dict[str, Any], dict[Path, float]]] = [
        (PROMPTS[0], {"model": "style-a"}, {adapters[0]: 1.0}),
        (PROMPTS[1], {"extra_body": {"lora": [{"id": 1, "scale": 1.0}]}}, {adapters[1]: 1.0}),
        (PROMPTS[2], {}, {}),
        (PROMPTS[3], {"model": "terse"}, {adapters[1]: 1.0}),
        (PROMPTS[4], {"extra_body": {"lora": [{"id": 0, "scale": 1.0}]}}, {adapters[0]: 1.0}),
        (PROMPTS[5], {}, {}),
    ]
    with ThreadPoolExecutor(len(cases)) as ex:
        replies = list(ex.map(lambda case: complete(served, case[0], **case[1]), cases))
    for (prompt, _, config), reply in zip(cases, replies, strict=True):
        ref.check(config, prompt, reply.choices[0].logprobs)
        # The check tells the adapters apart: a reply run under another request's adapters would fail it.
        for other in ({}, {adapters[0]: 1.0}, {adapters[1]: 1.0}):
            if other != config:
                with pytest.raises(AssertionError):
                    ref.check(other, prompt, reply.choices[0].logprobs)


def test_bad_adapters_and_models_are_400s_and_the_server_serves_on(served: Served) -> None:
    def post(route: str, body: Mapping[str, Any] | str) -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        return httpx.post(served.url + route, content=content, headers={"content-type": "application/json"},
                          timeout=60)

    completion = {"model": base_name(served), "prompt": "Hi", "max_tokens": 1}
    for lora in ([{"id": 2, "scale": 1.0}], [{"id": -1, "scale": 1.0}], [{"id": "0", "scale": 1.0}],
                 [{"id": True, "scale": 1.0}], [{"id": 0, "scale": "0.5"}], [{"id": 0}],
                 [{"id": 0, "scale": None}], [{"id": 0, "scale": True}], {"id": 0, "scale": 1.0}, [0],
                 [{"id": 0, "scale": 1.0}, {"id": 0, "scale": 0.5}]):
        for route, body in (("/v1/completions", completion),
                            ("/v1/chat/completions", {"model": base_name(served), "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": "Hi"}]})):
            got = post(route, {**body, "lora": lora})
            assert got.status_code == 400, (lora, got.text)
            assert got.json()["error"]["param"] == "lora", got.text
    # Non-finite scales, as Python's json (which the server reads with) writes and reads them.
    for scale in ("NaN", "Infinity", "-Infinity", "1e999"):
        got = post("/v1/completions", json.dumps(completion)[:-1] + f', "lora": [{{"id": 0, "scale": {scale}}}]}}')
        assert got.status_code == 400 and got.json()["error"]["param"] == "lora", (scale, got.text)
    client = served.client()
    for call in (lambda: client.completions.create(model="style-c", prompt="Hi", max_tokens=1),
                 lambda: client.chat.completions.create(model="style-c", max_tokens=1,
                                                        messages=[{"role": "user", "content": "Hi"}])):
        with pytest.raises(openai.BadRequestError) as bad:
            call()
        assert bad.value.code == "model_not_found" and bad.value.param == "model"
        assert "style-a" in bad.value.message and "terse" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:  # an embedding is the model's own
        client.embeddings.create(model="terse", input="a cat")
    assert bad.value.param == "model"
    assert len(client.embeddings.create(model=base_name(served), input="a cat").data) == 1
    good = client.completions.create(model="terse", prompt="Hi", max_tokens=2, extra_body={
        "lora": [{"id": 0, "scale": 0.25, "path": "ignored: llama-server's list may be sent back"}]})
    assert good.usage is not None and good.usage.completion_tokens == 2
    metrics = httpx.get(served.url + "/metrics").text
    assert 'lloyal_errors_total{status="400"}' in metrics


def test_models_list_the_adapters_and_lora_adapters_shows_them(served: Served, lpool: Pool,
                                                               adapters: list[Path]) -> None:
    client = served.client()
    base = Path(lpool[0].models[0].path).stem
    listed = client.models.list().data
    assert [m.id for m in listed] == [base, "style-a", "terse"]
    assert [getattr(m, "parent", None) for m in listed] == [None, base, base]
    assert client.models.retrieve("terse").id == "terse"
    assert getattr(client.models.retrieve("style-a"), "parent", None) == base
    assert client.models.retrieve(base).id == base
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("style-c")
    got = httpx.get(served.url + "/lora-adapters").json()
    assert got == [{"id": 0, "path": str(adapters[0]), "name": "style-a", "scale": 0.0},
                   {"id": 1, "path": str(adapters[1]), "name": "terse", "scale": 0.0}]
    assert httpx.post(served.url + "/lora-adapters", json=[{"id": 0, "scale": 1.0}]).status_code == 405


def test_an_app_refuses_bad_adapters_at_start(served: Served, lpool: Pool, adapters: list[Path],
                                              tmp_path: Path) -> None:
    base = Path(lpool[0].models[0].path).stem
    for lora, match in (([adapters[0], ("style-a", adapters[1])], "two LoRA adapters are named 'style-a'"),
                        ([("a", adapters[0]), ("b", adapters[0])], "given twice"),
                        ([(base, adapters[0])], "as the model is"),
                        (str(adapters[0]), "single path"),
                        ([("", adapters[0])], "needs a name")):
        with pytest.raises(ValueError, match=match):
            create_app(lpool, lora=lora)  # type: ignore[arg-type]
    text = tmp_path / "notes.gguf"
    text.write_text("not an adapter")
    with pytest.raises(LoraError, match=r"the LoRA adapter 'notes' \(.*notes.gguf\) cannot be loaded for .*"
                                        r"in worker .*not a GGUF"):
        create_app(lpool, lora=[text])
    with pytest.raises(LoraError, match=r"'gone'.*not found"):
        create_app(lpool, lora={"gone": tmp_path / "gone.gguf"})
    assert all(len(inst.models[0].loras) == 2 for inst in lpool)  # nothing more was loaded

    class RayLike:
        def serving_backend(self) -> Any:
            return type("B", (), {"model_path": lambda self: "/m/model.gguf"})()

    with pytest.raises(ValueError, match="RayPool"):
        create_app(RayLike(), lora=[adapters[0]])


def test_a_replaced_worker_loads_the_adapters_with_its_model(served: Served, lpool: Pool, gemma_path: Path,
                                                              adapters: list[Path]) -> None:
    fresh = lpool.replace(1)
    model = fresh.load_model(gemma_path)  # as the application loaded it at start
    model.batcher(slots=8, n_ctx_slot=512)
    assert model.loras == []
    client = served.client()
    assert client.completions.create(model=base_name(served), prompt="Hi", max_tokens=1).usage is not None
    assert [a.path for a in model.loras] == sorted(str(p) for p in adapters)  # before that request was routed
    for _ in range(4):  # requests on an adapter are served on either worker
        assert client.completions.create(model="terse", prompt="Hi", max_tokens=1).usage is not None


def test_serve_command_lora_options(gemma_path: Path, adapters: list[Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._lora_arg("style=/a/b.gguf") == ("style", "/a/b.gguf")
    assert cli._lora_arg("/a/b.gguf") == ("b", "/a/b.gguf")
    odd = tmp_path / "x=y.gguf"
    odd.write_text("")
    assert cli._lora_arg(str(odd)) == ("x=y", str(odd))  # a path that exists is a path
    serve = ["serve", "-m", str(gemma_path)]
    for args, match in ((["--lora", f"a={adapters[0]}", "--lora", f"a={adapters[1]}"], "two LoRA adapters"),
                        (["--lora", f"{adapters[0]}", "--lora", f"{adapters[0]}"], "given twice"),
                        (["--lora", f"{gemma_path.stem}={adapters[0]}"], "as the model is"),
                        (["--lora", f"a={tmp_path / 'missing.gguf'}"], "no such file"),
                        (["--ray", "--lora", str(adapters[0])], "not --ray")):
        with pytest.raises(SystemExit, match=match):  # before any worker starts
            cli.main(serve + args)
    notes = tmp_path / "notes.gguf"
    notes.write_text("not an adapter")
    assert cli.main(serve + ["--lora", f"n={notes}"]) == 1  # a worker refused it: a clear error, no server
    err = capsys.readouterr().err
    assert "LoraError: the LoRA adapter 'n'" in err and "not a GGUF" in err
    said = chat_with_the_serve_command(["-m", str(gemma_path), "--name", "gemma", "--lora", str(adapters[0]),
                                        "--lora", f"terse={adapters[1]}"])
    assert "with LoRA adapters style-a, terse" in said

