"""The worker's engine runs in this process too: the same request logic, without a subprocess."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from lloyal_pool.errors import StaleHandleError
from lloyal_pool.shm import Region
from lloyal_pool.worker import engine as engine_mod


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    import lloyal_pool.worker._native_cpu as native

    eng = engine_mod.Engine(native, Region.anonymous(8 << 20))
    yield eng
    eng.close()


def test_load_generate_logits_in_process(engine, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    events: list[dict[str, object]] = []
    loaded = engine.load_model(str(tiny_model), emit=events.append)
    assert events and events[-1] == {"progress": 1.0}
    model = loaded["model"]
    desc = engine.new_context(model, {"n_ctx": 128})
    ctx = desc["context"]
    pieces: list[dict[str, object]] = []
    r = engine.generate(ctx, "Hello", {"n_predict": 8, "ignore_eos": True}, request_id=5, stream=True,
                        emit=pieces.append)
    assert r["n_decoded"] == 8 and "".join(str(p["piece"]) for p in pieces) == r["text"]
    d = engine.logits(ctx)
    logits = engine.region.floats(d["offset"], d["count"])
    assert logits.shape == (loaded["info"]["n_vocab"],) and np.isfinite(logits).all()
    engine.free_context(ctx)
    with pytest.raises(StaleHandleError):
        engine.logits(ctx)
    engine.free_model(model)
    with pytest.raises(StaleHandleError):
        engine.tokenize(model, "x")


def test_interrupt_word_in_process(engine, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    model = engine.load_model(str(tiny_model))["model"]
    desc = engine.new_context(model, {"n_ctx": 512})
    seen: list[object] = []

    def on_event(ev: dict[str, object]) -> None:
        seen.append(ev)
        if len(seen) == 5:  # from another thread, as a client would
            t = threading.Thread(target=engine.region.set_interrupt, args=(desc["interrupt_slot"], 9))
            t.start()
            t.join()

    r = engine.generate(desc["context"], "Hello", {"n_predict": 0, "ignore_eos": True}, request_id=9,
                        stream=True, emit=on_event)
    assert r["stop_reason"] == "interrupted" and 5 <= r["n_decoded"] < 50
    # The same word does not stop a different request.
    r = engine.generate(desc["context"], "", {"n_predict": 3}, request_id=10)
    assert r["stop_reason"] == "length" and r["n_decoded"] == 3
    engine.free_model(model)
