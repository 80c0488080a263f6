"""Contexts made on first use and shared by threads, one call at a time: the embedding context the HTTP
endpoint embeds with, on a Pool's worker (serve/backend.py) and on a RayPool's actor (ray.py), and the
context that scores a completion's echoed prompt (Scorer)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .params import ContextParams, TokenLogprob

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

#: The context the embeddings route embeds with, mean-pooled.
EMBEDDING_CONTEXT = ContextParams(n_ctx=2048, embeddings=True, pooling="mean")


class _LazyContext:
    """A context of ``model`` with ``params``, made at the first call (and again if it was closed); calls
    hold the lock while they use it."""

    def __init__(self, model: Model, params: ContextParams) -> None:
        self.model = model
        self._params = params
        self._ctx: Context | None = None
        self._lock = threading.Lock()

    def _context(self) -> Context:  # with the lock held
        if self._ctx is None or self._ctx.closed:
            self._ctx = self.model._new_context(self._params, pageable=False)
        return self._ctx


class Embedder(_LazyContext):
    def __init__(self, model: Model) -> None:
        super().__init__(model, EMBEDDING_CONTEXT)

    def embed(self, inputs: Sequence[str | list[int]]) -> tuple[list[np.ndarray], int]:
        """The vectors (copies), and the number of tokens the inputs hold."""
        with self._lock:  # one embed at a time (its rows share one block of the region), copied before the next
            vectors = [np.array(v) for v in self._context().embed(inputs)]
        return vectors, sum(len(t) if isinstance(t, list) else len(self.model.tokenize(t)) for t in inputs)


class Scorer(_LazyContext):
    """Scores prompts with their tokens' log-probabilities (Context.score(logprobs=N)) on a context of
    ``n_ctx`` tokens."""

    def __init__(self, model: Model, n_ctx: int) -> None:
        super().__init__(model, ContextParams(n_ctx=n_ctx))

    def score(self, tokens: list[int], logprobs: int) -> list[TokenLogprob]:
        """Each token's after the first: given the tokens before it."""
        with self._lock:
            scored = self._context().score(tokens, logprobs=logprobs).logprobs
        assert scored is not None
        return list(scored)
