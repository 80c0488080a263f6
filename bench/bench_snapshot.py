#!/usr/bin/env python3
"""Snapshots: fork-to-first-token against a cold start, and the memory of forked instances.

    .venv/bin/python bench/bench_snapshot.py [-m MODEL] [-t THREADS] [-n PROMPT_TOKENS] [-r ROUNDS] [--json-out FILE]

A prepared instance holds the model and a context prefilled with an -n token prompt (default 1,000).

- cold start: Pool(1) (spawn and handshake), load_model, new_context, eval(prompt), then one token;
- fork: Snapshot.fork() then one token from the fork's prepared context (its prompt is already there).

Rounds interleave a cold start and a fork; the medians are reported, with the fork split into fork()
and the first token, and the prompt's prefill in a cold start (THREADS threads) against the zygote's
(one thread: the price of forking without an OpenMP team, docs/SNAPSHOTS.md).

Memory, with 4 forks alive that have each generated 16 tokens: the proportional set size
(/proc/PID/smaps_rollup Pss: shared pages split among their sharers) of the 4 forks, and of the 4 forks
plus their zygote, against one cold instance that holds the same (measured alone). Targets from
the snapshots issue: fork to first token <= 50 ms; 4 forks' PSS <= 1.5x one instance.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, emit_report, model_path


def pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("-n", "--prompt-tokens", type=int, default=1000)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    args = ap.parse_args()

    from lloyal_pool import Context, Instance, Pool

    path = model_path(args.model)
    n_ctx = (args.prompt_tokens + 64 + 255) // 256 * 256
    rng = random.Random(0)
    # Random tokens from the lower vocabulary (no special ones): the prompt's length is what matters.
    prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens)]

    prefill_s: dict[str, list[float]] = {"cold": [], "zygote": []}

    def cold_start() -> tuple[float, Pool, Context]:
        t0 = time.perf_counter()
        pool = Pool(1, threads_per_worker=args.threads)
        ctx = pool[0].load_model(path).new_context(n_ctx=n_ctx)
        t1 = time.perf_counter()
        ctx.eval(prompt)
        prefill_s["cold"].append(time.perf_counter() - t1)
        ctx.generate("", append=True, n_predict=1)
        return time.perf_counter() - t0, pool, ctx

    def prepare(instance: Instance) -> dict[str, Any]:
        ctx = instance.load_model(path).new_context(n_ctx=n_ctx, n_threads=args.threads)
        t1 = time.perf_counter()
        ctx.eval(prompt)  # a zygote computes on one thread
        prefill_s["zygote"].append(time.perf_counter() - t1)
        return {"ctx": ctx}

    report: dict[str, Any] = {"model": path.name, "threads": args.threads, "prompt_tokens": args.prompt_tokens}
    # Memory of one cold instance, measured while it is the only process that maps the model.
    _, pool, ctx = cold_start()
    ctx.generate("", append=True, n_predict=16)
    one = pss(pool[0].pid)
    pool.close()

    with Pool(1, threads_per_worker=args.threads) as host:
        t0 = time.perf_counter()
        snapshot = host.snapshot(prepare)
        report["snapshot_s"] = time.perf_counter() - t0  # spawn, load, prefill on one thread, freeze
        cold_s: list[float] = []
        fork_s: list[float] = []
        first_s: list[float] = []
        for _ in range(args.rounds):
            seconds, pool, _ctx = cold_start()
            cold_s.append(seconds)
            pool.close()
            t0 = time.perf_counter()
            fork = snapshot.fork()
            t1 = time.perf_counter()
            fork.prepared["ctx"].generate("", append=True, n_predict=1)  # type: ignore[union-attr]
            t2 = time.perf_counter()
            fork_s.append(t1 - t0)
            first_s.append(t2 - t1)
            fork.close()
        total = [a + b for a, b in zip(fork_s, first_s, strict=True)]
        report.update(
            cold_start_to_first_token_ms=1000 * statistics.median(cold_s),
            fork_to_first_token_ms=1000 * statistics.median(total),
            fork_ms=1000 * statistics.median(fork_s), first_token_after_fork_ms=1000 * statistics.median(first_s),
            speedup=statistics.median(cold_s) / statistics.median(total))

        forks = [snapshot.fork() for _ in range(4)]
        for fork in forks:
            fork.prepared["ctx"].generate("", append=True, n_predict=16)  # type: ignore[union-attr]
        four = sum(pss(f.pid) for f in forks)
        zygote = pss(snapshot._zygote.pid)
        report.update(pss_one_instance_mb=one / 1e6, pss_four_forks_mb=four / 1e6,
                      pss_four_forks_and_zygote_mb=(four + zygote) / 1e6,
                      four_forks_vs_one=four / one, four_forks_and_zygote_vs_one=(four + zygote) / one)
        for fork in forks:
            fork.close()
        snapshot.close()
    report.update(prefill_ms_cold=1000 * statistics.median(prefill_s["cold"]),
                  prefill_ms_zygote_one_thread=1000 * statistics.median(prefill_s["zygote"]))
    report["targets"] = {"fork_to_first_token_ms": 50.0, "four_forks_vs_one": 1.5}
    emit_report(report, args.json_out)


if __name__ == "__main__":
    main()
