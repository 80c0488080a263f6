"""The requests on a context's branches: creating, forking and pruning them, their sampling, and the decodes
that advance them (Commit, Prefill, Step, ClearAndReseed).

A branch's logits snapshot is a block of the shared region that the native side owns: written on every
commit, read in place by the client, freed with the branch. Each request that moves a branch replies with
its new state (BranchState), which the client's handle caches instead of asking again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from .. import protocol as p
from ..errors import InvalidArgumentError, LoraError
from ..params import BranchInfo
from .registry import Call, ContextEntry, Registry, handles


def branch_state(entry: ContextEntry, handle: int, info: dict[str, Any] | None = None) -> p.BranchState:
    """What a client's branch handle caches of the branch, from its native info (read now unless given)."""
    d = entry.native.branch_info(handle) if info is None else info
    return p.BranchState(branch=handle, position=d["position"], n_accepted=d["n_accepted"],
                         perplexity=d["perplexity"], sampling_perplexity=d["sampling_perplexity"])


class BranchHandlers(Registry):
    def _created(self, entry: ContextEntry, created: tuple[int, int]) -> p.BranchCreated:
        handle, offset = created
        info = entry.native.branch_info(handle)
        return p.BranchCreated(logits_offset=offset, state=branch_state(entry, handle, info), parent=info["parent"])

    # -- the tree -------------------------------------------------------------------------------------
    @handles(p.BranchCreate)
    def branch_create(self, req: p.BranchCreate, call: Call) -> p.BranchCreated:
        entry = self._context(req.context)
        spec = self._grammar(req.grammar)
        tokens = self._prompt_tokens(entry, req.prompt, bos=True)
        created = entry.native.branch_create(req.params, spec, call.request_id)
        if tokens:
            try:
                entry.native.prefill([(created[0], tokens)], call.request_id, call.prompt_progress(req.progress))
            except BaseException:
                entry.native.branch_prune(created[0], True)
                raise
        return self._created(entry, created)

    @handles(p.BranchFork)
    def branch_fork(self, req: p.BranchFork, call: Call) -> p.BranchCreated:
        entry = self._context(req.context)
        return self._created(entry, entry.native.branch_fork(req.branch))

    @handles(p.BranchAdopt)
    def branch_adopt(self, req: p.BranchAdopt, call: Call) -> p.BranchCreated:
        entry = self._context(req.context)
        spec = self._grammar(req.grammar)
        return self._created(entry, entry.native.branch_adopt(req.seq, req.params, spec, call.request_id))

    @handles(p.BranchPrune)
    def branch_prune(self, req: p.BranchPrune, call: Call) -> list[int]:
        return self._context(req.context).native.branch_prune(req.branch, req.subtree)

    @handles(p.BranchRetainOnly)
    def branch_retain_only(self, req: p.BranchRetainOnly, call: Call) -> list[int]:
        return self._context(req.context).native.branch_retain_only(req.branch)

    @handles(p.BranchDetach)
    def branch_detach(self, req: p.BranchDetach, call: Call) -> int:
        return self._context(req.context).native.branch_detach(req.branch)

    @handles(p.BranchInfoRequest)
    def branch_info(self, req: p.BranchInfoRequest, call: Call) -> BranchInfo:
        return msgspec.convert(self._context(req.context).native.branch_info(req.branch), BranchInfo)

    # -- sampling -------------------------------------------------------------------------------------
    @handles(p.BranchSetParams)
    def branch_set_params(self, req: p.BranchSetParams, call: Call) -> None:
        self._context(req.context).native.branch_set_params(req.branch, req.params)

    @handles(p.BranchSetGrammar)
    def branch_set_grammar(self, req: p.BranchSetGrammar, call: Call) -> None:
        self._context(req.context).native.branch_set_grammar(req.branch, self._grammar(req.grammar), call.request_id)

    @handles(p.BranchSetLogitBias)
    def branch_set_logit_bias(self, req: p.BranchSetLogitBias, call: Call) -> None:
        self._context(req.context).native.branch_set_logit_bias(req.branch, req.bias)

    @handles(p.BranchReseed)
    def branch_reseed(self, req: p.BranchReseed, call: Call) -> None:
        self._context(req.context).native.branch_reseed(req.branch, req.seed)

    @handles(p.BranchSetLogits)
    def branch_set_logits(self, req: p.BranchSetLogits, call: Call) -> None:
        entry = self._context(req.context)
        # The client checks too; a request that skipped it must not put NaNs into the sampler.
        row = np.frombuffer(req.logits, dtype=np.float32)
        if np.isnan(row).any() or (row == np.inf).any():
            raise InvalidArgumentError("logits must be finite, or -inf to ban a token; got NaN or +inf")
        entry.native.branch_set_logits(req.branch, req.logits)

    @handles(p.BranchMergeLogits)
    def branch_merge_logits(self, req: p.BranchMergeLogits, call: Call) -> None:
        self._context(req.context).native.branch_merge_logits(req.branch, req.experts, req.alpha)

    @handles(p.Produce)
    def produce(self, req: p.Produce, call: Call) -> list[p.Produced]:
        return list(self._context(req.context).native.produce(req.branches, call.request_id))

    @handles(p.BranchSetLogprobs)
    def branch_set_logprobs(self, req: p.BranchSetLogprobs, call: Call) -> None:
        self._context(req.context).native.branch_set_logprobs(req.branch, req.logprobs)

    @handles(p.BranchSetText)
    def branch_set_text(self, req: p.BranchSetText, call: Call) -> None:
        self._context(req.context).native.branch_set_text(req.branch, req.stop, req.render_special, req.logprobs)

    @handles(p.ProduceText)
    def produce_text(self, req: p.ProduceText, call: Call) -> list[p.TextProduced]:
        return list(self._context(req.context).native.produce_text(req.branches, call.request_id))

    # -- decoding -------------------------------------------------------------------------------------
    # The decoding calls report the time spent inside llama_decode, so a caller can tell its overhead,
    # and the state of every branch they changed, which the client's handles cache.
    def _decoded(self, entry: ContextEntry, handles: Sequence[int]) -> p.Decoded:
        return p.Decoded(decode_ms=entry.native.last_decode_ms, states=[branch_state(entry, h) for h in handles])

    @handles(p.Commit)
    def commit(self, req: p.Commit, call: Call) -> p.Decoded:
        entry = self._context(req.context)
        entry.native.commit(req.pairs, call.request_id)
        return self._decoded(entry, [h for h, _ in req.pairs])

    @handles(p.Prefill)
    def prefill(self, req: p.Prefill, call: Call) -> p.Decoded:
        entry = self._context(req.context)
        loras = None
        if req.loras is not None:
            # A request's own adapter that was closed meanwhile fails that request (LoraError), not the
            # context as a stale handle would say.
            missing = [h for h, _ in req.loras if h not in self._loras]
            if missing:
                raise LoraError(f"LoRA adapter handle(s) {missing} are not loaded in this worker (closed, or freed "
                                f"with their model)")
            loras = [(self._loras[h].native, float(scale)) for h, scale in req.loras]
        entry.native.prefill([(h, self._prompt_tokens(entry, toks, bos=False)) for h, toks in req.items],
                             call.request_id, call.prompt_progress(req.progress), req.commits, loras)
        return self._decoded(entry, [h for h, _ in req.items] + [h for h, _ in req.commits])

    @handles(p.Step)
    def step(self, req: p.Step, call: Call) -> p.Stepped:
        entry = self._context(req.context)
        produced = list(entry.native.step(req.branches, call.request_id))
        committed = [h for h, (_, _, stop, _) in zip(req.branches, produced, strict=True) if not stop]
        done = self._decoded(entry, committed)
        return p.Stepped(decode_ms=done.decode_ms, states=done.states, produced=produced)

    @handles(p.ClearAndReseed)
    def clear_and_reseed(self, req: p.ClearAndReseed, call: Call) -> p.Decoded:
        entry = self._context(req.context)
        entry.native.clear_and_reseed(req.sinks, req.tail, call.request_id)
        return self._decoded(entry, entry.native.branches())


__all__ = ["BranchHandlers", "branch_state"]
