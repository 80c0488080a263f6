#!/usr/bin/env python3
"""Prepare once, serve many: a long instruction prompt is prefilled once in a snapshot, then each
question gets its own forked instance that already holds it, answered in parallel threads."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Context, Instance, Pool

INSTRUCTIONS = (
    "The following is a reference card for the Lakeside Museum.\n"
    "Opening hours: nine in the morning to five in the evening, closed on Mondays.\n"
    "Tickets: twelve euros for adults, free for children under twelve.\n"
    "Cafe: on the second floor, serving coffee, tea and cakes.\n"
    "Guided tours: every hour on the hour, starting at the main entrance.\n\n"
)
QUESTIONS = ["Q: When does the museum open?\nA:", "Q: Where is the cafe?\nA:",
             "Q: How much is a ticket for an adult?\nA:", "Q: When do guided tours start?\nA:"]


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--questions", type=int, default=len(QUESTIONS))
    ap.add_argument("-t", "--tokens", type=int, default=16)
    args = ap.parse_args()
    path = model_path(args.model)

    def prepare(instance: Instance) -> dict[str, Context]:
        ctx = instance.load_model(path).new_context(n_ctx=1024)
        ctx.eval(INSTRUCTIONS)  # decoded once, here
        return {"card": ctx}

    with Pool(1) as pool:
        t0 = time.perf_counter()
        snapshot = pool.snapshot(prepare)
        print(f"prepared in {time.perf_counter() - t0:.2f}s (mode: {snapshot.mode})")

        def answer(question: str) -> str:
            t1 = time.perf_counter()
            fork = snapshot.fork()  # its own worker, holding the prefilled card
            ready = time.perf_counter() - t1
            try:
                card = fork.prepared["card"]
                assert isinstance(card, Context)
                r = card.generate(question, append=True, n_predict=args.tokens, stop=["\n"])
                return f"[fork {fork.pid}: ready in {1000 * ready:.0f} ms, {r.n_prompt} prompt tokens] " \
                       f"{question.splitlines()[0]} ->{r.text}"
            finally:
                fork.close()

        with ThreadPoolExecutor(max_workers=2) as threads:
            for line in threads.map(answer, QUESTIONS[: args.questions]):
                print(line)
        snapshot.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
