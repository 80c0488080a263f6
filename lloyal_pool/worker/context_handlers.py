"""The requests on a context itself: creating and freeing it, reading it raw, and lloyal.node's low-level loop.

A context takes an interrupt word of the region (one slot of INTERRUPT_SLOTS, so a worker holds at most
that many) and a block of its bulk area for its logits row; a region too small for one more row is an
error that says how large to make it. Its KV sequences, its decode and sample, and its grammar handles
are served here as the native side has them, with no branch bookkeeping on top.
"""

from __future__ import annotations

import msgspec

from .. import protocol as p
from ..errors import ContextError
from ..params import BufferMemory, KVPressure
from ..shm import BULK_OFFSET, INTERRUPT_OFFSET, INTERRUPT_SLOTS, row_bytes, shm_bytes_for
from .memory_cap import context_lower_bound, memory_cap, name_memory_limit, refuse_over_cap, thread_headroom
from .registry import Call, ContextEntry, ModelEntry, Registry, handles


class ContextHandlers(Registry):
    # -- contexts -------------------------------------------------------------------------------------
    @handles(p.NewContext)
    def new_context(self, req: p.NewContext, call: Call) -> p.ContextCreated:
        entry = self._model(req.model)
        if not self._free_slots:
            raise ContextError(f"a worker holds at most {INTERRUPT_SLOTS} contexts")
        params = req.params
        if self.default_threads and params.get("n_threads") is None:
            params = {**params, "n_threads": self.default_threads}
        cap = memory_cap()
        if cap is not None and self.native.gpu_device_count() == 0:
            # On the CPU every buffer of the context is heap the cap counts (a GPU build's are not).
            refuse_over_cap(cap, context_lower_bound(entry.native.info(), params), "needs at least")
        try:
            native = self.native.Context(entry.native, params, self.arena)
        except self.native.RegionFullError:
            raise self._region_full(entry) from None
        except (ContextError, MemoryError) as exc:
            raise name_memory_limit(exc) from None
        if self.single_threaded:
            native.set_threads(1, 1)
        if cap is not None:
            # The buffers fitted, but the threads llama.cpp starts at the first decode need their stacks
            # under the same cap (past it libgomp exits the worker): refuse now, the context freed.
            refuse_over_cap(cap, thread_headroom(max(native.n_threads, native.n_threads_batch)),
                            "leaves too little for its compute threads, which need")
        slot = self._free_slots.pop()
        self.region.set_interrupt(slot, 0)
        # The native side indexes u64 words from the start of the region.
        native.set_interrupt_word(self.region.view, INTERRUPT_OFFSET // 8 + slot)
        context_id = self._new_id()
        self._contexts[context_id] = ContextEntry(native, req.model, slot)
        entry.contexts.add(context_id)
        return p.ContextCreated(
            context=context_id, interrupt_slot=slot, logits_offset=native.logits_offset, n_vocab=entry.n_vocab,
            n_ctx=native.n_ctx, n_batch=native.n_batch, n_ubatch=native.n_ubatch, n_seq_max=native.n_seq_max,
            n_threads=native.n_threads, pooling=native.pooling)

    def _region_full(self, entry: ModelEntry) -> ContextError:
        """No room in the region for a context's logits row: say how much larger shm_bytes must be."""
        row = row_bytes(entry.n_vocab)
        size = self.region.size
        free = int(self.arena.free_bytes)
        # Enough for one more even when the free bytes are scattered; and the size that holds twice as
        # many rows as now, for an application that keeps adding contexts.
        held = (size - BULK_OFFSET) // row
        return ContextError(
            f"no room for another context in this worker's shared-memory region: each context of this model "
            f"keeps its logits row there ({row} bytes: n_vocab {entry.n_vocab} x 4, rounded up to a page), and "
            f"{free} of its {size} bytes are free ({len(self._contexts)} context(s) here, and branch "
            f"snapshots and embedding results take rows too). Create the Pool with a larger shm_bytes: "
            f"{size + row} holds one more, {shm_bytes_for(entry.n_vocab, 2 * max(held, 1))} about twice as "
            f"many (lloyal_pool.shm_bytes_for(n_vocab, rows))")

    @handles(p.FreeContext)
    def free_context(self, req: p.FreeContext, call: Call) -> None:
        self._free_context(req.context)

    @handles(p.Logits)
    def logits(self, req: p.Logits, call: Call) -> p.LogitsAt:
        entry = self._context(req.context)
        entry.native.write_logits()
        return p.LogitsAt(offset=entry.native.logits_offset, count=self._models[entry.model_id].n_vocab)

    @handles(p.Reset)
    def reset(self, req: p.Reset, call: Call) -> None:
        self._context(req.context).native.reset()  # drops every branch and detached sequence too

    @handles(p.Tokens)
    def tokens(self, req: p.Tokens, call: Call) -> list[int]:
        return list(self._context(req.context).native.tokens())

    @handles(p.NPast)
    def n_past(self, req: p.NPast, call: Call) -> int:
        return int(self._context(req.context).native.n_past())

    @handles(p.MemoryBreakdown)
    def memory_breakdown(self, req: p.MemoryBreakdown, call: Call) -> list[BufferMemory]:
        return [BufferMemory(**row) for row in self._context(req.context).native.memory_breakdown()]

    # -- raw KV sequences -----------------------------------------------------------------------------
    @handles(p.KvCopy)
    def kv_copy(self, req: p.KvCopy, call: Call) -> None:
        self._context(req.context).native.kv_seq_cp(req.src, req.dst, req.p0, req.p1)

    @handles(p.KvKeep)
    def kv_keep(self, req: p.KvKeep, call: Call) -> None:
        self._context(req.context).native.kv_seq_keep(req.seq)

    @handles(p.KvRemove)
    def kv_remove(self, req: p.KvRemove, call: Call) -> bool:
        return bool(self._context(req.context).native.kv_seq_rm(req.seq, req.p0, req.p1))

    @handles(p.KvPosMin)
    def kv_pos_min(self, req: p.KvPosMin, call: Call) -> int:
        return int(self._context(req.context).native.kv_seq_pos_min(req.seq))

    @handles(p.KvPosMax)
    def kv_pos_max(self, req: p.KvPosMax, call: Call) -> int:
        return int(self._context(req.context).native.kv_seq_pos_max(req.seq))

    @handles(p.KvFree)
    def kv_free(self, req: p.KvFree, call: Call) -> None:
        self._context(req.context).native.free_seq(req.seq)

    @handles(p.KvPressureRequest)
    def kv_pressure(self, req: p.KvPressureRequest, call: Call) -> KVPressure:
        return msgspec.convert(self._context(req.context).native.kv_pressure(), KVPressure)

    # -- lloyal.node's low-level loop and grammar handles ---------------------------------------------
    @handles(p.RawDecode)
    def raw_decode(self, req: p.RawDecode, call: Call) -> float:
        return float(self._context(req.context).native.decode(req.tokens, req.pos, req.seq, call.request_id))

    @handles(p.Sample)
    def sample(self, req: p.Sample, call: Call) -> int:
        native = self._context(req.context).native
        return int(native.sample(req.params, req.grammar or None, call.request_id))

    @handles(p.GrammarNew)
    def grammar_new(self, req: p.GrammarNew, call: Call) -> int:
        entry = self._context(req.context)
        return int(entry.native.grammar_new(self._grammar(req.grammar), call.request_id))

    @handles(p.GrammarClone)
    def grammar_clone(self, req: p.GrammarClone, call: Call) -> int:
        return int(self._context(req.context).native.grammar_clone(req.handle))

    @handles(p.GrammarMask)
    def grammar_mask(self, req: p.GrammarMask, call: Call) -> int:
        return int(self._context(req.context).native.grammar_mask(req.handle, call.request_id))

    @handles(p.GrammarAccept)
    def grammar_accept(self, req: p.GrammarAccept, call: Call) -> None:
        self._context(req.context).native.grammar_accept(req.handle, req.token, call.request_id)

    @handles(p.GrammarFree)
    def grammar_free(self, req: p.GrammarFree, call: Call) -> None:
        self._context(req.context).native.grammar_free(req.handle)


__all__ = ["ContextHandlers"]
