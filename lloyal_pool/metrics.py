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


class PerplexityTracker:
    """A running perplexity: exp of the mean surprisal (in nats) of the tokens added so far, the measure a
    branch keeps natively, kept here for tokens scored anywhere (logits from score_choices, a Context's
    logits() before each commit, another model's view of the same text). ``clone()`` forks it, so a
    tracker can follow each branch of a tree. Plain Python: it lives in the parent, not in a worker."""

    __slots__ = ("_count", "_total")

    def __init__(self) -> None:
        self._count = 0
        self._total = 0.0

    def add(self, surprisal: float) -> None:
        """Adds one token's surprisal in nats (metrics.surprisal(logits, token)); inf for a token the
        logits banned makes the perplexity inf."""
        value = float(surprisal)
        if math.isnan(value) or value < 0.0:
            raise ValueError(f"a surprisal is a non-negative number of nats, got {surprisal!r}")
        self._count += 1
        self._total += value

    def add_logits(self, logits: np.ndarray, token: int) -> float:
        """Adds token's surprisal under logits and returns it."""
        value = surprisal(logits, token)
        self.add(value)
        return value

    @property
    def count(self) -> int:
        """Tokens added."""
        return self._count

    @property
    def perplexity(self) -> float:
        """exp(mean surprisal); inf before the first token, as a branch's perplexity is."""
        return math.exp(self._total / self._count) if self._count else math.inf

    def clone(self) -> PerplexityTracker:
        """An independent copy that goes on from the same sums."""
        twin = PerplexityTracker()
        twin._count, twin._total = self._count, self._total
        return twin

    def reset(self) -> None:
        """Back to no tokens (perplexity inf)."""
        self._count = 0
        self._total = 0.0

    def __repr__(self) -> str:
        return f"PerplexityTracker(count={self._count}, perplexity={self.perplexity:.4g})"


__all__ = ["PerplexityTracker", "entropy", "surprisal"]
