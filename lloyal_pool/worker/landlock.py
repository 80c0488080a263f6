"""Landlock: the worker confines its own filesystem and network access, through raw syscalls (ctypes).

Applied by the worker after its native module and Python modules are loaded and before it serves a
request, so a request (a crafted GGUF, prompt or grammar that subverts native code) runs confined:

- writes: only beneath the worker's private temporary directory (its cwd), the ``writable`` directories
  the pool was given, and a few device nodes (/dev/null, GPU devices);
- reads: anywhere by default; only beneath ``readable`` plus what the interpreter and the drivers need
  (the Python installation, sys.path, /usr, /lib*, /etc, /proc/self, CPU topology) when it is given;
- network: TCP bind and connect refused (Landlock ABI >= 4) unless the pool allows the network; on ABI
  >= 6 also connecting to abstract Unix sockets outside the worker, and signalling other processes.
  UDP and pathname Unix sockets are not covered by Landlock; block_ip_sockets (seccomp) covers UDP.

A kernel without Landlock (or with an older ABI) gets what it supports; ``apply`` reports exactly that,
and the pool passes it on (Instance.sandbox), so nothing claims a confinement it does not have.
A Landlock-confined process also cannot ptrace or read the /proc/<pid>/fd of an unconfined one, which
is why a confined worker's state transfers use a memfd it made itself (shm.WorkerTransfer).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from typing import Any

_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_RULE_NET_PORT = 2

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
_WRITE_V1 = (FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_CHAR | FS_MAKE_DIR | FS_MAKE_REG
             | FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_BLOCK | FS_MAKE_SYM)
_FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE  # what a rule on a non-directory may hold


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (not Linux, too old, or disabled)."""
    numbers = _SYSCALLS.get(platform.machine())
    if not sys.platform.startswith("linux") or numbers is None:
        return 0
    try:
        v = int(_libc().syscall(numbers[0], None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)))
    except (OSError, AttributeError):
        return 0
    return max(v, 0)


def system_read_dirs() -> list[str]:
    """What a worker reads after start-up besides its models: the Python installation and import path
    (lazy imports, tracebacks' source lines), shared libraries a GPU backend may dlopen, /etc (the loader's
    cache, locale), its own /proc entry and the CPU topology the thread pool reads."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../lloyal_pool
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(package)}
    dirs.update(p for p in sys.path if p)
    dirs.update(("/usr", "/lib", "/lib64", "/etc", "/opt", "/proc/self", "/proc/cpuinfo", "/proc/meminfo",
                 "/proc/stat", "/sys/devices/system/cpu", "/sys/devices/system/node", "/sys/fs/cgroup",
                 "/dev/urandom", "/dev/random", "/proc/driver", "/sys/bus/pci", "/sys/class", "/sys/devices"))
    return sorted(dirs)


def device_write_paths() -> list[str]:
    """Device nodes a worker writes: /dev/null and friends, and the GPU's (NVIDIA, DRM, ROCm)."""
    paths = ["/dev/null", "/dev/zero", "/dev/full", "/dev/dri", "/dev/kfd"]
    try:
        paths += [f"/dev/{n}" for n in os.listdir("/dev") if n.startswith("nvidia")]
    except OSError:
        pass
    return paths


def apply(*, private_dir: str, readable: Sequence[str] | None, writable: Sequence[str] = (),
          network: bool = False) -> dict[str, Any]:
    """Confines the calling process (and its future children) for good; needs no_new_privs set first.
    ``readable`` None leaves reads alone. Returns what is enforced: {"landlock": ABI (0: none),
    "writes_scoped", "reads_scoped", "tcp_blocked", "scoped"}; raises OSError when a ruleset the kernel
    supports cannot be applied."""
    abi = abi_version()
    info: dict[str, Any] = {"landlock": abi, "writes_scoped": False, "reads_scoped": False,
                            "tcp_blocked": False, "scoped": False, "network": bool(network)}
    if abi == 0:
        return info
    write = _WRITE_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    handled_fs = write | (_READ if readable is not None else 0)
    handled_net = (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 and not network else 0
    scoped = (SCOPE_SIGNAL | (0 if network else SCOPE_ABSTRACT_UNIX_SOCKET)) if abi >= 6 else 0
    create, add_rule, restrict = _SYSCALLS[platform.machine()]
    libc = _libc()
    attr = _RulesetAttr(handled_fs, handled_net, scoped)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16  # older kernels reject the unknown field
    ruleset = int(libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)))
    if ruleset < 0:
        raise _errno_error("landlock_create_ruleset")
    try:
        def allow(paths: Iterable[str], access: int) -> None:
            for path in paths:
                _add_path_rule(libc, add_rule, ruleset, path, access & handled_fs)

        allow(readable or (), _READ)
        allow(system_read_dirs() if readable is not None else (), _READ)
        allow([private_dir, *writable], _READ | write)
        allow(device_write_paths(), _READ | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))
        if int(libc.syscall(restrict, ctypes.c_int(ruleset), ctypes.c_uint32(0))) != 0:
            raise _errno_error("landlock_restrict_self")
    finally:
        os.close(ruleset)
    info.update(writes_scoped=True, reads_scoped=readable is not None, tcp_blocked=bool(handled_net),
                scoped=bool(scoped))
    return info


# seccomp: socket(AF_INET/AF_INET6) fails with EACCES, which Landlock's TCP rules alone do not give (UDP).
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SOCKET_NR = {"x86_64": 41, "aarch64": 198}
_IO_URING_SETUP = 425  # io_uring can create sockets without the socket syscall
_X32_BIT = 0x40000000
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_EACCES = 0x00050000 | 13


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def block_ip_sockets() -> bool:
    """Installs a seccomp filter under which creating an IPv4/IPv6 socket (TCP, UDP, raw) or an io_uring
    fails with EACCES; other sockets (Unix, netlink) are left alone. False where it cannot (not Linux on
    x86_64/aarch64, no seccomp). Needs no_new_privs first."""
    machine = platform.machine()
    if not sys.platform.startswith("linux") or machine not in _AUDIT_ARCH:
        return False
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    prog = [
        (ld_w_abs, 0, 0, 4),  # seccomp_data.arch
        (jeq_k, 1, 0, _AUDIT_ARCH[machine]),
        (ret_k, 0, 0, _RET_EACCES),  # another ABI (i386 on x86_64): no way to check it, refuse it
        (ld_w_abs, 0, 0, 0),  # seccomp_data.nr
        (jge_k, 6, 0, _X32_BIT),  # x32 syscalls: refused
        (jeq_k, 5, 0, _IO_URING_SETUP),
        (jeq_k, 0, 5, _SOCKET_NR[machine]),
        (ld_w_abs, 0, 0, 16),  # args[0], the family (low word, little-endian)
        (jeq_k, 2, 0, 2),  # AF_INET
        (jeq_k, 1, 0, 10),  # AF_INET6
        (ret_k, 0, 0, _RET_ALLOW),
        (ret_k, 0, 0, _RET_EACCES),
        (ret_k, 0, 0, _RET_ALLOW),
    ]
    filters = (_SockFilter * len(prog))(*(_SockFilter(*ins) for ins in prog))
    fprog = _SockFprog(len(prog), filters)
    try:
        return int(_libc().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _add_path_rule(libc: Any, add_rule: int, ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path this machine does not have needs no rule
    try:
        import stat

        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= _FILE_ONLY
        if not access:
            return
        rule = _PathBeneathAttr(access, fd)
        if int(libc.syscall(add_rule, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                            ctypes.byref(rule), ctypes.c_uint32(0))) != 0:
            raise _errno_error(f"landlock_add_rule({path!r})")
    finally:
        os.close(fd)


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")
