"""Snapshots: a worker prepared once, frozen as a zygote, forked into ready instances (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from procs import FAULTS, all_end, ended

from lloyal_pool import (
    Context,
    Instance,
    InvalidArgumentError,
    Model,
    Pool,
    Snapshot,
    SnapshotError,
    StaleHandleError,
    WorkerCrashedError,
    variants,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="snapshots fork: Linux only")
# Forking needs CPU kernels without AMX (their copy of the weights starts an OpenMP team): where the suite
# runs AMX kernels (LLOYAL_POOL_CPU=sapphirerapids), these pools run the best level without them.
CPU = "auto" if os.environ.get(variants.ENV_CPU, "").strip().lower() == "sapphirerapids" else None

SYSTEM = ("You are a terse assistant for a museum. Answer in one sentence. The museum opens at nine and "
          "closes at five; tickets cost twelve euros. Question: When does the museum open? Answer:")


def _prepare(gemma_path: Path):  # type: ignore[no-untyped-def]
    def prepare(instance: Instance) -> dict[str, Model | Context]:
        model = instance.load_model(gemma_path)
        ctx = model.new_context(n_ctx=512, n_threads=2)
        ctx.eval(SYSTEM)
        return {"model": model, "ctx": ctx}
    return prepare


@pytest.fixture(scope="module")
def snap_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with Pool(1, env=FAULTS, writable_dirs=[tmp_path_factory.getbasetemp()], cpu=CPU) as pool:
        yield pool


@pytest.fixture(scope="module", params=[True, False], ids=["fork", "replay"])
def snap(snap_pool: Pool, gemma_path: Path, request: pytest.FixtureRequest) -> Iterator[Snapshot]:
    with snap_pool.snapshot(_prepare(gemma_path), fork=request.param) as snapshot:
        assert snapshot.mode == ("fork" if request.param else "replay")
        yield snapshot


def test_a_fork_continues_as_a_cold_start_does(snap: Snapshot, snap_pool: Pool, gemma_path: Path) -> None:
    # The cold path: a fresh context in an ordinary worker, prefilled with the same prompt.
    cold = snap_pool[0].load_model(gemma_path).new_context(n_ctx=512, n_threads=2)
    cold.eval(SYSTEM)
    history = cold.tokens()
    expected = cold.generate("", append=True, n_predict=12)
    fork = snap.fork()
    try:
        assert set(fork.prepared) == {"model", "ctx"} == set(snap.names)
        ctx = fork.prepared["ctx"]
        assert isinstance(ctx, Context) and ctx.instance is fork and ctx.model is fork.prepared["model"]
        assert ctx.tokens() == history  # the prepared history is there, decoded once, in the zygote
        assert ctx.n_threads == 2  # the zygote computed on one thread; the fork has the context's own
        threads_before = psutil.Process(fork.pid).num_threads()
        got = ctx.generate("", append=True, n_predict=12)
        assert got.tokens == expected.tokens
        # It decoded with a team of 2 (the OpenMP runtime keeps its second thread): where a zygote
        # computed on one thread, the fork computes on the context's own number.
        assert psutil.Process(fork.pid).num_threads() == threads_before + 1
        assert got.n_prompt == 0  # nothing to prefill: the prepared logits came with the fork
    finally:
        fork.close()
        cold.model.close()


def test_a_pool_of_no_workers_serves_snapshots(tiny_model: Path) -> None:
    # An application that only forks snapshots keeps no idle worker: Pool(0) starts none.
    def prepare(instance: Instance) -> dict[str, Model | Context]:
        ctx = instance.load_model(tiny_model).new_context(n_ctx=128)
        ctx.eval("once upon a time")
        return {"ctx": ctx}

    def workers() -> set[int]:
        return {c.pid for c in psutil.Process().children() if "lloyal_pool.worker" in c.cmdline()}

    before = workers()  # other tests' pools may be open
    with Pool(0, cpu=CPU) as pool:
        assert len(pool) == 0 and pool.instances == [] and workers() == before
        with pytest.raises(InvalidArgumentError, match="no live worker"):
            pool.generate("Hi", n_predict=1)
        with pool.snapshot(prepare) as snapshot:
            fork = snapshot.fork()
            ctx = fork.prepared["ctx"]
            assert isinstance(ctx, Context) and ctx.generate(" there", append=True, n_predict=2).n_decoded == 2
        fork.close()


def test_forks_are_independent_processes(snap: Snapshot) -> None:
    first, second = snap.fork(), snap.fork()
    try:
        zygote = [snap._zygote.pid] if snap._zygote is not None else []
        assert len({first.pid, second.pid, *zygote}) == 2 + len(zygote)
        prepared = second.prepared["ctx"].tokens()
        a = first.prepared["ctx"]
        a.generate(" The museum closes at", append=True, n_predict=4)
        assert second.prepared["ctx"].tokens() == prepared  # a generate in one fork is not seen in another
        # A crash in one fork is that fork's alone, reported with its exit status by way of the zygote.
        with pytest.raises(WorkerCrashedError) as crash:
            first.fault("segv").result(timeout=60)
        assert crash.value.returncode == -signal.SIGSEGV
        assert "SIGSEGV" in str(crash.value)
        with pytest.raises(StaleHandleError):
            a.tokens()
        assert second.prepared["ctx"].generate("", append=True, n_predict=2).n_decoded == 2
        third = snap.fork()  # the zygote is untouched
        assert third.prepared["ctx"].tokens() == prepared
        third.close()
    finally:
        first.close()
        second.close()


def test_a_fork_has_its_own_region_and_logits(snap: Snapshot) -> None:
    first, second = snap.fork(), snap.fork()
    try:
        before = second.prepared["ctx"].logits(copy=True)
        first.prepared["ctx"].generate(" Tickets cost", append=True, n_predict=2)
        after = first.prepared["ctx"].logits(copy=True)
        # The zygote's region content came with each fork (its prepared logits); what one fork writes
        # to its own region reaches only its own client.
        assert (second.prepared["ctx"].logits(copy=True) == before).all()
        assert not (after == before).all()
        assert first._proc.region is not second._proc.region
    finally:
        first.close()
        second.close()


def test_a_fork_shares_the_model_pages(snap_pool: Pool, gemma_path: Path) -> None:
    snapshot = snap_pool.snapshot(_prepare(gemma_path), fork=True)
    forks = [snapshot.fork() for _ in range(2)]
    snapshot.close()
    try:
        for fork in forks:
            fork.prepared["ctx"].generate("", append=True, n_predict=2)
        rss = [psutil.Process(f.pid).memory_full_info() for f in forks]
        # Proportional set size splits shared pages among their sharers: copy-on-write forks (and the
        # zygote) share the mapped weights and the prepared heap, so each one's PSS is well below its RSS.
        for info in rss:
            assert info.pss < 0.75 * info.rss
    finally:
        for fork in forks:
            fork.close()


def test_forks_outlive_their_closed_snapshot(snap_pool: Pool, gemma_path: Path) -> None:
    snapshot = snap_pool.snapshot(_prepare(gemma_path))
    assert snapshot.mode == "fork" and snapshot._zygote is not None  # the default where it can
    fork = snapshot.fork()
    zygote = snapshot._zygote.pid
    snapshot.close()
    assert snapshot.closed
    with pytest.raises(SnapshotError, match="closed"):
        snapshot.fork()
    assert fork.prepared["ctx"].generate("", append=True, n_predict=2).n_decoded == 2
    fork.close()  # its exit status is gone with the zygote; closing still ends it
    assert all_end([zygote])
    assert not fork.alive


def test_waiting_on_a_running_fork_expires_at_its_timeout_asking_the_zygote_twice_a_second(
        snap_pool: Pool, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fork's parent is the zygote, so the pool waits for it by Reap requests, each of which blocks in
    # the zygote for up to half a second: a wait with a timeout must neither return early nor poll hot.
    from lloyal_pool import protocol as p
    from lloyal_pool._process import ForkedChild

    with snap_pool.snapshot(lambda instance: {"m": instance.load_model(tiny_model)}) as snapshot:
        fork = snapshot.fork()
        try:
            child = fork._proc.proc
            assert isinstance(child, ForkedChild)
            zygote = child._zygote
            reaps: list[float] = []
            call = zygote.call

            def counted(req: p.Request[object]):  # type: ignore[no-untyped-def]
                if isinstance(req, p.Reap):
                    reaps.append(req.timeout)
                return call(req)

            monkeypatch.setattr(zygote, "call", counted)
            start = time.monotonic()
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(timeout=1.2)
            assert time.monotonic() - start >= 1.2
            assert 2 <= len(reaps) <= 5 and all(0.0 <= t <= 0.5 for t in reaps), reaps
            assert sum(reaps) <= 1.2, reaps  # none asks for more than the time left
            assert child.returncode is None
            monkeypatch.undo()
            assert fork.prepared["m"].tokenize("still here")  # the fork was only waited on
        finally:
            fork.close()


def test_a_frozen_worker_serves_only_forks(snap_pool: Pool, tiny_model: Path) -> None:
    from lloyal_pool import protocol as p

    with snap_pool.snapshot(lambda instance: {"m": instance.load_model(tiny_model)}) as snapshot:
        assert snapshot._zygote is not None
        with pytest.raises(SnapshotError, match="frozen snapshot"):
            snapshot._zygote.call(p.Tokenize(model=1, text="hello")).result(timeout=30)
        assert snapshot._zygote.alive
        assert snapshot.fork().prepared["m"].tokenize("hello")


def test_fork_true_refuses_a_gpu_variant_and_the_default_replays(tiny_model: Path) -> None:
    def prepare(instance: Instance) -> dict[str, Model | Context]:
        ctx = instance.load_model(tiny_model).new_context(n_ctx=256)
        ctx.eval("Hello world")
        return {"ctx": ctx}

    # The worker falls back to the CPU build here; a GPU runtime could not have been forked anyway.
    with Pool(1, variant="cuda") as pool:
        with pytest.raises(SnapshotError, match=r"cannot fork.*'cuda'"):
            pool.snapshot(prepare, fork=True)
        with pool.snapshot(prepare) as snapshot:
            assert snapshot.mode == "replay"
            fork = snapshot.fork()
            ctx = fork.prepared["ctx"]
            assert isinstance(ctx, Context)
            assert ctx.tokens() == pool[0].load_model(tiny_model).tokenize("Hello world")


@pytest.mark.parametrize("returned", [["ctx"], {"x": 3}, {1: None}])
def test_prepare_must_return_named_handles(snap_pool: Pool, returned: object) -> None:
    before = {p.pid for p in snap_pool._all_procs}
    with pytest.raises(SnapshotError):
        snap_pool.snapshot(lambda instance: returned)  # type: ignore[arg-type,return-value]
    assert {p.pid for p in snap_pool._all_procs} == before  # the would-be zygote is gone


def test_prepare_errors_propagate_and_the_worker_goes(snap_pool: Pool, tiny_model: Path) -> None:
    def prepare(instance: Instance) -> None:
        instance.load_model(tiny_model.with_name("missing.gguf"))

    from lloyal_pool import ModelLoadError

    before = len(snap_pool._all_procs)
    with pytest.raises(ModelLoadError):
        snap_pool.snapshot(prepare)
    assert len(snap_pool._all_procs) == before


def test_handles_of_another_instance_are_refused(snap_pool: Pool, tiny_model: Path) -> None:
    other = snap_pool[0].load_model(tiny_model)
    try:
        with pytest.raises(SnapshotError, match="not a live handle"):
            snap_pool.snapshot(lambda instance: {"m": other})
    finally:
        other.close()


def test_a_fork_is_confined_as_its_pool(snap: Snapshot, snap_pool: Pool, tmp_path: Path) -> None:
    fork = snap.fork()
    try:
        assert fork.sandbox == snap_pool[0].sandbox and fork.sandbox["writes_scoped"]
        outside = Path("/var/tmp") / f"lloyal-fork-{os.getpid()}"
        assert not fork.fault("write_file", arg=str(outside)).result(timeout=30)["ok"]
        assert not outside.exists()
        inside = tmp_path / "written-by-a-fork"
        assert fork.fault("write_file", arg=str(inside)).result(timeout=30)["ok"]
        # State goes through the fork's own transfer memfd, not its zygote's (shared by every fork).
        ctx = fork.prepared["ctx"]
        data = ctx.save_state()
        assert ctx.load_state(data) == len(ctx.tokens())
    finally:
        fork.close()


def test_pool_close_ends_the_snapshot_and_its_forks(gemma_path: Path) -> None:
    pool = Pool(1, cpu=CPU)
    snapshot = pool.snapshot(_prepare(gemma_path))
    forks = [snapshot.fork() for _ in range(2)]
    pids = [snapshot._zygote.pid] + [f.pid for f in forks]
    pool.close()
    assert snapshot.closed and not any(f.alive for f in forks)
    assert all_end(pids)


_OWNER = textwrap.dedent("""
    import sys
    from lloyal_pool import Pool
    pool = Pool(1, env={"LLOYAL_POOL_TEST_NO_PDEATHSIG": "1", "LLOYAL_POOL_TEST_FAULTS": "1"}, cpu=sys.argv[2] or None)
    def prepare(instance):
        return {"model": instance.load_model(sys.argv[1])}
    snapshot = pool.snapshot(prepare)
    fork = snapshot.fork()
    busy = fork.fault("hang", seconds=3600)  # a busy fork does not read its request pipe
    print(snapshot._zygote.pid, fork.pid, flush=True)
    sys.stdin.read()  # until the test kills us
""")


def test_a_fork_dies_with_the_pool_owner(tiny_model: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tiny_model), CPU or ""], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    pids: list[int] = []
    try:
        assert owner.stdout is not None
        pids = [int(x) for x in owner.stdout.readline().split()]
        assert len(pids) == 2 and not any(ended(pid) for pid in pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert all_end(pids)  # the fork's own lifeline ended it
    finally:
        owner.kill()
        owner.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "replay"])
def test_lora_adapters_come_with_a_fork(snap_pool: Pool, tiny_model: Path, tmp_path: Path, fork: bool) -> None:
    from loras import attention_shapes, write_lora

    from lloyal_pool import LoraAdapter

    probe = snap_pool[0].load_model(tiny_model)
    lora_path = write_lora(tmp_path / "tiny.gguf", "llama", attention_shapes(probe.info, range(probe.info.n_layer)),
                           rank=4, seed=1)
    # The cold path: the same adapter on a context in an ordinary worker.
    cold = probe.new_context(n_ctx=256)
    cold.set_lora([(probe.load_lora(lora_path), 1.0)])
    cold.eval("Hello world")
    expected = cold.generate("", append=True, n_predict=8).tokens

    def prepare(instance: Instance) -> dict[str, Model | Context | LoraAdapter]:
        model = instance.load_model(tiny_model)
        adapter = model.load_lora(lora_path)
        ctx = model.new_context(n_ctx=256)
        ctx.set_lora([(adapter, 1.0)])
        ctx.eval("Hello world")
        return {"ctx": ctx, "adapter": adapter}

    try:
        with snap_pool.snapshot(prepare, fork=fork) as snapshot:
            instance = snapshot.fork()
            ctx, adapter = instance.prepared["ctx"], instance.prepared["adapter"]
            assert isinstance(ctx, Context) and isinstance(adapter, LoraAdapter)
            assert ctx.lora == [(adapter, 1.0)] and adapter.model is ctx.model
            assert ctx.generate("", append=True, n_predict=8).tokens == expected
            ctx.set_lora([])  # the fork's adapter handle is its own: it can be released there
            adapter.close()
            instance.close()
    finally:
        probe.close()


def test_a_fork_that_fails_leaves_no_descriptor_or_directory_behind(snap_pool: Pool, tiny_model: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def prepare(instance: Instance) -> dict[str, Model | Context]:
        return {"model": instance.load_model(tiny_model)}

    with snap_pool.snapshot(prepare, fork=True) as snapshot:
        zygote = snapshot._zygote
        assert zygote is not None
        snapshot.fork().close()  # one that works first: whatever it opens once for good is open now

        def refused(*args: object, **kwargs: object) -> None:
            raise OSError("the zygote could not fork")  # as when it dies between the check and the fork

        fds = set(os.listdir("/proc/self/fd"))
        dirs = set(os.listdir(zygote._cwd))
        monkeypatch.setattr(zygote, "fork_child", refused)
        with pytest.raises(OSError, match="could not fork"):
            snapshot.fork()
        assert set(os.listdir("/proc/self/fd")) == fds
        assert set(os.listdir(zygote._cwd)) == dirs
        monkeypatch.undo()
        snapshot.fork().close()  # the snapshot still serves


def test_a_pool_on_amx_kernels_snapshots_by_replay() -> None:
    # What the pool's workers said at their handshake decides (named AMX kernels copy the weights at load,
    # on an OpenMP team a fork would not survive); a pool without them may fork.
    from types import SimpleNamespace

    from lloyal_pool.pool import Pool as RealPool

    class FakePool:
        def __init__(self, features: dict[str, str], variant: str = "cpu") -> None:
            self._options = SimpleNamespace(variant=variant)
            self._instances = [SimpleNamespace(alive=True, build_info={"cpu": {"kernels": "k", "features": features}})]

    def why_no_fork(pool: FakePool) -> str | None:
        return RealPool._why_no_fork(pool)  # type: ignore[arg-type]

    assert why_no_fork(FakePool({"AVX512": "1"})) is None
    why = why_no_fork(FakePool({"AVX512": "1", "AMX_INT8": "1"}))
    assert why is not None and "AMX" in why
    assert "variant is 'cuda'" in str(why_no_fork(FakePool({}, variant="cuda")))
