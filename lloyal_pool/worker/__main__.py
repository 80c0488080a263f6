"""Worker process entry point: ``python -I -m lloyal_pool.worker --fds R,W --shm SPEC ...``.

Started only by the client (client._process), never by forking it. In order: die with the parent
(signal and lifeline pipe), keep stdout off the protocol, harden, load the native module and its
backends (the CPU kernels asked for, then a GPU backend if one was, falling back to the CPU unless
strict: variants.py), attach the shared region, say HELLO,
serve until the parent closes the pipe or says SHUTDOWN.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import sys
import traceback
from types import ModuleType
from typing import Any

from .. import variants
from ..protocol import PROTOCOL_VERSION, Kind, error_payload, pack, write_frame
from ..shm import TRANSFER_MEMFD, Region, RegionSpec
from . import landlock, sandbox


def load_native(cpu: str, requested: str, strict: bool) -> tuple[ModuleType, str, str | None]:
    """The native module with its CPU kernels (build_info()["cpu"] says which) and the GPU backend that
    loaded: (module, the variant running, why the requested variant did not load, or None)."""
    native = importlib.import_module(variants.MODULE)
    native.load_cpu_backend(cpu)
    failures: list[str] = []
    for variant in variants.candidates(requested):
        n_devices, why = (1, "") if variant == "cpu" else native.load_gpu_backend(variant)
        if n_devices:
            return native, variant, "; ".join(failures) if failures else None
        failures.append(f"{variant}: {why}")
        if strict:
            break
    raise ImportError(f"no native variant could be loaded (requested {requested!r}, strict={strict}): "
                      + "; ".join(failures))


def probe_variants(cpu: str = "auto") -> list[dict[str, Any]]:
    """What variants.probe() reports, found in this (throwaway) process: the CPU kernels a worker would
    run, then each GPU backend: whether it loads and sees a device, and why not."""
    try:
        native = importlib.import_module(variants.MODULE)
        chosen = native.load_cpu_backend(cpu)
    except Exception as exc:  # what went wrong is the probe's answer
        return [{"name": "cpu", "loads": False, "devices": 0, "detail": f"{type(exc).__name__}: {exc}"}]
    out = [{"name": "cpu", "loads": True, "devices": 0, "detail": f"CPU kernels {chosen['kernels']}"}]
    for name in variants.KNOWN:
        if name != "cpu":
            n, why = native.load_gpu_backend(name)
            out.append({"name": name, "loads": n > 0, "devices": n, "detail": why or f"{n} GPU device(s)"})
    return out


def imported_modules() -> list[str]:
    """What this worker has imported beyond the standard library: lloyal_pool's modules by name, other
    packages by their top-level name. A worker should hold the wire modules and its own, not the client
    (tests/test_worker_imports.py)."""
    found = set()
    for name in list(sys.modules):
        top = name.partition(".")[0]
        if top == "lloyal_pool":
            found.add(name)
        elif top not in sys.stdlib_module_names and top != "__main__":
            found.add(top)
    return sorted(found)


def confine(args: argparse.Namespace) -> dict[str, Any]:
    """Applies Landlock (landlock.py) as the pool asked; refuses to start when read scoping was asked
    for and the kernel cannot enforce it, rather than run a worker that only looks confined."""
    import json

    readable = None if args.allowed_dirs is None else list(json.loads(args.allowed_dirs))
    if args.no_sandbox:
        return {"landlock": 0, "writes_scoped": False, "reads_scoped": False, "tcp_blocked": False,
                "scoped": False, "network": True, "ip_sockets_blocked": False, "disabled": True}
    info = landlock.apply(private_dir=os.getcwd(), readable=readable,
                          writable=list(json.loads(args.writable_dirs)), network=args.network)
    if readable is not None and not info["reads_scoped"]:
        raise OSError("allowed_dirs needs Landlock, which this kernel does not offer "
                      f"(Landlock ABI {info['landlock']})")
    info["ip_sockets_blocked"] = False if args.network else landlock.block_ip_sockets()
    # The parent cannot hand a confined worker its memfds (/proc/<parent>/fd is closed to it), so the
    # worker makes the one its state transfers use (memfd_create is no path access Landlock checks), and
    # the parent opens it through /proc/<worker>/fd.
    info["transfer_fd"] = os.memfd_create(TRANSFER_MEMFD, os.MFD_CLOEXEC) if (
        info["landlock"] and hasattr(os, "memfd_create")) else None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lloyal_pool.worker")
    ap.add_argument("--fds", required=True, help="request-read,reply-write")
    ap.add_argument("--shm", required=True)
    ap.add_argument("--lifeline", type=int, default=-1, help="read end of a pipe only the parent writes to")
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--worker-id", type=int, default=0)
    ap.add_argument("--variant", default="cpu")
    ap.add_argument("--cpu", default="auto", help="the CPU kernels' level, or auto")
    ap.add_argument("--strict-variant", action="store_true")
    ap.add_argument("--memory-limit", type=int, default=0)
    ap.add_argument("--log-level", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="default n_threads of this worker's contexts")
    ap.add_argument("--allowed-dirs", default=None, help="JSON list: the only directories it may read")
    ap.add_argument("--writable-dirs", default="[]", help="JSON list: where it may write besides its cwd")
    ap.add_argument("--network", action="store_true", help="leave TCP alone")
    ap.add_argument("--no-sandbox", action="store_true", help="skip Landlock")
    ap.add_argument("--zygote", type=int, default=-1,
                    help="a snapshot's zygote: the Unix socket a fork's descriptors arrive on")
    args = ap.parse_args(argv)
    # On an abort, ggml forks a child that execs gdb to attach to the worker; inside the sandbox that
    # attach can hang the dying worker forever. faulthandler and the stderr tail report the crash instead.
    os.environ["GGML_NO_BACKTRACE"] = "1"

    sandbox.die_with_parent(args.parent_pid)
    sandbox.watch_lifeline(args.lifeline)
    sandbox.stdout_to_stderr()
    faulthandler.enable()  # a native crash leaves a Python stack in the stderr tail the client reports
    rfd, wfd = (int(x) for x in args.fds.split(","))
    try:
        sandbox.harden(args.memory_limit or None)
        native, variant, fallback = load_native(args.cpu, args.variant, args.strict_variant)
        native.set_log_level(args.log_level)
        region = Region.attach(RegionSpec.from_arg(args.shm))
    except BaseException as exc:
        write_frame(wfd, pack(Kind.ERROR, 0, error_payload(exc, traceback.format_exc())))
        return 71

    from .engine import Engine
    from .loop import WorkerLoop

    try:  # last, once everything start-up reads is loaded: from here on requests run confined
        confinement = confine(args)
    except BaseException as exc:
        write_frame(wfd, pack(Kind.ERROR, 0, error_payload(exc, traceback.format_exc())))
        return 71

    build = native.build_info()
    hello: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "worker_id": args.worker_id,
        "variant": variant,
        "requested_variant": args.variant,
        "fallback_reason": fallback,
        "build": build,
        "threads": args.threads or build["default_threads"],
        "python": sys.version.split()[0],
        "modules": imported_modules(),
        "sandbox": confinement,
    }
    if fallback:
        print(f"[worker] [startup] native variant {args.variant!r} unavailable, using "
              f"{variant!r}: {fallback}", file=sys.stderr, flush=True)
    engine = Engine(native, region, default_threads=args.threads or None, single_threaded=args.zygote >= 0)
    zygote = None
    if args.zygote >= 0:
        from .zygote import Zygote

        engine.zygote = zygote = Zygote(args.zygote, args.lifeline, hello)
    loop = WorkerLoop(engine, rfd, wfd, zygote)
    try:
        loop.send(Kind.HELLO, 0, hello)
        return loop.run()
    except BrokenPipeError:
        return 0  # the parent went away mid-reply


if __name__ == "__main__":
    sys.exit(main())
