"""A worker imports the wire modules and its own package, not the client: what its handshake reports it
had imported once it was ready to serve (worker/__main__.py, imported_modules). What it may import later,
inside its handlers, tests/unit/test_layers.py reads from the source."""

from __future__ import annotations

from lloyal_pool import Pool

WIRE = {"lloyal_pool", "lloyal_pool.errors", "lloyal_pool.params", "lloyal_pool.chat", "lloyal_pool.protocol",
        "lloyal_pool.shm", "lloyal_pool.variants", "lloyal_pool._files"}


def test_a_running_worker_holds_only_the_wire_modules_and_its_own() -> None:
    with Pool(1) as pool:
        modules = set(pool[0]._proc.hello["modules"])
    ours = {m for m in modules if m.startswith("lloyal_pool")}
    assert ours - WIRE == {m for m in ours if m.startswith("lloyal_pool.worker")}
    assert {"lloyal_pool.worker.engine", "lloyal_pool.worker.loop", "lloyal_pool.worker._native"} <= ours
    assert {"psutil", "lloyal_pool.client", "lloyal_pool._process"}.isdisjoint(modules)
