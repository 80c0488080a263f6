"""The engine of one worker: models and contexts over the native module, addressed by integer handles.

It knows nothing of pipes or frames (worker/loop.py does), so it runs the same in-process, which is how
the tests exercise the request logic without a subprocess. Every method takes and returns plain
msgpack-able values; bulk results are written into the shared-memory region and returned as
(offset, count) descriptors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..errors import BranchError, ContextError, LloyalError, ModelLoadError, StaleHandleError
from ..protocol import MAX_FRAME
from ..shm import INTERRUPT_OFFSET, INTERRUPT_SLOTS, BlockAllocator, Region

EventSink = Callable[[dict[str, Any]], None]
# Context.kv's operations -> the native Context methods that do them.
_KV_OPS = {"cp": "kv_seq_cp", "keep": "kv_seq_keep", "rm": "kv_seq_rm", "pos_min": "kv_seq_pos_min",
           "pos_max": "kv_seq_pos_max", "free": "free_seq"}
_GGUF_MAGIC = b"GGUF"


@dataclass
class _ModelEntry:
    native: Any
    path: str
    n_vocab: int
    contexts: set[int]


@dataclass
class _ContextEntry:
    native: Any
    model_id: int
    slot: int  # interrupt word index
    logits_offset: int
    logits_bytes: int
    branches: dict[int, int] = field(default_factory=dict)  # branch handle -> its logits block


class Engine:
    def __init__(self, native: ModuleType, region: Region, default_threads: int | None = None) -> None:
        self.native = native
        self.region = region
        self.default_threads = default_threads
        self._alloc = BlockAllocator(region.size)
        self._models: dict[int, _ModelEntry] = {}
        self._contexts: dict[int, _ContextEntry] = {}
        self._free_slots = list(range(INTERRUPT_SLOTS - 1, -1, -1))
        self._next_id = 1

    def _new_id(self) -> int:
        handle = self._next_id
        self._next_id += 1
        return handle

    def _model(self, model_id: int) -> _ModelEntry:
        try:
            return self._models[model_id]
        except KeyError:
            raise StaleHandleError(f"model handle {model_id} is not loaded in this worker") from None

    def _context(self, context_id: int) -> _ContextEntry:
        try:
            return self._contexts[context_id]
        except KeyError:
            raise StaleHandleError(f"context handle {context_id} does not exist in this worker") from None

    # -- models ---------------------------------------------------------------------------------------
    def load_model(self, path: str, n_gpu_layers: int = 0, use_mmap: bool = True, vocab_only: bool = False,
                   emit: EventSink | None = None) -> dict[str, Any]:
        _check_gguf_file(path)
        last = [-1.0]

        def progress(fraction: float) -> bool:
            # llama.cpp reports hundreds of steps; a percent is enough for a progress bar.
            if emit is not None and (fraction - last[0] >= 0.01 or fraction >= 1.0):
                last[0] = fraction
                emit({"progress": fraction})
            return True

        native = self.native.Model(path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap,
                                   vocab_only=vocab_only, progress=progress)
        model_id = self._new_id()
        self._models[model_id] = _ModelEntry(native, path, int(native.n_vocab), set())
        return {"model": model_id, "info": native.info()}

    def free_model(self, model: int) -> None:
        entry = self._model(model)
        for ctx in list(entry.contexts):
            self.free_context(ctx)
        del self._models[model]

    def tokenize(self, model: int, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return list(self._model(model).native.tokenize(text, add_special, parse_special))

    def detokenize(self, model: int, tokens: Sequence[int], remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        return str(self._model(model).native.detokenize(tokens, remove_special, unparse_special))

    def token_to_piece(self, model: int, token: int, special: bool = True) -> bytes:
        return bytes(self._model(model).native.token_to_piece(token, special))

    def apply_chat_template(self, model: int, messages: Sequence[Sequence[str]], template: str | None = None,
                            add_assistant: bool = True) -> str:
        pairs = [(str(m[0]), str(m[1])) for m in messages]
        return str(self._model(model).native.apply_chat_template(pairs, template, add_assistant))

    def json_schema_to_grammar(self, schema: str) -> str:
        return str(self.native.json_schema_to_grammar(schema))

    # -- contexts -------------------------------------------------------------------------------------
    def new_context(self, model: int, params: dict[str, Any]) -> dict[str, Any]:
        entry = self._model(model)
        if not self._free_slots:
            raise ContextError(f"a worker holds at most {INTERRUPT_SLOTS} contexts")
        logits_bytes = entry.n_vocab * 4
        offset = self._alloc.alloc(logits_bytes)
        if self.default_threads and params.get("n_threads") is None:
            params = {**params, "n_threads": self.default_threads}
        try:
            native = self.native.Context(entry.native, params)
        except BaseException:
            self._alloc.free(offset, logits_bytes)
            raise
        slot = self._free_slots.pop()
        self.region.set_interrupt(slot, 0)
        # The native side indexes u64 words from the start of the region.
        native.set_interrupt_word(self.region.view, INTERRUPT_OFFSET // 8 + slot)
        context_id = self._new_id()
        self._contexts[context_id] = _ContextEntry(native, model, slot, offset, logits_bytes)
        entry.contexts.add(context_id)
        return {
            "context": context_id, "interrupt_slot": slot, "logits_offset": offset, "n_vocab": entry.n_vocab,
            "n_ctx": native.n_ctx, "n_batch": native.n_batch, "n_ubatch": native.n_ubatch,
            "n_seq_max": native.n_seq_max, "n_threads": native.n_threads,
        }

    def free_context(self, context: int) -> None:
        entry = self._context(context)
        del self._contexts[context]
        self._models[entry.model_id].contexts.discard(context)
        self._free_blocks(entry, list(entry.branches))
        self._alloc.free(entry.logits_offset, entry.logits_bytes)
        self._free_slots.append(entry.slot)

    def eval(self, context: int, tokens: Sequence[int] | None = None, text: str | None = None,
             add_special: bool | None = None, parse_special: bool = True, request_id: int = 0) -> dict[str, Any]:
        entry = self._context(context)
        if text is not None:
            if add_special is None:
                add_special = entry.native.n_past() == 0
            tokens = self.tokenize(entry.model_id, text, add_special, parse_special)
        # Token ids are checked (InvalidTokenError) by the native side, before anything is decoded.
        return dict(entry.native.eval(tokens or [], request_id))

    def generate(self, context: int, prompt: str | Sequence[int], params: dict[str, Any], request_id: int = 0,
                 stream: bool = False, emit: EventSink | None = None) -> dict[str, Any]:
        entry = self._context(context)
        on_piece = None
        if stream and emit is not None:
            def on_piece(piece: str) -> None:
                emit({"piece": piece})
        return dict(entry.native.generate(prompt, params, request_id, on_piece))

    def logits(self, context: int) -> dict[str, int]:
        entry = self._context(context)
        entry.native.logits_into(self.region.writable(entry.logits_offset, entry.logits_bytes))
        return {"offset": entry.logits_offset, "count": entry.logits_bytes // 4}

    def reset(self, context: int) -> None:
        entry = self._context(context)
        entry.native.reset()  # drops every branch and detached sequence too
        self._free_blocks(entry, list(entry.branches))

    def tokens(self, context: int) -> list[int]:
        return list(self._context(context).native.tokens())

    # -- branches -------------------------------------------------------------------------------------
    # A branch's logits snapshot is a block of the shared region: the native side writes it on every
    # commit, the client reads it in place. The engine hands blocks out and takes them back when the
    # native side reports the handles it freed.
    def _new_block(self, entry: _ContextEntry) -> tuple[int, memoryview]:
        try:
            offset = self._alloc.alloc(entry.logits_bytes)
        except LloyalError as exc:
            raise BranchError(f"{exc} (every branch keeps its {entry.logits_bytes >> 10} KiB logits snapshot "
                              "there)") from None
        return offset, self.region.writable(offset, entry.logits_bytes)

    def _free_blocks(self, entry: _ContextEntry, handles: Sequence[int]) -> None:
        for h in handles:
            offset = entry.branches.pop(int(h), None)
            if offset is not None:
                self._alloc.free(offset, entry.logits_bytes)

    def _new_branch(self, entry: _ContextEntry, make: Callable[[memoryview], int]) -> dict[str, int]:
        offset, block = self._new_block(entry)
        try:
            handle = int(make(block))
        except BaseException:
            self._alloc.free(offset, entry.logits_bytes)
            raise
        entry.branches[handle] = offset
        return {"branch": handle, "logits_offset": offset}

    def _grammar(self, grammar: dict[str, Any] | None) -> dict[str, Any] | None:
        if grammar is None:
            return None
        grammar = dict(grammar)
        schema = grammar.pop("json_schema", None)
        if schema is not None:
            grammar["gbnf"] = self.json_schema_to_grammar(schema)
        return grammar

    def _prompt_tokens(self, entry: _ContextEntry, prompt: str | Sequence[int], bos: bool) -> list[int]:
        """Token ids, or text tokenized with special tokens parsed (BOS only for a root's prompt)."""
        if isinstance(prompt, str):
            return self.tokenize(entry.model_id, prompt, add_special=bos, parse_special=True)
        return list(prompt)

    def branch_create(self, context: int, params: dict[str, Any], grammar: dict[str, Any] | None = None,
                      prompt: str | Sequence[int] = (), request_id: int = 0) -> dict[str, int]:
        entry = self._context(context)
        spec = self._grammar(grammar)
        tokens = self._prompt_tokens(entry, prompt, bos=True)
        out = self._new_branch(entry, lambda block: entry.native.branch_create(block, params, spec))
        if tokens:
            try:
                entry.native.prefill([(out["branch"], list(tokens))], request_id)
            except BaseException:
                self._free_blocks(entry, entry.native.branch_prune(out["branch"], True))
                raise
        return out

    def branch_fork(self, context: int, branch: int) -> dict[str, int]:
        entry = self._context(context)
        return self._new_branch(entry, lambda block: entry.native.branch_fork(branch, block))

    def branch_adopt(self, context: int, seq: int, params: dict[str, Any],
                     grammar: dict[str, Any] | None = None) -> dict[str, int]:
        entry = self._context(context)
        spec = self._grammar(grammar)
        return self._new_branch(entry, lambda block: entry.native.branch_adopt(seq, block, params, spec))

    def branch_prune(self, context: int, branch: int, subtree: bool = False) -> list[int]:
        entry = self._context(context)
        freed = [int(h) for h in entry.native.branch_prune(branch, subtree)]
        self._free_blocks(entry, freed)
        return freed

    def branch_retain_only(self, context: int, branch: int) -> list[int]:
        entry = self._context(context)
        freed = [int(h) for h in entry.native.branch_retain_only(branch)]
        self._free_blocks(entry, freed)
        return freed

    def branch_detach(self, context: int, branch: int) -> int:
        entry = self._context(context)
        seq = int(entry.native.branch_detach(branch))
        self._free_blocks(entry, [branch])
        return seq

    def branch_info(self, context: int, branch: int) -> dict[str, Any]:
        return dict(self._context(context).native.branch_info(branch))

    def branch_set_params(self, context: int, branch: int, params: dict[str, Any]) -> None:
        self._context(context).native.branch_set_params(branch, params)

    def branch_set_grammar(self, context: int, branch: int, grammar: dict[str, Any] | None) -> None:
        self._context(context).native.branch_set_grammar(branch, self._grammar(grammar))

    def branch_set_logit_bias(self, context: int, branch: int, bias: Sequence[Sequence[float]] | None) -> None:
        pairs = None if bias is None else [(int(t), float(b)) for t, b in bias]
        self._context(context).native.branch_set_logit_bias(branch, pairs)

    def branch_reseed(self, context: int, branch: int, seed: int) -> None:
        self._context(context).native.branch_reseed(branch, seed)

    def branch_set_logits(self, context: int, branch: int, logits: bytes) -> None:
        self._context(context).native.branch_set_logits(branch, logits)

    def branch_merge_logits(self, context: int, branch: int, experts: Sequence[int], alpha: float) -> None:
        self._context(context).native.branch_merge_logits(branch, list(experts), float(alpha))

    def produce(self, context: int, branches: Sequence[int]) -> list[Any]:
        return list(self._context(context).native.produce(list(branches)))

    # The decoding calls report the time spent inside llama_decode, so a caller can tell its overhead.
    def commit(self, context: int, pairs: Sequence[Sequence[int]], request_id: int = 0) -> dict[str, float]:
        native = self._context(context).native
        native.commit([(int(h), int(t)) for h, t in pairs], request_id)
        return {"decode_ms": native.last_decode_ms}

    def prefill(self, context: int, items: Sequence[Sequence[Any]], request_id: int = 0) -> dict[str, float]:
        entry = self._context(context)
        native = entry.native
        native.prefill([(int(h), self._prompt_tokens(entry, p, bos=False)) for h, p in items], request_id)
        return {"decode_ms": native.last_decode_ms}

    def step(self, context: int, branches: Sequence[int], request_id: int = 0) -> dict[str, Any]:
        native = self._context(context).native
        produced = list(native.step(list(branches), request_id))
        return {"produced": produced, "decode_ms": native.last_decode_ms}

    # -- raw KV sequences -----------------------------------------------------------------------------
    def kv_seq(self, context: int, op: str, args: Sequence[int]) -> Any:
        name = _KV_OPS.get(op)
        if name is None:
            raise ValueError(f"unknown KV operation {op!r} (one of {', '.join(_KV_OPS)})")
        return getattr(self._context(context).native, name)(*[int(a) for a in args])

    def kv_pressure(self, context: int) -> dict[str, int]:
        return dict(self._context(context).native.kv_pressure())

    def state_seq_get(self, context: int, seq: int) -> bytes:
        data = bytes(self._context(context).native.state_seq_get(seq))
        if len(data) > MAX_FRAME - 4096:
            raise ContextError(f"the state of sequence {seq} is {len(data)} bytes, more than one protocol frame "
                               f"carries ({MAX_FRAME}): save it to a file with kv.save_file instead")
        return data

    def state_seq_set(self, context: int, seq: int, data: bytes) -> int:
        return int(self._context(context).native.state_seq_set(seq, data))

    def state_seq_save_file(self, context: int, seq: int, path: str, tokens: Sequence[int] = ()) -> int:
        return int(self._context(context).native.state_seq_save_file(seq, path, list(tokens)))

    def state_seq_load_file(self, context: int, seq: int, path: str) -> dict[str, Any]:
        tokens, n = self._context(context).native.state_seq_load_file(seq, path)
        return {"tokens": list(tokens), "bytes": int(n)}

    def clear_and_reseed(self, context: int, sinks: Sequence[int], tail: Sequence[int],
                         request_id: int = 0) -> dict[str, float]:
        native = self._context(context).native
        native.clear_and_reseed(list(sinks), list(tail), request_id)
        return {"decode_ms": native.last_decode_ms}

    def close(self) -> None:
        for model in list(self._models):
            self.free_model(model)


def _check_gguf_file(path: str) -> None:
    """The cheap checks llama.cpp would otherwise report only as a log line and a null model."""
    if not os.path.exists(path):
        raise ModelLoadError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise ModelLoadError(f"model path is a directory: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc}") from exc
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {path}")


__all__ = ["Engine", "EventSink", "LloyalError"]
