"""The chaos storm, short (bench/chaos.py runs it for ten minutes): every never-away feature of one pool
on at once (recovery, a spare, checkpoints, paging, moves, pause and resume, drains, chat turns,
branches), three caller threads on shared contexts, and workers SIGKILLed and SIGSTOPped at random. It
passes when no call hangs, every error is a LloyalError, every greedy or seeded result equals the same
call alone in a fresh pool on this machine, every context answers correctly after the storm, and nothing
of the pool is left once it is closed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from chaos import ChaosConfig, Storm, summary


@pytest.mark.timeout(400)
def test_the_storm_leaves_nothing_hung_untyped_wrong_or_behind(tiny_model: Path) -> None:
    cfg = ChaosConfig(duration=30.0, seed=5, kill_every=(3.0, 6.0), model="tiny", verbose=False)
    report = Storm(cfg, str(tiny_model)).run()
    print(summary(report))
    assert sum(report["disruptions"].values()) >= 5, report["disruptions"]  # the storm did storm
    assert report["calls_total"] >= 200, report["calls"]
    assert report["passed"], summary(report)
