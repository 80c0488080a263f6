"""Branches: forkable generation state on one context, and the context's raw KV sequences.

    ctx = model.new_context(n_ctx=4096, n_seq_max=8)
    root = ctx.branch(prompt_tokens, SamplerParams(temperature=0.8, seed=1))
    kids = [root.fork(reseed=i) for i in range(1, 5)]
    for _ in range(32):
        ctx.branches.step(kids)           # produce for each, then ONE batched decode for all

A Branch is a handle; its state (a KV sequence, sampler chain, grammar, logit bias, perplexity) lives in
the worker. Its logits snapshot lives in the worker's shared memory, so ``branch.logits`` is a numpy view
read with no copy and no round trip. Everything here is a request to the worker except reading logits
and the metrics computed from them (metrics.py).
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import metrics
from ._futures import mapped
from .errors import BranchError, StaleHandleError
from .params import Grammar, SamplerParams
from .protocol import Op

if TYPE_CHECKING:
    from .client import Context

GrammarLike = str | Grammar | None


class Produced(NamedTuple):
    """One sampled token. ``text`` is its piece (bytes of a character split across tokens show as
    U+FFFD here; Branch.iterate() joins them properly). ``is_stop``: an end-of-generation token, or -1
    when the grammar or logit bias allow no token at all."""

    token: int
    text: str
    is_stop: bool
    piece: bytes = b""  # the raw bytes of the token


@dataclass(frozen=True)
class BranchInfo:
    handle: int
    seq: int
    position: int
    fork_head: int
    parent: int  # 0: a root
    children: list[int]
    has_logits: bool
    n_accepted: int
    perplexity: float  # inf before the first committed token
    sampling_perplexity: float
    last_token: int

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> BranchInfo:
        return cls(handle=int(d["handle"]), seq=int(d["seq"]), position=int(d["position"]),
                   fork_head=int(d["fork_head"]), parent=int(d["parent"]), children=[int(c) for c in d["children"]],
                   has_logits=bool(d["has_logits"]), n_accepted=int(d["n_accepted"]),
                   perplexity=float(d["perplexity"]), sampling_perplexity=float(d["sampling_perplexity"]),
                   last_token=int(d["last_token"]))


@dataclass(frozen=True)
class KVPressure:
    n_ctx: int
    cells_used: int  # shared prefixes counted once
    remaining: int
    n_seq_max: int
    seqs_leased: int  # by branches and detached sequences
    seqs_free: int


def _grammar_wire(grammar: GrammarLike) -> dict[str, Any] | None:
    if grammar is None:
        return None
    if isinstance(grammar, str):
        grammar = Grammar(gbnf=grammar)
    return grammar.to_wire()


def _produced(rows: Sequence[Sequence[Any]]) -> list[Produced]:
    return [Produced(int(t), bytes(piece).decode("utf-8", "replace"), bool(stop), bytes(piece))
            for t, piece, stop in rows]


class Branch:
    """One branch of a generation tree. Create roots with Context.branch(), children with fork()."""

    def __init__(self, context: Context, handle: int, logits_offset: int) -> None:
        self.context = context
        self.handle = handle
        self._logits_offset = logits_offset
        self._alive = True

    def __repr__(self) -> str:
        state = "" if self._alive else " released"
        return f"<Branch {self.handle} context={self.context._handle}{state}>"

    # -- plumbing ---------------------------------------------------------------------------------------
    def _live(self) -> int:
        if not self._alive:
            raise StaleHandleError(f"branch {self.handle} was pruned, retained away or detached")
        return self.handle

    def _call(self, op: Op, **args: Any) -> Any:
        return self.context._request(op, branch=self._live(), **args)

    @property
    def alive(self) -> bool:
        return self._alive

    # -- tree ---------------------------------------------------------------------------------------------
    def fork(self, *, reseed: int | None = None) -> Branch:
        """A child at this branch's position that shares its KV prefix (no tensor copy) and starts with a
        copy of its sampler (PRNG and penalty history), grammar state, logit bias, logits and perplexity.
        Unreseeded siblings sample identical tokens: pass ``reseed`` to make them diverge."""
        r = self._call(Op.BRANCH_FORK)
        child = self.context.branches._register(r)
        if reseed is not None:
            child.reseed_sampler(reseed)
        return child

    def prune(self) -> None:
        """Frees this branch and its KV sequence. A branch with live children raises BranchError (use
        prune_subtree)."""
        self.context.branches._released(self._call(Op.BRANCH_PRUNE, subtree=False))

    def prune_subtree(self) -> None:
        """Frees this branch and every descendant."""
        self.context.branches._released(self._call(Op.BRANCH_PRUNE, subtree=True))

    def detach(self) -> int:
        """Releases the handle but keeps its KV sequence, whose id is returned for raw use through
        Context.kv; Context.kv.free(seq) gives it back. Children become roots."""
        seq = int(self._call(Op.BRANCH_DETACH))
        self.context.branches._released([self.handle])
        return seq

    def info(self) -> BranchInfo:
        return BranchInfo.from_wire(self._call(Op.BRANCH_INFO))

    @property
    def position(self) -> int:
        return self.info().position

    @property
    def parent(self) -> Branch | None:
        return self.context.branches._get(self.info().parent)

    @property
    def children(self) -> list[Branch]:
        found = (self.context.branches._get(h) for h in self.info().children)
        return [b for b in found if b is not None]

    @property
    def is_leaf(self) -> bool:
        return not self.info().children

    @property
    def perplexity(self) -> float:
        """exp(mean model surprisal) of the committed tokens, each under the logits before it was decoded."""
        return self.info().perplexity

    @property
    def sampling_perplexity(self) -> float:
        """The same over the distribution the sampler drew from (after grammar, bias and truncation)."""
        return self.info().sampling_perplexity

    # -- sampling and decoding ------------------------------------------------------------------------
    def produce(self) -> Produced:
        """Samples the next token from this branch's logits; changes no KV, grammar or perplexity."""
        return self.context.branches.produce([self])[0]

    def commit(self, token: int) -> None:
        """Accepts token (grammar, penalties, perplexity) and decodes it; the logits become the new row."""
        self.context.branches.commit([(self, token)])

    def prefill(self, tokens: Sequence[int] | str) -> None:
        """Decodes tokens (or text, no BOS added) into this branch, accepting nothing: context, not choices."""
        self.context.branches.prefill([(self, tokens)])

    def step(self) -> Produced:
        """produce(), then commit() unless the token is a stop: one round trip."""
        return self.context.branches.step([self])[0]

    def iterate(self, max_tokens: int | None = None) -> Iterator[Produced]:
        """produce -> commit -> yield, until a stop token (not committed) or max_tokens. Stop at any point
        (break) and fork: everything yielded is committed. ``text`` joins multi-byte characters."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        n = 0
        while max_tokens is None or n < max_tokens:
            p = self.step()
            if p.is_stop:
                return
            n += 1
            yield p._replace(text=decoder.decode(p.piece))

    def __iter__(self) -> Iterator[Produced]:
        return self.iterate()

    # -- sampler, grammar, bias -----------------------------------------------------------------------
    def set_sampler_params(self, params: SamplerParams | None = None, **overrides: Any) -> None:
        """A new sampler chain: its PRNG restarts from params.seed; penalty windows keep their tokens."""
        p = SamplerParams.of(params, overrides)
        self._call(Op.BRANCH_SET_PARAMS, params=p.to_wire())

    def reseed_sampler(self, seed: int) -> None:
        """Reseeds the final draw (greedy chains have none and are left alone)."""
        self._call(Op.BRANCH_RESEED, seed=int(seed))

    def set_grammar(self, grammar: GrammarLike) -> None:
        """GBNF text, a Grammar (JSON schema, lazy triggers), or None to remove. Invalid grammars raise
        GrammarError now. Forks inherit the grammar and its state."""
        self._call(Op.BRANCH_SET_GRAMMAR, grammar=_grammar_wire(grammar))

    def set_logit_bias(self, bias: Mapping[int, float] | None) -> None:
        """Added to the logits before sampling (-inf bans a token); None or {} clears it."""
        pairs = None if not bias else [[int(t), float(b)] for t, b in bias.items()]
        self._call(Op.BRANCH_SET_LOGIT_BIAS, bias=pairs)

    def clear_logit_bias(self) -> None:
        self.set_logit_bias(None)

    # -- logits and metrics ---------------------------------------------------------------------------
    @property
    def logits(self) -> np.ndarray:
        """The logits the next token is sampled from (n_vocab float32): a read-only view of shared memory,
        no copy and no round trip. It follows the branch (each commit rewrites it) and is valid while the
        branch lives; copy it to keep it."""
        self._live()
        proc = self.context._proc
        if not proc.alive:
            raise StaleHandleError(f"branch {self.handle}'s worker is gone")
        return proc.region.floats(self._logits_offset, self.context.model.n_vocab)

    def logits_at(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        return np.array(self.logits[np.asarray(tokens, dtype=np.int64)], dtype=np.float32)

    def set_logits(self, logits: np.ndarray | Sequence[float]) -> None:
        arr = np.ascontiguousarray(logits, dtype=np.float32)
        if arr.shape != (self.context.model.n_vocab,):
            raise ValueError(f"logits must have shape ({self.context.model.n_vocab},), got {arr.shape}")
        self._call(Op.BRANCH_SET_LOGITS, logits=arr.tobytes())

    def merge_logits(self, experts: Sequence[Branch], alpha: float) -> None:
        """self.logits += alpha * sum(expert.logits), in the worker (contrastive / DExperts decoding)."""
        self._call(Op.BRANCH_MERGE_LOGITS, experts=[self.context.branches._own(e) for e in experts],
                   alpha=float(alpha))

    def model_entropy(self, base: str = "nats") -> float:
        return metrics.entropy(self.logits, base)

    def model_surprisal(self, token: int, base: str = "nats", logits: np.ndarray | None = None) -> float:
        return metrics.surprisal(self.logits if logits is None else logits, token, base)


class BranchStore:
    """The branches of one context (``context.branches``) and the operations over many of them."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self._live: dict[int, Branch] = {}
        # Time the worker spent inside llama_decode during the last commit, prefill or step on this
        # context: subtract it from a call's wall time to see what everything else cost.
        self.last_decode_ms = 0.0

    def __iter__(self) -> Iterator[Branch]:
        return iter(list(self._live.values()))

    def __len__(self) -> int:
        return len(self._live)

    # -- registry -------------------------------------------------------------------------------------
    def _register(self, reply: Mapping[str, Any]) -> Branch:
        branch = Branch(self.context, int(reply["branch"]), int(reply["logits_offset"]))
        self._live[branch.handle] = branch
        return branch

    def _released(self, handles: Iterable[int]) -> None:
        for h in handles:
            branch = self._live.pop(int(h), None)
            if branch is not None:
                branch._alive = False

    def _forget_all(self) -> None:
        self._released(list(self._live))

    def _get(self, handle: int) -> Branch | None:
        return self._live.get(handle)

    def _own(self, branch: Branch) -> int:
        if branch.context is not self.context:
            raise BranchError(f"{branch!r} belongs to another context")
        return branch._live()

    def _timed(self, reply: Mapping[str, Any]) -> Mapping[str, Any]:
        self.last_decode_ms = float(reply["decode_ms"])
        return reply

    def _untimed(self, reply: Mapping[str, Any]) -> None:
        self._timed(reply)

    # -- creation -------------------------------------------------------------------------------------
    def create(self, prompt: Sequence[int] | str | None = None, params: SamplerParams | None = None, *,
               grammar: GrammarLike = None, **overrides: Any) -> Branch:
        return self.create_async(prompt, params, grammar=grammar, **overrides).result()

    def create_async(self, prompt: Sequence[int] | str | None = None, params: SamplerParams | None = None, *,
                     grammar: GrammarLike = None, **overrides: Any) -> Future[Branch]:
        p = SamplerParams.of(params, overrides)
        args: dict[str, Any] = {"context": self.context._handle, "params": p.to_wire(),
                                "grammar": _grammar_wire(grammar), "prompt": self._wire_prompt(prompt)}
        return mapped(self.context._decode_call(Op.BRANCH_CREATE, args), self._register)

    def adopt(self, seq: int, params: SamplerParams | None = None, *, grammar: GrammarLike = None,
              **overrides: Any) -> Branch:
        """A root branch over an existing sequence (a detached branch's, or one loaded with kv.load): it
        continues at pos_max + 1. It has no logits until its next prefill or commit."""
        p = SamplerParams.of(params, overrides)
        return self._register(self.context._request(Op.BRANCH_ADOPT, seq=int(seq), params=p.to_wire(),
                                                    grammar=_grammar_wire(grammar)))

    @staticmethod
    def _wire_prompt(prompt: Sequence[int] | str | None) -> str | list[int]:
        # Text is tokenized by the worker, in the same request: no extra round trip.
        if prompt is None:
            return []
        return prompt if isinstance(prompt, str) else [int(t) for t in prompt]

    # -- batched operations ---------------------------------------------------------------------------
    def produce(self, branches: Sequence[Branch]) -> list[Produced]:
        """Samples every branch (one round trip)."""
        return _produced(self.context._request(Op.PRODUCE, branches=[self._own(b) for b in branches]))

    def commit(self, pairs: Iterable[tuple[Branch, int]]) -> None:
        """Commits one token per branch in ONE llama_decode. All or nothing: if the decode fails (KV full:
        DecodeError; interrupt: InterruptedByClient) every branch is exactly as before."""
        self.commit_async(pairs).result()

    def commit_async(self, pairs: Iterable[tuple[Branch, int]]) -> Future[None]:
        wire = [[self._own(b), int(t)] for b, t in pairs]
        return mapped(self.context._decode_call(Op.COMMIT, {"context": self.context._handle, "pairs": wire}),
                      self._untimed)

    def prefill(self, items: Iterable[tuple[Branch, Sequence[int] | str]]) -> None:
        """Decodes a token run into each branch, packed into n_batch chunks. All or nothing."""
        self.prefill_async(items).result()

    def prefill_async(self, items: Iterable[tuple[Branch, Sequence[int] | str]]) -> Future[None]:
        wire = [[self._own(b), self._wire_prompt(toks)] for b, toks in items]
        return mapped(self.context._decode_call(Op.PREFILL, {"context": self.context._handle, "items": wire}),
                      self._untimed)

    def step(self, branches: Sequence[Branch]) -> list[Produced]:
        """produce for every branch, then one batched commit of those whose token is not a stop."""
        return self.step_async(branches).result()

    def step_async(self, branches: Sequence[Branch]) -> Future[list[Produced]]:
        args = {"context": self.context._handle, "branches": [self._own(b) for b in branches]}
        return mapped(self.context._decode_call(Op.STEP, args), lambda r: _produced(self._timed(r)["produced"]))

    def retain_only(self, winner: Branch) -> None:
        """Keeps winner's KV sequence (one llama_memory_seq_keep) and drops every other branch and
        detached sequence; winner becomes a root."""
        self._released(self.context._request(Op.BRANCH_RETAIN_ONLY, branch=self._own(winner)))

    @property
    def available(self) -> int:
        """Sequence ids free to lease (to create or fork a branch)."""
        return self.context.kv.pressure().seqs_free


class KV:
    """Raw operations on the context's KV-cache sequences (``context.kv``). Sequences owned by a branch
    can be read but not written (BranchError): detach the branch first."""

    def __init__(self, context: Context) -> None:
        self.context = context

    def _seq(self, op: str, *args: int) -> Any:
        return self.context._request(Op.KV_SEQ, op=op, args=[int(a) for a in args])

    def copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """dst gets src's cells in [p0, p1) (p1 -1: to the end); shared, not copied."""
        self._seq("cp", src, dst, p0, p1)

    def keep(self, seq: int) -> None:
        self._seq("keep", seq)

    def remove(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        return bool(self._seq("rm", seq, p0, p1))

    def pos_min(self, seq: int) -> int:
        return int(self._seq("pos_min", seq))

    def pos_max(self, seq: int) -> int:
        """Last position in seq, -1 when it is empty."""
        return int(self._seq("pos_max", seq))

    def free(self, seq: int) -> None:
        """Removes a detached sequence's cells and returns its id to the lease pool."""
        self._seq("free", seq)

    def clear(self) -> None:
        """Empties the whole cache: Context.reset() (every branch is released)."""
        self.context.reset()

    def pressure(self) -> KVPressure:
        return KVPressure(**{k: int(v) for k, v in self.context._request(Op.KV_PRESSURE).items()})

    def save(self, seq: int) -> bytes:
        """seq's KV state (llama_state_seq_get_data): that sequence only, never the whole context."""
        return bytes(self.context._request(Op.STATE_SEQ_GET, seq=int(seq)))

    def load(self, seq: int, data: bytes) -> int:
        return int(self.context._request(Op.STATE_SEQ_SET, seq=int(seq), data=bytes(data)))

    def save_file(self, seq: int, path: str | os.PathLike[str], tokens: Sequence[int] = ()) -> int:
        return int(self.context._request(Op.STATE_SEQ_SAVE_FILE, seq=int(seq), path=os.path.abspath(os.fspath(path)),
                                  tokens=[int(t) for t in tokens]))

    def load_file(self, seq: int, path: str | os.PathLike[str]) -> list[int]:
        """Loads seq from a file written by save_file and returns the tokens saved with it."""
        r = self.context._request(Op.STATE_SEQ_LOAD_FILE, seq=int(seq), path=os.path.abspath(os.fspath(path)))
        return [int(t) for t in r["tokens"]]


__all__ = ["KV", "Branch", "BranchInfo", "BranchStore", "KVPressure", "Produced"]
