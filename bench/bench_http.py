#!/usr/bin/env python3
"""HTTP load test, on localhost only: N concurrent clients stream /v1/completions for a fixed time from
``lloyal-pool serve`` and from llama-server built from the same tree (same threads, same slots), one
server at a time. Each client sends a different prompt of 128 random tokens and asks for 64 tokens
(ignore_eos, greedy), again and again until the time is up.

    .venv/bin/python bench/bench_http.py [-m MODEL] [-t THREADS] [-c CLIENTS] [-d SECONDS] [--json-out FILE]

Reports per server: completed requests, tokens per second (streamed pieces over the run), time to first
token p50/p99 and inter-token latency p50/p99 (the gap between two pieces of one stream).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import common_args, emit_report, model_path, tool
from bench_serving import free_port, percentile

N_PROMPT, N_GEN = 128, 64


def wait_healthy(port: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


def start(kind: str, model: Path, threads: int, slots: int, port: int) -> subprocess.Popen[str]:
    if kind == "lloyal_pool":
        cmd = [sys.executable, "-m", "lloyal_pool", "serve", "-m", str(model), "--port", str(port), "--workers", "1",
               "--threads", str(threads), "--slots", str(slots), "--n-ctx-slot", str(N_PROMPT + N_GEN + 64)]
    else:
        cmd = [str(tool("llama-server")), "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
               "-np", str(slots), "-c", str(slots * (N_PROMPT + N_GEN + 64)), "-t", str(threads), "-tb", str(threads),
               "-kvu", "--swa-full", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    wait_healthy(port, proc)
    return proc


def client(port: int, seed: int, until: float, n_vocab: int, bos: int, out: dict[str, list[float]]) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        prompt = [bos] + [rng.randrange(1000, n_vocab) for _ in range(N_PROMPT - 1)]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": N_GEN, "temperature": 0,
                           "ignore_eos": True, "stream": True})
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        last = 0.0
        pieces = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not event.get("choices") or not event["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if pieces == 0:
                out["ttft"].append(now - t0)
            else:
                out["itl"].append(now - last)
            last = now
            pieces += 1
        conn.close()
        out["pieces"].append(float(pieces))
        out["done"].append(time.perf_counter())


def run_load(kind: str, model: Path, threads: int, clients: int, seconds: float, n_vocab: int,
             bos: int) -> dict[str, float]:
    port = free_port()
    proc = start(kind, model, threads, clients, port)
    try:
        out: dict[str, list[float]] = {"ttft": [], "itl": [], "pieces": [], "done": []}
        t0 = time.monotonic()
        until = t0 + seconds
        workers = [threading.Thread(target=client, args=(port, 1000 * i, until, n_vocab, bos, out))
                   for i in range(clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(30)
    return {"requests": len(out["done"]), "tokens_per_s": sum(out["pieces"]) / wall, "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(out["ttft"]), "ttft_p99_ms": 1000 * percentile(out["ttft"], 0.99),
            "itl_p50_ms": 1000 * statistics.median(out["itl"]), "itl_p99_ms": 1000 * percentile(out["itl"], 0.99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("-c", "--clients", type=int, default=8)
    ap.add_argument("-d", "--duration", type=float, default=60.0)
    args = ap.parse_args()
    model = model_path(args.model)
    tool("llama-server")
    from lloyal_pool import Pool

    with Pool(1) as pool:
        info = pool[0].load_model(model, vocab_only=True).info
    results: dict[str, Any] = {}
    for kind in ("lloyal_pool", "llama_server"):
        results[kind] = run_load(kind, model, args.threads, args.clients, args.duration, info.n_vocab, info.bos)
    ours, theirs = results["lloyal_pool"], results["llama_server"]
    report = {"model": model.name, "threads": args.threads, "clients": args.clients, "duration_s": args.duration,
              "n_prompt": N_PROMPT, "n_gen": N_GEN, **results,
              "ratios": {"tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
                         "ttft_p99": ours["ttft_p99_ms"] / theirs["ttft_p99_ms"],
                         "itl_p99": ours["itl_p99_ms"] / theirs["itl_p99_ms"]}}
    emit_report(report, args.json_out)
    for kind, r in results.items():
        print(f"{kind:12s} {r['requests']:4d} requests, {r['tokens_per_s']:6.1f} tok/s, TTFT p50/p99 "
              f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms, "
              f"ITL p50/p99 {r['itl_p50_ms']:.0f}/{r['itl_p99_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
