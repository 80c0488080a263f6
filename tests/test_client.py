"""Client mechanics: load progress, per-worker figures, calls from many threads, the pool's lifecycle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lloyal_pool import Model, Pool, PoolClosedError, WorkerCrashedError


def test_load_progress_reaches_the_callback(pool: Pool, tiny_model: Path) -> None:
    seen: list[float] = []
    model = pool[1].load_model(tiny_model, progress=seen.append)
    try:
        assert seen and seen[-1] == 1.0
        assert seen == sorted(seen) and all(0.0 <= f <= 1.0 for f in seen)
    finally:
        model.close()


def test_worker_figures(pool: Pool) -> None:
    stats = pool.stats()
    assert [s["worker_id"] for s in stats] == [pool[0].worker_id, pool[1].worker_id]
    for s in stats:
        assert s["state"] == "alive" and s["rss"] > 10 << 20 and s["num_threads"] >= 1
        assert s["variant"] == "cpu" and "user" in s["cpu_times"]
    info = pool[0].build_info
    assert info["llama_cpp"] and info["default_threads"] >= 1


def test_a_dead_workers_figures_say_how_it_ended() -> None:
    with Pool(2) as pool:
        pool[1].kill()
        with pytest.raises(WorkerCrashedError):
            pool[1].ping(timeout=30)
        alive, dead = pool.stats()
        assert alive["state"] == "alive" and alive["in_flight"] == 0
        assert dead == {"worker_id": pool[1].worker_id, "pid": pool[1].pid, "state": "dead", "variant": "cpu",
                        "in_flight": 0, "returncode": -9}


def test_many_threads_share_a_worker(tiny: Model) -> None:
    # Each thread has its own context on the same worker; results equal a sequential run.
    contexts = [tiny.new_context(n_ctx=128) for _ in range(6)]
    prompts = [f"Prompt number {i}" for i in range(6)]
    try:
        expected = [c.generate(p, n_predict=12).tokens for c, p in zip(contexts, prompts, strict=True)]
        for c in contexts:
            c.reset()
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda cp: cp[0].generate(cp[1], n_predict=12).tokens,
                              zip(contexts, prompts, strict=True)))
        assert got == expected
    finally:
        for c in contexts:
            c.close()


def test_calls_on_one_context_run_in_order(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=256)
    try:
        futs = [ctx.eval_async([1, 100 + i]) if i == 0 else ctx.eval_async([100 + i]) for i in range(20)]
        n_past = [f.result().n_past for f in futs]
        assert n_past == list(range(2, 22))
        assert ctx.tokens() == [1] + [100 + i for i in range(20)]
    finally:
        ctx.close()


def test_closed_pool_refuses_calls(tiny_model: Path) -> None:
    pool = Pool(1)
    model = pool[0].load_model(tiny_model)
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(PoolClosedError):
        model.tokenize("hello")
    with pytest.raises(PoolClosedError):
        pool.replace(0)
    with pytest.raises(PoolClosedError):
        pool.snapshot(lambda instance: None)


def test_workers_share_the_cpus_by_default(pool: Pool, tiny: Model) -> None:
    import os

    share = max(1, len(os.sched_getaffinity(0)) // len(pool))
    assert [inst.threads for inst in pool] == [share] * len(pool)
    ctx = tiny.new_context(n_ctx=64)
    explicit = tiny.new_context(n_ctx=64, n_threads=3)
    try:
        assert (ctx.n_threads, explicit.n_threads) == (share, 3)
    finally:
        ctx.close()
        explicit.close()


@pytest.mark.parametrize("threads", [1, 512])
def test_threads_per_worker_takes_ggmls_whole_range(tiny_model: Path, threads: int) -> None:
    with Pool(1, threads_per_worker=threads) as pool:
        assert pool[0].threads == threads
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=64)
        assert ctx.n_threads == threads


def test_a_model_is_mapped_by_default_and_read_when_asked(tiny_model: Path) -> None:
    """use_mmap (default True) maps the file into the worker; False reads it into the worker's memory."""
    def mapped(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return any(line.rstrip().endswith(str(tiny_model.resolve())) for line in f)

    with Pool(1) as pool:
        worker = pool[0]
        model = worker.load_model(tiny_model)
        assert mapped(worker.pid)
        model.close()
        worker.load_model(tiny_model, use_mmap=False)
        assert not mapped(worker.pid)


def test_handles_say_what_they_are_in_their_repr(tiny_model: Path, tmp_path: Path) -> None:
    from loras import attention_shapes, write_lora

    with Pool(1) as pool:
        inst = pool[0]
        assert repr(inst) == f"<Instance worker={inst.worker_id} pid={inst.pid} variant=cpu alive>"
        model = inst.load_model(tiny_model)
        assert repr(model) == f"<Model {model.info.desc!r} worker={inst.worker_id} handle={model._handle}>"
        ctx = model.new_context(n_ctx=64)
        assert repr(ctx) == f"<Context n_ctx=64 worker={inst.worker_id} handle={ctx.handle}>"
        branch = model.new_context(n_ctx=64, n_seq_max=2).branch([1, 2])
        assert repr(branch) == f"<Branch {branch.handle} context={branch.store._link.handle}>"
        branch.prune()
        assert repr(branch).endswith(" released>")
        path = write_lora(tmp_path / "a.gguf", "llama", attention_shapes(model.info, [0]), rank=2, seed=1)
        adapter = model.load_lora(path)
        assert repr(adapter) == f"<LoraAdapter 'a.gguf' handle={adapter._handle}>"
        adapter.close()
        assert repr(adapter).endswith(" closed>")
        with ctx.stream("Hi", n_predict=2) as stream:
            assert "".join(stream) == stream.result.text and stream.done
        inst.kill()
        with pytest.raises(WorkerCrashedError):
            inst.ping(timeout=30)
        assert repr(inst).endswith(" dead>")
