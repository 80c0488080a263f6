#!/usr/bin/env python3
"""Whole-context state throughput: save_state()/load_state() (bytes through a transfer memfd) and the file
variants, for a context holding --tokens tokens, restored into a context of another worker.

    .venv/bin/python bench/bench_state.py [-m MODEL] [-n TOKENS] [-r REPS] [--dir DIR] [--json-out FILE]

Prints JSON: the state's size and, per direction, the median seconds and MB/s (1 MB = 1e6 bytes) over
--reps runs. The save includes the worker's llama_state_get_data into the mapping and the parent's copy
out into bytes; the load the parent's write into the memfd and the worker's checks (checksum included)
and llama_state_set_data.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn: Any, reps: int) -> tuple[float, Any]:
    times = []
    out = None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="GGUF (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("-n", "--tokens", type=int, default=3000)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--dir", help="where the file variant writes (default: the temporary directory)")
    ap.add_argument("--json-out", help="also write the JSON here")
    args = ap.parse_args()

    from lloyal_pool import Pool, default_model_path

    path = Path(args.model) if args.model else default_model_path()
    n_ctx = (args.tokens + 255) // 256 * 256 + 256
    with Pool(2, writable_dirs=[args.dir or tempfile.gettempdir()]) as pool:  # the sandbox: file variant
        src_model = pool[0].load_model(path)
        dst_model = pool[1].load_model(path)
        src = src_model.new_context(n_ctx=n_ctx)
        dst = dst_model.new_context(n_ctx=n_ctx)
        rng = random.Random(0)
        # Random tokens from the lower vocabulary (no special ones): only the cache's size matters here.
        src.eval([rng.randrange(1000, 20000) for _ in range(args.tokens)])

        save_s, data = timed(src.save_state, args.reps)
        load_s, _ = timed(lambda: dst.load_state(data), args.reps)
        assert dst.tokens() == src.tokens()
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            f = Path(d) / "ctx.state"
            save_file_s, _ = timed(lambda: src.save_state_file(f), args.reps)
            load_file_s, _ = timed(lambda: dst.load_state_file(f), args.reps)

    mb = len(data) / 1e6
    report = {
        "model": str(path),
        "tokens": args.tokens,
        "state_bytes": len(data),
        "bytes_per_token": len(data) / args.tokens,
        "reps": args.reps,
        "save_bytes": {"s": save_s, "MB/s": mb / save_s},
        "load_bytes": {"s": load_s, "MB/s": mb / load_s},
        "save_file": {"s": save_file_s, "MB/s": mb / save_file_s},
        "load_file": {"s": load_file_s, "MB/s": mb / load_file_s},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
