"""What every handler of the engine shares: the tables behind its handles, and ``@handles``, which registers one.

A worker addresses its models, contexts and LoRA adapters by integer handles it hands out itself. Registry
holds what each one stands for and turns a request's fields into what the native side takes: a handle into
its entry (StaleHandleError for one that is gone), a text into tokens, a grammar into a native spec. The
handlers are methods of Registry's subclasses, one module per concern (worker/*_handlers.py), or
functions of other worker modules (loop.py, zygote.py); Engine (worker/engine.py) is all of those
subclasses at once and dispatches each request by its type through HANDLERS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import StaleHandleError
from ..protocol import Request
from ..shm import BULK_OFFSET, HEARTBEAT_OFFSET, INTERRUPT_SLOTS, PAGE, Region
from .grammar_trie import factor_literal_alternations

if TYPE_CHECKING:  # the stub is the native module's contract: mypy checks the engine's calls against it
    from . import _native as native_api

EventSink = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Call:
    """What a handler knows about the request it serves besides its fields."""

    request_id: int = 0  # the id the interrupt word is compared with (0: never interrupted)
    emit: EventSink | None = None  # EVENT frames for this request

    def prompt_progress(self, wanted: bool) -> Callable[[int, int], None] | None:
        """The native on_progress for a request that asked for prompt_progress events (else None)."""
        emit = self.emit
        if not wanted or emit is None:
            return None

        def on_progress(done: int, total: int) -> None:
            emit({"prompt_progress": (done, total)})

        return on_progress


Q = TypeVar("Q", bound=Request[Any])
E = TypeVar("E", bound="Registry")
# The first argument is the Engine, whichever of its bases (or other worker module) a handler is written
# in: Engine.handle() passes itself, and it is every one of them.
Handler = Callable[[Any, Any, Call], Any]
HANDLERS: dict[type[Request[Any]], Handler] = {}


def handles(request: type[Q]) -> Callable[[Callable[[E, Q, Call], Any]], Callable[[E, Q, Call], Any]]:
    """Registers the decorated method as the handler of one request struct."""

    def register(fn: Callable[[E, Q, Call], Any]) -> Callable[[E, Q, Call], Any]:
        if request in HANDLERS:
            raise TypeError(f"two handlers for {request.__name__}")
        HANDLERS[request] = fn
        return fn

    return register


@dataclass
class ModelEntry:
    native: native_api.Model
    path: str
    n_vocab: int
    contexts: set[int]


@dataclass
class ContextEntry:
    native: native_api.Context
    model_id: int
    slot: int  # interrupt word index
    loras: frozenset[int] = frozenset()  # the adapters its configuration holds


@dataclass
class LoraEntry:
    native: native_api.Lora
    model_id: int


class Registry:
    """The worker's models, contexts and adapters by handle, over one native module and one region."""

    def __init__(self, native: ModuleType, region: Region, default_threads: int | None = None,
                 single_threaded: bool = False) -> None:
        self.native = native
        self.region = region
        self.default_threads = default_threads
        # A snapshot's zygote (worker/zygote.py): its contexts compute on one thread until a fork thaws
        # them (Engine.thaw()).
        self.single_threaded = single_threaded
        # The region's bulk area, handed out by the native side: a block per context (its logits row)
        # and per branch (its snapshot), each freed natively with its owner.
        self.arena = native.Arena(region.view, BULK_OFFSET, PAGE)
        # The native loops advance it at every interrupt check; Engine.handle() at every request.
        native.set_heartbeat_word(region.view, HEARTBEAT_OFFSET // 8)
        self._models: dict[int, ModelEntry] = {}
        self._contexts: dict[int, ContextEntry] = {}
        self._loras: dict[int, LoraEntry] = {}
        self._free_slots = list(range(INTERRUPT_SLOTS - 1, -1, -1))
        self._next_id = 1

    def _new_id(self) -> int:
        handle = self._next_id
        self._next_id += 1
        return handle

    def _model(self, model_id: int) -> ModelEntry:
        try:
            return self._models[model_id]
        except KeyError:
            raise StaleHandleError(f"model handle {model_id} is not loaded in this worker") from None

    def _context(self, context_id: int) -> ContextEntry:
        try:
            return self._contexts[context_id]
        except KeyError:
            raise StaleHandleError(f"context handle {context_id} does not exist in this worker") from None

    def _lora(self, lora_id: int) -> LoraEntry:
        try:
            return self._loras[lora_id]
        except KeyError:
            raise StaleHandleError(f"LoRA adapter handle {lora_id} is not loaded in this worker (closed, or "
                                   f"freed with its model)") from None

    def _free_context(self, context: int) -> None:
        entry = self._context(context)
        del self._contexts[context]
        self._models[entry.model_id].contexts.discard(context)
        self._free_slots.append(entry.slot)

    def _tokenize(self, model: int, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return list(self._model(model).native.tokenize(text, add_special, parse_special))

    def _prompt_tokens(self, entry: ContextEntry, prompt: str | Sequence[int], bos: bool) -> list[int]:
        """Token ids, or text tokenized with special tokens parsed (BOS only for a root's prompt)."""
        if isinstance(prompt, str):
            return self._tokenize(entry.model_id, prompt, bos, True)
        return list(prompt)

    def _grammar(self, grammar: dict[str, Any] | None) -> dict[str, Any] | None:
        if grammar is None:
            return None
        grammar = dict(grammar)
        schema = grammar.pop("json_schema", None)
        if schema is not None:
            grammar["gbnf"] = str(self.native.json_schema_to_grammar(schema))
        if isinstance(grammar.get("gbnf"), str):
            grammar["gbnf"] = factor_literal_alternations(grammar["gbnf"])
        return grammar


__all__ = ["HANDLERS", "Call", "ContextEntry", "EventSink", "Handler", "LoraEntry", "ModelEntry", "Registry",
           "handles"]
