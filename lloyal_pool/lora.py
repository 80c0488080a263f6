"""LoraAdapter: a LoRA adapter loaded in a worker for one model, applied per context (Context.set_lora)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from . import protocol as p

if TYPE_CHECKING:
    from .model import Model


class LoraAdapter:
    """A LoRA adapter loaded in one worker for one model (Model.load_lora). Apply it to contexts of that
    model with Context.set_lora; each context has its own configuration."""

    def __init__(self, model: Model, handle: int, path: str, alpha: float, meta: Mapping[str, str]) -> None:
        self.model = model
        self._handle = handle
        self._closed = False
        self.path = path
        self.alpha = alpha  # adapter.lora.alpha (0.0: the file has none)
        self.meta = dict(meta)  # the adapter GGUF's scalar metadata, as strings

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<LoraAdapter {os.path.basename(self.path)!r} handle={self._handle}{state}>"

    @property
    def closed(self) -> bool:
        """Whether the adapter was freed (by close() or with its model)."""
        return self._closed or self.model._closed

    def close(self) -> None:
        """Frees the adapter. LoraError while a context still applies it (set_lora([]) there first).
        Idempotent; the model's close frees it too."""
        if self.closed:
            return
        if self.model._proc.alive:
            self.model._proc.call(p.FreeLora(lora=self._handle)).result()
        self._closed = True

