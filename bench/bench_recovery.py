#!/usr/bin/env python3
"""Crash recovery of a running stream, with and without a hot spare and background checkpoints (issue 27,
item 2): the time from a SIGKILL of the worker to the next piece of a greedy stream that continues a
~1,000-token conversation, on Pool(1, recover=True), with spares=1, and with spares=1 and
checkpoint_tokens=256.

    .venv/bin/python bench/bench_recovery.py [-m MODEL] [-t THREADS] [-r ROUNDS] [--json-out FILE]

Each round: a stream of 48 tokens after the conversation; the worker is killed after its 12th piece and
the time until the 13th arrives is taken (recovery: a worker, the model loaded, the context restored from
its journal, the generation sent again, its first 12 pieces decoded again and not delivered twice). The
text must equal an uninterrupted run's. Rounds alternate between the two pools. Timings on a shared
machine range widely: check the load average it prints.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, model_path

from lloyal_pool import Pool

CONVERSATION_TOKENS, N_PREDICT, KILL_AT = 1000, 48, 12
TEXT = ("The lighthouse keeper wrote in his log every night: the wind, the ships, the lamp's oil, and what the "
        "sea had brought to the rocks below. In the spring of the storm he wrote more than ever before. ")


def load() -> float:
    return os.getloadavg()[0]


def one_round(pool: Pool, spares: int, threads: int) -> dict[str, Any]:
    model = pool[0].models[0]
    ctx = model.new_context(n_ctx=2048, n_threads=threads)
    try:
        tokens = model.tokenize(TEXT * 40)[:CONVERSATION_TOKENS]
        params: dict[str, Any] = {"n_predict": N_PREDICT, "temperature": 0.0, "ignore_eos": True}
        reference = ctx.generate(tokens, **params).text
        journal = ctx._link.journal  # a background checkpoint (checkpoint_tokens) lands before the kill
        deadline = time.monotonic() + 30
        while journal is not None and journal._checkpointing and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.01)
        deadline = time.monotonic() + 120
        while pool.spares < spares and time.monotonic() < deadline:  # a fresh spare, its model loaded
            time.sleep(0.05)
        pieces: list[str] = []
        killed = resumed = 0.0
        with ctx.stream(tokens, **params) as stream:
            for piece in stream:
                pieces.append(piece)
                if len(pieces) == KILL_AT:
                    killed = time.perf_counter()
                    os.kill(pool[0].pid, signal.SIGKILL)
                elif len(pieces) == KILL_AT + 1:
                    resumed = time.perf_counter()
        if "".join(pieces) != reference:
            raise RuntimeError("the recovered stream's text differs from an uninterrupted run's")
        return {"kill_to_next_piece_ms": (resumed - killed) * 1000.0}
    finally:
        ctx.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    args = ap.parse_args()
    model_file = str(model_path(args.model))
    print(f"load average before: {load():.2f}")
    configs: dict[str, dict[str, Any]] = {
        "spares=0": {"spares": 0},
        "spares=1": {"spares": 1},
        "spares=1, checkpoint_tokens=256": {"spares": 1, "checkpoint_tokens": 256},
    }
    figures: dict[str, list[float]] = {name: [] for name in configs}
    pools = {name: Pool(1, recover=True, threads_per_worker=args.threads, **config)
             for name, config in configs.items()}
    try:
        for pool in pools.values():
            pool[0].load_model(model_file)
        for _ in range(args.rounds):
            for name, pool in pools.items():
                figures[name].append(one_round(pool, configs[name]["spares"], args.threads)["kill_to_next_piece_ms"])
    finally:
        for pool in pools.values():
            pool.close()
    print(f"load average after: {load():.2f}")
    print(f"\nSIGKILL -> next streamed piece, {CONVERSATION_TOKENS}-token conversation, killed after piece {KILL_AT}:")
    report: dict[str, Any] = {}
    for name, values in figures.items():
        report[name] = {"ms": values, "median_ms": statistics.median(values)}
        print(f"  {name:32} median {statistics.median(values):7.0f} ms   rounds {[round(v) for v in values]}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
