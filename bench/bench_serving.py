#!/usr/bin/env python3
"""Continuous batching: concurrent requests, all arriving at once, on one worker's Batcher against
llama.cpp's own programs built from the same tree with the same threads (issue 26), under a load that
--scenario picks.

- plain (the default): N independent requests (--requests, default 8): different 128-token prompts of
  random token ids, 64 greedy tokens each (ignore_eos). Against
  - llama-batched-bench at B=N without a shared prompt (-npl N, unified KV): generated tokens over its
    whole time (prompts included), the same measure as ours. Target >= 0.85x.
  - llama-server with N parallel slots under the same load (N client threads streaming /completion over
    HTTP on localhost, cache_prompt off: no prompt repeats): aggregate tok/s (target >= 1.0x), time to
    first token p99 (target <= 1.0x) and inter-token latency p99 (target <= 1.0x at 8 requests).
- preamble: 8 requests (or --requests) whose prompts share one 700-token preamble (BOS and random token
  ids: a system prompt or a document, the same for every request and both servers), then a 24-token
  question of their own; 64 greedy tokens each. This is the FIRST burst on a fresh runner: the warm-up
  sends prompts of other random tokens, so no slot holds the preamble when the burst comes.
  llama-server gets cache_prompt on (its default). Targets: time to first token p50 <= 0.3x
  llama-server's, tok/s >= 2x. No llama-batched-bench here: its -pps shares a whole prompt, not a
  preamble followed by questions of their own, so it has no figure to set beside ours.
- all: plain at 8, plain at 32 and preamble at 8 in one process (--requests is ignored), with one
  summary table of ratios at the end.

    .venv/bin/python bench/bench_serving.py [--scenario plain|preamble|all] [--requests N] [-m MODEL]
        [-t THREADS] [-r ROUNDS] [--n-gen N] [--n-preamble N] [--json-out FILE]

Figures per runner: tok/s (generated tokens over the burst's wall time), time to first token p50/p99
and inter-token latency p50/p99: the gaps between consecutive streamed pieces of one request, all
requests pooled. A piece of ours (one on_piece call) may hold more than one token (text held back as an
incomplete UTF-8 sequence comes out with the next token's); llama-server streams one event per token.
Both sides count only pieces with text.

Runners take turns round after round (ours and llama-server swap places each round; in a round every
scenario runs in turn, each on fresh runners), each figure is a median over rounds, and each scenario's
per_round lists each round's ratios. The JSON report holds every scenario under "scenarios" (keyed
plain-8, plain-32, preamble-8...). --n-gen and --n-preamble shrink a run for a quick check; figures
with other values than the defaults are not the issue's. llama-server is built on first use
(scripts/reference_tools.py; several minutes).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, emit_report, model_path, tool

from lloyal_pool import Pool

N_PROMPT, N_GEN, N_REQ = 128, 64, 8
N_PREAMBLE, N_QUESTION = 700, 24
N_CTX_SLOT = 256  # room per request in the plain scenario: prompt + generation, as llama-server's -c / -np
WARM_SEED = 1  # the warm-up's tokens; rounds use 100 + round, so no warm-up prompt shares their prefix


@dataclass(frozen=True)
class Scenario:
    """One burst: ``requests`` prompts of ``n_shared`` tokens the same for all (BOS, then the preamble
    when there is one) followed by ``n_own`` tokens of each request's own, ``n_gen`` tokens each."""

    kind: str  # "plain" or "preamble"
    requests: int
    n_shared: int
    n_own: int
    n_gen: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.requests}"

    @property
    def n_prompt(self) -> int:
        return self.n_shared + self.n_own

    @property
    def n_ctx_slot(self) -> int:
        # Prompt, generation and a margin, in whole 256-cell blocks: N_CTX_SLOT for plain, as before.
        return 256 * -(-(self.n_prompt + self.n_gen + 64) // 256)

    @property
    def cache_prompt(self) -> bool:
        # llama-server's default; off in plain, where no prompt repeats, as the plain runs always had it.
        return self.kind == "preamble"

    def load(self, n_vocab: int, bos: int, seed: int) -> list[list[int]]:
        # Ids from 1000 up: clear of the control tokens at the low end of the vocabulary. With n_shared=1
        # the draws are those the plain prompts always had (same seed, same prompts).
        rng = random.Random(seed)
        shared = [bos] + [rng.randrange(1000, n_vocab) for _ in range(self.n_shared - 1)]
        return [shared + [rng.randrange(1000, n_vocab) for _ in range(self.n_own)] for _ in range(self.requests)]

    def targets(self) -> dict[str, tuple[str, float]]:
        """Ratio (ours over theirs) -> (comparison, bound)."""
        if self.kind == "preamble":
            return {"ttft_p50_vs_server": ("<=", 0.3), "tps_vs_server": (">=", 2.0)}
        out = {"tps_vs_batched_bench": (">=", 0.85), "tps_vs_server": (">=", 1.0), "ttft_p99_vs_server": ("<=", 1.0)}
        if self.requests == 8:
            out["itl_p99_vs_server"] = ("<=", 1.0)
        return out


def scenarios(which: str, requests: int, n_gen: int, n_preamble: int) -> list[Scenario]:
    plain = [Scenario("plain", n, 1, N_PROMPT - 1, n_gen) for n in ((N_REQ, 32) if which == "all" else (requests,))]
    preamble = [Scenario("preamble", N_REQ if which == "all" else requests, n_preamble, N_QUESTION, n_gen)]
    return {"plain": plain, "preamble": preamble, "all": plain + preamble}[which]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def load_figures(stamps: list[list[float]], ends: list[float], wall: float, n_tokens: int) -> dict[str, float]:
    """stamps: each request's piece times (seconds since the burst began); ends: when each ended (its time
    to first token when it streamed no text)."""
    ttft = [s[0] if s else e for s, e in zip(stamps, ends, strict=True)]
    gaps = [b - a for s in stamps for a, b in pairwise(s)] or [0.0]
    return {"tps": n_tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_p99_ms": 1000 * percentile(ttft, 0.99), "itl_p50_ms": 1000 * statistics.median(gaps),
            "itl_p99_ms": 1000 * percentile(gaps, 0.99), "wall_s": wall}


# -- lloyal_pool -----------------------------------------------------------------------------------------
class PoolRunner:
    def __init__(self, model: Path, threads: int, sc: Scenario, warm: list[list[int]]) -> None:
        self.sc = sc
        self.pool = Pool(1, threads_per_worker=threads)
        self.model = self.pool[0].load_model(model)
        self.batcher = self.model.batcher(slots=sc.requests, n_ctx_slot=sc.n_ctx_slot)
        self.run(warm)

    def run(self, load: list[list[int]]) -> dict[str, float]:
        stamps: list[list[float]] = [[] for _ in load]
        ends: list[float] = [0.0] * len(load)

        def seen(i: int) -> Any:
            def on_piece(_: str) -> None:
                stamps[i].append(time.perf_counter())
            return on_piece

        def ended(i: int) -> Any:
            return lambda _: ends.__setitem__(i, time.perf_counter())

        t0 = time.perf_counter()
        handles = [self.batcher.submit(p, n_predict=self.sc.n_gen, ignore_eos=True, on_piece=seen(i))
                   for i, p in enumerate(load)]
        for i, h in enumerate(handles):
            h.future.add_done_callback(ended(i))
        results = [h.future.result() for h in handles]
        wall = time.perf_counter() - t0
        assert all(r.n_decoded == self.sc.n_gen for r in results), [r.n_decoded for r in results]
        return load_figures([[t - t0 for t in s] for s in stamps], [e - t0 for e in ends], wall,
                            sum(r.n_decoded for r in results))

    def close(self) -> None:
        self.pool.close()


# -- llama-batched-bench ------------------------------------------------------------------------------------
def batched_bench(model: Path, threads: int, sc: Scenario) -> dict[str, float]:
    out = subprocess.run([str(tool("llama-batched-bench")), "-m", str(model), "-c", str(sc.requests * sc.n_ctx_slot),
                          "-b", "2048", "-ub", "512", "-npp", str(sc.n_prompt), "-ntg", str(sc.n_gen),
                          "-npl", str(sc.requests), "-kvu", "--swa-full", "-t", str(threads), "-tb", str(threads),
                          "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True)
    row = next(json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))
    return {"tps": sc.requests * sc.n_gen / float(row["t"]), "tg_tps": float(row["speed_tg"]),
            "pp_tps": float(row["speed_pp"]), "wall_s": float(row["t"])}


# -- llama-server ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerRunner:
    def __init__(self, model: Path, threads: int, sc: Scenario, warm: list[list[int]]) -> None:
        self.sc = sc
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(tool("llama-server")), "-m", str(model), "-np", str(sc.requests),
             "-c", str(sc.requests * sc.n_ctx_slot), "-t", str(threads), "-tb", str(threads), "-kvu", "--swa-full",
             "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None:
                log = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"llama-server exited: {log[-2000:]}")
            time.sleep(0.2)
        else:
            raise RuntimeError("llama-server did not become healthy within 120 s")
        # Its stderr is its log: drain it, or a full pipe would stall the server.
        threading.Thread(target=lambda: self.proc.stderr and self.proc.stderr.read(), daemon=True).start()
        self.run(warm)

    def _one(self, tokens: list[int], t0: float, out: dict[str, Any]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        body = json.dumps({"prompt": tokens, "n_predict": self.sc.n_gen, "ignore_eos": True, "temperature": 0,
                           "stream": True, "cache_prompt": self.sc.cache_prompt})
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        stamps: list[float] = []
        n = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("content"):
                stamps.append(time.perf_counter() - t0)
            if event.get("stop"):
                n = int(event.get("tokens_predicted", self.sc.n_gen))
                break
        out["stamps"] = stamps
        out["n"] = n
        out["end"] = time.perf_counter() - t0

    def run(self, load: list[list[int]]) -> dict[str, float]:
        outs: list[dict[str, Any]] = [{} for _ in load]
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._one, args=(p, t0, o)) for p, o in zip(load, outs, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ends = [float(o["end"]) for o in outs]
        return load_figures([o["stamps"] for o in outs], ends, max(ends), int(sum(o["n"] for o in outs)))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# -- the report -------------------------------------------------------------------------------------------------
# Each ratio's name and the figure it divides.
RATIOS = {"tps_vs_server": "tps", "ttft_p50_vs_server": "ttft_p50_ms", "ttft_p99_vs_server": "ttft_p99_ms",
          "itl_p50_vs_server": "itl_p50_ms", "itl_p99_vs_server": "itl_p99_ms"}


def ratios(o: dict[str, float], s: dict[str, float], b: dict[str, float] | None) -> dict[str, float]:
    out = {name: o[k] / s[k] for name, k in RATIOS.items()}
    if b is not None:
        out["tps_vs_batched_bench"] = o["tps"] / b["tps"]
    return out


def met(value: float, target: tuple[str, float]) -> bool:
    op, bound = target
    return value >= bound if op == ">=" else value <= bound


def median_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def scenario_report(sc: Scenario, ours: list[dict[str, float]], server: list[dict[str, float]],
                    bench: list[dict[str, float]]) -> dict[str, Any]:
    o, s = median_rows(ours), median_rows(server)
    b = median_rows(bench) if bench else None
    r = ratios(o, s, b)
    targets = sc.targets()
    rep: dict[str, Any] = {
        "scenario": sc.kind, "requests": sc.requests, "n_prompt": sc.n_prompt, "n_shared": sc.n_shared,
        "n_own": sc.n_own, "n_gen": sc.n_gen, "n_ctx_slot": sc.n_ctx_slot, "server_cache_prompt": sc.cache_prompt,
        "lloyal_pool": o, "llama_server": s, "llama_batched_bench": b,
        "ratios": r, "targets": {k: f"{op} {v}" for k, (op, v) in targets.items()},
        "met": {k: met(r[k], t) for k, t in targets.items() if k in r},
        "per_round": [ratios(a, c, bench[i] if bench else None)
                      for i, (a, c) in enumerate(zip(ours, server, strict=True))],
    }
    if b is None:
        rep["llama_batched_bench_skipped"] = ("llama-batched-bench shares a whole prompt (-pps), not a "
                                              "preamble followed by questions of their own")
    return rep


def print_summary(reports: dict[str, dict[str, Any]]) -> None:
    for name, rep in reports.items():
        o, s, b = rep["lloyal_pool"], rep["llama_server"], rep["llama_batched_bench"]
        bb = f" | llama-batched-bench {b['tps']:.1f}" if b else " | llama-batched-bench skipped"
        shared = f" ({rep['n_shared']} shared)" if rep["n_shared"] > 1 else ""
        print(f"\n{name}: {rep['requests']} requests x {rep['n_gen']} tokens, {rep['n_prompt']}-token prompts{shared}: "
              f"lloyal_pool {o['tps']:.1f} tok/s{bb} | llama-server {s['tps']:.1f}")
        for label, key in (("time to first token", "ttft"), ("inter-token latency", "itl")):
            print(f"  {label} p50/p99: lloyal_pool {o[f'{key}_p50_ms']:.1f}/{o[f'{key}_p99_ms']:.1f} ms, "
                  f"llama-server {s[f'{key}_p50_ms']:.1f}/{s[f'{key}_p99_ms']:.1f} ms")
    # Ours over theirs; a ratio with a target says whether it is met.
    cols = [*RATIOS, "tps_vs_batched_bench"]
    heads = ["scenario", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "tok/s vs b-bench"]
    rows = []
    for name, rep in reports.items():
        cells = [name]
        for c in cols:
            v = rep["ratios"].get(c)
            cell = "-" if v is None else f"{v:.2f}x"
            if c in rep["met"]:
                cell += f" ({rep['targets'][c]} {'ok' if rep['met'][c] else 'MISS'})"
            cells.append(cell)
        rows.append(cells)
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]
    print("\nratios, lloyal_pool over llama-server (last column: over llama-batched-bench):")
    for r in [heads, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--scenario", choices=("plain", "preamble", "all"), default="plain")
    ap.add_argument("--requests", type=int, default=N_REQ, help="concurrent requests (ignored by --scenario all)")
    ap.add_argument("--n-gen", type=int, default=N_GEN, help="tokens per request (>= 2)")
    ap.add_argument("--n-preamble", type=int, default=N_PREAMBLE, help="shared tokens of the preamble scenario")
    args = ap.parse_args()
    if args.n_gen < 2 or args.requests < 1 or args.n_preamble < 2 or args.rounds < 1:
        ap.error("needs --n-gen >= 2, --requests >= 1, --n-preamble >= 2 and --rounds >= 1")
    model = model_path(args.model)
    tool("llama-server")  # build it first, outside any timing
    plan = scenarios(args.scenario, args.requests, args.n_gen, args.n_preamble)
    if any(sc.kind == "plain" for sc in plan):
        tool("llama-batched-bench")

    with Pool(1) as probe:
        m = probe[0].load_model(model, vocab_only=True)
        n_vocab, bos = m.n_vocab, m.info.bos

    ours: dict[str, list[dict[str, float]]] = {sc.name: [] for sc in plan}
    server: dict[str, list[dict[str, float]]] = {sc.name: [] for sc in plan}
    bench: dict[str, list[dict[str, float]]] = {sc.name: [] for sc in plan}

    # Every runner is fresh for its burst (a new worker or llama-server, warmed up on prompts that share
    # nothing with the burst's beyond BOS), so the preamble burst is a first one on both sides.
    def run_ours(sc: Scenario, load: list[list[int]], warm: list[list[int]]) -> None:
        runner = PoolRunner(model, args.threads, sc, warm)
        try:
            ours[sc.name].append(runner.run(load))
        finally:
            runner.close()

    def run_server(sc: Scenario, load: list[list[int]], warm: list[list[int]]) -> None:
        srv = ServerRunner(model, args.threads, sc, warm)
        try:
            server[sc.name].append(srv.run(load))
        finally:  # a failed burst must not leave a server holding the cores for the next runner
            srv.close()

    # One runner at a time holds the cores: llama.cpp's threads spin while they wait. The order turns
    # round after round, so that neither side always runs first (a slow drift of the machine's speed
    # would otherwise favour one).
    for i in range(args.rounds):
        for sc in plan:
            load, warm = sc.load(n_vocab, bos, seed=100 + i), sc.load(n_vocab, bos, seed=WARM_SEED)
            print(f"[round {i + 1}/{args.rounds}] {sc.name}", file=sys.stderr, flush=True)
            first, last = (run_ours, run_server) if i % 2 == 0 else (run_server, run_ours)
            first(sc, load, warm)
            if sc.kind == "plain":
                bench[sc.name].append(batched_bench(model, args.threads, sc))
            last(sc, load, warm)

    reports = {sc.name: scenario_report(sc, ours[sc.name], server[sc.name], bench[sc.name]) for sc in plan}
    report: dict[str, Any] = {
        "model": model.name, "threads": args.threads, "rounds": args.rounds, "scenario": args.scenario,
        "scenarios": reports, "all_met": all(all(rep["met"].values()) for rep in reports.values()),
    }
    emit_report(report, args.json_out)
    print_summary(reports)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
