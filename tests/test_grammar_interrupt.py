"""Interrupt inside a long grammar step: a grammar of thousands of alternatives makes one sampling step
take seconds (llama.cpp's grammar costs stacks x candidates); the native side runs it in slices and asks
for an interrupt between them. The sliced grammar allows exactly what llama.cpp's single call allows.
How fast an interrupt lands is measured in bench/bench_interrupt.py, not asserted here."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import lloyal_pool.worker._native as native
from lloyal_pool import Grammar, GrammarError, InterruptedByClient, Model, Pool, SamplerParams, StopReason


def many_words(n: int) -> str:
    """A grammar of n alternatives: as many parse stacks, which is what makes a step slow. Each ends in a
    character class, so the worker's trie rewrite of literal alternations (worker/grammar_trie.py, which
    makes a plain list of words fast) leaves it as written: grammars it cannot rewrite are still slow."""
    return "root ::= " + " | ".join(f'"w{i}" [.]?' for i in range(n))


@pytest.fixture(scope="module")
def tiny_native(tiny_model: Path) -> Any:
    native.set_log_level(3)
    return native.Model(str(tiny_model))  # a real 32,000-token vocabulary: each full mask is quick


def test_sliced_grammar_allows_what_llama_cpp_allows(tiny_native: Any) -> None:
    # 300 alternatives: three slices of stacks. A second rule keeps stacks of another shape alive, and a
    # list lets the grammar go on after a word; accepting steps through all of it.
    gbnf = ('root ::= " "? item ("," " "? item)*\nitem ::= word | "n" [0-9]+ | "é" [a-z]*\n'
            "word ::= " + " | ".join(f'"w{i}"' for i in range(300)))
    tokens = tiny_native.tokenize("w12, n7, é", False, False)
    steps = native._grammar_slices_check(tiny_native, gbnf, tokens)
    assert len(steps) == len(tokens) + 1
    for theirs, ours in steps:
        assert ours == theirs
    assert all(theirs for theirs, _ in steps), "each step allows something"
    # The grammar of many words alone: several slices from the first step on.
    spaced = 'root ::= " "? word\nword ::= ' + " | ".join(f'"w{i}"' for i in range(400))
    words = native._grammar_slices_check(tiny_native, spaced, tiny_native.tokenize("w5", False, False))
    for theirs, ours in words:
        assert ours == theirs


def test_interrupt_lands_inside_a_grammar_step_of_a_generation(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256)
    try:
        def on_progress(done: int, total: int) -> None:
            if done == total:  # the prompt is in: what remains is the first (slow) sampling step
                threading.Thread(target=ctx.interrupt).start()

        fut = ctx.generate_async("Say a word:", n_predict=3, grammar=many_words(5000), progress=on_progress)
        result = fut.result(timeout=600)
        assert result.stop_reason is StopReason.INTERRUPTED
        assert result.n_decoded == 0 and result.text == ""  # stopped inside the step, not after it
        assert ctx.generate("Hello", n_predict=2).n_decoded == 2  # still serving
    finally:
        ctx.close()


def test_an_interrupted_grammar_step_changes_no_branch(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256, n_seq_max=4)
    try:
        b = ctx.branch("Say a word:", SamplerParams(temperature=1.0, seed=3), grammar=many_words(5000))
        twin = b.fork()
        before = b.info()
        fut = ctx.branches.step_async([b])
        time.sleep(1.0)  # not a measurement: the step (seconds of grammar work) is under way by then
        ctx.interrupt()
        with pytest.raises(InterruptedByClient, match="grammar"):  # inside the grammar step, not before it
            fut.result(timeout=600)
        assert b.info() == before
        # Without the grammar both draw from the same PRNG state: the interrupted step drew nothing.
        b.set_grammar(None)
        twin.set_grammar(None)
        assert [ctx.branches.produce([b])[0].token for _ in range(3)] == \
            [ctx.branches.produce([twin])[0].token for _ in range(3)]
    finally:
        ctx.close()


def test_interrupt_lands_while_a_large_grammar_is_parsed(tiny_model: Path) -> None:
    """A grammar of 20,000 alternatives takes llama.cpp seconds to set up (its stacks) before the first
    token: the parse runs aside and the generation takes an interrupt meanwhile."""
    with Pool(1) as pool:
        model = pool[0].load_model(tiny_model)
        ctx = model.new_context(n_ctx=256)
        fut = ctx.generate_async("Hi", n_predict=3, grammar=many_words(20000))
        time.sleep(0.3)  # not a measurement: the parse is under way by then
        ctx.interrupt()
        result = fut.result(timeout=600)
        assert result.stop_reason is StopReason.INTERRUPTED and result.n_decoded == 0
        assert ctx.tokens() == []  # stopped before the prompt was decoded
        assert ctx.generate("Hello", n_predict=2).n_decoded == 2
        model.close()  # waits for the parse left running: it reads this model's vocabulary
        assert pool[0].ping(timeout=30) < 1.0


def test_a_large_grammar_being_parsed_is_not_a_hang(tiny_model: Path) -> None:
    # The parse (seconds) gives signs of life: a hang watch far shorter than it leaves the worker alone.
    with Pool(1, hang_timeout=1.0) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=256)
        result = ctx.generate("Hi", n_predict=1, grammar=many_words(20000))
        assert result.n_decoded == 1 and result.text.startswith("w") and pool[0].alive


def test_a_large_grammar_that_does_not_parse_says_why(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=256)
        with pytest.raises(GrammarError, match="expecting"):
            ctx.generate("Hi", n_predict=1, grammar=many_words(2000) + " | (")
        lazy = Grammar(gbnf=many_words(2000), lazy=True, trigger_patterns=["(unclosed"])
        with pytest.raises(GrammarError, match="invalid trigger pattern"):
            ctx.generate("Hi", n_predict=1, grammar=lazy)
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2


def test_interrupt_lands_while_a_new_branchs_large_grammar_is_set_up(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=256, n_seq_max=2)
        fut = ctx.branches.create_async("Hi", SamplerParams(), grammar=many_words(20000))
        time.sleep(0.3)  # not a measurement: the set-up is under way by then
        ctx.interrupt()
        with pytest.raises(InterruptedByClient, match="grammar"):
            fut.result(timeout=600)
        # Nothing was created: both sequences are free for new branches.
        branches = [ctx.branch("Hi", SamplerParams()) for _ in range(2)]
        assert len({b.handle for b in branches}) == 2


def test_interrupt_lands_while_a_branchs_large_grammar_is_set(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=256, n_seq_max=2)
        branch = ctx.branch("Hi", SamplerParams(), grammar='root ::= "zq"')
        timer = threading.Timer(0.3, ctx.interrupt)  # not a measurement: the set-up is under way by then
        timer.start()
        with pytest.raises(InterruptedByClient, match="grammar"):
            branch.set_grammar(many_words(20000))
        timer.join()
        assert ctx.branches.produce([branch])[0].text.startswith("z")  # the grammar it had
