#!/usr/bin/env python3
"""Infinite context in a fixed KV cache (BlinkKV): when the branch nears the end of the context,
clear_and_reseed() rebuilds the cache from a few attention-sink tokens (the start of the prompt) and the
most recent tail, and generation goes on. The branch keeps its handle, sampler and perplexity, so
the per-segment perplexity shows what each reseed costs."""

from __future__ import annotations

import codecs
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Pool, SamplerParams


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--tokens", type=int, default=600)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--tail", type=int, default=128)
    ap.add_argument("prompt", nargs="?", default="Chapter 1. The lighthouse keeper woke before dawn, as always, and")
    args = ap.parse_args()

    with Pool(1) as pool:
        model = pool[0].load_model(model_path(args.model))
        ctx = model.new_context(n_ctx=args.n_ctx, n_seq_max=1)
        prompt = model.tokenize(args.prompt)
        branch = ctx.branch(prompt, SamplerParams(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1,
                                                  repeat_last_n=64, seed=5))
        history = list(prompt)
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        seg_start = (0, 0.0)  # (tokens accepted, their total surprisal) at the last reseed
        reseeds = 0
        for _ in range(args.tokens):
            if branch.position >= args.n_ctx - 1:
                info = branch.info()
                total = math.log(info.perplexity) * info.n_accepted
                seg = math.exp((total - seg_start[1]) / (info.n_accepted - seg_start[0]))
                seg_start = (info.n_accepted, total)
                reseeds += 1
                # sinks: the first tokens, always the same; tail: the most recent tokens
                ctx.clear_and_reseed(history[:args.sinks], history[-args.tail:])
                print(f"\n--- reseed {reseeds}: segment perplexity {seg:.2f}, "
                      f"cache {args.sinks}+{args.tail} tokens, position {branch.position} ---", flush=True)
            p = branch.step()
            if p.is_stop:
                break
            history.append(p.token)
            print(utf8.decode(p.piece), end="", flush=True)
        print(f"\n\n{len(history) - len(prompt)} tokens through a {args.n_ctx}-token cache, {reseeds} reseeds, "
              f"perplexity {branch.perplexity:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
