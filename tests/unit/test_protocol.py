"""The wire format and the shared region, without workers or native code."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from lloyal_pool import errors
from lloyal_pool.protocol import MAX_FRAME, Kind, PeerClosed, pack, read_frame, unpack, write_frame
from lloyal_pool.shm import BULK_OFFSET, PAGE, Region, TransferFile, WorkerTransfer


def test_frame_round_trip_over_a_pipe() -> None:
    r, w = os.pipe()
    try:
        payload = ["generate", {"prompt": "héllo", "bias": {5: -1.5}, "blob": b"\x00\xff" * 1000}]
        write_frame(w, pack(Kind.REQUEST, 42, payload))
        kind, req_id, got = read_frame(r)
        assert (kind, req_id, got) == (Kind.REQUEST, 42, payload)
        os.close(w)
        w = -1
        with pytest.raises(PeerClosed):
            read_frame(r)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_oversized_and_malformed_frames_are_protocol_errors() -> None:
    r, w = os.pipe()
    try:
        os.write(w, struct.pack("<I", MAX_FRAME + 1))
        with pytest.raises(errors.ProtocolError, match="exceeds"):
            read_frame(r)
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(errors.ProtocolError):
        unpack(b"\xc1not msgpack")
    with pytest.raises(errors.ProtocolError):
        unpack(pack(Kind.EVENT, 1, None)[4:][:-1] + b"\x93")  # wrong shape
    with pytest.raises(errors.ProtocolError):
        unpack(b"\x93\x63\x01\xc0")  # kind 99 does not exist


def test_oversized_frames_are_refused_by_the_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    from lloyal_pool import _frames

    monkeypatch.setattr(_frames, "MAX_FRAME", 1000)
    pack(Kind.RESPONSE, 1, b"x" * 900)
    with pytest.raises(errors.ProtocolError, match="RESPONSE frame of"):
        pack(Kind.RESPONSE, 1, b"x" * 1000)


def test_remote_errors_keep_their_type_and_traceback() -> None:
    exc = errors.rebuild("GrammarError", "bad rule", "Traceback: in the worker")
    assert isinstance(exc, errors.GrammarError) and isinstance(exc, ValueError)
    assert exc.remote_traceback == "Traceback: in the worker"
    assert "in the worker" in str(exc.__cause__)
    assert isinstance(errors.rebuild("KeyError", "k", None), KeyError)
    unknown = errors.rebuild("ZeroDivisionError", "boom", "tb")
    assert isinstance(unknown, errors.RemoteError) and unknown.remote_type == "ZeroDivisionError"


def test_exit_descriptions_name_the_signal() -> None:
    assert "SIGKILL" in errors.describe_exit(-9)
    assert "SIGSEGV" in errors.describe_exit(-11)
    assert errors.describe_exit(3) == "exited with code 3"
    crashed = errors.WorkerCrashedError("x", returncode=-9, stderr_tail="last words")
    assert crashed.signal_name == "SIGKILL" and "last words" in str(crashed)


@pytest.mark.parametrize("field", ["magic", "version", "size"])
def test_a_region_whose_header_does_not_match_is_refused(field: str) -> None:
    # Each field on its own: a worker must never read a region laid out by another version of the package.
    import struct

    from lloyal_pool.errors import LloyalError
    from lloyal_pool.shm import LAYOUT_VERSION, MAGIC, RegionSpec

    region = Region.create(1 << 20, backend="memfd")
    try:
        values = {"magic": MAGIC, "version": LAYOUT_VERSION, "size": region.size}
        values[field] += 1
        struct.pack_into("<QII", region.view, 0, values["magic"], values["version"], values["size"])
        with pytest.raises(LloyalError, match="header does not match"):
            Region.attach(RegionSpec(region.size, os.dup(region.spec.fd)))
    finally:
        region.close()


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_region_is_shared_between_mappings(backend: str) -> None:
    region = Region.create(1 << 20, backend=backend)
    try:
        if backend == "memfd":
            # Sealed: nobody can shrink the region under the parent (that would be a SIGBUS on read).
            with pytest.raises(PermissionError):
                os.ftruncate(region.spec.fd, PAGE)
            fd = os.dup(region.spec.fd)
            from lloyal_pool.shm import RegionSpec

            other = Region.attach(RegionSpec(region.size, fd))
        else:
            other = Region.attach(region.spec)
        other.view[BULK_OFFSET:BULK_OFFSET + 8] = np.arange(2, dtype=np.float32).tobytes()
        assert list(region.floats(BULK_OFFSET, 2)) == [0.0, 1.0]
        region.set_interrupt(3, 77)
        assert int(other.interrupt[3]) == 77
        other.close()
    finally:
        region.close()
        region.close()  # idempotent


def test_posix_region_leaves_nothing_in_dev_shm() -> None:
    region = Region.create(1 << 20, backend="posix")
    name = region.spec.name
    assert os.path.exists(f"/dev/shm/{name}")
    region.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_worker_refuses_malformed_requests_as_bad_requests() -> None:
    from lloyal_pool import protocol as p

    assert p.parse_request(["ping", {}]) == p.Ping()
    assert p.parse_request(["tokenize", {"model": 1, "text": "hi"}]) == p.Tokenize(model=1, text="hi")
    for bad in (["no_such_op", {}], ["ping", [1]], "ping", ["ping"], ["ping", {"extra": 1}],
                ["tokenize", {"model": "1", "text": "hi"}], ["tokenize", {"text": "hi"}]):
        with pytest.raises(errors.BadRequestError):
            p.parse_request(bad)


# -- bulk transfer files ------------------------------------------------------------------------------------
def test_a_transfer_memfd_is_sealed_before_the_worker_reads_it() -> None:
    import fcntl

    with TransferFile() as f:
        assert f.path == f"/proc/{os.getpid()}/fd/{f._fd}"  # a memfd: no name anywhere
        f.write(b"state" * 1000)
        seals = fcntl.fcntl(f._fd, fcntl.F_GET_SEALS)
        for seal in (fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_WRITE, fcntl.F_SEAL_SEAL):
            assert seals & seal, f"seal {seal} missing: {seals:#x}"
        with open(f.path, "r+b", buffering=0) as worker_side, pytest.raises(PermissionError):
            worker_side.write(b"x")  # what a worker sees: read-only
        with open(f.path, "rb") as worker_side:
            assert worker_side.read() == b"state" * 1000


def test_a_transfer_memfd_is_sealed_against_resizing_before_the_parent_maps_it() -> None:
    import fcntl

    with TransferFile() as f:
        with open(f.path, "r+b") as worker_side:  # the worker writes its state
            worker_side.write(b"w" * 10000)
        assert f.read() == b"w" * 10000
        seals = fcntl.fcntl(f._fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and not seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(f._fd, 10)  # a worker shrinking it under the mapping is refused


def test_a_transfer_file_in_a_directory_is_removed_at_close(tmp_path: Path) -> None:
    f = TransferFile(str(tmp_path))
    assert os.path.dirname(f.path) == str(tmp_path) and os.path.isfile(f.path)
    assert f.read() == b""
    f.write(b"abc" * 100)
    with open(f.path, "r+b") as worker_side:
        assert worker_side.read() == b"abc" * 100
        worker_side.write(b"more")  # a plain file: the worker may write where it was given one
    assert f.read() == b"abc" * 100 + b"more"
    f.close()
    f.close()  # idempotent
    assert list(tmp_path.iterdir()) == []


def test_a_worker_transfer_is_emptied_after_each_use() -> None:
    fd = os.memfd_create("worker_side")
    try:
        t = WorkerTransfer(os.getpid(), fd)
        assert t.path == f"/proc/self/fd/{fd}"
        with t:
            t.write(b"state" * 100)
            assert os.fstat(fd).st_size == 500 and t.read() == b"state" * 100
        assert os.fstat(fd).st_size == 0  # its memory freed
        with t:
            assert t.read() == b""
        t.close()
        t.close()
    finally:
        os.close(fd)


# -- how much memory a region may take --------------------------------------------------------------------
MiB = 1 << 20
V2 = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
V1 = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")


@pytest.mark.parametrize(("files", "backend", "free_shm", "expected"), [
    ({}, "auto", None, None),
    ({"/proc/meminfo": "MemTotal: 9 kB\nMemAvailable: 4096 kB\n"}, "auto", None, 4 * MiB),
    ({"/proc/meminfo": "MemAvailable: oops kB\n"}, "auto", None, None),
    ({"/proc/meminfo": "MemAvailable: 4096 kB\n", V2[0]: "2097152\n", V2[1]: "1048576\n"}, "auto", None, 1 * MiB),
    ({"/proc/meminfo": "MemAvailable: 4096 kB\n", V2[0]: "max\n", V2[1]: "1048576\n"}, "auto", None, 4 * MiB),
    # v2 answers, so v1's files (a hybrid mount) are not read
    ({"/proc/meminfo": "MemAvailable: 4096 kB\n", V2[0]: "max\n", V2[1]: "0\n", V1[0]: "1024\n", V1[1]: "0\n"},
     "auto", None, 4 * MiB),
    ({"/proc/meminfo": "MemAvailable: 4096 kB\n", V1[0]: str((1 << 63) - 4096), V1[1]: "0"}, "auto", None,
     4 * MiB),
    ({"/proc/meminfo": "MemAvailable: 4096 kB\n", V1[0]: "3145728", V1[1]: "4194304"}, "auto", None, 0),
    ({V2[0]: "8388608", V2[1]: "garbage", V1[0]: "3145728", V1[1]: "1048576"}, "auto", None, 2 * MiB),
    ({"/proc/meminfo": "MemAvailable: 4096 kB\n"}, "posix", 3 * MiB, 3 * MiB),
    ({"/proc/meminfo": "MemAvailable: 4096 kB\n"}, "memfd", 3 * MiB, 4 * MiB),
    ({}, "posix", 5 * MiB, 5 * MiB),
])
def test_available_memory_is_the_least_of_what_the_machine_says(
        monkeypatch: pytest.MonkeyPatch, files: dict[str, str], backend: str, free_shm: int | None,
        expected: int | None) -> None:
    import io

    from lloyal_pool import shm

    def fake_open(path: str, *args: object, **kwargs: object) -> io.StringIO:
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])

    def fake_statvfs(path: str) -> os.statvfs_result:
        assert path == "/dev/shm"
        if free_shm is None:
            raise OSError("no /dev/shm")
        return os.statvfs_result((4096, 4096, 0, 0, free_shm // 4096, 0, 0, 0, 0, 255))

    monkeypatch.setattr(shm, "open", fake_open, raising=False)
    monkeypatch.setattr(os, "statvfs", fake_statvfs)
    assert shm.available_memory(backend) == expected


def test_a_region_moves_only_onto_a_memfd_of_its_own_size() -> None:
    region = Region.create(BULK_OFFSET + 4 * PAGE, backend="memfd")
    try:
        region.view[BULK_OFFSET:BULK_OFFSET + 6] = b"hello!"  # the "!" is past what is used
        address = np.frombuffer(region.view, dtype=np.uint8).ctypes.data
        small = os.memfd_create("smaller")
        try:
            os.ftruncate(small, region.size - PAGE)
            with pytest.raises(errors.LloyalError, match="memfd of its zygote's size"):
                region.move_to(small, BULK_OFFSET + 5)
        finally:
            os.close(small)
        child = os.memfd_create("child")
        os.ftruncate(child, region.size)
        region.move_to(child, BULK_OFFSET + 5)  # takes child's descriptor
        # The same address, now the child's memory, with what was used copied over.
        assert np.frombuffer(region.view, dtype=np.uint8).ctypes.data == address
        assert bytes(region.view[BULK_OFFSET:BULK_OFFSET + 6]) == b"hello\x00"
    finally:
        region.close()
