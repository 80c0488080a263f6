#!/usr/bin/env python3
"""The performance gate: both benchmarks, their ratios against llama.cpp's own tools, and an exit status.

    .venv/bin/python bench/perfgate.py [-r ROUNDS] [--json-out FILE]

Runs bench_generate.py (single stream: pool vs llama-bench) and bench_branches.py (best-of-8: pool vs
llama-batched-bench), each in interleaved rounds, and exits 1 when a ratio falls below its target. The
pool is the portable build (the CPU kernels its workers choose at run time); llama.cpp's tools are built
from the same tree for this machine alone (-march=native, static: build/native-reference, built on first
use):

    pool / llama-bench, prompt processing (pp512)     >= 0.95
    pool / llama-bench, generation (tg128)            >= 0.97
    best-of-8 / llama-batched-bench (B=8)             >= 0.90

The gated figure is the median of the per-round ratios (each round's pool run against the reference run
beside it), which cancels the slow and fast stretches of a shared machine better than a ratio of medians;
both are printed. Not part of the test suite: these machines are noisy, so run it alone on a quiet one
(cat /proc/loadavg, no other busy process), before and after a change to a hot path, and quote both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
# (name, bench script, paired-ratio key, ratio-of-medians key, target)
GATES = [
    ("pp512 pool / llama-bench", "bench_generate.py", ("paired_ratios", "pool_vs_llama_bench_pp"),
     ("ratios", "pool_vs_llama_bench_pp"), 0.95),
    ("tg128 pool / llama-bench", "bench_generate.py", ("paired_ratios", "pool_vs_llama_bench_tg"),
     ("ratios", "pool_vs_llama_bench_tg"), 0.97),
    ("best-of-8 / llama-batched-bench", "bench_branches.py", ("ratios", "best_of_8_vs_batched_bench_paired"),
     ("ratios", "best_of_8_vs_batched_bench"), 0.90),
]


def run(script: str, rounds: int, extra: list[str]) -> dict[str, Any]:
    flag = "-r" if script == "bench_generate.py" else "--rounds"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        subprocess.run([sys.executable, str(BENCH / script), flag, str(rounds), "--json-out", str(out), *extra],
                       check=True, stdout=subprocess.DEVNULL)
        report: dict[str, Any] = json.loads(out.read_text())
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-r", "--rounds", type=int, default=5, help="interleaved rounds per benchmark (default 5)")
    ap.add_argument("-m", "--model", help="GGUF (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("--json-out", help="also write both reports and the verdicts here")
    args = ap.parse_args()
    extra = ["-m", args.model] if args.model else []

    print(f"[perfgate] load average before: {os.getloadavg()[0]:.2f} (run alone on a quiet machine)", flush=True)
    reports = {script: run(script, args.rounds, extra) for script in ("bench_generate.py", "bench_branches.py")}
    rows = []
    for name, script, (sec, key), (msec, mkey), target in GATES:
        paired = float(reports[script][sec][key])
        of_medians = float(reports[script][msec][mkey])
        rows.append({"gate": name, "paired": paired, "ratio_of_medians": of_medians, "target": target,
                     "pass": paired >= target})
    print(f"[perfgate] load average after: {os.getloadavg()[0]:.2f}")
    print(f"\n{'gate':<34} {'paired':>8} {'medians':>8} {'target':>7}")
    for r in rows:
        verdict = "ok" if r["pass"] else "BELOW TARGET"
        print(f"{r['gate']:<34} {r['paired']:>7.3f}x {r['ratio_of_medians']:>7.3f}x {r['target']:>6.2f}x  {verdict}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"gates": rows, "reports": reports}, indent=2) + "\n")
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
