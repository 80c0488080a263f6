#!/usr/bin/env python3
"""Crash recovery of a running stream, with and without a hot spare and background checkpoints (issue 27,
item 2): the time from a SIGKILL of the worker to the next piece of a greedy stream that continues a
~1,000-token conversation, on Pool(1, recover=True), with spares=1, and with spares=1 and
checkpoint_tokens=256 and 128 (a stream is checkpointed whenever decoding it again would cost that many
prompt tokens, a generated token costing 16: every 16 and 8 generated tokens; a pause, its state saved,
resumed; the uninterrupted stream's time says what that costs).

    .venv/bin/python bench/bench_recovery.py [-m MODEL] [-t THREADS] [-r ROUNDS] [--json-out FILE]

Each round: a stream of 48 tokens after the conversation; the worker is killed after its 12th piece and
the time until the 13th arrives is taken (recovery: a worker, the model loaded, the context restored from
its journal, the generation sent again, its first 12 pieces decoded again and not delivered twice). The
text must equal an uninterrupted run's. Rounds alternate between the pools.

Then (--prompt-rounds, default 1; 0 skips it) a killed long prompt: a stream, and a generate() with
on_piece, of a 3,400-token prompt (n_ctx 4096) whose worker is killed once 2,600 of its tokens are decoded
(its progress callback says when), on Pool(1, recover=True, spares=1) with and without
checkpoint_tokens=256 (which checkpoints a prompt every 256 tokens: paused between two ubatches, saved, sent
again). Reported: the time
from the kill to the first piece, and to the end, against the same stream uninterrupted; the text must
be the uninterrupted one's. Timings on a shared machine range widely: check the load average it prints.
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

from lloyal_pool import Context, Pool

CONVERSATION_TOKENS, N_PREDICT, KILL_AT = 1000, 48, 12
LONG_PROMPT_TOKENS, LONG_KILL_AT, LONG_N_PREDICT = 3400, 2600, 16
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
        t0 = time.perf_counter()
        with ctx.stream(tokens, **params) as stream:  # uninterrupted: what the checkpoints cost a stream
            if "".join(stream) != reference:
                raise RuntimeError("a stream's text differs from generate's")
        stream_ms = (time.perf_counter() - t0) * 1000.0
        link = ctx._link  # a background checkpoint (checkpoint_tokens) lands before the kill
        link.core.wait_for(lambda: not link.state.checkpointing, 30)
        deadline = time.monotonic() + 120
        while pool.spares < spares and time.monotonic() < deadline:  # a fresh spare, its model loaded
            time.sleep(0.05)
        return {"kill_to_next_piece_ms": kill_to_next_piece_ms(pool, ctx, tokens, reference), "stream_ms": stream_ms}
    finally:
        ctx.close()


def kill_to_next_piece_ms(pool: Pool, ctx: Context, tokens: list[int], reference: str) -> float:
    """Streams N_PREDICT greedy tokens after ``tokens``, SIGKILLs the worker after piece KILL_AT and
    returns the time until the next piece; the text must be ``reference``."""
    pieces: list[str] = []
    killed = resumed = 0.0
    with ctx.stream(tokens, n_predict=N_PREDICT, temperature=0.0, ignore_eos=True) as stream:
        for piece in stream:
            pieces.append(piece)
            if len(pieces) == KILL_AT:
                killed = time.perf_counter()
                os.kill(pool[0].pid, signal.SIGKILL)
            elif len(pieces) == KILL_AT + 1:
                resumed = time.perf_counter()
    if "".join(pieces) != reference:
        raise RuntimeError("the recovered stream's text differs from an uninterrupted run's")
    return (resumed - killed) * 1000.0


def long_prompt_round(pool: Pool, threads: int, call: str = "stream") -> dict[str, Any]:
    """A generation of a LONG_PROMPT_TOKENS prompt (``call``: a stream, or generate() with on_piece),
    uninterrupted, then killed at LONG_KILL_AT."""
    model = pool[0].models[0]
    tokens = model.tokenize(TEXT * 120)[:LONG_PROMPT_TOKENS]
    params: dict[str, Any] = {"n_predict": LONG_N_PREDICT, "temperature": 0.0, "ignore_eos": True}
    figures: dict[str, Any] = {}
    texts = []
    for kill in (False, True):
        deadline = time.monotonic() + 120
        while pool.spares < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        ctx = model.new_context(n_ctx=4096, n_threads=threads)
        killed: list[float] = []

        def progress(done: int, total: int, kill: bool = kill, killed: list[float] = killed) -> None:
            if kill and done >= LONG_KILL_AT and not killed:
                killed.append(time.perf_counter())
                os.kill(pool[0].pid, signal.SIGKILL)

        try:
            t0 = time.perf_counter()
            pieces: list[str] = []
            at: list[float] = []  # when each piece came

            def on_piece(piece: str, pieces: list[str] = pieces, at: list[float] = at) -> None:
                at.append(time.perf_counter())
                pieces.append(piece)

            if call == "stream":
                with ctx.stream(tokens, progress=progress, **params) as stream:
                    for piece in stream:
                        on_piece(piece)
            else:
                ctx.generate(tokens, progress=progress, on_piece=on_piece, **params)
            end, first = time.perf_counter(), at[0]
            texts.append("".join(pieces))
            if kill:
                figures["kill_to_first_piece_ms"] = (first - killed[0]) * 1000.0
                figures["kill_to_end_ms"] = (end - killed[0]) * 1000.0
            else:
                figures["uninterrupted_ms"] = (end - t0) * 1000.0
                figures["uninterrupted_first_piece_ms"] = (first - t0) * 1000.0
        finally:
            ctx.close()
    if texts[0] != texts[1]:
        raise RuntimeError("the recovered long prompt's text differs from an uninterrupted run's")
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--prompt-rounds", type=int, default=1)
    args = ap.parse_args()
    model_file = str(model_path(args.model))
    print(f"load average before: {load():.2f}")
    configs: dict[str, dict[str, Any]] = {
        "spares=0": {"spares": 0},
        "spares=1": {"spares": 1},
        "spares=1, checkpoint_tokens=256": {"spares": 1, "checkpoint_tokens": 256},
        "spares=1, checkpoint_tokens=128": {"spares": 1, "checkpoint_tokens": 128},
    }
    figures: dict[str, list[float]] = {name: [] for name in configs}
    stream_ms: dict[str, list[float]] = {name: [] for name in configs}
    pools = {name: Pool(1, recover=True, threads_per_worker=args.threads, **config)
             for name, config in configs.items()}
    try:
        for pool in pools.values():
            pool[0].load_model(model_file)
        for _ in range(args.rounds):
            for name, pool in pools.items():
                got = one_round(pool, configs[name]["spares"], args.threads)
                figures[name].append(got["kill_to_next_piece_ms"])
                stream_ms[name].append(got["stream_ms"])
        long_prompt: dict[tuple[str, str], list[dict[str, Any]]] = {
            (name, call): [] for call in ("stream", "generate") for name in list(configs)[1:3]}
        for _ in range(args.prompt_rounds):
            for (name, call), rounds in long_prompt.items():
                rounds.append(long_prompt_round(pools[name], args.threads, call))
    finally:
        for pool in pools.values():
            pool.close()
    print(f"load average after: {load():.2f}")
    print(f"\nSIGKILL -> next streamed piece, {CONVERSATION_TOKENS}-token conversation, killed after piece {KILL_AT}:")
    report: dict[str, Any] = {}
    for name, values in figures.items():
        report[name] = {"ms": values, "median_ms": statistics.median(values),
                        "uninterrupted_stream_ms": statistics.median(stream_ms[name])}
        print(f"  {name:32} median {statistics.median(values):7.0f} ms   rounds {[round(v) for v in values]}   "
              f"(the {N_PREDICT}-token stream uninterrupted: {statistics.median(stream_ms[name]):.0f} ms)")
    if args.prompt_rounds:
        print(f"\na {LONG_PROMPT_TOKENS}-token prompt (a stream, generate()), killed once {LONG_KILL_AT} tokens were "
              f"decoded (median of {args.prompt_rounds}):")
        for (name, call), rounds in long_prompt.items():
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            report[f"long prompt, {call}, {name}"] = {"rounds": rounds, "median": med}
            print(f"  {call:8} {name:32} kill -> first piece {med['kill_to_first_piece_ms']:7.0f} ms, kill -> end "
                  f"{med['kill_to_end_ms']:7.0f} ms   (uninterrupted: first piece "
                  f"{med['uninterrupted_first_piece_ms']:.0f} ms, all {med['uninterrupted_ms']:.0f} ms)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
