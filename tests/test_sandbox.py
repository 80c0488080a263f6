"""The worker sandbox (Landlock, worker/landlock.py) bites: each option is shown refusing what it should
and allowing what it should, through the pool, with the test-only probes of worker/loop.py."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import FAULTS

from lloyal_pool import Pool
from lloyal_pool.errors import ModelLoadError, StateError
from lloyal_pool.shm import WorkerTransfer
from lloyal_pool.worker.landlock import abi_version

ABI = abi_version()
needs_landlock = pytest.mark.skipif(ABI < 4, reason="this kernel lacks Landlock ABI >= 4 (fs + TCP rules)")


def probe(pool: Pool, kind: str, arg: str) -> dict[str, Any]:
    result: dict[str, Any] = pool[0].fault(kind, arg=arg).result(timeout=30)
    return result


@pytest.fixture
def listener() -> Iterator[str]:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        yield f"127.0.0.1:{srv.getsockname()[1]}"


@pytest.fixture(scope="module")
def default_pool() -> Iterator[Pool]:
    with Pool(1, env=FAULTS) as p:
        yield p


def test_an_ordinary_worker_is_no_snapshot_zygote(default_pool: Pool) -> None:
    # Only a snapshot's zygote holds the socket its forks' descriptors go through; a worker that could
    # be asked to fork children is not what Pool(...) starts.
    proc = default_pool[0]._proc
    argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
    assert "--zygote" not in argv and proc._control is None, argv
    fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
    assert not [f for f in fds if f.startswith("socket:")], fds


def test_the_worker_reports_what_its_kernel_enforces(default_pool: Pool) -> None:
    box = default_pool[0].sandbox
    assert box["landlock"] == ABI
    assert box["writes_scoped"] is (ABI > 0)
    assert box["reads_scoped"] is False  # allowed_dirs=None: reads anywhere
    assert box["tcp_blocked"] is (ABI >= 4)
    assert box["network"] is False


@needs_landlock
def test_by_default_writes_go_only_to_the_private_directory(default_pool: Pool, tmp_path: Path) -> None:
    outside = tmp_path / "planted.txt"
    got = probe(default_pool, "write_file", str(outside))
    assert got["ok"] is False and got["errno"] == errno.EACCES
    assert not outside.exists()
    inside = Path(default_pool[0]._proc._cwd) / "scratch.txt"
    assert probe(default_pool, "write_file", str(inside)) == {"ok": True}
    assert inside.read_bytes() == b"written by a worker\n"


@needs_landlock
def test_by_default_reads_are_not_scoped(default_pool: Pool, tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_bytes(b"hello")
    assert probe(default_pool, "read_file", str(tmp_path / "f.txt")) == {"ok": True, "data": b"hello"}


@needs_landlock
def test_by_default_tcp_connect_is_refused(default_pool: Pool, listener: str) -> None:
    got = probe(default_pool, "connect", listener)
    assert got["ok"] is False and got["errno"] == errno.EACCES


def test_by_default_no_ip_socket_can_be_made_udp_included(default_pool: Pool) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(0)
        assert default_pool[0].sandbox["ip_sockets_blocked"] is True
        got = probe(default_pool, "udp", f"127.0.0.1:{rx.getsockname()[1]}")
        assert got["ok"] is False and got["errno"] == errno.EACCES
        with pytest.raises(BlockingIOError):
            rx.recv(100)  # nothing arrived


@needs_landlock
def test_by_default_a_state_file_outside_writable_dirs_is_refused(default_pool: Pool, tiny_model: Path,
                                                                   tmp_path: Path) -> None:
    ctx = default_pool[0].load_model(tiny_model).new_context(n_ctx=128)
    ctx.eval("one two three")
    with pytest.raises(StateError, match=r"outside the pool's writable_dirs \[\]"):
        ctx.save_state_file(tmp_path / "ctx.state")
    assert not (tmp_path / "ctx.state").exists()
    # The bytes API still works, through a memfd the worker made before it confined itself.
    assert isinstance(default_pool[0]._proc.transfer(), WorkerTransfer)
    data = ctx.save_state()
    assert len(data) > 0 and ctx.load_state(data) == len(ctx.tokens())
    assert ctx.generate(ctx.tokens(), n_predict=3, temperature=0.0).tokens  # and it keeps serving


@needs_landlock
def test_allowed_dirs_scope_reads_and_writable_dirs_writes(tiny_model: Path, tmp_path: Path,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    secret = tmp_path_factory.mktemp("secret") / "key.txt"
    secret.write_bytes(b"secret")
    out = tmp_path / "out"
    out.mkdir()
    with Pool(1, env=FAULTS, allowed_dirs=[tiny_model.parent], writable_dirs=[out]) as pool:
        box = pool[0].sandbox
        assert box["reads_scoped"] is True and box["writes_scoped"] is True
        got = probe(pool, "read_file", str(secret))
        assert got["ok"] is False and got["errno"] == errno.EACCES
        with pytest.raises(ModelLoadError, match="allowed_dirs"):
            pool[0].load_model(secret)
        model = pool[0].load_model(tiny_model)  # inside the scope
        ctx = model.new_context(n_ctx=128)
        assert ctx.generate("hello world", n_predict=4, temperature=0.0).tokens
        n = ctx.save_state_file(out / "ctx.state")  # a writable dir
        assert (out / "ctx.state").stat().st_size == n
        assert ctx.load_state_file(out / "ctx.state") == len(ctx.tokens())
        got = probe(pool, "write_file", str(tmp_path / "elsewhere.txt"))
        assert got["ok"] is False and got["errno"] == errno.EACCES
        assert pool[0].ping() > 0  # every refusal left the worker serving


@needs_landlock
def test_network_true_allows_tcp_and_udp(listener: str) -> None:
    with Pool(1, env=FAULTS, network=True) as pool, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        assert pool[0].sandbox["tcp_blocked"] is False and pool[0].sandbox["ip_sockets_blocked"] is False
        assert pool[0].sandbox["writes_scoped"] is True  # the filesystem stays confined
        assert probe(pool, "connect", listener) == {"ok": True}
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(60)  # a guard against hanging, not a timing assertion: the datagram is already sent
        assert probe(pool, "udp", f"127.0.0.1:{rx.getsockname()[1]}") == {"ok": True}
        assert rx.recv(100) == b"datagram from a worker"


def test_sandbox_false_turns_it_off(tmp_path: Path, listener: str, tiny_model: Path) -> None:
    with Pool(1, env=FAULTS, sandbox=False) as pool:
        assert pool[0].sandbox["landlock"] == 0 and pool[0].sandbox["disabled"] is True
        assert probe(pool, "write_file", str(tmp_path / "free.txt")) == {"ok": True}
        assert probe(pool, "connect", listener) == {"ok": True}
        # An unconfined worker opens the parent's own per-transfer memfd (shm.TransferFile).
        with pool[0]._proc.transfer() as transfer:
            assert not isinstance(transfer, WorkerTransfer)
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=128)
        ctx.eval("one two three")
        assert ctx.load_state(ctx.save_state()) == len(ctx.tokens())


def test_a_kernel_without_landlock_is_reported_and_allowed_dirs_refused(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """In-process, with the kernel's answer replaced by "no Landlock" (so nothing here gets confined)."""
    import argparse

    from lloyal_pool.worker import __main__ as worker_main
    from lloyal_pool.worker import landlock

    monkeypatch.setattr(landlock, "abi_version", lambda: 0)

    def no_seccomp_here() -> bool:
        raise AssertionError("confine() must refuse before it installs anything")

    monkeypatch.setattr(landlock, "block_ip_sockets", no_seccomp_here)
    monkeypatch.chdir(tmp_path)
    info = landlock.apply(private_dir=str(tmp_path), readable=None)
    assert info["landlock"] == 0 and not info["writes_scoped"] and not info["tcp_blocked"]
    args = argparse.Namespace(no_sandbox=False, allowed_dirs='["/models"]', writable_dirs="[]", network=False)
    with pytest.raises(OSError, match="allowed_dirs needs Landlock"):
        worker_main.confine(args)
