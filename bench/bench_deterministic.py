#!/usr/bin/env python3
"""What a deterministic batcher costs: 8 concurrent requests (different 128-token prompts, 64 greedy tokens
each, all arriving at once) on Model.batcher() of a model loaded as usual, and on
Model.batcher(deterministic=True) of the model loaded with repack=False, in alternating rounds. Also one
request alone on each (single-stream decode speed), and how many of the 8 batched requests give the tokens
they give alone on the same batcher (the deterministic one must give all 8).

    .venv/bin/python bench/bench_deterministic.py [-m MODEL] [-t THREADS] [-r ROUNDS] [--json-out FILE]
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

from lloyal_pool import GenerateParams, Pool

N_REQ, N_PROMPT, N_GEN, N_CTX_SLOT = 8, 128, 64, 256


def prompts(n_vocab: int, bos: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[bos] + [rng.randrange(1000, n_vocab) for _ in range(N_PROMPT - 1)] for _ in range(N_REQ)]


def run(model_file: Path, threads: int, deterministic: bool, load: list[list[int]]) -> dict[str, Any]:
    with Pool(1, threads_per_worker=threads) as pool:
        model = pool[0].load_model(model_file, repack=not deterministic)
        batcher = model.batcher(slots=N_REQ, n_ctx_slot=N_CTX_SLOT, deterministic=deterministic)
        params = GenerateParams(n_predict=N_GEN, ignore_eos=True)
        batcher.generate(load[0][:16], n_predict=8)  # warm-up
        t0 = time.perf_counter()
        solo = batcher.generate(load[0], params)
        solo_s = time.perf_counter() - t0
        alone = [solo] + [batcher.generate(p, params) for p in load[1:]]
        t0 = time.perf_counter()
        together = [h.future.result() for h in [batcher.submit(p, params) for p in load]]
        wall = time.perf_counter() - t0
        return {"tps_batched": sum(r.n_decoded for r in together) / wall,
                "tps_alone": solo.decode_tokens_per_second, "alone_wall_s": solo_s,
                "same_as_alone": sum(a.tokens == t.tokens for a, t in zip(alone, together, strict=True))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    args = ap.parse_args()
    model_file = model_path(args.model)
    with Pool(1) as probe:
        m = probe[0].load_model(model_file, vocab_only=True)
        n_vocab, bos = m.n_vocab, m.info.bos

    rows: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for i in range(args.rounds):
        load = prompts(n_vocab, bos, seed=200 + i)
        for deterministic in ((False, True) if i % 2 == 0 else (True, False)):
            rows[deterministic].append(run(model_file, args.threads, deterministic, load))

    def med(rs: list[dict[str, Any]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in rs) for k in rs[0]}

    default, det = med(rows[False]), med(rows[True])
    report = {"model": model_file.name, "threads": args.threads, "rounds": args.rounds, "requests": N_REQ,
              "n_gen": N_GEN, "default": default, "deterministic": det,
              "ratios": {"batched_tps": det["tps_batched"] / default["tps_batched"],
                         "alone_tps": det["tps_alone"] / default["tps_alone"]},
              "per_round": {"default": rows[False], "deterministic": rows[True]}}
    emit_report(report, args.json_out)
    print(f"\n8 batched requests: {default['tps_batched']:.1f} tok/s default, {det['tps_batched']:.1f} deterministic "
          f"({report['ratios']['batched_tps']:.3f}x); one alone: {default['tps_alone']:.1f} vs {det['tps_alone']:.1f} "
          f"tok/s ({report['ratios']['alone_tps']:.3f}x)")
    print(f"requests whose batched tokens equal their own alone: default {rows[False][-1]['same_as_alone']}/8, "
          f"deterministic {rows[True][-1]['same_as_alone']}/8 (last round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
