#!/usr/bin/env python3
"""Grammar-constrained generation as a pull loop: a JSON schema becomes a grammar (llama.cpp's own
converter), a Python generator pulls tokens from the branch one at a time, and when the output reaches
a chosen field the loop stops there and forks: each fork inherits the KV and the grammar's state, so each
completes the same object differently, and every result is valid JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Branch, Grammar, Pool, SamplerParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "species": {"type": "string", "enum": ["cat", "dog", "parrot", "tortoise"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 100},
        "favourite_food": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "species", "age", "favourite_food"],
    "additionalProperties": False,
}


def pull(branch: Branch, limit: int = 200) -> Iterator[str]:
    """The pull loop: each next() produces one token, commits it and hands its text over. The caller
    can stop at any token, and what it saw is exactly what the branch holds."""
    for p in branch.iterate(limit):
        yield p.text


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--field", default="favourite_food", help="fork when the output reaches this field")
    ap.add_argument("-n", "--forks", type=int, default=3)
    ap.add_argument("prompt", nargs="?", default="A pet from the shelter, described as JSON: ")
    args = ap.parse_args()

    with Pool(1) as pool:
        model = pool[0].load_model(model_path(args.model))
        ctx = model.new_context(n_ctx=1024, n_seq_max=args.forks + 1)
        root = ctx.branch(args.prompt, SamplerParams(temperature=0.8, top_k=40, seed=11),
                          grammar=Grammar(json_schema=SCHEMA))
        prefix = ""
        marker = f'"{args.field}":'
        for piece in pull(root):
            prefix += piece
            if marker in prefix.replace(" ", ""):
                break  # stop pulling: the object so far is in the KV cache and the grammar's state
        print(f"shared prefix ({root.position} tokens): {prefix}")

        for i in range(args.forks):
            fork = root.fork(reseed=1000 + i)
            rest = "".join(pull(fork))
            obj = json.loads(prefix + rest)  # always parses: the grammar allows nothing else
            print(f"fork {i}: {args.field} = {obj[args.field]!r:28} -> {json.dumps(obj)}")
            fork.prune()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
