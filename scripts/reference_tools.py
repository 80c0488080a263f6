#!/usr/bin/env python3
"""llama.cpp's own programs (llama-simple, llama-bench, llama-batched-bench, llama-server), built from the same
vendored tree, in two builds:

- ``tool(name)``: the portable build the native module comes from (its persistent build directory, ggml's
  CPU backends as libraries beside the programs). It runs the level of CPU kernels the pool's workers run
  here (LLOYAL_POOL_CPU, else the best this CPU runs), so a test compares like with like. scripts/test
  builds these up front.
- ``native_tool(name)``: llama.cpp as it is built for one machine (``-march=native``, static, without AMX
  as the workers run; bench/native-reference), in build/native-reference: what the benchmarks' gates
  compare against. Built on first use (minutes).

    python scripts/reference_tools.py            # the portable programs
    python scripts/reference_tools.py --native   # the native ones
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORTABLE = ("llama-simple", "llama-bench", "llama-batched-bench")
NATIVE = ("llama-bench", "llama-batched-bench", "llama-server")


def build_dir() -> Path:
    """The persistent CMake build directory `pip install` used (build/<wheel tag>)."""
    dirs = sorted(glob.glob(str(ROOT / "build" / "*" / "CMakeCache.txt")), key=os.path.getmtime)
    dirs = [d for d in dirs if Path(d).parent.name != "native-reference"]
    if not dirs:
        raise RuntimeError("no CMake build directory under build/: run scripts/test (or scripts/setup.sh) first")
    return Path(dirs[-1]).parent


def _build(bdir: Path, *targets: str) -> None:
    subprocess.run(["cmake", "--build", str(bdir), "--target", *targets, "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)


@functools.cache
def cpu_level() -> str:
    """The level of CPU kernels the pool's workers run on this machine, as they choose it (the native
    module asked in a process of its own: this one never loads it)."""
    script = ("import lloyal_pool.worker._native as n, lloyal_pool.variants as v; "
              "print(n.load_cpu_backend(v.requested_cpu(None))['kernels'])")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def tool(name: str) -> Path:
    """The portable program `name`, built on demand, in a folder of its own beside the one CPU backend the
    workers run (ggml loads the best backend it finds beside the program)."""
    bdir = build_dir()
    exe = bdir / "bin" / name
    if not exe.exists():
        _build(bdir, name)
    level = cpu_level()
    home = bdir / "reference" / level
    home.mkdir(parents=True, exist_ok=True)
    linked = home / name
    if not linked.exists() or linked.stat().st_ino != exe.stat().st_ino:  # a rebuild made a new file
        linked.unlink(missing_ok=True)
        os.link(exe, linked)
    backend = home / f"libggml-cpu-{level}.so"
    if not backend.exists():
        backend.symlink_to(bdir / "bin" / backend.name)
    return linked


def native_tool(name: str) -> Path:
    """`name` built for this machine alone (-march=native, static libraries; bench/native-reference),
    built on demand."""
    bdir = ROOT / "build" / "native-reference"
    exe = bdir / "bin" / name
    if not (bdir / "CMakeCache.txt").exists():
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        print(f"[reference] configuring {bdir} (-march=native)", file=sys.stderr)
        subprocess.run(["cmake", "-S", str(ROOT / "bench" / "native-reference"), "-B", str(bdir), *generator,
                        "-DCMAKE_BUILD_TYPE=Release"], check=True, stdout=subprocess.DEVNULL)
    if not exe.exists():
        print(f"[reference] building {name} for this machine (first time: minutes)", file=sys.stderr)
        _build(bdir, name)
    return exe


def llama_simple_text(exe: Path, model: Path, prompt: str, n: int) -> str:
    """What llama-simple generates greedily after prompt (n tokens)."""
    out = subprocess.run([str(exe), "-m", str(model), "-n", str(n), prompt], capture_output=True, text=True,
                         timeout=300, check=True)
    # llama-simple prints the prompt's pieces (BOS rendered as "<bos>"), then each generated piece, then a
    # newline.
    text = out.stdout.removeprefix("<bos>")
    if not text.startswith(prompt):
        raise RuntimeError(f"llama-simple did not echo the prompt: {text[:200]!r}")
    return text[len(prompt):].removesuffix("\n")


if __name__ == "__main__":
    try:
        if sys.argv[1:] == ["--native"]:
            for program in NATIVE:
                native_tool(program)
        else:
            _build(build_dir(), *PORTABLE)
            for program in PORTABLE:
                tool(program)
    except RuntimeError as exc:
        sys.exit(str(exc))
