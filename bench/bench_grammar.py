#!/usr/bin/env python3
"""Large enumerations in a grammar: generate(n_predict=2) and a whole value under a grammar of N string
alternatives, as the worker runs it (the alternation factored into a trie, lloyal_pool/worker/grammar_trie.py)
and as llama.cpp would run it unfactored (the same language with each alternative a rule of its own, which
the rewrite leaves alone).

    .venv/bin/python bench/bench_grammar.py [-n 500 5000 20000] [--unfactored-up-to 5000]

The unfactored runs grow with N (one parse stack per alternative): they stop at --unfactored-up-to."""

from __future__ import annotations

import argparse
import time

from lloyal_pool import Grammar, Pool, default_model_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, nargs="+", default=[500, 5000, 20000])
    ap.add_argument("--unfactored-up-to", type=int, default=5000)
    args = ap.parse_args()
    with Pool(1) as pool:
        ctx = pool[0].load_model(default_model_path()).new_context(n_ctx=256)
        print(f"{'N':>6} {'form':<12} {'2 tokens s':>10} {'a value s':>10}")
        for n in args.n:
            values = [f"item{i:05d}" for i in range(n)]
            forms: dict[str, str | Grammar] = {
                "gbnf": "root ::= " + " | ".join(f'"{v}"' for v in values),
                "json enum": Grammar(json_schema={"enum": values})}
            if n <= args.unfactored_up_to:
                forms["unfactored"] = ("root ::= " + " | ".join(f"v{i}" for i in range(n)) + "\n"
                                       + "\n".join(f'v{i} ::= "{v}"' for i, v in enumerate(values)))
            for name, grammar in forms.items():
                t0 = time.perf_counter()
                ctx.generate("Pick an item:", n_predict=2, grammar=grammar)
                t1 = time.perf_counter()
                ctx.generate("Pick an item:", n_predict=24, grammar=grammar)
                t2 = time.perf_counter()
                print(f"{n:>6} {name:<12} {t1 - t0:>10.2f} {t2 - t1:>10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
