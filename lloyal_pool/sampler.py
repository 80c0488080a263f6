"""Grammar handles (lloyal.node's createSampler, cloneSampler, applySampler, acceptSamplerToken and
freeSamplerHandle): a grammar's parse state that lives in a context's worker, apart from any branch or
generation. It says which tokens may come next as a mask that applies to any logits row (a context's,
a branch's, another model's, ones you edited), and moves on as tokens are accepted. Context.sample()
takes one to sample under it."""

from __future__ import annotations

import numpy as np

from . import protocol as p
from ._core import ContextCore
from .errors import InvalidArgumentError, StaleHandleError
from .params import token_id


class Sampler:
    """A grammar handle of one context (Context.sampler()). Freed by close(), by its context's close()
    and with its worker (a context recovered in a new worker has none of its handles); a freed handle
    raises StaleHandleError."""

    def __init__(self, link: ContextCore, handle: int, n_vocab: int) -> None:
        self._link = link
        self._handle = handle
        self._n_vocab = n_vocab
        self._incarnation = link.incarnation  # a context made again (a crash) holds none of its handles
        self._closed = False
        link.state.holders.add(self)  # its context stays resident while it is open (its state is the worker's)

    @property
    def handle(self) -> int:
        """The handle's number in its context's worker."""
        return self._handle

    def _live(self) -> int:
        if self.closed:
            raise StaleHandleError("this Sampler was closed, or its context was, or its worker died")
        return self._handle

    def mask(self) -> np.ndarray:
        """n_vocab float32: 0 for each token the grammar allows next, -inf for the others (a copy).
        One pass of the grammar over the whole vocabulary, in the worker."""
        offset = self._link.call(p.GrammarMask(context=self._link.handle, handle=self._live())).result()
        mask: np.ndarray = self._link.region.floats(offset, self._n_vocab).copy()
        return mask

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """logits (n_vocab values) with every token the grammar does not allow next set to -inf, as a new
        float32 array; the others unchanged."""
        row = np.asarray(logits, dtype=np.float32)
        if row.shape != (self._n_vocab,):
            raise InvalidArgumentError(f"logits must have shape ({self._n_vocab},), got {row.shape}")
        out: np.ndarray = row + self.mask()
        return out

    def accept(self, token: int) -> None:
        """Moves the grammar on by token. GrammarError (and nothing changes) for a token it does not
        allow here."""
        self._link.call(p.GrammarAccept(context=self._link.handle, handle=self._live(),
                                        token=token_id(token, self._n_vocab))).result()

    def clone(self) -> Sampler:
        """A new handle at the same parse state that goes on independently (a fork's grammar)."""
        h = self._link.call(p.GrammarClone(context=self._link.handle, handle=self._live())).result()
        return Sampler(self._link, h, self._n_vocab)

    @property
    def closed(self) -> bool:
        """Whether the handle was freed: close(), its context's close(), or its worker's death."""
        link = self._link
        return self._closed or link.closed or link.incarnation != self._incarnation or not link.proc.alive

    def holds(self) -> bool:
        """Whether it keeps its context in its worker (residency: an open handle's state is the worker's)."""
        return not self.closed

    def close(self) -> None:
        """Frees the handle in the worker. Idempotent."""
        if not self.closed:
            self._closed = True
            self._link.call(p.GrammarFree(context=self._link.handle, handle=self._handle)).result()

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sampler(handle={self._handle}{', closed' if self.closed else ''})"


__all__ = ["Sampler"]
