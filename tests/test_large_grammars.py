"""Grammars of thousands of alternatives (a JSON-schema enum, a list of names), on Gemma 3 270M: the
worker writes large literal alternations as a trie (lloyal_pool/worker/grammar_trie.py), which llama.cpp
walks with a handful of parse stacks instead of one per alternative. The rewrite must not change what
the grammar allows: compared here, token by token, with the same language written so that the rewrite
leaves it alone (each alternative a rule of its own)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from lloyal_pool import Context, Grammar, Model

WORDS = [f"{w}{i}" for i, w in enumerate(["alpha", "beta", "gamma", "delta", "omega", "sigma"] * 60)]


@pytest.fixture
def ctx(gemma: Model) -> Iterator[Context]:
    c = gemma.new_context(n_ctx=256)
    yield c
    c.close()


def _allowed(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(mask == 0.0).tolist())


def test_the_trie_allows_what_the_alternation_allows(ctx: Context) -> None:
    listed = "root ::= " + " | ".join(f'"{w}"' for w in WORDS)  # rewritten in the worker
    by_rule = "root ::= " + " | ".join(f"w{i}" for i in range(len(WORDS))) + "\n" + "\n".join(
        f'w{i} ::= "{w}"' for i, w in enumerate(WORDS))  # as written: no group of literals
    fast, slow = ctx.sampler(listed), ctx.sampler(by_rule)
    text = ""
    for _ in range(12):
        allowed = _allowed(fast.mask())
        assert allowed == _allowed(slow.mask()), text
        ends = allowed & set(ctx.model.eog_tokens)
        choices = sorted(allowed - ends)
        if not choices:
            assert ends and text in WORDS
            return
        tok = choices[len(choices) // 2]  # a path through the middle of the trie
        fast.accept(tok)
        slow.accept(tok)
        text += ctx.model.detokenize([tok])
    raise AssertionError(f"no word ended after 12 tokens: {text!r}")


@pytest.mark.parametrize("form", ["gbnf", "json_schema"])
def test_an_enum_of_twenty_thousand_values_is_practical(ctx: Context, form: str) -> None:
    values = [f"item{i:05d}" for i in range(20000)]
    grammar: str | Grammar = ("root ::= " + " | ".join(f'"{v}"' for v in values) if form == "gbnf"
                              else Grammar(json_schema={"enum": values}))
    t0 = time.perf_counter()
    r = ctx.generate("Pick an item:", n_predict=24, grammar=grammar)
    took = time.perf_counter() - t0
    print(f"{form}: 20,000 alternatives, {len(r.tokens)} tokens in {took:.2f} s")
    text = r.text if form == "gbnf" else r.text.strip().strip('"')
    assert text in values
