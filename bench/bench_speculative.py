#!/usr/bin/env python3
"""Speculative decoding against plain generation, greedy, in the same run: tokens per second, acceptance
rate and target decodes per generated token, for the ngram drafter (prompt lookup) and a draft model.

    .venv/bin/python bench/bench_speculative.py [-m MODEL] [--draft-model GGUF] [-t THREADS] [-r ROUNDS]
                                                [-n TOKENS] [--n-draft N] [--prompt TEXT]

The default prompt is one Gemma 3 270M's base model loops on ("The capital of France is"), which is
where prompt lookup pays off; the default draft model is Gemma truncated to its first 4 blocks (written
once into the user's cache by tests/gemmadraft.py; same vocabulary, untrained for that depth, so a
modest acceptance rate). Each round runs plain, ngram and draft-model generation once each, in that
order, on fresh contexts; the report keeps the medians of each. Target (instances issue): ngram >= 1.5x
plain on the repetitive prompt.

Target decodes per token: each verification is one decode of the target, which emits the accepted drafts
plus the target's own next choice, so it is (n_decoded - n_accepted) / n_decoded (1.0 for plain).
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


def default_draft(target: Path, n_layers: int) -> Path:
    from gemmadraft import gemma_draft_path  # tests/gemmadraft.py: the suite's fixture, same cache

    return gemma_draft_path(ROOT / ".cache" / "test-models", target, n_layers=n_layers)


def run(ctx: Any, prompt: str, n: int, **kw: Any) -> dict[str, float]:
    if kw:
        r = ctx.generate_with_draft(prompt, n_predict=n, ignore_eos=True, cache_prompt=False, **kw)
    else:
        r = ctx.generate(prompt, n_predict=n, ignore_eos=True, cache_prompt=False)
    return {"tok_s": r.decode_tokens_per_second, "acceptance": r.acceptance_rate,
            "decodes_per_token": (r.n_decoded - r.n_accepted) / r.n_decoded, "n_drafted": r.n_drafted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap)
    ap.add_argument("--draft-model", help="GGUF with the target's vocabulary (default: Gemma truncated to 4 blocks)")
    ap.add_argument("--draft-layers", type=int, default=4, help="blocks of the default truncated-Gemma draft")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("-n", "--tokens", type=int, default=256)
    ap.add_argument("--n-draft", type=int, default=8)
    ap.add_argument("--n-draft-model", type=int, default=4, help="n_draft for the draft model")
    ap.add_argument("--prompt", default="The capital of France is")
    args = ap.parse_args()

    from lloyal_pool import Pool

    path = model_path(args.model)
    draft_path = Path(args.draft_model) if args.draft_model else default_draft(path, args.draft_layers)
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "ngram": [], "draft_model": []}
    with Pool(1, threads_per_worker=args.threads) as pool:
        target = pool[0].load_model(path)
        small = pool[0].load_model(draft_path)
        n_ctx = 2 * args.tokens + 256
        for i in range(args.rounds):
            for name in rows:
                ctx = target.new_context(n_ctx=n_ctx)
                draft = small.new_context(n_ctx=n_ctx) if name == "draft_model" else None
                try:
                    if name == "plain":
                        rows[name].append(run(ctx, args.prompt, args.tokens))
                    elif name == "ngram":
                        rows[name].append(run(ctx, args.prompt, args.tokens, draft="ngram", n_draft=args.n_draft))
                    else:
                        rows[name].append(run(ctx, args.prompt, args.tokens, draft=draft,
                                              n_draft=args.n_draft_model))
                finally:
                    ctx.close()
                    if draft is not None:
                        draft.close()
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]['tok_s']:.1f} tok/s" for k, v in rows.items()),
                  file=sys.stderr)
    med = {k: {m: round(statistics.median(r[m] for r in v), 3) for m in v[0]} for k, v in rows.items()}
    plain = med["plain"]["tok_s"]
    report = {"model": str(path), "draft_model": str(draft_path), "threads": args.threads, "tokens": args.tokens,
              "rounds": args.rounds, "prompt": args.prompt, "n_draft": args.n_draft,
              "n_draft_model": args.n_draft_model, "median": med,
              "speedup": {k: round(v["tok_s"] / plain, 2) for k, v in med.items()}}
    emit_report(report, args.json_out)
    print(f"\n{'':12} {'tok/s':>8} {'speedup':>8} {'accept':>8} {'decodes/token':>14}")
    for k, v in med.items():
        print(f"{k:12} {v['tok_s']:8.1f} {v['tok_s'] / plain:7.2f}x {v['acceptance']:8.2f} "
              f"{v['decodes_per_token']:14.2f}")
    print("target: ngram >= 1.5x plain on the repetitive prompt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
