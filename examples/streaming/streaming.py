#!/usr/bin/env python3
"""Infinite context in a fixed KV cache (BlinkKV) with sidecar summarization: when the branch nears the
end of the context, clear_and_reseed() rebuilds the cache from a few attention-sink tokens (the start of
the prompt), a short summary of the text it is about to evict, and the most recent tail, and generation
goes on. The summary is written by a sidecar, a second context on the same model. The branch keeps its
handle, sampler and perplexity, so the per-segment perplexity shows what each reseed costs."""

from __future__ import annotations

import codecs
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Context, GenerateParams, Model, Pool, SamplerParams

# The summary is one line that starts with a word (after at most one space): a grammar, not a hope, so
# that a greedy sidecar never returns an empty summary or wanders into a second paragraph. It may end (end
# of turn) after any character, and n_predict bounds it.
ONE_LINE = r'root ::= [ ]? [A-Za-z0-9"(] [^\n]*'

INSTRUCTION = "Summarize the story in one sentence."
EARLIER = 2  # how many earlier summaries the sidecar sees, as the turns before the new one


class Sidecar:
    """Summarizes evicted text on its own context of the same model: the weights are shared, only the KV
    cache (and the time to decode) is extra. It sees what its earlier summaries said as the conversation
    before the new request, so names and events carry over from one summary to the next."""

    def __init__(self, model: Model, n_ctx: int, max_tokens: int) -> None:
        self.model = model
        # Room for the whole prompt (the earlier turns, the instruction, the evicted text: less than
        # n_ctx tokens) and the summary it generates.
        self.ctx: Context = model.new_context(n_ctx=n_ctx + (EARLIER + 1) * (max_tokens + 32) + 64, n_seq_max=1)
        self.template = None if model.info.chat_template else "gemma"  # the default model's file has none
        self.params = GenerateParams(n_predict=max_tokens, grammar=ONE_LINE)  # temperature 0: greedy
        self.summaries: list[str] = []
        self.seconds = 0.0  # time spent summarizing: the sidecar's cost

    def summarize(self, evicted: Sequence[int]) -> list[int]:
        """A summary of the evicted tokens, in the light of the earlier summaries; returns its token ids."""
        start = time.perf_counter()
        text = self.model.detokenize(evicted, remove_special=True)
        # Every request starts the same way, so the sidecar's prompt cache reuses those tokens. The earlier
        # summaries come as earlier turns (their stories elided). The model's turn starts with "Summary:",
        # which a small model needs to write one rather than copy the story.
        messages = []
        for earlier in self.summaries[-EARLIER:]:
            messages += [{"role": "user", "content": f"{INSTRUCTION}\n\nStory: ..."},
                         {"role": "assistant", "content": f"Summary: {earlier}"}]
        messages.append({"role": "user", "content": f"{INSTRUCTION}\n\nStory: ...{text}"})
        prompt = self.model.apply_chat_template(messages, template=self.template) + "Summary:"
        r = self.ctx.generate(self.model.tokenize(prompt, parse_special=True), self.params)
        self.summaries.append(r.text.strip())
        self.seconds += time.perf_counter() - start
        return r.tokens


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--tokens", type=int, default=600)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--tail", type=int, default=128)
    ap.add_argument("--summary-tokens", type=int, default=48,
                    help="most tokens the summary takes in the cache, its markers included")
    ap.add_argument("--no-summary", action="store_true", help="reseed with sinks + tail only, no sidecar")
    ap.add_argument("prompt", nargs="?", default="Chapter 1. The lighthouse keeper woke before dawn, as always, and")
    args = ap.parse_args()

    with Pool(1) as pool:
        model = pool[0].load_model(model_path(args.model))
        # The summary sits between the sinks and the tail, inside these markers (plain text, like the story).
        opening = model.tokenize("\n\n(Earlier: ", add_special=False)
        closing = model.tokenize(")\n\n", add_special=False)
        budget = 0 if args.no_summary else args.summary_tokens
        # The cap is what makes the scheme work: a reseed decodes sinks + summary + tail from position 0, so
        # they must fit in n_ctx, and the room left after them is how many tokens the branch generates
        # before the next reseed (and the next summary). An uncapped summary could fill the cache and
        # leave no room, or reseed (and summarize) every few tokens. So the summary's tokens, markers
        # included, never exceed --summary-tokens, and this refuses settings that leave no room.
        room = args.n_ctx - 1 - (args.sinks + budget + args.tail)
        if room < 1:
            ap.error(f"--sinks {args.sinks} + summary {budget} + --tail {args.tail} leave no room to generate "
                     f"in --n-ctx {args.n_ctx}")
        if budget and budget <= len(opening) + len(closing):
            ap.error(f"--summary-tokens must be more than the {len(opening) + len(closing)} tokens of its markers")
        sidecar = None if args.no_summary else Sidecar(model, args.n_ctx, budget - len(opening) - len(closing))

        ctx = model.new_context(n_ctx=args.n_ctx, n_seq_max=1)
        prompt = model.tokenize(args.prompt)
        branch = ctx.branch(prompt, SamplerParams(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1,
                                                  repeat_last_n=64, seed=5))
        # An endless stream: end-of-generation tokens are banned, so the story goes on for --tokens.
        branch.set_logit_bias({t: -math.inf for t in model.eog_tokens})
        history = list(prompt)
        kept = args.sinks  # history[kept:] is what the cache holds after the sinks (and the summary)
        memory: list[int] = []  # the summary tokens, markers included, that the cache holds
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        seg_start = (0, 0.0)  # (tokens accepted, their total surprisal) at the last reseed
        reseeds = summaries = 0
        for _ in range(args.tokens):
            if branch.position >= args.n_ctx - 1:
                info = branch.info()
                total = math.log(info.perplexity) * info.n_accepted
                seg = math.exp((total - seg_start[1]) / (info.n_accepted - seg_start[0]))
                seg_start = (info.n_accepted, total)
                reseeds += 1
                # evicted: what lies between the sinks (and the old summary) and the tail that is kept
                evicted = history[kept:len(history) - args.tail]
                kept = len(history) - args.tail
                if sidecar is not None and evicted:
                    took = sidecar.seconds
                    tokens = sidecar.summarize(evicted)
                    summaries += 1
                    memory = opening + tokens + closing if tokens else []
                    print(f"\n[summary {summaries}: {len(tokens)} tokens of {len(evicted)} evicted, "
                          f"{sidecar.seconds - took:.2f} s] {sidecar.summaries[-1]}", flush=True)
                # sinks: the first tokens, always the same; then the summary; tail: the most recent tokens
                ctx.clear_and_reseed(history[:args.sinks] + memory, history[-args.tail:])
                print(f"\n--- reseed {reseeds}: segment perplexity {seg:.2f}, cache "
                      f"{args.sinks}+{len(memory)}+{args.tail} tokens, position {branch.position} ---", flush=True)
            p = branch.step()
            if p.is_stop:
                break
            history.append(p.token)
            print(utf8.decode(p.piece), end="", flush=True)
        cost = f" ({sidecar.seconds:.2f} s in the sidecar)" if sidecar is not None else ""
        print(f"\n\n{len(history) - len(prompt)} tokens through a {args.n_ctx}-token cache, {reseeds} reseeds, "
              f"{summaries} summaries{cost}, perplexity {branch.perplexity:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
