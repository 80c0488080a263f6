"""An embedding context made on first use and shared by threads: what the HTTP endpoint embeds with,
on a Pool's worker (serve/backend.py) and on a RayPool's actor (ray.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .params import ContextParams

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

#: The context the embeddings route embeds with, mean-pooled.
EMBEDDING_CONTEXT = ContextParams(n_ctx=2048, embeddings=True, pooling="mean")


class Embedder:
    def __init__(self, model: Model) -> None:
        self.model = model
        self._ctx: Context | None = None
        self._lock = threading.Lock()

    def embed(self, inputs: Sequence[str | list[int]]) -> tuple[list[np.ndarray], int]:
        """The vectors (copies), and the number of tokens the inputs hold."""
        with self._lock:  # one embed at a time (its rows share one block of the region), copied before the next
            if self._ctx is None or self._ctx.closed:
                self._ctx = self.model.new_context(EMBEDDING_CONTEXT)
            vectors = [np.array(v) for v in self._ctx.embed(inputs)]
        return vectors, sum(len(t) if isinstance(t, list) else len(self.model.tokenize(t)) for t in inputs)
