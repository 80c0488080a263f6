"""Docstrings that must keep up with the code they describe, read from the code itself (no model)."""

from __future__ import annotations

import re
from pathlib import Path

from lloyal_pool.branches import Produced
from lloyal_pool.lifecycle import WorkerEvent

PACKAGE = Path(__file__).resolve().parents[2] / "lloyal_pool"


def test_worker_event_names_every_kind_the_pool_sends() -> None:
    sent = {kind for path in PACKAGE.rglob("*.py")
            for kind in re.findall(r'WorkerEvent\(\s*"([a-z]+)"', path.read_text())}
    assert sent == {"died", "replaced", "recovered"}
    doc = WorkerEvent.__doc__ or ""
    assert all(f'"{kind}"' in doc for kind in sent), doc


def test_produced_names_each_of_its_fields() -> None:
    doc = Produced.__doc__ or ""
    assert all(f"``{name}``" in doc for name in Produced._fields if name != "token"), doc
