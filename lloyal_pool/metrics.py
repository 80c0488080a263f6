"""Information measures over a logits row, computed here in numpy from the shared-memory view (no round
trip). The worker computes the same surprisal natively for the perplexity it tracks on every commit."""

from __future__ import annotations

import math

import numpy as np

_LN2 = math.log(2.0)


def _scale(base: str) -> float:
    if base == "nats":
        return 1.0
    if base == "bits":
        return 1.0 / _LN2
    raise ValueError(f"base must be 'nats' or 'bits', got {base!r}")


def _log_softmax_parts(logits: np.ndarray) -> tuple[np.ndarray, float]:
    """(finite logits as float64, their log-sum-exp), max-shifted so that nothing overflows."""
    z = np.asarray(logits, dtype=np.float64)
    z = z[np.isfinite(z)]
    if z.size == 0:
        raise ValueError("no finite logits")
    m = float(z.max())
    return z, m + math.log(float(np.exp(z - m).sum()))


def entropy(logits: np.ndarray, base: str = "nats") -> float:
    """Shannon entropy of softmax(logits); -inf entries (banned tokens) carry no probability."""
    scale = _scale(base)
    z, lse = _log_softmax_parts(logits)
    logp = z - lse
    return float(-(np.exp(logp) * logp).sum()) * scale


def surprisal(logits: np.ndarray, token: int, base: str = "nats") -> float:
    """-log softmax(logits)[token]: how unexpected token is under these logits (0 for a certainty)."""
    scale = _scale(base)
    arr = np.asarray(logits)
    if not 0 <= token < arr.shape[-1]:
        raise IndexError(f"token {token} out of range for {arr.shape[-1]} logits")
    x = float(arr[token])
    if not math.isfinite(x):
        return math.inf
    _, lse = _log_softmax_parts(arr)
    return max(0.0, lse - x) * scale


__all__ = ["entropy", "surprisal"]
