"""The worker's engine runs in this process too: the same request logic, without a subprocess."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lloyal_pool import protocol as p
from lloyal_pool.errors import StaleHandleError
from lloyal_pool.protocol import Kind
from lloyal_pool.shm import Region
from lloyal_pool.worker import engine as engine_mod
from lloyal_pool.worker import loop


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


def test_the_loop_answers_bad_requests_and_keeps_serving() -> None:
    """Unknown ops and mistyped fields fail their own request; the next one is served."""
    import lloyal_pool.worker._native as native

    engine = engine_mod.Engine(native, Region.anonymous(1 << 20))
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    worker = threading.Thread(target=loop.WorkerLoop(engine, req_r, rep_w).run, daemon=True)
    worker.start()
    try:
        sent = [["no_such_op", {}], ["tokenize", {"model": "one", "text": "hi"}], ["ping", {"extra": 1}],
                ["ping", {}]]
        for i, payload in enumerate(sent, 1):
            p.write_frame(req_w, p.pack(Kind.REQUEST, i, payload))
        replies = [p.read_frame(rep_r) for _ in sent]
        assert [r[:2] for r in replies] == [(Kind.ERROR, 1), (Kind.ERROR, 2), (Kind.ERROR, 3), (Kind.RESPONSE, 4)]
        assert {r[2]["type"] for r in replies[:3]} == {"BadRequestError"}
        assert "$.model" in replies[1][2]["message"]
        assert p.parse_reply(p.Ping, replies[3][2]).pid == os.getpid()
        p.write_frame(req_w, p.pack(Kind.SHUTDOWN, 0, None))
        worker.join(5)
    finally:
        for fd in (req_r, req_w, rep_r, rep_w):
            os.close(fd)
