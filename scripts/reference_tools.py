#!/usr/bin/env python3
"""llama.cpp's own programs (llama-simple, llama-bench, llama-batched-bench), built from the same vendored
tree and with the same flags as the native module, in its persistent build directory. The tests and the
benchmarks compare against them; scripts/test builds them all up front:

    python scripts/reference_tools.py
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_dir() -> Path:
    """The persistent CMake build directory `pip install` used (build/<wheel tag>)."""
    dirs = sorted(glob.glob(str(ROOT / "build" / "*" / "CMakeCache.txt")), key=os.path.getmtime)
    if not dirs:
        raise RuntimeError("no CMake build directory under build/: run scripts/test (or scripts/setup.sh) first")
    return Path(dirs[-1]).parent


def _build(bdir: Path, target: str) -> None:
    subprocess.run(["cmake", "--build", str(bdir), "--target", target, "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)


def tool(name: str) -> Path:
    """The program `name`, built on demand."""
    bdir = build_dir()
    exe = bdir / "bin" / name
    if not exe.exists():
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
        _build(build_dir(), "lloyal_reference_tools")
    except RuntimeError as exc:
        sys.exit(str(exc))
