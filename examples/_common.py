"""What every example needs: a command line with the model (default: Gemma 3 270M) and a pool."""

from __future__ import annotations

import argparse
from pathlib import Path


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("-m", "--model", help="GGUF file (default: Gemma 3 270M Q4_K_M from the package registry)")
    return ap


def model_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from lloyal_pool import default_model_path

    return default_model_path()
