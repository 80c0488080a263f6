"""Scale-out on Ray (lloyal_pool.ray): RayPool on a local Ray cluster the test starts (two CPUs), its
actors each a Pool of one worker holding Gemma 3 270M, spoken to as a Pool and over HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from invariance import assert_same_within_invariance, reference
from readme import run_section
from served import PATIENCE, Served, chat_with_the_serve_command

from lloyal_pool import InvalidArgumentError, ModelLoadError, Pool, PoolClosedError, WorkerCrashedError
from lloyal_pool.client import WorkerEvent
from lloyal_pool.errors import BadRequestError, InvalidTokenError, RemoteError
from lloyal_pool.ray import RayPool

pytestmark = pytest.mark.gemma
LONG: dict[str, Any] = {"n_predict": 0, "temperature": 0}  # until its slot is full: runs until interrupted
# Two actors of half a CPU each leave room on the two-CPU cluster for the ones a test starts of its own.
OPTIONS: dict[str, Any] = {"num_cpus": 0.5, "threads_per_worker": 1, "slots": 4, "n_ctx_slot": 512}


def test_the_readme_section_runs() -> None:
    """First in the file: the section starts its own local cluster, before the tests' one exists."""
    out = run_section("## More machines: Ray")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith("[(") and lines[1].strip() and lines[2].strip()


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def rpool(cluster: None, gemma_path: Path) -> Iterator[RayPool]:
    with RayPool(2, gemma_path, **OPTIONS) as pool:
        yield pool


@pytest.fixture(scope="module")
def local(gemma_path: Path) -> Iterator[Pool]:
    """The same worker on this machine: what each actor runs."""
    with Pool(1, threads_per_worker=1) as pool:
        pool[0].load_model(gemma_path).batcher(slots=4, n_ctx_slot=512)
        yield pool


def wait_until(condition: object, what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not callable(condition) or not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_actors_are_placed_and_described(rpool: RayPool, gemma_path: Path) -> None:
    assert len(rpool) == 2 and all(w.alive for w in rpool)
    node = ray.get_runtime_context().get_node_id()
    for w in rpool:
        assert w.node_id == node and w.model_path == str(gemma_path) and w.slots == 4
        assert w.pid != os.getpid() and w.worker_pid not in (w.pid, os.getpid())  # llama.cpp: a third process
    assert len({w.pid for w in rpool}) == 2
    assert [s["worker_id"] for s in rpool.stats()] == [0, 0]  # each actor's own Pool of one


def test_greedy_requests_equal_the_local_pools(rpool: RayPool, local: Pool) -> None:
    # The actors batch the three requests together, the local pool runs each alone: equal up to a near tie.
    prompts: list[str | list[int]] = ["The capital of France is", "Once upon a time", [2, 818, 5279, 529]]
    futures = [rpool.submit(p, n_predict=12, temperature=0).future for p in prompts]
    compared = 0
    for prompt, fut in zip(prompts, futures, strict=True):
        got, want = fut.result(PATIENCE), local.generate(prompt, n_predict=12, temperature=0)
        n = assert_same_within_invariance(got.tokens, want.tokens, reference(local[0].models[0], prompt, 12)[1])
        if n == len(want.tokens):
            assert got.text == want.text and got.stop_reason == want.stop_reason
        compared += n
    assert compared > 0  # the comparison had something to compare


def test_a_stream_joins_to_its_text_and_the_asyncio_twins_work(rpool: RayPool) -> None:
    with rpool.stream("Once upon a time", n_predict=10, temperature=0) as stream:
        pieces = list(stream)
    assert len(pieces) >= 2 and "".join(pieces) == stream.result.text

    async def main() -> tuple[str, str]:
        whole = await rpool.agenerate("Once upon a time", n_predict=10, temperature=0)
        joined = "".join([piece async for piece in rpool.astream("Once upon a time", n_predict=10, temperature=0)])
        return whole.text, joined

    whole, joined = asyncio.run(main())
    assert whole == joined == stream.result.text


def test_interrupting_one_request_leaves_the_others_running(rpool: RayPool) -> None:
    long = rpool.submit("Tell me a story.", **LONG)
    other = rpool.submit("Count: 1, 2, 3,", n_predict=24, temperature=0)
    wait_until(lambda: sum(w.load for w in rpool) == 2, "both requests were sent")
    long.interrupt()
    cut = long.future.result(PATIENCE)
    assert cut.stop_reason == "interrupted" and cut.n_decoded < 512
    assert other.future.result(PATIENCE).n_decoded == 24
    wait_until(lambda: sum(w.load for w in rpool) == 0, "the loads came back to zero")


def test_interrupts_reach_an_actor_whose_threads_are_all_busy(cluster: None, gemma_path: Path) -> None:
    with RayPool(1, gemma_path, **{**OPTIONS, "slots": 1}) as pool:  # threads for 4 requests
        requests = [pool.submit("Tell me a story.", **LONG) for _ in range(6)]
        time.sleep(1.0)
        for r in requests:
            r.interrupt()
        assert [r.future.result(PATIENCE).stop_reason for r in requests] == ["interrupted"] * 6


def test_cancelling_an_asyncio_task_interrupts_its_request(rpool: RayPool) -> None:
    async def main() -> None:
        task = asyncio.create_task(rpool.agenerate("Tell me a story.", **LONG))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_until(lambda: sum(w.load for w in rpool) == 0, "the cancelled request ended on its actor")


def test_the_router_spreads_load_and_keeps_a_conversation_where_it_was(rpool: RayPool) -> None:
    first, second = rpool._pick("a" * 10), rpool._pick("b" * 10)  # both free: the least loaded
    assert first is not second
    for w in (first, second):
        with rpool._lock:
            w.load -= 1
    history = "The conversation so far, long enough to share a prefix: " + "x" * 80
    home = rpool._pick(history)  # still running: the other actor is now the less loaded one
    for _ in range(2):  # later turns extend the conversation: they go where it is, its slot has room
        turn = rpool._pick(history + " and one more turn")
        assert turn is home
        with rpool._lock:
            turn.load -= 1
    other = rpool._pick("Something else entirely")  # no shared prefix: the least loaded
    assert other is not home
    with rpool._lock:
        home.load -= 1
        other.load -= 1


def test_bad_requests_are_refused_in_the_driver(rpool: RayPool, local: Pool) -> None:
    with pytest.raises(InvalidArgumentError):
        rpool.submit("x", model=local[0].models[0])  # a handle of another process's worker
    with pytest.raises(InvalidArgumentError):
        rpool.submit([1, "two"])  # type: ignore[list-item]
    with pytest.raises(BadRequestError):
        rpool.generate("x", nonsense=1)
    with pytest.raises(InvalidArgumentError):
        RayPool(0, "x")
    with pytest.raises(InvalidArgumentError, match="slots"):
        RayPool(1, "x", slots=0)


def test_an_actor_that_cannot_start_says_why(cluster: None, gemma_path: Path) -> None:
    with pytest.raises(RemoteError, match=r"TypeError.*nonsense"):
        RayPool(1, gemma_path, pool_options={"nonsense": 1}, **OPTIONS)
    with pytest.raises(InvalidArgumentError, match="n_ctx_slot"):  # the worker's own check, with its type
        RayPool(1, gemma_path, **{**OPTIONS, "n_ctx_slot": 2})


def test_an_error_in_the_worker_keeps_its_type(rpool: RayPool) -> None:
    with pytest.raises(InvalidTokenError, match="outside"):
        rpool.generate([10**9], n_predict=2)  # an id outside the vocabulary, refused by the worker
    assert all(w.alive for w in rpool)


def test_the_model_path_is_resolved_on_the_node(cluster: None, gemma_path: Path) -> None:
    assert "LLOYAL_TEST_MODELS" not in os.environ  # only the actor's environment has it
    env = {"runtime_env": {"env_vars": {"LLOYAL_TEST_MODELS": str(gemma_path.parent)}}}
    with RayPool(1, f"$LLOYAL_TEST_MODELS/{gemma_path.name}", actor_options=env, **OPTIONS) as pool:
        assert pool[0].model_path == str(gemma_path)
        assert pool.generate("Hi", n_predict=2, temperature=0).n_decoded == 2
    with pytest.raises(ModelLoadError, match="is not a file on node"):
        RayPool(1, "/nowhere/model.gguf", **OPTIONS)
    with RayPool(1, lambda: str(gemma_path), **OPTIONS) as pool:
        assert pool[0].model_path == str(gemma_path)


def test_the_gpus_ray_gives_an_actor_are_its_workers(cluster: None, gemma_path: Path) -> None:
    env = {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": "7"}}}  # as Ray sets it for num_gpus
    with RayPool(1, gemma_path, actor_options=env, **OPTIONS) as pool:
        environ = Path(f"/proc/{pool[0].worker_pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=7" in environ


def test_a_dead_actor_is_reported_and_replaced(cluster: None, gemma_path: Path) -> None:
    events: list[WorkerEvent] = []
    with RayPool(1, gemma_path, **OPTIONS) as pool:
        pool.subscribe(events.append)
        victim = pool[0]
        request = pool.submit("Tell me a story.", **LONG)
        wait_until(lambda: victim.load == 1, "the request was sent")
        time.sleep(0.5)
        ray.kill(victim.actor)
        with pytest.raises(WorkerCrashedError, match="Ray actor of worker 0"):
            request.future.result(PATIENCE)
        wait_until(lambda: [e.kind for e in events] == ["died", "replaced"], "the actor was replaced")
        assert isinstance(events[0].error, WorkerCrashedError) and events[1].index == 0
        fresh = pool[0]
        assert fresh is not victim and fresh.alive and fresh.worker_id == 1 and not victim.alive
        assert pool.generate("Hi", n_predict=2, temperature=0).n_decoded == 2


def test_a_crashed_worker_inside_an_actor_is_reported_and_replaced(cluster: None, gemma_path: Path) -> None:
    events: list[WorkerEvent] = []
    with RayPool(1, gemma_path, **OPTIONS) as pool:
        pool.subscribe(events.append)
        request = pool.submit("Tell me a story.", **LONG)
        time.sleep(1.0)
        os.kill(pool[0].worker_pid, signal.SIGKILL)  # llama.cpp's process, under the actor
        with pytest.raises(WorkerCrashedError) as err:
            request.future.result(PATIENCE)
        assert err.value.signal_name == "SIGKILL"
        wait_until(lambda: [e.kind for e in events] == ["died", "replaced"], "the actor was replaced")
        assert pool.generate("Hi", n_predict=2, temperature=0).n_decoded == 2


def test_a_closed_pool_refuses_requests_and_fails_running_ones(cluster: None, gemma_path: Path) -> None:
    pool = RayPool(1, gemma_path, **OPTIONS)
    request = pool.submit("Tell me a story.", **LONG)
    time.sleep(0.5)
    closer = threading.Thread(target=pool.close)
    closer.start()
    with pytest.raises(PoolClosedError):
        request.future.result(PATIENCE)
    closer.join(PATIENCE)
    with pytest.raises(PoolClosedError):
        pool.generate("Hi", n_predict=2)
    pool.close()  # idempotent


def test_the_http_endpoint_serves_from_a_ray_pool(rpool: RayPool, local: Pool) -> None:
    served = Served(rpool)
    try:
        client = served.client()
        assert [m.id for m in client.models.list().data] == [Path(rpool[0].model_path).stem]
        got = client.completions.create(model="x", prompt="The capital of France is", max_tokens=8, temperature=0)
        assert got.choices[0].text == local.generate("The capital of France is", n_predict=8, temperature=0).text
        chunks = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0)
        assert streamed == whole.choices[0].message.content and streamed
        two = client.completions.create(model="x", prompt="Hi", max_tokens=3, n=2, seed=1, extra_body={"priority": -1})
        assert [c.index for c in two.choices] == [0, 1]
        with pytest.raises(openai.BadRequestError, match="slots"):  # each actor's batcher has 4
            client.completions.create(model="x", prompt="Hi", max_tokens=3, n=5)
        vectors = client.embeddings.create(model="x", input=["a cat", "a dog"]).data
        assert len(vectors) == 2 and len(vectors[0].embedding) > 100
        health = httpx.get(served.url + "/health").json()
        assert health == {"status": "ok", "workers": 2, "workers_alive": 2}
        assert 'lloyal_worker_alive{worker="0@' in httpx.get(served.url + "/metrics").text
    finally:
        served.close()


def test_the_serve_command_on_a_ray_cluster(rpool: RayPool, gemma_path: Path) -> None:
    address = ray.get_runtime_context().gcs_address  # an existing cluster, as a multi-node deployment has
    err = chat_with_the_serve_command(["--ray", address, "-m", str(gemma_path), "--workers", "1", "-t", "1",
                                       "--slots", "2", "--n-ctx-slot", "512"])
    assert "has no chat template: chats use the gemma format" in err and "on 1 Ray actor(s) on 1 node(s)" in err
