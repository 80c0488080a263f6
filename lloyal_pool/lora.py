"""LoraAdapter: a LoRA adapter loaded in a worker for one model, applied per context (Context.set_lora)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from . import protocol as p
from ._owners import ModelLike
from .errors import BadRequestError, LoraError, StaleHandleError


class LoraOwner(ModelLike, Protocol):
    """The model an adapter was loaded for (a Model, which makes it: Model.load_lora): what the adapter uses
    of it (it is freed with it), and what a user reaches through ``adapter.model``, its adapters included."""

    @property
    def _closed(self) -> bool: ...
    @property
    def _loras(self) -> set[LoraAdapter]: ...
    @property
    def loras(self) -> list[LoraAdapter]: ...
    def load_lora(self, path: str | os.PathLike[str]) -> LoraAdapter: ...
    def lora(self, name: str) -> LoraAdapter: ...


class LoraAdapter:
    """A LoRA adapter loaded in one worker for one model (Model.load_lora). Apply it to contexts of that
    model with Context.set_lora; each context has its own configuration."""

    def __init__(self, model: LoraOwner, handle: int, path: str, alpha: float, meta: Mapping[str, str]) -> None:
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
        if self.model.instance.alive:
            self.model.instance._core.call(p.FreeLora(lora=self._handle)).result()
        self._closed = True
        self.model._loras.discard(self)

    def _lost(self) -> None:
        """Crash recovery could not load it again in the replacement: it is closed."""
        self._closed = True



def lora_pairs(adapters: Iterable[tuple[LoraAdapter, float]], core: Any, call: str) -> list[tuple[LoraAdapter, float]]:
    """(adapter, scale) pairs checked for a context of the worker whose core is ``core``: BadRequestError for
    anything but such pairs, StaleHandleError for a closed adapter, LoraError for one loaded in another
    worker."""
    pairs: list[tuple[LoraAdapter, float]] = []
    for item in adapters:
        adapter, scale = item
        if not isinstance(adapter, LoraAdapter):
            raise BadRequestError(f"{call} takes (LoraAdapter, scale) pairs, got {type(adapter).__name__}")
        if adapter.closed:
            raise StaleHandleError(f"{adapter!r} was closed")
        if adapter.model.instance._core is not core:
            # Handles are numbered per worker: another worker's would name something else there.
            raise LoraError(f"{adapter!r} was loaded in another worker, for another model: load it with this "
                            f"context's model")
        pairs.append((adapter, float(scale)))
    return pairs


def lora_wire(pairs: Iterable[tuple[LoraAdapter, float]]) -> list[tuple[int, float]]:
    """Checked pairs (lora_pairs) as a request carries them: (handle, scale)."""
    return [(a._handle, s) for a, s in pairs]
