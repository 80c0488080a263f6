"""The trie rewrite of large literal alternations (lloyal_pool/worker/grammar_trie.py) keeps the language:
checked here by turning the rewritten group into a Python regex (it is only literals, groups, bars and
optionals) and matching it against the strings and against strings that are not among them."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from lloyal_pool.worker.grammar_trie import MIN_ALTERNATIVES, _decode, _literal, factor_literal_alternations

_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|[()|?]|\s+')


def _regex(expr: str) -> re.Pattern[str]:
    """The rewritten expression as a regex: literals escaped, the rest as it is."""
    out = []
    for m in _PIECE.finditer(expr):
        piece = m.group()
        if piece.startswith('"'):
            decoded = _decode(piece)
            assert decoded is not None
            out.append(re.escape(decoded))
        elif not piece.isspace():
            out.append(piece)
    assert sum(len(m.group()) for m in _PIECE.finditer(expr)) == len(expr), expr  # nothing else in it
    return re.compile("".join(out), re.DOTALL)


def _body(gbnf: str, rule: str = "root") -> str:
    line = next(x for x in gbnf.splitlines() if x.startswith(f"{rule} ::= "))
    return line[len(rule) + 5:]


def _alternation(strings: list[str]) -> str:
    return "root ::= " + " | ".join(_literal(s) for s in strings) + "\n"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from('ab"\\\n\té€ '), max_size=6), min_size=1, max_size=60),
       st.lists(st.text(alphabet=st.sampled_from('ab"\\\n\té€ '), max_size=7), max_size=30))
def test_the_trie_accepts_exactly_the_strings(strings: list[str], others: list[str]) -> None:
    rewritten = factor_literal_alternations(_alternation(strings), min_alternatives=1)
    pattern = _regex(_body(rewritten))
    for s in strings:
        assert pattern.fullmatch(s), (s, rewritten)
    for s in others:
        assert bool(pattern.fullmatch(s)) == (s in strings), (s, rewritten)


def test_an_enum_in_parentheses_is_factored_and_the_rest_kept() -> None:
    words = [f'"item{i:03d}"' for i in range(200)]
    gbnf = ("# an enum, as llama.cpp's JSON-schema converter writes one\n"
            f"root ::= ({' | '.join(_literal(w) for w in words)}) space\n"
            'space ::= | " " | "\\n"{1,2} [ \\t]{0,20}\n')
    out = factor_literal_alternations(gbnf)
    assert len(out) < len(gbnf) * 0.6  # prefixes written once
    assert out.endswith('space ::= | " " | "\\n"{1,2} [ \\t]{0,20}\n')  # not literals only: as written
    body = _body(out)
    assert body.endswith(" space") and body.startswith("(")
    pattern = _regex(body[:-len(" space")])
    assert all(pattern.fullmatch(w) for w in words) and not pattern.fullmatch('"item200"')


def test_what_it_does_not_understand_stays_as_written() -> None:
    few = _alternation([f"w{i}" for i in range(MIN_ALTERNATIVES - 1)])
    assert factor_literal_alternations(few) == few
    mixed = "root ::= " + " | ".join([f'"w{i}"' for i in range(40)] + ["[a-z]+"]) + "\n"
    assert factor_literal_alternations(mixed) == mixed
    refs = "root ::= " + " | ".join(f"w{i}" for i in range(40)) + "\n" + "".join(
        f'w{i} ::= "x{i}"\n' for i in range(40))
    assert factor_literal_alternations(refs) == refs
    odd_escape = "root ::= " + " | ".join([f'"w{i}"' for i in range(40)] + ['"\\q"']) + "\n"
    assert factor_literal_alternations(odd_escape) == odd_escape


def test_alternatives_over_several_lines_and_an_empty_one() -> None:
    strings = [f"k{i}" for i in range(40)] + [""]
    gbnf = "root ::= " + " |\n    ".join(_literal(s) for s in strings) + "\nnext ::= root root\n"
    out = factor_literal_alternations(gbnf)
    assert out.endswith("\nnext ::= root root\n")
    pattern = _regex(_body(out))
    assert all(pattern.fullmatch(s) for s in strings) and not pattern.fullmatch("k40")
