#!/usr/bin/env python3
"""Best-of-8 with branches: 8 branches forked from one shared prompt, 64 tokens each, one batched commit
per step, through a worker; against llama.cpp's llama-batched-bench (pure decode of the same shape: shared
prompt, B=8, unified KV, same threads) and against 8 sequential single-stream generations.

    .venv/bin/python bench/bench_branches.py [-m MODEL] [-t THREADS] [-r ROUNDS] [--json-out FILE]

Also measured: fork time (client round trip, and the worker's share of it), per-step client overhead
(a batched step's wall time minus the time the worker spent inside llama_decode for it) and the time to
read a branch's logits. Target from the branches issue: best-of-8 >= 0.90x llama-batched-bench.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, emit_report, model_path, tool

N_PROMPT, N_GEN, N_BRANCH = 128, 64, 8
SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def batched_bench(model: Path, threads: int) -> dict[str, float]:
    out = subprocess.run([str(tool("llama-batched-bench")), "-m", str(model), "-c", "2048", "-b", "2048",
                          "-ub", "512", "-npp", str(N_PROMPT), "-ntg", str(N_GEN), "-npl", f"1,{N_BRANCH}",
                          "-pps", "-kvu", "--swa-full", "-t", str(threads), "-tb", str(threads),
                          "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    by_pl = {int(r["pl"]): r for r in rows}
    return {"tg_tps_b8": float(by_pl[N_BRANCH]["speed_tg"]), "tg_tps_b1": float(by_pl[1]["speed_tg"]),
            "step_ms_b8": 1000.0 * float(by_pl[N_BRANCH]["t_tg"]) / N_GEN}


def pool_round(model: Path, threads: int, seed: int) -> dict[str, float]:
    from lloyal_pool import Pool, SamplerParams

    with Pool(1, threads_per_worker=threads) as pool:
        m = pool[0].load_model(model)
        rng = random.Random(seed)
        prompt = [m.info.bos] + [rng.randrange(m.n_vocab) for _ in range(N_PROMPT - 1)]
        params = SamplerParams(**SAMPLING, seed=seed)
        ctx = m.new_context(n_ctx=2048, n_batch=2048, n_ubatch=512, n_seq_max=N_BRANCH + 1)

        # warm up: one short best-of run, as llama-batched-bench warms up before measuring
        root = ctx.branch(prompt[:16], params)
        kids = [root.fork(reseed=i) for i in range(1, N_BRANCH + 1)]
        for _ in range(4):
            ctx.branches.step(kids)
        root.prune_subtree()

        root = ctx.branch(prompt, params)
        # as llama-batched-bench never stops early: no end of generation (forks inherit the bias)
        root.set_logit_bias({m.info.eos: float("-inf")})
        t0 = time.perf_counter()
        kids = [root.fork(reseed=i) for i in range(1, N_BRANCH + 1)]
        fork_ms = (time.perf_counter() - t0) * 1000.0 / N_BRANCH
        n_tokens = 0
        step_s = []
        overhead_ms = []
        for _ in range(N_GEN):
            t1 = time.perf_counter()
            produced = ctx.branches.step(kids)
            step_s.append(time.perf_counter() - t1)
            # everything but llama_decode: produce, commit bookkeeping, the round trip
            overhead_ms.append(step_s[-1] * 1000.0 - produced.decode_ms)
            n_tokens += sum(not p.is_stop for p in produced)
        gen_s = sum(step_s)
        best = min(kids, key=lambda b: b.perplexity)  # best-of-n by perplexity, outside the timing

        # logits read: the view (what users get) and a full copy of it
        t2 = time.perf_counter()
        for _ in range(1000):
            view = best.logits
        view_ms = (time.perf_counter() - t2)
        t3 = time.perf_counter()
        for _ in range(100):
            view.copy()
        copy_ms = (time.perf_counter() - t3) * 10.0
        root.prune_subtree()

        # 8 sequential single-stream generations of the same length and sampling
        ctx.close()
        seq_ctx = m.new_context(n_ctx=2048, n_batch=2048, n_ubatch=512)
        seq_ctx.generate(prompt[:16], n_predict=4, **SAMPLING)
        seq_s = 0.0
        for i in range(N_BRANCH):
            seq_ctx.reset()
            r = seq_ctx.generate(prompt, n_predict=N_GEN, ignore_eos=True, seed=seed + i, **SAMPLING)
            seq_s += r.decode_ms / 1000.0
        seq_ctx.close()
    return {"best_of_8_tps": n_tokens / gen_s, "step_ms": 1000.0 * statistics.median(step_s),
            "step_overhead_ms": statistics.median(overhead_ms),
            "fork_ms": fork_ms, "logits_view_ms": view_ms, "logits_copy_ms": copy_ms,
            "sequential_tps": N_BRANCH * N_GEN / seq_s}


def fork_worker_ms(model: Path, threads: int) -> float:
    """The worker's share of a fork: the native fork timed in-process, median of 200."""
    import lloyal_pool.worker._native as native
    from lloyal_pool.shm import BULK_OFFSET, PAGE, Region

    m = native.Model(str(model))
    region = Region.anonymous(16 << 20)
    ctx = native.Context(m, {"n_ctx": 1024, "n_seq_max": 4, "n_threads": threads},
                         native.Arena(region.view, BULK_OFFSET, PAGE))
    root, _ = ctx.branch_create(dict(SAMPLING, seed=1), None)
    ctx.prefill([(root, [int(m.info()["bos"])] + list(range(100, 163)))], 0)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        child, _ = ctx.branch_fork(root)
        times.append(time.perf_counter() - t0)
        ctx.branch_prune(child, False)
    return 1000.0 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    args = ap.parse_args()
    model = model_path(args.model)

    # Runners take turns round after round and each figure is a median over rounds (noisy machines).
    pool_rows: list[dict[str, float]] = []
    ref_rows: list[dict[str, float]] = []
    for i in range(args.rounds):
        pool_rows.append(pool_round(model, args.threads, seed=1000 + i))
        ref_rows.append(batched_bench(model, args.threads))

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    pool = {k: med(pool_rows, k) for k in pool_rows[0]}
    ref = {k: med(ref_rows, k) for k in ref_rows[0]}
    paired = statistics.median(p["best_of_8_tps"] / r["tg_tps_b8"] for p, r in zip(pool_rows, ref_rows, strict=True))
    report: dict[str, Any] = {
        "model": model.name, "threads": args.threads, "rounds": args.rounds, "n_prompt": N_PROMPT,
        "n_gen": N_GEN, "branches": N_BRANCH, "sampling": SAMPLING,
        "pool": pool, "llama_batched_bench": ref, "fork_worker_ms": fork_worker_ms(model, args.threads),
        "ratios": {
            "best_of_8_vs_batched_bench": pool["best_of_8_tps"] / ref["tg_tps_b8"],
            "best_of_8_vs_batched_bench_paired": paired,
            "best_of_8_vs_sequential": pool["best_of_8_tps"] / pool["sequential_tps"],
        },
        "targets": {"best_of_8_vs_batched_bench": 0.90, "fork_ms": 1.0, "logits_read_ms": 0.1},
    }
    emit_report(report, args.json_out)
    r = report["ratios"]
    print(f"\nbest-of-8 {pool['best_of_8_tps']:.1f} tok/s | llama-batched-bench B=8 {ref['tg_tps_b8']:.1f} tok/s "
          f"| 8 sequential {pool['sequential_tps']:.1f} tok/s")
    print(f"best-of-8 / batched-bench {r['best_of_8_vs_batched_bench']:.3f}x (paired {paired:.3f}x, target 0.90x); "
          f"best-of-8 / sequential {r['best_of_8_vs_sequential']:.2f}x")
    print(f"fork {pool['fork_ms']:.3f} ms round trip, {report['fork_worker_ms']:.3f} ms in the worker (target 1 ms); "
          f"step overhead {pool['step_overhead_ms']:.2f} ms (a step: {pool['step_ms']:.2f} ms, batched-bench's "
          f"{ref['step_ms_b8']:.2f} ms); "
          f"logits view {pool['logits_view_ms'] * 1000:.1f} us, copy {pool['logits_copy_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
