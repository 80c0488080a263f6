"""Large alternations of string literals in a GBNF grammar, factored into a trie before llama.cpp sees it.

llama.cpp's grammar keeps a parse stack per alternative the text may still be in, and checks each
candidate token against every stack: an enum of 20,000 strings (a JSON-schema ``enum``, a list of names
written as ``"a" | "b" | ...``) made ``generate(n_predict=2)`` take over a minute on 2 cores, most of it
masking the vocabulary against 20,000 stacks. Written as a trie (shared prefixes once, the choice made
where the strings part), the same language never has more stacks than characters that may come next.

The rewrite keeps the language, so at every step the grammar allows the same tokens: it only touches a
group (a rule's body, or the inside of parentheses) whose every alternative is a sequence of string
literals, and only from MIN_ALTERNATIVES of them on. Anything it does not understand is left as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MIN_ALTERNATIVES = 32

# GBNF's lexical pieces, in the order they are tried: a literal, a character class, a comment, the rule
# operator, a name, a repetition, a single significant character, whitespace (newlines kept apart: they
# end a rule).
_TOKEN = re.compile(r'''
    (?P<lit>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<comment>\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z0-9_-]+)
  | (?P<repeat>\{[^}]*\}|[*+?])
  | (?P<op>[|()])
  | (?P<newline>\r?\n)
  | (?P<space>[ \t]+)
  | (?P<other>.)
''', re.VERBOSE | re.DOTALL)

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_HEX = {"x": 2, "u": 4, "U": 8}


@dataclass
class _Tok:
    kind: str
    text: str
    start: int
    end: int


def _tokens(gbnf: str) -> list[_Tok]:
    out = []
    for m in _TOKEN.finditer(gbnf):
        kind = m.lastgroup or "other"
        if kind not in ("space", "comment"):
            out.append(_Tok(kind, m.group(), m.start(), m.end()))
    return out


def _decode(literal: str) -> str | None:
    """A GBNF string literal's characters, or None for an escape this does not know."""
    body, out, i = literal[1:-1], [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = body[i + 1: i + 2]
        if e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        elif e in _HEX:
            digits = body[i + 2: i + 2 + _HEX[e]]
            if len(digits) != _HEX[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                return None
            out.append(chr(int(digits, 16)))
            i += 2 + _HEX[e]
        else:
            return None
    return "".join(out)


def _literal(text: str) -> str:
    parts = []
    for c in text:
        if c in '"\\':
            parts.append("\\" + c)
        elif c == "\n":
            parts.append("\\n")
        elif c == "\r":
            parts.append("\\r")
        elif c == "\t":
            parts.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            parts.append(f"\\x{ord(c):02x}")
        else:
            parts.append(c)
    return '"' + "".join(parts) + '"'


@dataclass
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    end: bool = False  # a string ends here


def _trie(strings: list[str]) -> _Node:
    root = _Node()
    for s in strings:
        node = root
        for c in s:
            node = node.children.setdefault(c, _Node())
        node.end = True
    return root


def _emit(node: _Node) -> str:
    """The node's continuations as a GBNF expression ("" when none)."""
    alts = []
    for c, child in sorted(node.children.items()):
        run = c
        while not child.end and len(child.children) == 1:  # a chain without choices: one literal
            (c2, child), = child.children.items()
            run += c2
        rest = _emit(child)
        alts.append(_literal(run) + (" " + rest if rest else ""))
    if not alts:
        return ""
    body = " | ".join(alts)
    if node.end:
        return f"({body})?"
    return f"({body})" if len(alts) > 1 else body


def _pure(alternatives: list[list[_Tok]]) -> list[str] | None:
    """Each alternative's string when every one is a sequence of literals only, else None."""
    strings = []
    for alt in alternatives:
        parts = [t for t in alt if t.kind != "newline"]
        if any(t.kind != "lit" for t in parts):
            return None
        decoded = [_decode(t.text) for t in parts]
        if any(d is None for d in decoded):
            return None
        strings.append("".join(d for d in decoded if d is not None))
    return strings


def _split(toks: list[_Tok]) -> list[list[_Tok]]:
    """toks (one group's inside) at its top-level bars."""
    alts: list[list[_Tok]] = [[]]
    depth = 0
    for t in toks:
        if t.kind == "op" and t.text == "(":
            depth += 1
        elif t.kind == "op" and t.text == ")":
            depth -= 1
        if depth == 0 and t.kind == "op" and t.text == "|":
            alts.append([])
        else:
            alts[-1].append(t)
    return alts


def factor_literal_alternations(gbnf: str, min_alternatives: int = MIN_ALTERNATIVES) -> str:
    """gbnf with every large group of literal-only alternatives written as a trie (same language)."""
    toks = _tokens(gbnf)
    # Groups as token index spans [i, j): rule bodies (from ::= to the next rule's name) and paren insides.
    groups: list[tuple[int, int]] = []
    defines = [k for k, t in enumerate(toks) if t.kind == "define"]
    for n, k in enumerate(defines):
        end = defines[n + 1] - 1 if n + 1 < len(defines) else len(toks)  # the next rule's name is not ours
        groups.append((k + 1, end))
    stack = []
    for k, t in enumerate(toks):
        if t.kind == "op" and t.text == "(":
            stack.append(k)
        elif t.kind == "op" and t.text == ")" and stack:
            groups.append((stack.pop() + 1, k))
    edits: list[tuple[int, int, str]] = []
    for i, j in groups:
        alternatives = _split(toks[i:j])
        if len(alternatives) < min_alternatives:
            continue
        strings = _pure(alternatives)
        if strings is None:
            continue
        trie = _trie(strings)
        text = _emit(trie) or '""'
        # The group's characters, newlines between its alternatives included, from its first to last token.
        inner = [t for t in toks[i:j] if t.kind != "newline"]
        if inner:
            edits.append((inner[0].start, inner[-1].end, text))
    out = gbnf
    for start, end, text in sorted(edits, reverse=True):  # groups of literals never nest: no overlaps
        out = out[:start] + text + out[end:]
    return out


__all__ = ["MIN_ALTERNATIVES", "factor_literal_alternations"]
