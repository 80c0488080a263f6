#!/usr/bin/env python3
"""Entropy as a control signal: before each token, the model's entropy (computed from the branch's
logits in shared memory, no round trip) decides how to sample it. Confident: greedy. Unsure: sample.
Lost: explore three short futures on forks and keep the one the model likes best."""

from __future__ import annotations

import codecs
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Branch, Context, Pool, SamplerParams

# A mild repetition penalty in both modes: greedy decoding of a small model loops otherwise.
GREEDY = SamplerParams(repeat_penalty=1.2, repeat_last_n=64)
SAMPLE = SamplerParams(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.2, repeat_last_n=64, seed=7)


def explore(ctx: Context, branch: Branch, width: int, depth: int) -> tuple[Branch, list[bytes]]:
    """width forks, depth sampled tokens each (batched); returns the best fork and its tokens' bytes."""
    forks = [branch.fork() for _ in range(width)]
    for i, f in enumerate(forks):
        f.set_sampler_params(SAMPLE, seed=100 + i)
    tokens: dict[int, list[bytes]] = {f.handle: [] for f in forks}
    live = list(forks)
    for _ in range(depth):
        produced = ctx.branches.step(live)
        for f, p in zip(live, produced, strict=True):
            if not p.is_stop:
                tokens[f.handle].append(p.piece)
        live = [f for f, p in zip(live, produced, strict=True) if not p.is_stop]
        if not live:
            break
    best = min(forks, key=lambda f: f.perplexity)
    return best, tokens[best.handle]


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--tokens", type=int, default=60)
    ap.add_argument("--low", type=float, default=1.0, help="bits: below this, greedy")
    ap.add_argument("--high", type=float, default=4.0, help="bits: above this, explore forks")
    ap.add_argument("prompt", nargs="?", default="My favourite animal is the")
    args = ap.parse_args()

    with Pool(1) as pool:
        model = pool[0].load_model(model_path(args.model))
        ctx = model.new_context(n_ctx=1024, n_seq_max=5)
        branch = ctx.branch(args.prompt, GREEDY)
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        text, counts = "", {"greedy": 0, "sample": 0, "explore": 0}
        n = 0
        while n < args.tokens:
            bits = branch.model_entropy("bits")
            if bits > args.high:
                # Lost: look a few tokens ahead on three forks; the winner's tokens are already committed
                # on it, so it simply becomes the branch we continue.
                best, toks = explore(ctx, branch, width=3, depth=6)
                ctx.branches.retain_only(best)
                branch = best
                piece = "".join(utf8.decode(b) for b in toks)
                text += f"[{piece}]"
                counts["explore"] += 1
                n += max(1, len(toks))
                if len(toks) < 6:
                    break
                continue
            mode = "greedy" if bits < args.low else "sample"
            branch.set_sampler_params(GREEDY if mode == "greedy" else SAMPLE)
            p = branch.step()
            if p.is_stop:
                break
            text += utf8.decode(p.piece)
            counts[mode] += 1
            n += 1
        print(args.prompt + text)
        print(f"\n{counts['greedy']} greedy, {counts['sample']} sampled, {counts['explore']} explored "
              f"([...] marks tokens chosen by exploring); perplexity {branch.perplexity:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
