"""Hot spares (Pool(spares=N)): crash recovery takes a ready worker whose models are already loaded, and
another spare starts in its place."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import psutil
import pytest

from lloyal_pool import InvalidArgumentError, Pool
from lloyal_pool._recovery import Journal

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def _wait(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _model_loaded_in(pid: int, name: str) -> bool:
    try:
        return any(name in m.path for m in psutil.Process(pid).memory_maps())
    except psutil.Error:
        return False


def test_recovery_takes_a_spare_with_the_model_loaded(gemma_path: Path) -> None:
    with Pool(1, recover=True, spares=1) as pool:
        model = pool[0].load_model(gemma_path)
        ctx = model.new_context(n_ctx=1024)
        reference = ctx.generate(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True).text
        _wait(lambda: pool.spares == 1)
        spare_pids = {c.pid for c in psutil.Process().children()} - {pool[0].pid}
        # The spare loads what the pool's workers hold (on a thread of its own, after their load).
        _wait(lambda: any(_model_loaded_in(pid, gemma_path.name) for pid in spare_pids))
        pieces: list[str] = []
        with ctx.stream(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True) as stream:
            for piece in stream:
                pieces.append(piece)
                if len(pieces) == 8:
                    os.kill(pool[0].pid, signal.SIGKILL)
        assert "".join(pieces) == stream.result.text == reference
        assert pool[0].pid in spare_pids  # the spare took the dead worker's place
        _wait(lambda: pool.spares == 1)  # and another spare started
        assert ctx.generate(PROMPT, n_predict=40, temperature=0.0, ignore_eos=True).text == reference


def test_spares_is_a_count(gemma_path: Path) -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="spares"):
            Pool(1, spares=bad)  # type: ignore[arg-type]
    with Pool(1) as pool:
        assert pool.spares == 0


def test_a_long_journal_is_checkpointed_in_the_background(gemma_path: Path) -> None:
    with Pool(1, recover=True, checkpoint_tokens=64) as pool:
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=1024)
        ctx.generate("Hi", n_predict=4, temperature=0.0)
        journal = cast("Journal", ctx._link.journal)
        assert journal.checkpoint is None  # 6 tokens to replay: none taken
        ctx.generate(PROMPT, n_predict=60, temperature=0.0, ignore_eos=True)
        _wait(lambda: journal.checkpoint is not None)  # 70 tokens to replay: one taken after the call
        _wait(lambda: not journal._checkpointing)
        assert journal.entries == []
        held = ctx.tokens()
        os.kill(pool[0].pid, signal.SIGKILL)  # restored from the checkpoint, nothing decoded again
        assert ctx.tokens() == held
        assert ctx.generate("", append=True, n_predict=8, temperature=0.0).n_cached == len(held)
        with pytest.raises(InvalidArgumentError, match="checkpoint_tokens"):
            Pool(1, recover=True, checkpoint_tokens=0)
