"""Generation on Gemma 3 270M through a worker: identical to llama.cpp's own llama-simple, deterministic,
streaming, stop strings, n_predict and stop reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference_tools import llama_simple_text

from lloyal_pool import GenerateParams, Grammar, Model, StopReason

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Water boils at",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_llama_simple(gemma: Model, gemma_path: Path, llama_simple: Path, prompt: str) -> None:
    expected = llama_simple_text(llama_simple, gemma_path, prompt, 32)
    ctx = gemma.new_context(n_ctx=512)
    try:
        result = ctx.generate(prompt, n_predict=32)
    finally:
        ctx.close()
    assert result.n_decoded == 32 or result.stop_reason is StopReason.EOS
    assert result.text == expected


def test_greedy_is_identical_across_n_batch_and_runs(gemma: Model) -> None:
    # llama.cpp's CPU kernels are not batch-invariant: the same row computed inside ubatches of different
    # shapes can differ (measured here: up to 0.9 in a logit on this Q4_K_M model), so n_ubatch is a
    # numerical choice. n_batch only decides how the prompt is cut into decode calls, and must not matter.
    prompt = "A long time ago, in a galaxy far, far away, there was a small planet where " * 3
    runs = []
    for n_batch in (512, 64, 32, 16):
        ctx = gemma.new_context(n_ctx=256, n_batch=n_batch, n_ubatch=16)
        try:
            runs.append(ctx.generate(prompt, n_predict=32, cache_prompt=False).tokens)
            runs.append(ctx.generate(prompt, n_predict=32, cache_bit_exact=True).tokens)
        finally:
            ctx.close()
    assert all(r == runs[0] for r in runs), runs


def test_sampling_is_reproducible_and_seeded(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256)
    try:
        p = GenerateParams(n_predict=24, temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=0,
                           cache_bit_exact=True)
        a = ctx.generate("My favourite colour is", p).tokens
        b = ctx.generate("My favourite colour is", p).tokens
        c = ctx.generate("My favourite colour is", p, seed=12345).tokens
    finally:
        ctx.close()
    assert a == b
    assert a != c


def test_stream_pieces_join_to_the_result(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256)
    try:
        stream = ctx.stream("Here is a list of fruits:", n_predict=40)
        pieces = list(stream)
        result = stream.result
        got: list[str] = []
        result2 = ctx.generate("Here is a list of fruits:", n_predict=40, cache_bit_exact=True, on_piece=got.append)
    finally:
        ctx.close()
    assert len(pieces) > 5
    assert "".join(pieces) == result.text
    assert "".join(got) == result2.text == result.text


def test_stop_string_cuts_mid_token(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256)
    try:
        full = ctx.generate("The capital of France is", n_predict=32)
        # A stop string that starts inside a token: the second character of the first word onwards.
        word = full.text.strip().split()[0]
        assert len(word) >= 3, full.text
        stop = word[1:3]
        pieces: list[str] = []
        cut = ctx.generate("The capital of France is", n_predict=32, stop=[stop], cache_bit_exact=True,
                           on_piece=pieces.append)
    finally:
        ctx.close()
    assert cut.stop_reason is StopReason.STOP
    assert cut.text == full.text[:full.text.index(stop)]
    assert "".join(pieces) == cut.text


def test_n_predict_and_stop_reasons(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=64)
    try:
        r = ctx.generate("One, two, three,", n_predict=5)
        assert (r.n_decoded, len(r.tokens), r.stop_reason) == (5, 5, StopReason.LENGTH)
        ctx.reset()
        # n_predict <= 0 runs until the context is full.
        r = ctx.generate("One, two, three,", n_predict=0, ignore_eos=True)
        assert r.stop_reason is StopReason.LENGTH
        assert r.n_prompt + r.n_decoded == ctx.n_ctx
        ctx.reset()
        # Forcing the end-of-turn token makes the model stop with eos.
        eos = gemma.info.eos
        r = ctx.generate("Hello", n_predict=10, logit_bias={eos: 100.0})
        assert r.stop_reason is StopReason.EOS and r.text == ""
    finally:
        ctx.close()


def test_logits_arrive_over_shared_memory(gemma: Model) -> None:
    import numpy as np

    ctx = gemma.new_context(n_ctx=128)
    try:
        ctx.eval("The capital of France is")
        logits = ctx.logits()
        assert logits.dtype == np.float32 and logits.shape == (gemma.n_vocab,)
        assert not logits.flags.writeable and np.isfinite(logits).all()
        greedy = ctx.generate("", n_predict=1, append=True)
        assert greedy.tokens[0] == int(np.argmax(logits))
    finally:
        ctx.close()


def test_model_info_and_tokenizer(gemma: Model) -> None:
    info = gemma.info
    assert info.n_vocab == 262144 and info.n_layer > 0 and info.n_swa > 0
    assert "gemma" in info.desc.lower()
    toks = gemma.tokenize("Hello world")
    assert toks[0] == info.bos and info.add_bos
    assert info.eos in gemma.eog_tokens and gemma.is_eog(info.eos) and not gemma.is_eog(info.bos)
    assert gemma.detokenize(toks[1:]) == "Hello world"
    assert b"".join(gemma.token_to_piece(t) for t in toks[1:]) == b"Hello world"


def test_generate_takes_the_grammars_branches_take(tiny: Model) -> None:
    """One grammar type for generate and branches: a JSON schema constrains the output, and a lazy
    grammar whose trigger never fires leaves the generation exactly as it is without one."""
    ctx = tiny.new_context(n_ctx=256)
    try:
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        r = ctx.generate("Hi", n_predict=64, grammar=Grammar(json_schema=schema))
        assert r.stop_reason is StopReason.EOS and json.loads(r.text)["ok"] in (True, False)
        ctx.reset()  # a generate continues what the context holds
        free = ctx.generate("Hi", n_predict=12, ignore_eos=True)
        ctx.reset()
        lazy = Grammar(gbnf='root ::= "never"', lazy=True, trigger_words=["\x01 no such text \x02"])
        assert ctx.generate("Hi", n_predict=12, ignore_eos=True, grammar=lazy).tokens == free.tokens
    finally:
        ctx.close()


def test_generate_and_stream_start_afresh_unless_asked_to_append(tiny: Model) -> None:
    """The same prompt twice is the same generation (its prefix comes from the cache); append=True
    continues after what the context holds instead."""
    ctx = tiny.new_context(n_ctx=256)
    try:
        first = ctx.generate("Once upon a time", n_predict=6, ignore_eos=True)
        with ctx.stream("Once upon a time", n_predict=6, ignore_eos=True) as stream:
            again = "".join(stream)
        assert (stream.result.tokens, again) == (first.tokens, first.text) and stream.result.n_cached > 0
        held = len(ctx.tokens())
        with ctx.stream("Once upon a time", n_predict=6, ignore_eos=True, append=True) as stream:
            "".join(stream)
        # appended after the whole history, which it reuses as it is
        assert stream.result.n_cached == held and stream.result.tokens != first.tokens
        assert ctx.generate("Once upon a time", n_predict=6, ignore_eos=True).tokens == first.tokens
    finally:
        ctx.close()


def test_sampler_values_are_checked_by_the_worker(tiny: Model) -> None:
    """The native side owns the sampler fields' rules; a value it refuses fails that request only."""
    ctx = tiny.new_context(n_ctx=64)
    try:
        for bad in ({"min_p": 1.5}, {"mirostat": 3}, {"top_k": -1}, {"dry_base": 0.5}):
            with pytest.raises(ValueError):
                ctx.generate("Hi", n_predict=2, **bad)
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2
    finally:
        ctx.close()
