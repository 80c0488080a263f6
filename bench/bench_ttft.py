#!/usr/bin/env python3
"""Time to first token with a shared prefix: a request whose prompt shares a ~1,000-token prefix with what
the context holds (cache_prompt, the default) against the same request on a context that holds nothing.

    .venv/bin/python bench/bench_ttft.py [-m MODEL] [-t THREADS] [-r ROUNDS] [--prefix-tokens N]

Each round: a cold request (a fresh context: the whole prompt is decoded), then, on the same context,
a warm request whose prompt is the same prefix with another question (only the question is decoded).
The time is measured in this process, from the call to the first streamed piece, so it includes the
IPC. Rounds interleave cold and warm; the report keeps the medians. Target (instances issue): warm at
least 10x faster than cold for a 1,000-token prefix.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, emit_report, model_path

QUESTIONS = [" Question: which item comes after item7? Answer:", " Question: how many items are listed? Answer:",
             " Question: name the first item. Answer:", " Question: is item3 in the list? Answer:"]


def first_piece_s(ctx, prompt: str) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    with ctx.stream(prompt, n_predict=8, ignore_eos=True) as stream:
        next(iter(stream))
        t = time.perf_counter() - t0
    r = stream.result
    return t, r.n_prompt, r.n_cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    args = ap.parse_args()

    from lloyal_pool import Pool

    path = model_path(args.model)
    with Pool(1, threads_per_worker=args.threads) as pool:
        model = pool[0].load_model(path)
        words: list[str] = []
        while len(model.tokenize("Here is a list: " + " ".join(words))) < args.prefix_tokens:
            words.append(f"item{len(words)}")
        prefix = "Here is a list: " + " ".join(words) + "."
        n_prefix = len(model.tokenize(prefix))
        cold_s, warm_s, cached = [], [], []
        for i in range(args.rounds):
            ctx = model.new_context(n_ctx=2048)
            try:
                t, n_prompt, n_cached = first_piece_s(ctx, prefix + QUESTIONS[i % len(QUESTIONS)])
                assert n_cached == 0
                cold_s.append(t)
                t, n_prompt, n_cached = first_piece_s(ctx, prefix + QUESTIONS[(i + 1) % len(QUESTIONS)])
                warm_s.append(t)
                cached.append(n_cached)
            finally:
                ctx.close()
            print(f"round {i + 1}: cold {cold_s[-1] * 1e3:.0f} ms, warm {warm_s[-1] * 1e3:.0f} ms "
                  f"({cached[-1]} of {n_prompt} prompt tokens reused)", file=sys.stderr)
    cold, warm = statistics.median(cold_s), statistics.median(warm_s)
    report = {"model": str(path), "threads": args.threads, "prefix_tokens": n_prefix, "rounds": args.rounds,
              "cold_ttft_ms": round(cold * 1e3, 1), "warm_ttft_ms": round(warm * 1e3, 1),
              "n_cached": cached[0], "speedup": round(cold / warm, 1),
              "cold_all_ms": [round(x * 1e3, 1) for x in cold_s], "warm_all_ms": [round(x * 1e3, 1) for x in warm_s]}
    emit_report(report, args.json_out)
    print(f"\ntime to first token, {n_prefix}-token shared prefix: cold {report['cold_ttft_ms']} ms, "
          f"warm {report['warm_ttft_ms']} ms: {report['speedup']}x (target >= 10x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
