#!/usr/bin/env python3
"""Hot spares forked from a zygote against spares started cold (issue 27, item 2): Pool(1, recover=True,
spares=1, checkpoint_tokens=128) with fork_spares=True and False, Gemma loaded, rounds interleaved.

    .venv/bin/python bench/bench_spares.py [-m MODEL] [-t THREADS] [-r ROUNDS] [--json-out FILE]

Each round, on each pool:
- refill: SIGKILL the worker (idle, a context with a ~1,000-token conversation in it) and time until a
  spare is ready again (``pool.spares == 1``: started, the model loaded);
- no spare ready: SIGKILL the ready spare first, none started in its place (as when a second crash follows
  the first before a spare is back), then stream
  after the conversation and SIGKILL the worker after piece 12: the time until piece 13 (recovery finds
  no spare: a cold pool starts a worker and loads the model, a forking pool forks one from the zygote).
  The text must equal an uninterrupted run's.
Then the memory of a ready spare (psutil: PSS and USS, MiB) in each pool, and of the zygote.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, cpu_name, model_path
from bench_recovery import CONVERSATION_TOKENS, N_PREDICT, TEXT, kill_to_next_piece_ms

from lloyal_pool import Context, Pool

MIB = 1024 * 1024


def wait(condition: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.002)


def refill_ms(pool: Pool, ctx: Context) -> float:
    wait(lambda: pool.spares == 1)
    killed = time.perf_counter()
    os.kill(pool[0].pid, signal.SIGKILL)
    wait(lambda: pool.spares == 0)  # recovery took it
    wait(lambda: pool.spares == 1)
    ms = (time.perf_counter() - killed) * 1000.0
    ctx.n_past()  # the context is back
    return ms


def no_spare_ms(pool: Pool, ctx: Context, tokens: list[int], reference: str) -> float:
    wait(lambda: pool.spares == 1)
    spare = pool._spares._ready[0].proc
    pool._spares.wanted = 0  # no spare replaces it: the recovery finds none ready
    os.kill(spare.pid, signal.SIGKILL)
    wait(lambda: not spare.alive and pool.spares == 0)
    try:
        return kill_to_next_piece_ms(pool, ctx, tokens, reference)
    finally:
        pool._spares.wanted = 1
        pool._spares.fill()


def memory(pid: int) -> dict[str, float]:
    info = psutil.Process(pid).memory_full_info()
    return {"pss_mib": info.pss / MIB, "uss_mib": info.uss / MIB, "rss_mib": info.rss / MIB}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    args = ap.parse_args()
    model_file = str(model_path(args.model))
    print(f"CPU: {cpu_name()}; load average before: {os.getloadavg()[0]:.2f}")
    modes = {"fork": True, "cold": False}
    pools = {name: Pool(1, recover=True, spares=1, fork_spares=fork, checkpoint_tokens=128,
                        threads_per_worker=args.threads) for name, fork in modes.items()}
    figures: dict[str, dict[str, list[float]]] = {name: {"refill_ms": [], "no_spare_ms": []} for name in modes}
    report: dict[str, Any] = {"cpu": cpu_name()}
    try:
        contexts: dict[str, tuple[Context, list[int], str]] = {}
        for name, pool in pools.items():
            model = pool[0].load_model(model_file)
            if pool._spares.mode != name:
                raise RuntimeError(f"the {name} pool's spares are {pool._spares.mode}")
            ctx = model.new_context(n_ctx=2048, n_threads=args.threads)
            tokens = model.tokenize(TEXT * 40)[:CONVERSATION_TOKENS]
            reference = ctx.generate(tokens, n_predict=N_PREDICT, temperature=0.0, ignore_eos=True).text
            contexts[name] = (ctx, tokens, reference)
        def settle() -> None:
            """Every pool's spare ready and started: a cold one starting takes the CPU a measurement needs."""
            for pool in pools.values():
                wait(lambda pool=pool: pool.spares == 1)  # type: ignore[misc]
            time.sleep(1.0)

        for _ in range(args.rounds):
            for name, pool in pools.items():
                ctx, tokens, reference = contexts[name]
                settle()
                figures[name]["refill_ms"].append(refill_ms(pool, ctx))
                settle()
                figures[name]["no_spare_ms"].append(no_spare_ms(pool, ctx, tokens, reference))
        for name, pool in pools.items():
            wait(lambda pool=pool: pool.spares == 1)  # type: ignore[misc]
            time.sleep(1.0)  # the spare's own start-up work done
            report[name] = {**figures[name], "spare_memory": memory(pool._spares._ready[0].proc.pid)}
            zygote = pool._spares._zygote
            if zygote is not None:
                report[name]["zygote_memory"] = memory(zygote.proc.pid)
    finally:
        for pool in pools.values():
            pool.close()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"\nPool(1, recover=True, spares=1, checkpoint_tokens=128), {args.rounds} rounds (median, then rounds):")
    for name in modes:
        r = report[name]
        for key, what in (("refill_ms", "SIGKILL -> a spare ready again"),
                          ("no_spare_ms", f"no spare ready: SIGKILL -> next piece ({CONVERSATION_TOKENS}-token chat)")):
            print(f"  {name:5} {what:58} {statistics.median(r[key]):7.0f} ms   {[round(v) for v in r[key]]}")
        mem = r["spare_memory"]
        line = (f"  {name:5} a ready spare: PSS {mem['pss_mib']:.0f} MiB, USS {mem['uss_mib']:.0f} MiB, "
                f"RSS {mem['rss_mib']:.0f} MiB")
        if "zygote_memory" in r:
            z = r["zygote_memory"]
            line += f"; the zygote: PSS {z['pss_mib']:.0f} MiB, USS {z['uss_mib']:.0f} MiB"
        print(line)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
