"""Which backends a worker runs on. Both sides import this module; only the worker loads them.

One native module (lloyal_pool.worker._native) serves every machine: llama.cpp is linked into it, and
ggml's backends are libraries beside it that each worker loads at start-up (native/backends.cpp):

- **CPU kernels**, one build per instruction-set level (``libggml-cpu-<level>.so``: x64, sse42,
  sandybridge, haswell, skylakex, icelake, sapphirerapids, ...). A worker runs the level that Pool(cpu=...)
  names, else the LLOYAL_POOL_CPU environment variable, else "auto": the best level its CPU runs, AMX
  kernels aside (they copy the model into the worker; named, they run where AMX does).
- **A GPU backend** (``libggml-cuda.so``; opt-in builds, docs/GPU.md), the "variant": Pool(variant=...),
  else LLOYAL_POOL_VARIANT, else "cpu"; "auto" means the best one that loads. A GPU backend that does not
  load or sees no device falls back to the CPU with a warning, or fails the worker's start in strict mode
  (Pool(strict_variant=True) or LLOYAL_POOL_VARIANT_STRICT=1).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError

KNOWN = ("cuda", "vulkan", "cpu")
ENV_VARIANT = "LLOYAL_POOL_VARIANT"
ENV_STRICT = "LLOYAL_POOL_VARIANT_STRICT"
ENV_CPU = "LLOYAL_POOL_CPU"
MODULE = "lloyal_pool.worker._native"
_CPU_PREFIX = "libggml-cpu"


def requested(variant: str | None) -> str:
    value = (variant or os.environ.get(ENV_VARIANT) or "cpu").strip().lower()
    if value != "auto" and value not in KNOWN:
        raise InvalidArgumentError(f"unknown native variant {value!r}; expected one of {', '.join(KNOWN)} or 'auto'")
    return value


def strict_requested(strict: bool | None) -> bool:
    if strict is not None:
        return strict
    return os.environ.get(ENV_STRICT, "") not in ("", "0", "false", "no")


def candidates(variant: str) -> list[str]:
    """The order a worker tries: the request first, CPU last."""
    if variant == "auto":
        return list(KNOWN)
    return [variant] if variant == "cpu" else [variant, "cpu"]


def backend_dir() -> Path | None:
    """Where the native module and the backends lie (an editable install keeps them apart from the
    sources): found without loading them."""
    spec = importlib.util.find_spec(MODULE)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def installed_cpu_levels() -> list[str]:
    """The CPU levels this install holds, by their files (sorted by name; "default" for a build of one)."""
    directory = backend_dir()
    names = []
    for path in directory.glob(f"{_CPU_PREFIX}*.so") if directory else ():
        level = path.name[len(_CPU_PREFIX):-len(".so")].lstrip("-")
        names.append(level or "default")
    return sorted(names)


def requested_cpu(cpu: str | None) -> str:
    """The CPU level a worker is told to load: ``cpu``, else LLOYAL_POOL_CPU, else "auto". A name this
    install does not hold is an InvalidArgumentError before any worker starts."""
    source = "cpu" if cpu else ENV_CPU
    value = (cpu or os.environ.get(ENV_CPU) or "auto").strip().lower()
    if value == "auto":
        return value
    levels = installed_cpu_levels()
    if levels and value not in levels:
        raise InvalidArgumentError(f"unknown CPU level {value!r} ({source}); this install has {', '.join(levels)} "
                                   "or 'auto'")
    return value


@dataclass(frozen=True)
class VariantProbe:
    """One native variant as probe() found it: whether it ``loads`` (for a GPU backend: loads and sees a
    device), the GPU ``devices`` it sees, and ``detail``: the CPU kernels chosen, or why it does not load."""

    name: str
    loads: bool
    devices: int
    detail: str


def probe(cpu: str | None = None, timeout: float = 120.0) -> list[VariantProbe]:
    """Which native variants can load on this machine (lloyal.node's loadBinary probe): the CPU kernels a
    worker would run (``cpu`` as Pool(cpu=...)), then each GPU backend of KNOWN, in that order. Tried in a
    throwaway child process, as a worker loads them: this process never loads llama.cpp. A worker asked
    for a variant that does not load here falls back to the CPU (or fails to start, strict)."""
    level = requested_cpu(cpu)
    code = (f"import json; from lloyal_pool.worker.__main__ import probe_variants; "
            f"print(json.dumps(probe_variants({level!r})))")
    env = {k: v for k, v in os.environ.items() if k != ENV_CPU}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [VariantProbe("cpu", False, 0, f"the probe process did not finish in {timeout:g} s")]
    try:
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return [VariantProbe("cpu", False, 0, f"the probe process failed (exit {out.returncode}): "
                                              f"{out.stderr[-2000:].strip()}")]
    return [VariantProbe(str(v["name"]), bool(v["loads"]), int(v["devices"]), str(v["detail"])) for v in found]


def fork_obstacle(variant: str, build: Mapping[str, Any]) -> str | None:
    """Why a worker of this native ``variant``, whose handshake reported ``build``, cannot be a zygote that
    forks ready workers (a snapshot's, the spares'); None: it can."""
    if not sys.platform.startswith("linux"):
        return f"forking a prepared worker needs Linux, not {sys.platform}"
    if variant != "cpu":
        return f"the pool's native variant is {variant!r} (a GPU runtime does not survive a fork)"
    cpu: Mapping[str, Any] = build.get("cpu", {})
    if any(name.startswith("AMX") for name in cpu.get("features", {})):
        return (f"the pool's CPU kernels ({cpu.get('kernels')}) use AMX, whose copy of the weights starts an "
                "OpenMP team that a fork cannot survive")
    return None
