#!/usr/bin/env python3
"""Speculative decoding with branches: a greedy drafter runs ahead k tokens on a chain of forks, the
target's sampler verifies them against the logits captured at each step, the longest accepted prefix is
kept (retain_only on the fork that holds it), and one more token comes from the target: the correction
at the first rejection, or a bonus token when every draft was accepted."""

from __future__ import annotations

import codecs
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Branch, Pool


def target_probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    return p / p.sum()


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("-k", "--draft", type=int, default=4, help="tokens drafted per round")
    ap.add_argument("-t", "--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7, help="the target's sampling temperature")
    ap.add_argument("prompt", nargs="?", default="A short history of the bicycle: the first bicycles")
    args = ap.parse_args()
    rng = np.random.default_rng(0)

    with Pool(1) as pool:
        model = pool[0].load_model(model_path(args.model))
        ctx = model.new_context(n_ctx=1024, n_seq_max=args.draft + 2)
        main_branch: Branch = ctx.branch(args.prompt)  # greedy sampler: the drafter
        out = codecs.getincrementaldecoder("utf-8")("replace")
        text, n_out, rounds, accepted_total = "", 0, 0, 0
        eos = False
        while n_out < args.tokens and not eos:
            rounds += 1
            # Draft: each fork commits one greedy token, so fork i holds the first i drafted tokens and the
            # logits that come after them. Nothing is decoded twice.
            chain, drafted, captured = [main_branch], [], [main_branch.logits.copy()]
            pieces: list[bytes] = []  # the drafted tokens' bytes, as produce returned them
            for _ in range(args.draft):
                fork = chain[-1].fork()
                p = fork.step()
                if p.is_stop:
                    fork.prune()
                    break
                chain.append(fork)
                drafted.append(p.token)
                pieces.append(p.piece)
                captured.append(fork.logits.copy())
            # Verify: a deterministic drafter proposes d with probability 1, so the target accepts it with
            # probability p_target(d); on a rejection it samples from p_target with d removed.
            n_ok, extra = 0, -1
            for d, logits in zip(drafted, captured, strict=False):
                p = target_probs(logits, args.temperature)
                if rng.random() < p[d]:
                    n_ok += 1
                    continue
                p[d] = 0.0
                extra = int(rng.choice(len(p), p=p / p.sum()))
                break
            if extra < 0:  # every draft accepted: the bonus token, from the logits after the last one
                extra = int(rng.choice(len(captured[n_ok]), p=target_probs(captured[n_ok], args.temperature)))
            # Keep the fork that holds the accepted prefix; every other fork (and its KV) goes.
            keep = chain[n_ok]
            ctx.branches.retain_only(keep)
            main_branch = keep
            accepted_total += n_ok
            for piece in pieces[:n_ok]:
                text += out.decode(piece)
            n_out += n_ok
            eos = extra == model.info.eos
            if not eos:
                main_branch.commit(extra)
                text += out.decode(model.token_to_piece(extra))
                n_out += 1

        print(args.prompt + text)
        print(f"\n{n_out} tokens in {rounds} rounds: {accepted_total} drafted tokens accepted "
              f"({accepted_total / max(1, rounds * args.draft):.0%} of drafted), "
              f"{n_out / rounds:.2f} tokens per target step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
