#!/usr/bin/env python3
"""An interactive chat in the terminal: each line you type is a user turn, the reply streams as it is
decoded. A Session formats the whole conversation every turn and reuses the context's cache, so only the
new turn's tokens are decoded (the stats line after each reply says how many were reused). Ctrl-C stops
a reply (what it got to stays in the conversation); Ctrl-D ends."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Pool

# The default model (Gemma 3 270M) is a base model: it ranks <end_of_turn> tens of thousands of places down
# and would never end a turn on its own. This logit bias lets it end its turns.
END_OF_TURN_BIAS = 12.0


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--template", help="chat format (gemma, chatml, llama3) or Jinja; default: the model's own")
    ap.add_argument("--system", help="a system message")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="most tokens per reply")
    args = ap.parse_args()

    with Pool(1) as pool:
        model = pool[0].load_model(model_path(args.model))
        ctx = model.new_context(n_ctx=4096)
        template, bias = args.template, {}
        if template is None and model.info.chat_template is None:
            template = "gemma"
            (eot,) = model.tokenize("<end_of_turn>", add_special=False, parse_special=True)
            bias = {eot: END_OF_TURN_BIAS}
            print("(no chat template in the model: the Gemma format, with a bias on <end_of_turn>)", file=sys.stderr)
        session = ctx.chat(args.system, template=template, n_predict=args.n_predict, logit_bias=bias)
        tty = sys.stdin.isatty()
        while True:
            try:
                line = input("you> ") if tty else sys.stdin.readline()
            except EOFError:
                break
            except KeyboardInterrupt:
                print()
                continue
            if not line:  # end of piped input
                break
            if not line.strip():
                continue
            print("model> ", end="", flush=True)
            stream = session.stream(line.strip())
            try:
                for piece in stream:
                    print(piece, end="", flush=True)
            except KeyboardInterrupt:
                stream.interrupt()  # stops this reply; the program goes on
            r = stream.reply.result
            print(f"\n  [{r.n_prompt - r.n_cached} prompt tokens decoded, {r.n_cached} reused; "
                  f"{r.n_decoded} generated; {r.stop_reason.value}]", flush=True)
        print(f"{len(session.messages)} messages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
