"""Worker process entry point: ``python -I -m lloyal_pool.worker --fds R,W --shm SPEC ...``.

Started only by the client (client._process), never by forking it. In order: die with the parent
(signal and lifeline pipe), keep stdout off the protocol, harden, load one native variant (falling
back to CPU unless strict), attach the shared region, say HELLO,
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
from ..shm import Region, RegionSpec
from . import sandbox


def load_native(requested: str, strict: bool) -> tuple[ModuleType, str | None]:
    """The first variant that imports, and why the requested one did not (None when it did)."""
    failures: list[str] = []
    for variant in variants.candidates(requested):
        try:
            return importlib.import_module(variants.module_name(variant)), (
                "; ".join(failures) if failures else None)
        except ImportError as exc:
            failures.append(f"{variant}: {exc}")
            if strict:
                break
    raise ImportError(f"no native variant could be loaded (requested {requested!r}, strict={strict}): "
                      + "; ".join(failures))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lloyal_pool.worker")
    ap.add_argument("--fds", required=True, help="request-read,reply-write")
    ap.add_argument("--shm", required=True)
    ap.add_argument("--lifeline", type=int, default=-1, help="read end of a pipe only the parent writes to")
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--worker-id", type=int, default=0)
    ap.add_argument("--variant", default="cpu")
    ap.add_argument("--strict-variant", action="store_true")
    ap.add_argument("--memory-limit", type=int, default=0)
    ap.add_argument("--log-level", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="default n_threads of this worker's contexts")
    args = ap.parse_args(argv)

    sandbox.die_with_parent(args.parent_pid)
    sandbox.watch_lifeline(args.lifeline)
    sandbox.stdout_to_stderr()
    faulthandler.enable()  # a native crash leaves a Python stack in the stderr tail the client reports
    rfd, wfd = (int(x) for x in args.fds.split(","))
    try:
        sandbox.harden(args.memory_limit or None)
        native, fallback = load_native(args.variant, args.strict_variant)
        native.set_log_level(args.log_level)
        region = Region.attach(RegionSpec.from_arg(args.shm))
    except BaseException as exc:
        write_frame(wfd, pack(Kind.ERROR, 0, error_payload(exc, traceback.format_exc())))
        return 71

    from .engine import Engine
    from .loop import WorkerLoop

    build = native.build_info()
    hello: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "worker_id": args.worker_id,
        "variant": native.variant,
        "requested_variant": args.variant,
        "fallback_reason": fallback,
        "build": build,
        "threads": args.threads or build["default_threads"],
        "python": sys.version.split()[0],
    }
    if fallback:
        print(f"[worker] [startup] native variant {args.variant!r} unavailable, using "
              f"{native.variant!r}: {fallback}", file=sys.stderr, flush=True)
    loop = WorkerLoop(Engine(native, region, default_threads=args.threads or None), rfd, wfd)
    try:
        loop.send(Kind.HELLO, 0, hello)
        return loop.run()
    except BrokenPipeError:
        return 0  # the parent went away mid-reply


if __name__ == "__main__":
    sys.exit(main())
