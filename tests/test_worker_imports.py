"""A worker imports the wire modules and its own package, not the client: what its handshake reports it
had imported once it was ready to serve (worker/__main__.py, imported_modules), against the layers in
tests/layers.py. What it may import later, inside its handlers, tests/unit/test_layers.py reads from the
source."""

from __future__ import annotations

from layers import LAYERS, WORKER_MAY_IMPORT

from lloyal_pool import Pool

# The package's __init__ comes with any of its modules (it loads nothing itself); the native module is the
# worker's own.
ALLOWED = {"lloyal_pool", "lloyal_pool.worker._native"} | {
    f"lloyal_pool.{m}" if m else "lloyal_pool" for layer, modules in LAYERS if layer in WORKER_MAY_IMPORT
    for m in modules}


def test_a_running_worker_holds_only_the_wire_modules_and_its_own() -> None:
    with Pool(1) as pool:
        modules = set(pool[0]._proc.hello["modules"])
    ours = {m for m in modules if m.startswith("lloyal_pool")}
    assert ours - ALLOWED == set()
    assert {"lloyal_pool.worker.engine", "lloyal_pool.worker.loop", "lloyal_pool.worker._native"} <= ours
    assert {"psutil", "lloyal_pool.client", "lloyal_pool._process"}.isdisjoint(modules)
