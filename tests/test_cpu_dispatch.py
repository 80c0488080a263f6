"""Run-time CPU dispatch: one build runs on any x86-64 CPU. Each worker loads the best level of ggml's CPU
kernels this machine runs (AMX only when named, and where a tile instruction works), or the level that
Pool(cpu=) or LLOYAL_POOL_CPU names; the worker's devices and build info say which. The installed wheel on an
emulated old CPU: tests/test_wheel.py."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from invariance import assert_same_within_invariance, reference

from lloyal_pool import InvalidArgumentError, Model, Pool, variants

X86 = platform.machine() in ("x86_64", "AMD64")
# ggml's x86-64 levels, oldest first; each needs the instruction sets of the one before it, more or less.
X86_LEVELS = {"x64", "sse42", "sandybridge", "haswell", "skylakex", "icelake", "alderlake", "sapphirerapids"}


def native(code: str, *, prefix: list[str] | None = None, env: dict[str, str] | None = None,
           timeout: float = 120) -> Any:
    """What ``code`` (run with the native module imported as ``n``) prints as JSON, in a fresh process."""
    script = "import json, lloyal_pool.worker._native as n\n" + textwrap.dedent(code)
    out = subprocess.run([*(prefix or []), sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def levels() -> list[dict[str, Any]]:
    return list(native("print(json.dumps(n.cpu_levels()))"))


@pytest.mark.skipif(not X86, reason="the x86-64 levels")
def test_the_build_holds_every_x86_level_and_the_parent_sees_them() -> None:
    built = levels()
    names = {level["name"] for level in built}
    assert names >= X86_LEVELS, names
    assert set(variants.installed_cpu_levels()) == names  # read from the files: the parent loads nothing
    # Best first: no level this CPU cannot run (score 0) comes before one it can.
    scores = [level["score"] for level in built]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0
    by_name = {level["name"]: level["score"] for level in built}
    assert by_name["x64"] > 0  # every x86-64 CPU runs the baseline


def test_a_worker_runs_the_best_level_this_cpu_runs_that_does_not_copy_the_model() -> None:
    built = levels()
    with Pool(1, cpu="auto") as pool:  # "auto" named: whatever LLOYAL_POOL_CPU says
        cpu = pool[0].build_info["cpu"]
        devices = pool[0].devices()
        assert cpu["requested"] == "auto" and pool[0].cpu_kernels == cpu["kernels"]
    chosen = next(level for level in built if level["name"] == cpu["kernels"])
    # Only a level with AMX kernels (which copy every weight into the worker's memory) is passed over for a
    # lower one, and the reason says so.
    assert not any(k.startswith("AMX") for k in cpu["features"]), cpu
    for better in (level for level in built if level["score"] > chosen["score"]):
        assert f"{better['name']} passed over: its AMX kernels copy every weight" in cpu["reason"], cpu
    [device] = [d for d in devices if d.type == "cpu"]
    assert device.kernels == cpu["kernels"]


def test_every_level_this_cpu_runs_writes_what_the_best_one_writes(gemma: Model, gemma_path: Path) -> None:
    # The levels round differently (AVX2, AVX-512 and AMX accumulate in other orders): equal greedy tokens up
    # to the reference's first near tie. The prompt is decoded as one batch of many rows, which runs each
    # level's matrix kernels (AMX tiles included), the tokens after it one row at a time.
    prompt = "Count from one to twenty: 1, 2, 3, 4, 5, 6, 7,"
    want, margins = reference(gemma, prompt, 12)
    runnable = [level["name"] for level in levels() if level["score"] > 0]
    compared = {}
    for name in runnable:
        with Pool(1, cpu=name) as pool:
            assert pool[0].cpu_kernels == name
            got = pool[0].load_model(gemma_path).new_context(n_ctx=256).generate(prompt, n_predict=12)
        compared[name] = assert_same_within_invariance(got.tokens, want, margins)
    assert all(compared.values()), compared  # each had something to compare


@pytest.mark.skipif(not X86, reason="the x86-64 levels")
def test_a_level_named_is_the_level_run(tiny_model: Path) -> None:
    with Pool(1, cpu="haswell") as pool:
        cpu = pool[0].build_info["cpu"]
        assert pool[0].cpu_kernels == "haswell" and cpu["requested"] == "haswell"
        assert cpu["features"].get("AVX2") == "1" and "AVX512" not in cpu["features"], cpu
        assert [d.kernels for d in pool[0].devices() if d.type == "cpu"] == ["haswell"]
        result = pool[0].load_model(tiny_model).new_context().generate("Once upon a time", n_predict=8)
        assert result.n_decoded == 8


@pytest.mark.skipif(not X86, reason="the x86-64 levels")
def test_the_environment_names_the_level_and_the_option_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variants.ENV_CPU, "x64")
    with Pool(1) as pool:
        assert pool[0].cpu_kernels == "x64"
    with Pool(1, cpu="sse42") as pool:
        assert pool[0].cpu_kernels == "sse42"


def test_an_unknown_level_is_refused_before_a_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown CPU level 'pentium4'.*haswell"):
        Pool(1, cpu="pentium4")
    with pytest.raises(InvalidArgumentError, match="cpu"):
        Pool(1, cpu=3)  # type: ignore[arg-type]
    monkeypatch.setenv(variants.ENV_CPU, "pentium4")
    with pytest.raises(InvalidArgumentError, match=variants.ENV_CPU):
        Pool(1)


# A seccomp filter that makes arch_prctl(ARCH_REQ_XCOMP_PERM, ...) fail with EPERM, as a kernel or sandbox
# that does not grant AMX's tile data does; the pool's workers inherit it.
DENY_AMX = """
import ctypes, struct
code = [(0x20, 0, 0, 0), (0x15, 0, 3, 158), (0x20, 0, 0, 16), (0x15, 0, 1, 0x1023),
        (0x06, 0, 0, 0x00050000 | 1), (0x06, 0, 0, 0x7fff0000)]
filt = b"".join(struct.pack("HBBI", *c) for c in code)
buf = ctypes.create_string_buffer(filt)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
prog = Prog(len(code), ctypes.addressof(buf))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, filter
"""


@pytest.mark.skipif(not X86, reason="AMX is x86-64's")
def test_amx_kernels_named_fail_the_start_where_the_kernel_does_not_grant_amx() -> None:
    script = DENY_AMX + "from lloyal_pool import Pool\nPool(1, cpu='sapphirerapids')\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "WorkerStartupError" in out.stderr, out.stderr[-3000:]
    # On a CPU with AMX because the kernel refuses its tile data; on any other because the CPU lacks it.
    has_amx = next(level for level in levels() if level["name"] == "sapphirerapids")["score"] > 0
    why = "does not grant AMX tile data" if has_amx else "this CPU cannot run the 'sapphirerapids' kernels"
    assert why in out.stderr, out.stderr[-3000:]
