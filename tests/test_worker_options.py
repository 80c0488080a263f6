"""Per-pool worker options with safe defaults: the environment a worker sees, the lifeline that ends it
with its parent, and the memory cap. Each is read back from the running worker, not from our options."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from procs import PATIENCE, all_end

from lloyal_pool import ContextError, InvalidArgumentError, ModelLoadError, Pool, WorkerStartupError


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    pairs = (item.decode().split("=", 1) for item in raw.split(b"\0") if item)
    return {name: value for name, value in pairs}


def _pipe_ends(pid: int) -> set[tuple[str, int]]:
    """(pipe inode, access mode: os.O_RDONLY or os.O_WRONLY) of every pipe end pid holds."""
    ends = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
        except OSError:
            continue
        if link.startswith("pipe:"):
            ends.add((link, flags & os.O_ACCMODE))
    return ends


def test_worker_environment_is_empty_by_default(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    monkeypatch.setenv("LLOYAL_TEST_SECRET", "do-not-leak")
    with Pool(1) as pool:
        seen = _environ(pool[0].pid)
        # Nothing of ours: not the secret, not PATH or HOME, not even the LLOYAL_ prefix.
        assert "LLOYAL_TEST_SECRET" not in seen and "PATH" not in seen and "HOME" not in seen
        assert seen == {}
        # The interpreter and the native module need none of it.
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=256)
        assert ctx.generate("Hello", n_predict=2).n_decoded == 2


def test_worker_environment_is_the_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLOYAL_TEST_SECRET", "do-not-leak")
    monkeypatch.setenv("LLOYAL_TEST_PASSED", "ours")
    monkeypatch.delenv("LLOYAL_TEST_ABSENT", raising=False)
    env: dict[str, str | None] = {"LLOYAL_TEST_SET": "given", "LLOYAL_TEST_PASSED": None,
                                  "LLOYAL_TEST_ABSENT": None}
    with Pool(1, env=env) as pool:
        # An explicit value is set, None passes our value through, and a None we lack stays unset.
        assert _environ(pool[0].pid) == {"LLOYAL_TEST_SET": "given", "LLOYAL_TEST_PASSED": "ours"}


@pytest.mark.parametrize("env", [{"A=B": "x"}, {"": "x"}, {"A": 1}, {"A": "x\0y"}])
def test_bad_env_is_refused_before_any_worker_starts(env: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError, match="env"):
        Pool(1, env=env)  # type: ignore[arg-type]


def test_bad_memory_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="memory_limit"):
        Pool(1, memory_limit=0)


def test_a_memory_limit_too_small_to_start_a_worker_says_so() -> None:
    # A worker needs about 110 MiB of data before it loads a model: under a 48 MiB cap it cannot start, and
    # the error says that this cap is the likely cause and how much a worker needs.
    with pytest.raises(WorkerStartupError,
                       match=r"memory_limit=50331648 bytes \(48 MiB\) is likely too small .* about 110 MiB"):
        Pool(1, memory_limit=48 << 20)


_OWNER = textwrap.dedent("""
    import sys
    from lloyal_pool import Pool
    pool = Pool(2, env={"LLOYAL_POOL_TEST_NO_PDEATHSIG": "1", "LLOYAL_POOL_TEST_FAULTS": "1"})
    # Busy workers, as in a long decode: they do not read their request pipes, so its EOF cannot end them.
    hangs = [inst.fault("hang", seconds=3600) for inst in pool]
    print(" ".join(str(inst.pid) for inst in pool), flush=True)
    sys.stdin.read()  # until the test kills us
""")


def test_lifeline_ends_workers_of_a_killed_parent() -> None:
    # The workers run without the parent-death signal and are busy, so only the lifeline can end them.
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pids: list[int] = []
    try:
        assert owner.stdout is not None
        pids = [int(x) for x in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
        for pid in pids:
            assert "LLOYAL_POOL_TEST_NO_PDEATHSIG" in _environ(pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert all_end(pids)
    finally:
        owner.kill()
        owner.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_lifeline_write_end_stays_with_the_parent() -> None:
    with Pool(2) as pool:
        procs = [inst._proc for inst in pool]
        lifelines = [os.readlink(f"/proc/self/fd/{proc._life_w}") for proc in procs]
        assert (lifelines[0], os.O_WRONLY) in _pipe_ends(os.getpid())
        held = [_pipe_ends(inst.pid) for inst in pool]
        for i, pipes in enumerate(held):
            # No worker holds a write end of any lifeline: neither its own (it would never see EOF)
            # nor another's (that worker would outlive us for as long as the other one lives).
            assert not pipes & {(line, os.O_WRONLY) for line in lifelines}
            # Each holds the read end of its own lifeline and of no other.
            assert {line for line, mode in pipes if line in lifelines} == {lifelines[i]}
        assert all(inst.alive for inst in pool)


def test_lifeline_close_is_a_clean_exit() -> None:
    pool = Pool(1)
    proc = pool[0]._proc
    pool.close(timeout=PATIENCE)  # a worker that missed a shorter one would be SIGKILLed, not clean
    assert proc.proc.returncode == 0 and proc._life_w == -1


def test_memory_limit_names_the_option(gemma_path: Path) -> None:
    limit = 1 << 30
    with Pool(1, memory_limit=limit) as pool:
        model = pool[0].load_model(gemma_path)
        with pytest.raises(ContextError) as info:
            model.new_context(n_ctx=131072, swa_full=True)
        assert f"memory_limit={limit}" in str(info.value)
        # The worker survives the failed allocation and serves a context that fits.
        ctx = model.new_context(n_ctx=512)
        assert ctx.generate("The capital of France is", n_predict=3).n_decoded == 3
        assert pool[0].alive


@pytest.mark.parametrize("cap_mib", [600, 790, 795, 800])
def test_a_4096_context_under_a_tight_cap_is_an_error_or_works_never_a_dead_worker(gemma_path: Path,
                                                                                    cap_mib: int) -> None:
    # Measured here: at 600 MiB the context surely cannot fit (refused before llama.cpp allocates); at 790
    # and 795 its buffers fitted but the compute threads' stacks did not, and libgomp ended the worker at
    # the first decode; 800 fits. Every cap gives a ContextError naming the cap or a working context.
    limit = cap_mib << 20
    with Pool(1, memory_limit=limit) as pool:
        model = pool[0].load_model(gemma_path)
        try:
            ctx = model.new_context(n_ctx=4096)
        except ContextError as exc:
            assert f"memory_limit={limit}" in str(exc)
        else:
            assert ctx.generate("The capital of France is", n_predict=4, ignore_eos=True).n_decoded == 4
            ctx.close()
        assert pool[0].alive and model.tokenize("Hello")
        if cap_mib == 600:
            with pytest.raises(ContextError, match="needs at least"):
                model.new_context(n_ctx=4096)


def test_memory_limit_names_the_option_for_a_model_without_mmap(gemma_path: Path, tiny_model: Path) -> None:
    # Measured data segment of a worker (RLIMIT_DATA counts it): ~105 MB at start, ~146 MB after the failed
    # heap load (glibc keeps what the failed load freed), ~210 MB once Gemma is mapped (its repacked Q4_K
    # weights live on the heap); a heap load of Gemma needs ~105 + 233 (its CPU buffer) + more. 300 MB
    # leaves ~80 MB either way (200 MB once left 3 MB and failed on a CI machine).
    limit = 300 << 20
    with Pool(1, memory_limit=limit) as pool:
        with pytest.raises(ModelLoadError) as info:
            pool[0].load_model(gemma_path, use_mmap=False)
        assert f"memory_limit={limit}" in str(info.value)
        # the worker survives the failed allocation and serves a model that fits (the tiny one: named AMX
        # kernels copy even a mapped Gemma onto the heap)
        assert pool[0].load_model(tiny_model).tokenize("Hello")
        # an error that is not about memory keeps its own message
        with pytest.raises(ModelLoadError) as missing:
            pool[0].load_model(tiny_model.with_name("no-such-model.gguf"))
        assert "memory_limit" not in str(missing.value)
