"""A worker under a memory cap (Pool(memory_limit=...), RLIMIT_DATA): what fits, and errors that name the cap.

When llama.cpp cannot allocate a model's or a context's buffers under the cap, its error says only that an
allocation failed; the worker's says which option to raise. A context is also judged before and just after
llama.cpp allocates it: one whose logits and KV cache alone surely exceed what the cap leaves is refused
before any allocation, and one whose buffers fitted but leave no room for the stacks of the compute
threads its first decode starts (past the cap libgomp exits the worker) is refused while it can be.
"""

from __future__ import annotations

import resource
from typing import Any

from ..errors import ContextError, LloyalError, ModelLoadError

# context_core.cpp's message when llama.cpp returns no context (its buffers could not be allocated).
_NO_CONTEXT = "failed to create the llama context"


def memory_cap() -> int | None:
    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    return None if limit == resource.RLIM_INFINITY else int(limit)


def _under_memory_cap(exc: BaseException, error: type[LloyalError], failed_allocation: bool, what: str,
                      advice: str) -> BaseException:
    """A failed allocation as ``error``: under a memory cap, saying which option to raise. Anything else
    (a refused parameter, a bad or missing file) is returned as it is."""
    if not failed_allocation:
        return exc
    message = str(exc) or "out of memory"
    limit = memory_cap()
    if limit is None:
        return exc if isinstance(exc, error) else error(f"{what}: {message}")
    return error(f"{advice.format(limit=limit)} ({message})")


def _data_in_use() -> int:
    """What RLIMIT_DATA counts now (VmData: heap and private writable mappings), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def context_lower_bound(info: dict[str, Any], params: dict[str, Any]) -> int:
    """Bytes a context surely allocates: the logits of one micro-batch in its compute buffer, its output
    rows and its KV cache at one byte an element (llama.cpp's own buffers are larger)."""
    n_vocab = int(info.get("n_vocab", 0))
    n_ctx = int(params.get("n_ctx") or info.get("n_ctx_train") or 0)
    n_ubatch = min(int(params.get("n_ubatch") or 512), int(params.get("n_batch") or 2048), max(n_ctx, 1))
    n_seq = int(params.get("n_seq_max") or 1)
    n_head = max(int(info.get("n_head", 0)), 1)
    head_dim = int(info.get("n_embd", 0)) // n_head
    kv = n_ctx * int(info.get("n_layer", 0)) * int(info.get("n_head_kv", 0)) * head_dim * 2
    logits = 0 if params.get("embeddings") else n_vocab * 4 * (n_ubatch + n_seq)
    return logits + kv


def thread_headroom(n_threads: int) -> int:
    """A stack for each compute thread besides the calling one (glibc maps RLIMIT_STACK's size for each,
    and RLIMIT_DATA counts it), and a little room for a decode's own small allocations."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    if stack == resource.RLIM_INFINITY or stack <= 0:
        stack = 8 << 20
    return (max(n_threads, 1) - 1) * int(stack) + (2 << 20)


def refuse_over_cap(cap: int, need: int, what: str) -> None:
    """ContextError naming the cap when `need` bytes do not fit in what the cap leaves."""
    left = cap - _data_in_use()
    if need > left:
        raise ContextError(
            f"the context does not fit under this worker's memory cap, Pool(memory_limit={cap}) bytes: it {what} "
            f"about {need / (1 << 20):.0f} MiB and {max(left, 0) / (1 << 20):.0f} MiB are left: raise memory_limit "
            f"or lower n_ctx")


def name_memory_limit(exc: ContextError | MemoryError) -> BaseException:
    """A context that did not fit: under a memory cap, the error says which option to raise."""
    return _under_memory_cap(
        exc, ContextError, not isinstance(exc, ContextError) or _NO_CONTEXT in str(exc), "creating the context",
        "the context does not fit under this worker's memory cap, Pool(memory_limit={limit}) bytes: raise "
        "memory_limit or lower n_ctx")


def name_memory_limit_load(exc: ModelLoadError | MemoryError) -> BaseException:
    """A model whose buffers could not be allocated under a memory cap says which option to raise."""
    allocation = memory_cap() is not None and "alloc" in (str(exc) or "out of memory")
    return _under_memory_cap(
        exc, ModelLoadError, not isinstance(exc, ModelLoadError) or allocation,
        "loading the model", "the model does not fit under this worker's memory cap, "
        "Pool(memory_limit={limit}) bytes: raise memory_limit, or keep use_mmap=True")


__all__ = ["context_lower_bound", "memory_cap", "name_memory_limit", "name_memory_limit_load", "refuse_over_cap",
           "thread_headroom"]
