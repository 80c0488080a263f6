"""A short soak (bench/soak.py, about 40 s): client threads on two workers with interrupts, bad input and a
worker killed or stopped every 7 s; every call is accounted for and nothing is left behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from soak import Soak, SoakConfig, summary

pytestmark = pytest.mark.gemma


def test_a_short_soak_loses_no_call_and_leaks_nothing(gemma_path: Path, tiny_model: Path) -> None:
    cfg = SoakConfig(duration=40.0, threads=6, workers=2, kill_every=7.0, hang_timeout=3.0, seed=10,
                     model_paths={"gemma": str(gemma_path), "tiny": str(tiny_model)}, verbose=False)
    report = Soak(cfg).run()
    print(summary(report))
    totals = report["totals"]
    assert totals["lost"] == 0, report["lost"]
    assert report["stuck_threads"] == []
    assert {k: v for k, v in report["leaks"].items() if v} == {}
    assert report["bad_inputs"]["accepted"] == []
    assert report["targets"]["stops_not_found"]["met"], report["disruptions"]
    # It did what it says: calls of every kind, both disruptions, each dead worker replaced.
    assert {"generate", "stream", "branch_step", "score", "score_choices"} <= set(report["by_op"])
    assert all(report["by_op"][op]["ok"] > 0 for op in ("generate", "stream", "score", "score_choices"))
    assert sum(report["bad_inputs"]["raised_expected_type"].values()) > 0
    actions = {d["action"] for d in report["disruptions"]}
    assert {"SIGKILL", "SIGSTOP"} <= actions
    assert all(d["died_t"] is not None for d in report["disruptions"] if d["t"] < report["duration_s"] - 15)
    assert len(report["replacements"]) >= len(report["disruptions"]) - 1
    # The suite shares this process (other tests' pools, caches): the RSS growth is reported, and only
    # bounded generously here; bench/soak.py holds the 20 MiB target.
    assert report["rss_mib"]["growth"] < 100, report["rss_mib"]
