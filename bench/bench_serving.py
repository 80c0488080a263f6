#!/usr/bin/env python3
"""Continuous batching: 8 concurrent independent requests (different 128-token prompts, 64 greedy tokens
each, all arriving at once) on one worker's Batcher, against llama.cpp's own programs built from the same
tree with the same threads:

- llama-batched-bench at B=8 without a shared prompt (-npl 8, unified KV): generated tokens over its
  whole time (prompts included), the same measure as ours. Target >= 0.85x.
- llama-server with 8 parallel slots under the same load (8 client threads streaming /completion over
  HTTP on localhost): aggregate tok/s (target >= 1.0x) and time to first token (p50, p99: ours no worse).

    .venv/bin/python bench/bench_serving.py [-m MODEL] [-t THREADS] [-r ROUNDS] [--json-out FILE]

Runners take turns round after round (ours and llama-server swap places each round), each figure is a
median over rounds, and the report's per_round lists each round's ratios. llama-server is built on
first use (scripts/reference_tools.py; several minutes).
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, emit_report, model_path, tool

from lloyal_pool import Pool

N_PROMPT, N_GEN, N_REQ = 128, 64, 8
N_CTX_SLOT = 256  # room per request: prompt + generation, as llama-server's -c / -np gives each slot


def prompts(n_vocab: int, bos: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[bos] + [rng.randrange(1000, n_vocab) for _ in range(N_PROMPT - 1)] for _ in range(N_REQ)]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def load_figures(ttft: list[float], wall: float, n_tokens: int) -> dict[str, float]:
    return {"tps": n_tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_p99_ms": 1000 * percentile(ttft, 0.99), "wall_s": wall}


# -- lloyal_pool -----------------------------------------------------------------------------------------
class PoolRunner:
    def __init__(self, model: Path, threads: int) -> None:
        self.pool = Pool(1, threads_per_worker=threads)
        self.model = self.pool[0].load_model(model)
        self.batcher = self.model.batcher(slots=N_REQ, n_ctx_slot=N_CTX_SLOT)
        self.run(prompts(self.model.n_vocab, self.model.info.bos, seed=1))  # warm-up

    def run(self, load: list[list[int]]) -> dict[str, float]:
        first: list[float] = [0.0] * len(load)

        def seen(i: int) -> Any:
            def on_piece(_: str) -> None:
                if not first[i]:
                    first[i] = time.perf_counter()
            return on_piece

        t0 = time.perf_counter()
        handles = [self.batcher.submit(p, n_predict=N_GEN, ignore_eos=True, on_piece=seen(i))
                   for i, p in enumerate(load)]
        results = [h.future.result() for h in handles]
        wall = time.perf_counter() - t0
        assert all(r.n_decoded == N_GEN for r in results), [r.n_decoded for r in results]
        return load_figures([f - t0 for f in first], wall, sum(r.n_decoded for r in results))

    def close(self) -> None:
        self.pool.close()


# -- llama-batched-bench ------------------------------------------------------------------------------------
def batched_bench(model: Path, threads: int) -> dict[str, float]:
    out = subprocess.run([str(tool("llama-batched-bench")), "-m", str(model), "-c", str(N_REQ * N_CTX_SLOT),
                          "-b", "2048", "-ub", "512", "-npp", str(N_PROMPT), "-ntg", str(N_GEN), "-npl", str(N_REQ),
                          "-kvu", "--swa-full", "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True)
    row = next(json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))
    return {"tps": N_REQ * N_GEN / float(row["t"]), "tg_tps": float(row["speed_tg"]),
            "pp_tps": float(row["speed_pp"]), "wall_s": float(row["t"])}


# -- llama-server ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerRunner:
    def __init__(self, model: Path, threads: int, n_vocab: int, bos: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(tool("llama-server")), "-m", str(model), "-np", str(N_REQ), "-c", str(N_REQ * N_CTX_SLOT),
             "-t", str(threads), "-tb", str(threads), "-kvu", "--swa-full", "--host", "127.0.0.1",
             "--port", str(self.port), "--no-webui"],
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
        self.run(prompts(n_vocab, bos, seed=1))  # warm-up

    def _one(self, tokens: list[int], t0: float, out: dict[str, float]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        body = json.dumps({"prompt": tokens, "n_predict": N_GEN, "ignore_eos": True, "temperature": 0,
                           "stream": True, "cache_prompt": False})
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        n = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("content") and "first" not in out:
                out["first"] = time.perf_counter() - t0
            if event.get("stop"):
                n = int(event.get("tokens_predicted", N_GEN))
                break
        out["n"] = n
        out["end"] = time.perf_counter() - t0

    def run(self, load: list[list[int]]) -> dict[str, float]:
        outs: list[dict[str, float]] = [{} for _ in load]
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._one, args=(p, t0, o)) for p, o in zip(load, outs, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = max(o["end"] for o in outs)
        return load_figures([o.get("first", o["end"]) for o in outs], wall, int(sum(o["n"] for o in outs)))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    args = ap.parse_args()
    model = model_path(args.model)
    tool("llama-server")  # build it first, outside any timing

    ours: list[dict[str, float]] = []
    bench: list[dict[str, float]] = []
    server: list[dict[str, float]] = []
    with Pool(1) as probe:
        m = probe[0].load_model(model)
        n_vocab, bos = m.n_vocab, m.info.bos

    def run_ours(load: list[list[int]]) -> None:
        runner = PoolRunner(model, args.threads)
        ours.append(runner.run(load))
        runner.close()

    def run_server(load: list[list[int]]) -> None:
        srv = ServerRunner(model, args.threads, n_vocab, bos)
        server.append(srv.run(load))
        srv.close()

    # One runner at a time holds the cores: llama.cpp's threads spin while they wait. The order turns
    # round after round, so that neither side always runs first (a slow drift of the machine's speed
    # would otherwise favour one).
    for i in range(args.rounds):
        load = prompts(n_vocab, bos, seed=100 + i)
        first, last = (run_ours, run_server) if i % 2 == 0 else (run_server, run_ours)
        first(load)
        bench.append(batched_bench(model, args.threads))
        last(load)

    def med(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]}

    o, b, s = med(ours), med(bench), med(server)
    report: dict[str, Any] = {
        "model": model.name, "threads": args.threads, "rounds": args.rounds, "requests": N_REQ,
        "n_prompt": N_PROMPT, "n_gen": N_GEN, "lloyal_pool": o, "llama_batched_bench": b, "llama_server": s,
        "ratios": {"tps_vs_batched_bench": o["tps"] / b["tps"], "tps_vs_server": o["tps"] / s["tps"],
                   "ttft_p99_vs_server": o["ttft_p99_ms"] / s["ttft_p99_ms"],
                   "ttft_p50_vs_server": o["ttft_p50_ms"] / s["ttft_p50_ms"]},
        "targets": {"tps_vs_batched_bench": 0.85, "tps_vs_server": 1.0, "ttft_p99_vs_server": "<= 1.0"},
        "per_round": [{"tps_vs_server": a["tps"] / c["tps"], "ttft_p99_vs_server": a["ttft_p99_ms"] / c["ttft_p99_ms"],
                       "tps_vs_batched_bench": a["tps"] / b_["tps"]}
                      for a, b_, c in zip(ours, bench, server, strict=True)],
    }
    emit_report(report, args.json_out)
    r = report["ratios"]
    print(f"\n8 requests x {N_GEN} tokens: lloyal_pool {o['tps']:.1f} tok/s | llama-batched-bench {b['tps']:.1f} | "
          f"llama-server {s['tps']:.1f}")
    print(f"vs batched-bench {r['tps_vs_batched_bench']:.3f}x (target 0.85x); vs llama-server "
          f"{r['tps_vs_server']:.3f}x (target 1.0x)")
    print(f"time to first token p50/p99: lloyal_pool {o['ttft_p50_ms']:.0f}/{o['ttft_p99_ms']:.0f} ms, llama-server "
          f"{s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
