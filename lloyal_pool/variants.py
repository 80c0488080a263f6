"""Which native build a worker loads. Both sides import this module.

Every install has the CPU build (lloyal_pool.worker._native_cpu); GPU builds (_native_cuda,
_native_vulkan) are opt-in builds of the same sources (CMake option LLOYAL_VARIANT). Each worker picks
one at start-up, so one pool can mix them. The request comes from the Pool's ``variant`` option, else
the LLOYAL_POOL_VARIANT environment variable, else "cpu"; "auto" means the best one that loads.
A variant that fails to load falls back to CPU with a warning, or fails the worker's start in strict
mode (Pool(strict_variant=True) or LLOYAL_POOL_VARIANT_STRICT=1).
"""

from __future__ import annotations

import os

from .errors import InvalidArgumentError

KNOWN = ("cuda", "vulkan", "cpu")
ENV_VARIANT = "LLOYAL_POOL_VARIANT"
ENV_STRICT = "LLOYAL_POOL_VARIANT_STRICT"


def requested(variant: str | None) -> str:
    value = (variant or os.environ.get(ENV_VARIANT) or "cpu").strip().lower()
    if value != "auto" and value not in KNOWN:
        raise InvalidArgumentError(f"unknown native variant {value!r}; expected one of {', '.join(KNOWN)} or 'auto'")
    return value


def strict_requested(strict: bool | None) -> bool:
    if strict is not None:
        return strict
    return os.environ.get(ENV_STRICT, "") not in ("", "0", "false", "no")


def candidates(variant: str) -> list[str]:
    """The order a worker tries: the request first, CPU last."""
    if variant == "auto":
        return list(KNOWN)
    return [variant] if variant == "cpu" else [variant, "cpu"]


def module_name(variant: str) -> str:
    return f"lloyal_pool.worker._native_{variant}"
