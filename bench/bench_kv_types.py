#!/usr/bin/env python3
"""KV-cache types and flash attention: for each setting tests/test_kv_types.py checks (f16 with flash
attention on and off, q8_0 and q4_0 caches, a q8_0 K cache alone), the bytes the cache takes per token of
context, the perplexity of that test's fixed text (about 660 tokens) and its change from f16's, and the speed
of prefill (that text, decoded into an empty context) and of generation (128 tokens after it).

    .venv/bin/python bench/bench_kv_types.py [-m MODEL] [-t THREADS] [-r REPS] [--n-ctx N] [--json-out FILE]

Prints JSON, then a table. Speeds are the median of --reps runs (default 3) after a warm-up; one run on a
shared machine ranges widely, so compare rows of one report, not figures of two machines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from bench_generate import common_args, emit_report, model_path  # noqa: E402
from test_kv_types import F16, SETTINGS, TEXT  # noqa: E402

N_GEN = 128


def measure(model: Any, params: dict[str, str], n_ctx: int, threads: int, reps: int) -> dict[str, Any]:
    ctx = model.new_context(n_ctx=n_ctx, n_threads=threads, adapt_threads=False, **params)
    try:
        kv_bytes = sum(row.context for row in ctx.memory_breakdown())
        score = ctx.score(TEXT)
        pp, tg = [], []
        for i in range(reps + 1):
            r = ctx.generate(TEXT, n_predict=N_GEN, ignore_eos=True, cache_prompt=False)
            if i == 0:
                continue  # warm-up
            pp.append((r.n_prompt - r.n_cached) / (r.prompt_ms / 1000.0))
            tg.append(r.decode_tokens_per_second)
        return {"params": params, "kv_bytes": kv_bytes, "bytes_per_token": kv_bytes / n_ctx,
                "perplexity": score.perplexity, "n_tokens": score.n_tokens,
                "prefill_tps": statistics.median(pp), "generate_tps": statistics.median(tg)}
    finally:
        ctx.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--n-ctx", type=int, default=1024, help="a multiple of 256 (llama.cpp's cache size)")
    args = ap.parse_args()

    from lloyal_pool import Pool

    path = model_path(args.model)
    with Pool(1, threads_per_worker=args.threads) as pool:
        inst = pool[0]
        model = inst.load_model(path)
        rows = {name: measure(model, params, args.n_ctx, args.threads, args.reps) for name, params in SETTINGS.items()}
        ref = rows[F16]
        for row in rows.values():
            row["perplexity_delta"] = row["perplexity"] / ref["perplexity"] - 1.0
            row["bytes_ratio"] = row["bytes_per_token"] / ref["bytes_per_token"]
        report = {"model": str(path), "threads": args.threads, "cpu_kernels": inst.cpu_kernels,
                  "n_ctx": args.n_ctx, "n_gen": N_GEN, "settings": rows}
    emit_report(report, args.json_out)
    print(f"\n{'setting':18s} {'B/token':>8s} {'x f16':>6s} {'ppl':>8s} {'delta':>7s} {'pp tok/s':>9s} "
          f"{'tg tok/s':>9s}")
    for name, row in rows.items():
        print(f"{name:18s} {row['bytes_per_token']:8.0f} {row['bytes_ratio']:6.3f} {row['perplexity']:8.3f} "
              f"{row['perplexity_delta']:+7.2%} {row['prefill_tps']:9.1f} {row['generate_tps']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
