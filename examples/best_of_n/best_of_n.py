#!/usr/bin/env python3
"""Best-of-N: fork N candidates from one prompt, advance them together (one batched decode per step),
keep the one the model finds most likely (lowest perplexity)."""

from __future__ import annotations

import codecs
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Pool, SamplerParams


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--candidates", type=int, default=6)
    ap.add_argument("-t", "--tokens", type=int, default=48)
    ap.add_argument("prompt", nargs="?", default="The best advice I ever got about writing was")
    args = ap.parse_args()

    with Pool(1) as pool:
        model = pool[0].load_model(model_path(args.model))
        ctx = model.new_context(n_ctx=1024, n_seq_max=args.candidates + 1)
        # The prompt is decoded once; every candidate shares its KV cells.
        root = ctx.branch(args.prompt, SamplerParams(temperature=0.9, top_k=40, top_p=0.95, seed=42))
        candidates = [root.fork(reseed=i) for i in range(1, args.candidates + 1)]
        texts = {b.handle: "" for b in candidates}
        utf8 = {b.handle: codecs.getincrementaldecoder("utf-8")("replace") for b in candidates}
        running = list(candidates)
        for _ in range(args.tokens):
            if not running:
                break
            # produce for every running candidate, then ONE llama_decode commits all their tokens (a
            # candidate that produced end-of-generation is not committed and drops out)
            produced = ctx.branches.step(running)
            for branch, p in zip(running, produced, strict=True):
                texts[branch.handle] += utf8[branch.handle].decode(p.piece)
            running = [b for b, p in zip(running, produced, strict=True) if not p.is_stop]

        ranked = sorted(candidates, key=lambda b: b.perplexity)
        for b in ranked:
            print(f"ppl {b.perplexity:7.2f}  {args.prompt}{texts[b.handle]!r}")
        best = ranked[0]
        ctx.branches.retain_only(best)  # keep the winner's KV, free the rest: it can go on from here
        print(f"\nbest (ppl {best.perplexity:.2f}), now the only branch at position {best.position}:")
        print(args.prompt + texts[best.handle])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
