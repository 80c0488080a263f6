#!/usr/bin/env python3
"""llama.cpp's own programs (llama-simple, llama-bench, llama-batched-bench, llama-server), built from the same
vendored tree, in two builds:

- ``tool(name)``: the portable build the native module comes from (its persistent build directory, ggml's
  CPU backends as libraries beside the programs). It runs the level of CPU kernels the pool's workers run
  here (LLOYAL_POOL_CPU, else the best this CPU runs), so a test compares like with like. scripts/test
  builds these up front.
- ``native_tool(name)``: llama.cpp as it is built for one machine (``-march=native``, static), in
  build/native-reference: what the benchmarks' gates compare against. Built on first use (minutes).

    python scripts/reference_tools.py            # the portable programs
    python scripts/reference_tools.py --native   # the native ones
"""

from __future__ import annotations

import functools
import glob
import os
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


def _amx_usable() -> bool:
    script = "import lloyal_pool.worker._native as n; print(n.amx_usable()[0])"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


# /proc/cpuinfo's flags and the ggml options that use them: this CPU's instruction sets without AMX.
_GGML_FEATURES = {"sse4_2": "SSE42", "avx": "AVX", "avx2": "AVX2", "bmi2": "BMI2", "fma": "FMA", "f16c": "F16C",
                  "avx_vnni": "AVX_VNNI", "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI",
                  "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16"}


def _native_flags() -> list[str]:
    """-march=native, unless this CPU reports AMX that does not run here (a sandbox): then each instruction
    set it has but AMX, named to ggml."""
    if _amx_usable() or "amx_tile" not in Path("/proc/cpuinfo").read_text():
        return ["-DGGML_NATIVE=ON"]
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split())
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}"
                                   for flag, opt in _GGML_FEATURES.items())]


def native_tool(name: str) -> Path:
    """`name` built for this machine alone (-march=native, static libraries), built on demand."""
    bdir = ROOT / "build" / "native-reference"
    exe = bdir / "bin" / name
    if not (bdir / "CMakeCache.txt").exists():
        flags = _native_flags()
        generator = ["-G", "Ninja"] if subprocess.run(["ninja", "--version"], capture_output=True).returncode == 0 \
            else []
        print(f"[reference] configuring {bdir} ({' '.join(flags)})", file=sys.stderr)
        subprocess.run(["cmake", "-S", str(ROOT / "vendor" / "llama.cpp"), "-B", str(bdir), *generator,
                        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                        "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", *flags],
                       check=True, stdout=subprocess.DEVNULL)
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
