"""The worker's engine runs in this process too: the same request logic, without a subprocess."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lloyal_pool import protocol as p
from lloyal_pool.errors import StaleHandleError
from lloyal_pool.shm import Region
from lloyal_pool.worker import engine as engine_mod


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    import lloyal_pool.worker._native as native

    eng = engine_mod.Engine(native, Region.anonymous(8 << 20))
    yield eng
    eng.close()


def test_load_generate_logits_in_process(engine, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    events: list[dict[str, Any]] = []
    loaded = engine.handle(p.LoadModel(path=str(tiny_model)), emit=events.append)
    assert events and events[-1] == {"progress": 1.0}
    model = loaded.model
    ctx = engine.handle(p.NewContext(model=model, params={"n_ctx": 128})).context
    pieces: list[dict[str, Any]] = []
    r = engine.handle(p.Generate(context=ctx, prompt="Hello", params={"n_predict": 8, "ignore_eos": True},
                                 stream=True), request_id=5, emit=pieces.append)
    assert r.n_decoded == 8 and "".join(str(e["piece"]) for e in pieces) == r.text
    at = engine.handle(p.Logits(context=ctx))
    logits = engine.region.floats(at.offset, at.count)
    assert logits.shape == (loaded.info.n_vocab,) and np.isfinite(logits).all()
    assert engine.handle(p.NPast(context=ctx)) == len(engine.handle(p.Tokens(context=ctx)))
    engine.handle(p.FreeContext(context=ctx))
    with pytest.raises(StaleHandleError):
        engine.handle(p.Logits(context=ctx))
    engine.handle(p.FreeModel(model=model))
    with pytest.raises(StaleHandleError):
        engine.handle(p.Tokenize(model=model, text="x"))


def test_interrupt_word_in_process(engine, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    model = engine.handle(p.LoadModel(path=str(tiny_model))).model
    desc = engine.handle(p.NewContext(model=model, params={"n_ctx": 512}))
    seen: list[object] = []

    def on_event(ev: dict[str, object]) -> None:
        seen.append(ev)
        if len(seen) == 5:  # from another thread, as a client would
            t = threading.Thread(target=engine.region.set_interrupt, args=(desc.interrupt_slot, 9))
            t.start()
            t.join()

    r = engine.handle(p.Generate(context=desc.context, prompt="Hello", params={"n_predict": 0, "ignore_eos": True},
                                 stream=True), request_id=9, emit=on_event)
    assert r.stop_reason == "interrupted" and 5 <= r.n_decoded < 50
    # The same word does not stop a different request.
    r = engine.handle(p.Generate(context=desc.context, prompt="", params={"n_predict": 3}, append=True), request_id=10)
    assert r.stop_reason == "length" and r.n_decoded == 3
    engine.handle(p.FreeModel(model=model))
