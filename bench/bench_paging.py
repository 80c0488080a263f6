#!/usr/bin/env python3
"""Session paging against issue 27's target: 1,000 chat sessions of ~500 tokens on one worker with 16 of
them resident; resuming a paged-out session takes at most 100 ms; the disk and memory it uses are
reported by pool.stats().

    .venv/bin/python bench/bench_paging.py [-m MODEL] [-t THREADS] [--sessions N] [--resident N]
                                           [--resumes N] [--turns N] [--page-dir DIR] [--json FILE]

On a Pool(1, max_resident_contexts=--resident) with the model (Gemma 3 270M by default) loaded:

- re-prefill (first, on a fresh context that is closed again before the sessions start): what resuming
  a session would cost without paging, decoding its ~500-token first prompt from scratch
  (cache_prompt=False, n_predict 1); the median of 5.
- creation: --sessions sessions (default 1,000), each a context (n_ctx 1024) and a Context.chat Session
  whose first turn (a system prompt and a user message of text of its own, the session's number woven
  in, sized so that the context then holds ~500 tokens; greedy, n_predict 8, ignore_eos) fills it. Every
  new context beyond the budget pages out the least recently used one. Progress every 50 sessions; then
  whether exactly --resident contexts are resident and the rest paged out.
- resume: --resumes (default 100) sessions picked at random (seeded) among those paged out at that moment,
  each timed from the call to the return of ctx.n_past(): the page-in and the trivial call (the page-out
  of the least recently used resident context that makes room for it runs in the background, and is
  let end before the next resume, as it would between a user's turns). Median, p90 and max against
  the 100 ms target; and whether n_past is what the context held right after its first turn.
- next turn: --turns (default 20) other paged-out sessions send a second user turn (greedy, n_predict 8):
  its wall time, its prompt time (Result.prompt_ms), and n_cached, the tokens of its prompt the restored
  cache reused (all of the first turn's prompt at least, when the page-in restored the cache whole).

Then the pager's figures (stats()["paging"]: page files' size and disk use, page-outs and page-ins,
the mean page-in time), the worker's RSS and this process's. Prints a table (--json also writes the
figures). The full run creates 1,000 sessions, ~500 tokens of prefill each (about half an hour on 2
CPUs: 0.5 sessions/s), and holds their states in page files under --page-dir (default the system's
temporary directory): ~10 MiB each for Gemma 3 270M, ~10 GiB in all. Timings on a shared machine
range widely: check the load average it prints, and compare runs of one machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, cpu_name, model_path

from lloyal_pool import Context, Model, Pool, Session

RESUME_TARGET_MS = 100.0
N_CTX, N_PREDICT, REPREFILL_REPS, PROGRESS_EVERY = 1024, 8, 5, 50
# The first turn's prompt, in tokens: with the N_PREDICT - 1 generated tokens the cache then holds, ~500.
PROMPT_TOKENS, PROMPT_SLACK = 493, 8
# Greedy, and the whole length asked for: creation time is then prefill and 8 decodes for every session.
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
SYSTEM = ("You are the archivist of valley number {i}. Answer in one short sentence, and keep to the facts "
          "of the notes the user gives you about valley {i}.")
SENTENCES = (
    "In valley {i} the river rose in the spring, as it did every year, and the people moved their goats "
    "to the high meadows.",
    "The old miller of valley {i} counted the sacks of grain twice and wrote the numbers in a ledger bound "
    "in green cloth.",
    "Nobody in valley {i} remembered a year when the bridge had not held, but everybody remembered the year "
    "the mill wheel broke.",
    "The school of valley {i} had {k} pupils that winter, and the teacher walked three miles each morning "
    "to open it.",
    "A merchant came through valley {i} in the autumn with salt, needles and news, and left with {k} wheels "
    "of cheese.",
    "The chapel bell of valley {i} cracked in the great frost, and the smith recast it from {k} old pots "
    "and a broken plough.",
    "Wolves were heard above valley {i} in the hard months, though no one there had seen one in {k} years.",
    "The orchard at the head of valley {i} gave {k} baskets of apples, most of them small and sour.",
    "In valley {i} the road to the market town washed out twice, and the men rebuilt it with stones from "
    "the river bed.",
    "The weaver of valley {i} sold {k} bolts of grey wool and bought a second loom with the money.",
)
QUESTION = "Here are my notes on valley {i}. {notes} What is the most important thing in them?"
NEXT_QUESTION = "One more question about valley {i}: what should the people there do next spring?"


def ms(seconds: float) -> float:
    return seconds * 1000.0


def mib(n: float) -> float:
    return n / (1 << 20)


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def notes(i: int, n: int) -> str:
    """n sentences of session i's own text: the sentences rotated by i, with i and numbers of its own."""
    rng = random.Random(i)
    return " ".join(SENTENCES[(i + j) % len(SENTENCES)].format(i=i, k=rng.randrange(3, 300)) for j in range(n))


def first_turn(model: Model, session: Session, i: int, start: int) -> tuple[str, int]:
    """Session i's first user message, grown or cut by whole sentences so that the formatted prompt is
    PROMPT_TOKENS +- PROMPT_SLACK tokens (as near as sentences allow); and how many sentences that took,
    where the next session starts looking."""
    n, seen = max(1, start), set()
    while True:
        text = QUESTION.format(i=i, notes=notes(i, n))
        size = len(model.tokenize(session.prompt(text), add_special=False, parse_special=True))
        seen.add(n)
        if size < PROMPT_TOKENS - PROMPT_SLACK and n + 1 not in seen:
            n += 1
        elif size > PROMPT_TOKENS + PROMPT_SLACK and n > 1 and n - 1 not in seen:
            n -= 1
        else:
            return text, n


def paging(pool: Pool) -> dict[str, Any]:
    return dict(pool[0].stats()["paging"])


def bench_reprefill(model: Model) -> dict[str, Any]:
    """Decoding a session's first prompt from scratch: what a resume would cost without paging."""
    ctx = model.new_context(n_ctx=N_CTX)
    try:
        session = ctx.chat(SYSTEM.format(i=0))
        text, _ = first_turn(model, session, 0, 1)
        prompt = session.prompt(text)
        wall, prompt_ms = [], []
        n_prompt = 0
        ctx.generate(prompt, n_predict=1, cache_prompt=False, **GREEDY)  # warm-up
        for _ in range(REPREFILL_REPS):
            t0 = time.perf_counter()
            r = ctx.generate(prompt, n_predict=1, cache_prompt=False, **GREEDY)
            wall.append(ms(time.perf_counter() - t0))
            prompt_ms.append(r.prompt_ms)
            n_prompt = r.n_prompt
    finally:
        ctx.close()
    return {"n_prompt": n_prompt, "ms": wall, "median_ms": statistics.median(wall),
            "prompt_ms_median": statistics.median(prompt_ms)}


def create_sessions(pool: Pool, model: Model, n: int) -> tuple[list[Context], list[Session], dict[str, Any]]:
    contexts: list[Context] = []
    sessions: list[Session] = []
    n_past: list[int] = []
    n_prompt: list[int] = []
    sentences = 1
    t0 = time.perf_counter()
    for i in range(n):
        ctx = model.new_context(n_ctx=N_CTX)
        session = ctx.chat(SYSTEM.format(i=i), n_predict=N_PREDICT, **GREEDY)
        text, sentences = first_turn(model, session, i, sentences)
        reply = session.send(text)
        n_prompt.append(reply.result.n_prompt)
        n_past.append(ctx.n_past())  # right after the turn: still resident (the most recently used)
        contexts.append(ctx)
        sessions.append(session)
        if (i + 1) % PROGRESS_EVERY == 0 or i + 1 == n:
            elapsed = time.perf_counter() - t0
            stats = pool[0].stats()
            pg = stats["paging"]
            print(f"  {i + 1:5d} sessions  {elapsed:7.1f} s  {(i + 1) / elapsed:6.2f} sessions/s  "
                  f"resident {pg['resident']}, paged {pg['paged']}, page files {mib(pg['page_bytes']):.0f} MiB, "
                  f"worker RSS {mib(stats['rss']):.0f} MiB", flush=True)
    total = time.perf_counter() - t0
    return contexts, sessions, {"total_s": total, "rate_per_s": n / total, "n_past": n_past, "n_prompt": n_prompt,
                                "n_past_min": min(n_past), "n_past_max": max(n_past),
                                "n_past_mean": statistics.fmean(n_past)}


def settle(ctx: Context) -> None:
    """Lets the page-outs the worker's core runs in the background end."""
    ctx.instance._core.settle(30)


def pick_paged(rng: random.Random, contexts: list[Context], exclude: set[int]) -> int:
    candidates = [i for i, c in enumerate(contexts) if c.paged and i not in exclude]
    if not candidates:
        raise RuntimeError("no session is paged out: nothing to resume (fewer sessions than --resident?)")
    return rng.choice(candidates)


def bench_resume(contexts: list[Context], n_past: list[int], n: int, rng: random.Random) -> dict[str, Any]:
    times: list[float] = []
    preserved: list[bool] = []
    for _ in range(n):
        settle(contexts[0])
        i = pick_paged(rng, contexts, set())
        ctx = contexts[i]
        t0 = time.perf_counter()
        held = ctx.n_past()
        times.append(ms(time.perf_counter() - t0))
        preserved.append(held == n_past[i] and not ctx.paged)
    return {"resumes": n, "ms": times, "median_ms": statistics.median(times), "p90_ms": p90(times),
            "max_ms": max(times), "n_past_preserved": all(preserved), "n_past_lost": preserved.count(False),
            "target_ms": RESUME_TARGET_MS, "pass": statistics.median(times) <= RESUME_TARGET_MS}


def bench_next_turn(contexts: list[Context], sessions: list[Session], n_past: list[int], n_prompt: list[int],
                    n: int, rng: random.Random) -> dict[str, Any]:
    rows = []
    done: set[int] = set()
    for _ in range(n):
        settle(contexts[0])
        i = pick_paged(rng, contexts, done)
        done.add(i)
        t0 = time.perf_counter()
        reply = sessions[i].send(NEXT_QUESTION.format(i=i))
        wall = ms(time.perf_counter() - t0)
        r = reply.result
        rows.append({"session": i, "wall_ms": wall, "prompt_ms": r.prompt_ms, "n_prompt": r.n_prompt,
                     "n_cached": r.n_cached, "n_new": r.n_prompt - r.n_cached, "history": n_past[i],
                     "first_prompt": n_prompt[i]})
    return {"turns": rows, "wall_median_ms": statistics.median(x["wall_ms"] for x in rows),
            "prompt_median_ms": statistics.median(x["prompt_ms"] for x in rows),
            "n_cached_min": min(x["n_cached"] for x in rows),
            "n_new_median": statistics.median(x["n_new"] for x in rows),
            "history_short_min": min(x["history"] - x["n_cached"] for x in rows),
            "history_short_max": max(x["history"] - x["n_cached"] for x in rows),
            "cache_reused": all(x["n_cached"] >= x["first_prompt"] for x in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap)
    # The name the instructions use, beside the --json-out the other benches take.
    ap.add_argument("--json", dest="json_out", metavar="FILE", help="also write the figures here as JSON")
    ap.add_argument("--sessions", type=int, default=1000, help="chat sessions to create (default 1000)")
    ap.add_argument("--resident", type=int, default=16, help="max_resident_contexts (default 16)")
    ap.add_argument("--resumes", type=int, default=100, help="paged-out sessions to resume (default 100)")
    ap.add_argument("--turns", type=int, default=20, help="paged-out sessions to send a next turn (default 20)")
    ap.add_argument("--page-dir", help="where the page files go (default the system's temporary directory)")
    ap.add_argument("--seed", type=int, default=0, help="which sessions are resumed (default 0)")
    args = ap.parse_args()
    if args.resident < 1 or args.resumes < 1 or args.turns < 0:
        ap.error("--resident and --resumes must be at least 1, --turns at least 0")
    if args.sessions <= args.resident + args.turns:
        ap.error("--sessions must exceed --resident + --turns: the next turns each want a session paged out")
    path = model_path(args.model)

    load_before = os.getloadavg()[0]
    print(f"CPU: {cpu_name()}; {len(os.sched_getaffinity(0))} CPUs, {args.threads} threads per worker")
    print(f"load average before: {load_before:.2f} (run alone on a quiet machine)", flush=True)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with Pool(1, threads_per_worker=args.threads, max_resident_contexts=args.resident,
              page_dir=args.page_dir) as pool:
        model = pool[0].load_model(path)
        rss_loaded = pool[0].stats()["rss"]
        reprefill = bench_reprefill(model)
        print(f"re-prefill of a {reprefill['n_prompt']}-token first prompt: {reprefill['median_ms']:.0f} ms; "
              f"creating {args.sessions} sessions, {args.resident} resident", flush=True)
        contexts, sessions, created = create_sessions(pool, model, args.sessions)
        settle(contexts[0])
        after_create = paging(pool)
        counts_ok = (after_create["resident"] == args.resident
                     and after_create["paged"] == args.sessions - args.resident
                     and sum(c.paged for c in contexts) == args.sessions - args.resident)
        worker_after_create = pool[0].stats()
        resume = bench_resume(contexts, created["n_past"], args.resumes, rng)
        turns = bench_next_turn(contexts, sessions, created["n_past"], created["n_prompt"], args.turns,
                                rng) if args.turns else None
        settle(contexts[0])
        final = paging(pool)
        worker = pool[0].stats()
        for ctx in contexts:
            ctx.close()
    load_after = os.getloadavg()[0]
    me = psutil.Process()
    report = {"cpu": cpu_name(), "model": path.name, "threads": args.threads, "load_before": load_before,
              "load_after": load_after, "wall_s": time.perf_counter() - t0, "sessions": args.sessions,
              "resident_budget": args.resident, "n_ctx": N_CTX, "seed": args.seed, "reprefill": reprefill,
              "create": {k: v for k, v in created.items() if k not in ("n_past", "n_prompt")},
              "paging_after_create": after_create, "counts_ok": counts_ok, "resume": resume, "next_turn": turns,
              "paging": final, "worker_rss_loaded": rss_loaded, "worker_rss_after_create": worker_after_create["rss"],
              "worker_rss": worker["rss"], "self_rss": me.memory_info().rss,
              "self_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    print(f"load average after: {load_after:.2f}; {report['wall_s']:.0f} s in all\n")
    print(f"sessions: {args.sessions} on one worker, {args.resident} resident (n_ctx {N_CTX}); created in "
          f"{created['total_s']:.1f} s, {created['rate_per_s']:.2f} sessions/s; each holds "
          f"{created['n_past_min']}-{created['n_past_max']} tokens (mean {created['n_past_mean']:.0f})")
    print(f"after creation: resident {after_create['resident']}, paged {after_create['paged']} "
          f"(expected {args.resident} and {args.sessions - args.resident}): {verdict(counts_ok)}")
    print(f"\n{'':30s} {'median':>8s} {'p90':>8s} {'max':>8s} {'target':>8s}")
    print(f"{'resume (n_past() paged), ms':30s} {resume['median_ms']:8.1f} {resume['p90_ms']:8.1f} "
          f"{resume['max_ms']:8.1f} {RESUME_TARGET_MS:8.0f}  {verdict(resume['pass'])} (median; "
          f"{resume['resumes']} resumes)")
    print(f"{'  page-in alone (mean), ms':30s} {final['page_in_ms_mean']:8.1f}")
    print(f"{'re-prefill instead, ms':30s} {reprefill['median_ms']:8.1f}{'':18s}(prompt_ms "
          f"{reprefill['prompt_ms_median']:.1f}; {reprefill['n_prompt']} tokens from scratch)")
    if turns:
        print(f"{'next turn on a paged, ms':30s} {turns['wall_median_ms']:8.1f}{'':18s}(prompt_ms "
              f"{turns['prompt_median_ms']:.1f} for a median {turns['n_new_median']:.0f} new tokens)")
    print(f"\nn_past after resume = n_past after the first turn: {resume['n_past_preserved']} "
          f"({resume['n_past_lost']} differ)")
    if turns:
        print(f"next turns ({len(turns['turns'])}): n_cached min {turns['n_cached_min']}; history less n_cached "
              f"{turns['history_short_min']} to {turns['history_short_max']} tokens; the first turn's whole prompt "
              f"reused in every one: {turns['cache_reused']}")
    print(f"\npaging: {final['page_outs']} page-outs, {final['page_ins']} page-ins, page-in mean "
          f"{final['page_in_ms_mean']:.1f} ms; {final['paged']} paged, {final['resident']} resident")
    print(f"page files: {mib(final['page_bytes']):.1f} MiB ({mib(final['page_bytes']) / max(final['paged'], 1):.2f} "
          f"MiB a session), {mib(final['page_disk_bytes']):.1f} MiB on disk, in {final['page_dir']}")
    print(f"worker RSS: {mib(rss_loaded):.0f} MiB with the model loaded, {mib(worker_after_create['rss']):.0f} MiB "
          f"after creation, {mib(worker['rss']):.0f} MiB at the end; this process: "
          f"{mib(report['self_rss']):.0f} MiB (peak {mib(report['self_maxrss']):.0f} MiB)")
    ok = counts_ok and resume["pass"] and resume["n_past_preserved"] and (turns is None or turns["cache_reused"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
