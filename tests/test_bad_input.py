"""Bad input gets a typed error and the worker keeps serving.

The catalogue below goes through the public API only: each case is one call that must raise a LloyalError
(most of them also the fitting built-in ValueError or TypeError), after which the worker must still
answer. Cases share one model, one generation context and one branch context (module fixtures), so the
whole file stays fast; the few that need a pool or a file of their own make it.
"""

from __future__ import annotations

import gc
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tinymodel import make_not_gguf, make_truncated

from lloyal_pool import (
    BranchError,
    Context,
    ContextError,
    ContextOverflowError,
    GenerateParams,
    Grammar,
    GrammarError,
    InvalidArgumentError,
    InvalidTokenError,
    LloyalError,
    LoraError,
    Model,
    ModelLoadError,
    Pool,
    SamplerParams,
    StaleHandleError,
    StateError,
    shm_bytes_for,
)
from lloyal_pool import protocol as p
from lloyal_pool.errors import BadRequestError
from lloyal_pool.shm import BULK_OFFSET, MIN_SIZE, available_memory, row_bytes

N_VOCAB = 32000  # the tiny model's vocabulary (tests/tinymodel.py)


def _still_serving(model: Model) -> None:
    ctx = model.new_context(n_ctx=64)
    try:
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2
    finally:
        ctx.close()


# -- the shared things a case works on -------------------------------------------------------------------
@dataclass
class Env:
    pool: Pool
    model: Model
    ctx: Context  # a generation context (sequence mode), empty between cases
    bctx: Context  # a branch context, n_seq_max 4, no branch between cases
    ectx: Context  # an embedding context
    files: Path
    fifo: Path
    state: bytes  # a valid saved state of ctx's model

    def answers(self) -> None:
        """The worker is alive and serving: a round trip, a tokenize, and a decode on the shared context."""
        self.model.instance.ping()
        assert self.model.tokenize("Hi")
        assert self.ctx.eval([1, 15043]).n_tokens == 2
        self.ctx.reset()


@pytest.fixture(scope="module")
def env(pool: Pool, tiny: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    files = tmp_path_factory.mktemp("bad_input")
    fifo = files / "model.fifo"
    os.mkfifo(fifo)
    ctx = tiny.new_context(n_ctx=64)
    ctx.eval([1, 15043, 29892])
    state = ctx.save_state()
    ctx.reset()
    bctx = tiny.new_context(n_ctx=64, n_seq_max=4)
    ectx = tiny.new_context(n_ctx=64, embeddings=True, pooling="mean")
    yield Env(pool, tiny, ctx, bctx, ectx, files, fifo, state)
    for c in (ctx, bctx, ectx):
        c.close()


@pytest.fixture
def clean(env: Env) -> Iterator[Env]:
    yield env
    for b in list(env.bctx.branches):
        if b.alive and b.parent is None:
            b.prune_subtree()
    env.ctx.reset()
    env.answers()


Case = Callable[[Env], object]


def _root(e: Env, tokens: tuple[int, ...] = (1, 15043)) -> Any:
    return e.bctx.branch(list(tokens))


def _fork_pair(e: Env) -> tuple[Any, Any]:
    root = _root(e)
    return root, root.fork()


# -- token ids, at every entry that takes them ------------------------------------------------------------
BAD_IDS: list[tuple[str, object, type[LloyalError]]] = [
    ("negative", -1, InvalidTokenError),
    ("n_vocab", N_VOCAB, InvalidTokenError),
    ("huge", 10**7, InvalidTokenError),
    ("past_int32", 2**40, InvalidTokenError),
    ("float", 818.9, InvalidTokenError),
    ("integral_float", 2.0, InvalidTokenError),
    ("bool", True, InvalidTokenError),
    ("str", "5", InvalidTokenError),
    ("none", None, InvalidTokenError),
    ("np_float", np.float32(3), InvalidTokenError),
]

TOKEN_ENTRIES: list[tuple[str, Callable[[Env, object], object]]] = [
    ("generate", lambda e, t: e.ctx.generate([1, t], n_predict=1)),
    ("stream", lambda e, t: e.ctx.stream([1, t], n_predict=1)),
    ("eval", lambda e, t: e.ctx.eval([1, t])),
    ("detokenize", lambda e, t: e.model.detokenize([t])),
    ("token_to_piece", lambda e, t: e.model.token_to_piece(t)),  # type: ignore[arg-type]
    ("score", lambda e, t: e.ctx.score([1, t, 2])),
    ("score_choices", lambda e, t: e.ctx.score_choices([[t]])),
    ("branch_prompt", lambda e, t: e.bctx.branch([1, t])),
    ("prefill", lambda e, t: _root(e).prefill([t])),
    ("commit", lambda e, t: _root(e).commit(t)),  # type: ignore[arg-type]
    ("logits_at", lambda e, t: _root(e).logits_at([t])),  # type: ignore[list-item]
    ("logit_bias_key", lambda e, t: e.ctx.generate("Hi", n_predict=1, logit_bias={t: 1.0})),
    ("branch_logit_bias_key", lambda e, t: _root(e).set_logit_bias({t: 1.0})),  # type: ignore[dict-item]
    ("trigger_tokens", lambda e, t: e.ctx.generate("Hi", n_predict=1, grammar=Grammar(
        gbnf='root ::= "a"', lazy=True, trigger_tokens=[t]))),  # type: ignore[list-item]
]


@pytest.mark.parametrize(("entry", "call"), TOKEN_ENTRIES, ids=[n for n, _ in TOKEN_ENTRIES])
@pytest.mark.parametrize(("kind", "bad", "error"), BAD_IDS, ids=[k for k, _, _ in BAD_IDS])
def test_bad_token_ids_are_refused(clean: Env, entry: str, call: Callable[[Env, object], object], kind: str,
                                   bad: object, error: type[LloyalError]) -> None:
    with pytest.raises(error):
        call(clean, bad)
    assert clean.ctx.tokens() == []  # nothing was decoded


def test_numpy_integer_ids_are_token_ids(clean: Env) -> None:
    e = clean
    ids = np.array([1, 15043], dtype=np.int32)
    assert e.ctx.generate(ids, n_predict=2).n_prompt == 2
    assert e.ctx.generate([np.int64(1), np.uint16(15043)], n_predict=1).n_prompt == 2
    assert e.model.detokenize(np.array([15043], dtype=np.uint32)) == e.model.detokenize([15043])
    with pytest.raises(InvalidTokenError, match="integers"):
        e.ctx.generate(np.array([1.0, 2.0]), n_predict=1)
    with pytest.raises(InvalidTokenError, match="integers"):
        e.ctx.generate(np.array([True, False]), n_predict=1)


def test_a_float_token_id_is_refused_not_truncated(clean: Env) -> None:
    with pytest.raises(InvalidTokenError, match=r"818\.9"):
        clean.ctx.generate([2, 818.9], n_predict=4)  # type: ignore[list-item]
    assert clean.ctx.tokens() == []


# -- prompts of the wrong kind -----------------------------------------------------------------------------
BAD_PROMPTS: list[tuple[str, object, type[LloyalError]]] = [
    ("bytes", b"Hello", BadRequestError),
    ("bytearray", bytearray(b"Hello"), BadRequestError),
    ("memoryview", memoryview(b"Hello"), BadRequestError),
    ("none", None, BadRequestError),
    ("int", 5, BadRequestError),
    ("float", 3.5, BadRequestError),
    ("dict", {1: 2}, BadRequestError),
    ("set", {1, 2}, BadRequestError),
    ("array_2d", np.ones((2, 2), dtype=np.int32), BadRequestError),
    ("float_list", [1.0, 2.5], InvalidTokenError),
    ("lone_surrogate", "Hi \ud800 there", InvalidArgumentError),  # not Unicode: it cannot be sent as text
]
PROMPT_ENTRIES: list[tuple[str, Callable[[Env, object], object]]] = [
    ("generate", lambda e, x: e.ctx.generate(x, n_predict=1)),  # type: ignore[arg-type]
    ("eval", lambda e, x: e.ctx.eval(x)),  # type: ignore[arg-type]
    ("score", lambda e, x: e.ctx.score(x)),  # type: ignore[arg-type]
    ("branch", lambda e, x: e.bctx.branch(x)),  # type: ignore[arg-type]
    ("generate_with_draft", lambda e, x: e.ctx.generate_with_draft(x, n_predict=1)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("entry", "call"), PROMPT_ENTRIES, ids=[n for n, _ in PROMPT_ENTRIES])
@pytest.mark.parametrize(("kind", "bad", "error"), BAD_PROMPTS, ids=[k for k, _, _ in BAD_PROMPTS])
def test_bad_prompts_are_refused(clean: Env, entry: str, call: Callable[[Env, object], object], kind: str,
                                 bad: object, error: type[LloyalError]) -> None:
    if entry == "branch" and kind == "none":
        call(clean, bad)  # a branch without a prompt is a branch at position 0
        return
    with pytest.raises(error):
        call(clean, bad)
    assert clean.ctx.tokens() == []


def test_a_bytes_prompt_is_not_taken_as_token_ids(clean: Env) -> None:
    with pytest.raises(BadRequestError, match="decode it"):
        clean.ctx.generate(b"Hi", n_predict=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # BadRequestError is a TypeError too
        clean.ctx.generate(b"Hi", n_predict=2)  # type: ignore[arg-type]


# -- sampler and generation parameters -------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
BAD_PARAMS: list[tuple[str, dict[str, Any], type[LloyalError]]] = [
    ("seed_negative", {"seed": -1}, InvalidArgumentError),
    ("seed_random_marker", {"seed": 2**32 - 1}, InvalidArgumentError),
    ("temperature_nan", {"temperature": NAN}, InvalidArgumentError),
    ("top_p_inf", {"top_p": INF}, InvalidArgumentError),
    ("min_p_nan", {"min_p": NAN}, InvalidArgumentError),
    ("typical_p_-inf", {"typical_p": -INF}, InvalidArgumentError),
    ("repeat_penalty_nan", {"repeat_penalty": NAN}, InvalidArgumentError),
    ("dry_multiplier_inf", {"dry_multiplier": INF}, InvalidArgumentError),
    ("mirostat_tau_nan", {"mirostat_tau": NAN}, InvalidArgumentError),
    ("dry_breakers_str", {"dry_sequence_breakers": "abc"}, BadRequestError),
    ("unknown_field", {"n_predcit": 3}, BadRequestError),
    ("logit_bias_list", {"logit_bias": [1, 2]}, BadRequestError),
    ("logit_bias_nan", {"logit_bias": {5: NAN}}, InvalidArgumentError),
    ("logit_bias_+inf", {"logit_bias": {5: INF}}, InvalidArgumentError),
    ("logit_bias_str_value", {"logit_bias": {5: "x"}}, BadRequestError),
    ("logit_bias_bool_value", {"logit_bias": {5: True}}, BadRequestError),
    ("logit_bias_float_key", {"logit_bias": {5.5: 1.0}}, InvalidTokenError),
    ("stop_str", {"stop": "x"}, BadRequestError),
    ("stop_empty", {"stop": [""]}, InvalidArgumentError),
    # Types, refused by the client: the batcher reads n_predict, stop and the flags itself.
    ("top_k_float", {"top_k": 1.5}, BadRequestError),
    ("top_k_str", {"top_k": "5"}, BadRequestError),
    ("n_predict_str", {"n_predict": "10"}, BadRequestError),
    ("n_predict_float", {"n_predict": 2.5}, BadRequestError),
    ("n_predict_bool", {"n_predict": True}, BadRequestError),
    ("seed_str", {"seed": "1"}, BadRequestError),
    ("temperature_str", {"temperature": "hot"}, BadRequestError),
    ("top_p_bool", {"top_p": True}, BadRequestError),
    ("ignore_eos_int", {"ignore_eos": 1}, BadRequestError),
    ("render_special_str", {"render_special": "yes"}, BadRequestError),
    ("stop_ints", {"stop": [1, 2]}, BadRequestError),
    ("stop_int", {"stop": 5}, BadRequestError),
    ("grammar_int", {"grammar": 5}, BadRequestError),
    ("dry_breakers_ints", {"dry_sequence_breakers": [1]}, BadRequestError),
]


@pytest.mark.parametrize(("kw", "error"), [(kw, err) for _, kw, err in BAD_PARAMS], ids=[n for n, _, _ in BAD_PARAMS])
def test_bad_generate_params_are_refused(clean: Env, kw: dict[str, Any], error: type[LloyalError]) -> None:
    with pytest.raises(error):
        clean.ctx.generate("Hi", **{"n_predict": 1, **kw})
    assert clean.ctx.tokens() == []


# Values of the right type but out of range: the worker's native checks refuse them.
BAD_NATIVE_PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("top_k_negative", {"top_k": -1}),
    ("min_p_above_1", {"min_p": 1.5}),
    ("mirostat_3", {"mirostat": 3}),
    ("xtc_probability_2", {"xtc_probability": 2.0}),
    ("temperature_huge", {"temperature": 1e300}),
    ("repeat_last_n_-2", {"repeat_last_n": -2}),
    ("dry_allowed_length_negative", {"dry_allowed_length": -1}),
]


@pytest.mark.parametrize("kw", [kw for _, kw in BAD_NATIVE_PARAMS], ids=[n for n, _ in BAD_NATIVE_PARAMS])
def test_out_of_range_sampler_values_are_refused_by_the_worker(clean: Env, kw: dict[str, Any]) -> None:
    with pytest.raises((InvalidArgumentError, BadRequestError)):
        clean.ctx.generate("Hi", **{"n_predict": 1, **kw})
    with pytest.raises((InvalidArgumentError, BadRequestError)):
        _root(clean).set_sampler_params(**{k: v for k, v in kw.items() if k != "n_predict"} or {"top_k": -1})
    assert clean.ctx.tokens() == []


def test_logit_bias_that_is_a_list_is_a_typed_error(clean: Env) -> None:
    with pytest.raises(BadRequestError, match="logit_bias"):
        GenerateParams(logit_bias=[1, 2])  # type: ignore[arg-type]
    # -inf bans a token: a legitimate bias, and the banned token is never chosen.
    banned = clean.ctx.generate("Hi", n_predict=1).tokens[0]
    other = clean.ctx.generate("Hi", n_predict=1, logit_bias={banned: -INF}).tokens[0]
    assert other != banned


# -- grammars --------------------------------------------------------------------------------------------
BAD_GRAMMARS: list[tuple[str, Callable[[], object], type[LloyalError]]] = [
    ("unclosed_paren", lambda: 'root ::= "a" | ( ', GrammarError),
    ("undefined_rule", lambda: "root ::= missing", GrammarError),
    ("no_root", lambda: 'start ::= "a"', GrammarError),
    ("unterminated_string", lambda: 'root ::= "abc', GrammarError),
    ("bad_json_schema", lambda: Grammar(json_schema='{"type": "object", "properties": 7}'), GrammarError),
    ("json_schema_not_json", lambda: Grammar(json_schema="{not json"), GrammarError),
    ("bad_trigger_pattern", lambda: Grammar(gbnf='root ::= "a"', lazy=True, trigger_patterns=["(unclosed"]),
     GrammarError),
    ("lazy_without_triggers", lambda: Grammar(gbnf='root ::= "a"', lazy=True), GrammarError),
    ("both_gbnf_and_schema", lambda: Grammar(gbnf='root ::= "a"', json_schema="{}"), GrammarError),
    ("neither", lambda: Grammar(), GrammarError),
    ("trigger_words_str", lambda: Grammar(gbnf='root ::= "a"', lazy=True, trigger_words="word"), BadRequestError),
    ("lazy_with_prefill", lambda: Grammar(gbnf='root ::= "a"', lazy=True, trigger_words=["a"], prefill="x"),
     GrammarError),
]


@pytest.mark.parametrize(("make", "error"), [(m, err) for _, m, err in BAD_GRAMMARS],
                         ids=[n for n, _, _ in BAD_GRAMMARS])
@pytest.mark.parametrize("where", ["generate", "branch"])
def test_bad_grammars_are_refused(clean: Env, make: Callable[[], object], error: type[LloyalError],
                                  where: str) -> None:
    with pytest.raises(error):
        grammar = make()
        if where == "generate":
            clean.ctx.generate("Hi", n_predict=2, grammar=grammar)
        else:
            _root(clean).set_grammar(grammar)  # type: ignore[arg-type]
    assert clean.ctx.tokens() == []


# -- branch misuse ---------------------------------------------------------------------------------------
def _foreign_branch(e: Env) -> object:
    other = e.model.new_context(n_ctx=32)
    try:
        b = other.branch([1])
        return _root(e).merge_logits([b], 1.0)
    finally:
        other.close()


def _pruned(e: Env) -> Any:
    b = _root(e)
    b.prune()
    return b


def _nan_logits(n: int) -> np.ndarray:
    z = np.zeros(n, dtype=np.float32)
    z[7] = np.nan
    return z


def _pos_inf_logits(n: int) -> np.ndarray:
    z = np.zeros(n, dtype=np.float32)
    z[7] = np.inf
    return z


def _no_free_sequence(e: Env) -> object:
    roots = [_root(e) for _ in range(4)]
    return roots[0].fork()


BRANCH_MISUSE: list[tuple[str, Case, type[LloyalError]]] = [
    ("prune_with_children", lambda e: _fork_pair(e)[0].prune(), BranchError),
    ("same_branch_twice_in_commit", lambda e: e.bctx.branches.commit([(b := _root(e), 5), (b, 6)]), BranchError),
    ("same_branch_twice_in_step", lambda e: e.bctx.branches.step([b := _root(e), b]), BranchError),
    ("no_free_sequence", _no_free_sequence, BranchError),
    ("foreign_branch_merge", _foreign_branch, BranchError),
    ("not_a_branch_in_produce", lambda e: e.bctx.branches.produce([5]), BadRequestError),  # type: ignore[list-item]
    ("not_a_branch_in_merge", lambda e: _root(e).merge_logits([None], 1.0), BadRequestError),  # type: ignore[list-item]
    ("pruned_step", lambda e: _pruned(e).step(), StaleHandleError),
    ("pruned_logits", lambda e: _pruned(e).logits, StaleHandleError),
    ("pruned_fork", lambda e: _pruned(e).fork(), StaleHandleError),
    ("pruned_commit", lambda e: _pruned(e).commit(5), StaleHandleError),
    ("set_logits_short", lambda e: _root(e).set_logits(np.zeros(10, dtype=np.float32)), InvalidArgumentError),
    ("set_logits_2d", lambda e: _root(e).set_logits(np.zeros((2, N_VOCAB), dtype=np.float32)),
     InvalidArgumentError),
    ("set_logits_nan", lambda e: _root(e).set_logits(_nan_logits(N_VOCAB)), InvalidArgumentError),
    ("set_logits_+inf", lambda e: _root(e).set_logits(_pos_inf_logits(N_VOCAB)), InvalidArgumentError),
    ("set_logits_overflowing_float64", lambda e: _root(e).set_logits(np.full(N_VOCAB, 1e39)), InvalidArgumentError),
    ("set_logits_strings", lambda e: _root(e).set_logits(["a"] * N_VOCAB), BadRequestError),
    ("merge_alpha_nan", lambda e: _root(e).merge_logits([_root(e)], NAN), InvalidArgumentError),
    ("merge_alpha_inf", lambda e: _root(e).merge_logits([_root(e)], INF), InvalidArgumentError),
    ("merge_alpha_str", lambda e: _root(e).merge_logits([_root(e)], "1"), BadRequestError),  # type: ignore[arg-type]
    ("merge_without_logits", lambda e: e.bctx.branch().merge_logits([_root(e)], 1.0), BranchError),
    ("kv_free_of_a_branch_seq", lambda e: e.bctx.kv.free(_root(e).info().seq), BranchError),
    ("kv_copy_into_a_branch_seq", lambda e: e.bctx.kv.copy(0, _root(e).info().seq), BranchError),
    ("adopt_a_leased_seq", lambda e: e.bctx.branches.adopt(_root(e).info().seq), BranchError),
    ("grammar_refuses_commit", lambda e: e.bctx.branch([1], grammar='root ::= "yes"').commit(2), GrammarError),
    ("reseed_negative", lambda e: _root(e).reseed_sampler(-1), InvalidArgumentError),
    ("branch_on_sequence_history", lambda e: (e.ctx.eval([1, 2]), e.ctx.branch([1]))[1], ContextError),
]


@pytest.mark.parametrize(("case", "error"), [(c, err) for _, c, err in BRANCH_MISUSE],
                         ids=[n for n, _, _ in BRANCH_MISUSE])
def test_branch_misuse(clean: Env, case: Case, error: type[LloyalError]) -> None:
    with pytest.raises(error):
        case(clean)


def test_values_the_wire_cannot_carry_are_refused_naming_the_argument(clean: Env) -> None:
    # A seed past 64 bits, a stop string that is not Unicode: the caller's mistake, named, not a broken frame.
    with pytest.raises(InvalidArgumentError, match=r"seed must be in \[0, "):
        _root(clean).reseed_sampler(2**64)
    with pytest.raises(InvalidArgumentError, match="stop"):
        clean.ctx.generate("Hi", n_predict=1, stop=["\udfff"])
    with pytest.raises(InvalidArgumentError, match="text"):
        clean.model.tokenize("\ud800")
    clean.answers()


def test_set_logits_takes_minus_inf_as_a_ban(clean: Env) -> None:
    b = _root(clean)
    z = np.array(b.logits, dtype=np.float32)
    best = int(np.argmax(z))
    z[best] = -np.inf
    b.set_logits(z)
    assert b.produce().token != best
    z[:] = -np.inf  # nothing allowed: a stop, not a NaN draw
    b.set_logits(z)
    assert b.produce().is_stop


def test_merge_logits_keeps_bans_and_makes_no_nan(clean: Env) -> None:
    dst, expert = _root(clean), _root(clean)
    z = np.array(expert.logits, dtype=np.float32)
    z[:100] = -np.inf
    expert.set_logits(z)
    for alpha in (-1.0, 0.0, 2.0):
        dst.merge_logits([expert], alpha)
        merged = dst.logits
        assert not np.isnan(merged).any() and not (merged == np.inf).any()
        assert (merged[:100] == -np.inf).all()
    assert dst.produce().token >= 100
    big = _root(clean)
    big.set_logits(np.full(N_VOCAB, 3e38, dtype=np.float32))
    big.merge_logits([big], 1.0)  # 3e38 + 3e38 overflows float32: clamped, not +inf
    assert np.isfinite(big.logits).all()


def test_the_worker_refuses_nan_logits_that_skipped_the_client(clean: Env) -> None:
    b = _root(clean)
    row = _nan_logits(N_VOCAB).tobytes()
    call = clean.bctx._link.call(p.BranchSetLogits(context=clean.bctx.handle, branch=b.handle, logits=row))
    with pytest.raises(InvalidArgumentError):
        call.result()


def test_branch_logits_are_stale_once_the_model_is_closed(pool: Pool, tiny_model: Path) -> None:
    model = pool[1].load_model(tiny_model)
    branch = model.new_context(n_ctx=32).branch([1, 2])  # the Context handle itself is not kept
    gc.collect()
    assert branch.logits.shape == (N_VOCAB,)
    model.close()
    with pytest.raises(StaleHandleError):
        branch.logits  # noqa: B018
    with pytest.raises(StaleHandleError):
        branch.logits_at([1])
    with pytest.raises(StaleHandleError):
        branch.model_entropy()


# -- state blobs -----------------------------------------------------------------------------------------
def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


STATE_BLOBS: list[tuple[str, Callable[[bytes], bytes]]] = [
    ("empty", lambda s: b""),
    ("garbage", lambda s: b"not a state at all" * 10),
    ("header_only", lambda s: s[:32]),
    ("truncated_half", lambda s: s[: len(s) // 2]),
    ("truncated_last_byte", lambda s: s[:-1]),
    ("flipped_magic", lambda s: _flip(s, 0)),
    ("flipped_middle", lambda s: _flip(s, len(s) // 2)),
    ("flipped_last", lambda s: _flip(s, len(s) - 1)),
    ("zeros", lambda s: bytes(len(s))),
    ("extended", lambda s: s + b"\0" * 64),
]


@pytest.mark.parametrize("mangle", [m for _, m in STATE_BLOBS], ids=[n for n, _ in STATE_BLOBS])
def test_bad_state_blobs_are_refused(clean: Env, mangle: Callable[[bytes], bytes]) -> None:
    clean.ctx.eval([1, 15043])
    with pytest.raises(StateError):
        clean.ctx.load_state(mangle(clean.state))
    assert clean.ctx.tokens() == [1, 15043]  # left as it was


STATE_PATHS: list[tuple[str, Callable[[Env], object], type[LloyalError]]] = [
    ("load_missing", lambda e: e.ctx.load_state_file(e.files / "missing.state"), StateError),
    ("load_fifo", lambda e: e.ctx.load_state_file(e.fifo), StateError),
    ("load_dev_zero", lambda e: e.ctx.load_state_file("/dev/zero"), StateError),
    ("load_directory", lambda e: e.ctx.load_state_file(e.files), StateError),
    ("kv_load_file_fifo", lambda e: e.bctx.kv.load_file(0, e.fifo), StateError),
    ("kv_load_file_dev_zero", lambda e: e.bctx.kv.load_file(0, "/dev/zero"), StateError),
    ("kv_save_file_fifo", lambda e: e.bctx.kv.save_file(_root(e).info().seq, e.fifo), StateError),
    ("kv_load_garbage", lambda e: e.bctx.kv.load(_root(e, ()).info().seq, b"garbage"), ContextError),
    ("save_state_of_empty_context", lambda e: e.ctx.save_state(), ContextError),
    ("save_state_with_branches", lambda e: (_root(e), e.bctx.save_state()), ContextError),
]


@pytest.mark.parametrize(("case", "error"), [(c, err) for _, c, err in STATE_PATHS], ids=[n for n, _, _ in STATE_PATHS])
def test_bad_state_files_and_calls(clean: Env, case: Case, error: type[LloyalError]) -> None:
    with pytest.raises(error):
        case(clean)


# -- model and adapter files -----------------------------------------------------------------------------
def _socket_file(e: Env) -> Path:
    path = e.files / "model.sock"
    if not path.exists():
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    return path


def _symlink(e: Env, name: str, target: str | Path) -> Path:
    path = e.files / name
    if not path.is_symlink():
        path.symlink_to(target)
    return path


def _file(e: Env, name: str, data: bytes) -> Path:
    path = e.files / name
    path.write_bytes(data)
    return path


MODEL_FILES: list[tuple[str, Callable[[Env], str | Path]]] = [
    ("missing", lambda e: e.files / "nope.gguf"),
    ("directory", lambda e: e.files),
    ("fifo", lambda e: e.fifo),
    ("dev_zero", lambda e: "/dev/zero"),
    ("dev_null", lambda e: "/dev/null"),
    ("dev_urandom", lambda e: "/dev/urandom"),
    ("socket", _socket_file),
    ("link_to_fifo", lambda e: _symlink(e, "fifo.link", e.fifo)),
    ("link_to_dev_zero", lambda e: _symlink(e, "zero.link", "/dev/zero")),
    ("dangling_link", lambda e: _symlink(e, "dangling.link", e.files / "absent")),
    ("empty_file", lambda e: _file(e, "empty.gguf", b"")),
    ("not_gguf", lambda e: make_not_gguf(e.files / "junk.gguf")),
    ("magic_only", lambda e: _file(e, "magic.gguf", b"GGUF")),
    ("bad_version", lambda e: _file(e, "version.gguf", b"GGUF" + struct.pack("<I", 999) + bytes(16))),
    ("huge_tensor_count", lambda e: _file(e, "count.gguf", b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0))),
]


@pytest.mark.parametrize("make", [m for _, m in MODEL_FILES], ids=[n for n, _ in MODEL_FILES])
def test_bad_model_files(clean: Env, make: Callable[[Env], str | Path]) -> None:
    with pytest.raises(ModelLoadError):
        clean.model.instance.load_model(make(clean))


@pytest.mark.parametrize("make", [m for _, m in MODEL_FILES], ids=[n for n, _ in MODEL_FILES])
def test_bad_lora_files(clean: Env, make: Callable[[Env], str | Path]) -> None:
    with pytest.raises(LoraError):
        clean.model.load_lora(make(clean))


def test_a_fifo_or_a_device_is_named_as_such(clean: Env) -> None:
    with pytest.raises(ModelLoadError, match=r"FIFO \(named pipe\), not a regular file"):
        clean.model.instance.load_model(_symlink(clean, "fifo3.link", clean.fifo))  # the link is followed
    with pytest.raises(ModelLoadError, match="character device"):
        clean.model.instance.load_model("/dev/zero")


@pytest.mark.parametrize("path", ["fifo", "/dev/zero", "link"])
def test_the_worker_itself_refuses_what_is_not_a_regular_file(clean: Env, path: str) -> None:
    # Past the client's own check: the request as another client would send it. Without the worker's
    # check a FIFO blocks its open for ever and /dev/zero never ends its read.
    target = {"fifo": str(clean.fifo), "link": str(_symlink(clean, "fifo2.link", clean.fifo))}.get(path, path)
    proc = clean.model.instance._proc
    with pytest.raises(ModelLoadError, match="not a regular file"):
        proc.call(p.LoadModel(path=target)).result(timeout=60)
    with pytest.raises(LoraError, match="not a regular file"):
        proc.call(p.LoadLora(model=clean.model._handle, path=target)).result(timeout=60)


def test_missing_model_file(pool: Pool, tiny: Model, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        pool[1].load_model(tmp_path / "nope.gguf")
    _still_serving(tiny)


def test_file_that_is_not_gguf(pool: Pool, tiny: Model, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        pool[1].load_model(make_not_gguf(tmp_path / "junk.gguf"))
    _still_serving(tiny)


@pytest.mark.parametrize("keep", [4, 64, 4096, "most"])
def test_truncated_gguf(pool: Pool, tiny: Model, tiny_model: Path, tmp_path: Path, keep: int | str) -> None:
    size = tiny_model.stat().st_size
    nbytes = size - 1000 if keep == "most" else int(keep)
    with pytest.raises(ModelLoadError):
        pool[1].load_model(make_truncated(tiny_model, tmp_path / "cut.gguf", nbytes))
    _still_serving(tiny)


# -- context parameters ----------------------------------------------------------------------------------
BAD_CONTEXT_PARAMS: list[dict[str, Any]] = [
    {"n_ctx": -1}, {"n_ctx": 1.5}, {"n_ctx": "64"}, {"n_ctx": 2**40}, {"n_batch": 0}, {"n_batch": -1},
    {"n_ubatch": -5}, {"n_ubatch": 0}, {"n_seq_max": 0}, {"n_seq_max": 10**6}, {"n_threads": -2},
    {"n_threads": 0}, {"n_threads": 10**6}, {"n_threads_batch": -1}, {"type_k": "not-a-type"},
    {"type_v": "bogus"}, {"flash_attn": "maybe"}, {"rope_freq_base": NAN}, {"rope_freq_scale": INF},
    {"rope_freq_base": -1.0}, {"pooling": "mean"}, {"embeddings": True, "pooling": "average"},
    {"n_batch": 2, "n_seq_max": 5}, {"swa_full": "yes"}, {"adapt_threads": "no"}, {"adapt_threads": 0},
]


@pytest.mark.parametrize("params", BAD_CONTEXT_PARAMS, ids=[repr(x) for x in BAD_CONTEXT_PARAMS])
def test_invalid_context_params(clean: Env, params: dict[str, Any]) -> None:
    with pytest.raises(ContextError):
        clean.model.new_context(**params)


def test_unknown_context_param(clean: Env) -> None:
    with pytest.raises(BadRequestError, match="n_ctxx"):
        clean.model.new_context(n_ctxx=64)


# -- lifecycle misuse ------------------------------------------------------------------------------------
def _closed_context(e: Env) -> Context:
    ctx = e.model.new_context(n_ctx=32)
    ctx.close()
    return ctx


LIFECYCLE: list[tuple[str, Case]] = [
    ("closed_context_generate", lambda e: _closed_context(e).generate("Hi", n_predict=1)),
    ("closed_context_eval", lambda e: _closed_context(e).eval([1])),
    ("closed_context_logits", lambda e: _closed_context(e).logits()),
    ("closed_context_branch", lambda e: _closed_context(e).branch([1])),
    ("closed_context_save_state", lambda e: _closed_context(e).save_state()),
    ("closed_context_tokens", lambda e: _closed_context(e).tokens()),
    ("closed_context_kv_pressure", lambda e: _closed_context(e).kv.pressure()),
    ("closed_context_as_draft", lambda e: e.ctx.generate_with_draft("Hi", draft=_closed_context(e), n_predict=1)),
    ("branch_after_context_close", lambda e: (c := e.model.new_context(n_ctx=32), b := c.branch([1]), c.close(),
                                              b.step())),
    ("branch_after_reset", lambda e: (b := _root(e), e.bctx.reset(), b.produce())),
    ("detached_branch", lambda e: (b := _root(e), b.detach(), b.info())),
]


@pytest.mark.parametrize("case", [c for _, c in LIFECYCLE], ids=[n for n, _ in LIFECYCLE])
def test_lifecycle_misuse(clean: Env, case: Case) -> None:
    with pytest.raises(StaleHandleError):
        case(clean)


def test_closed_model_and_its_handles(pool: Pool, tiny_model: Path) -> None:
    model = pool[1].load_model(tiny_model)
    ctx = model.new_context(n_ctx=32)
    model.close()
    model.close()
    for call in (lambda: model.tokenize("Hi"), lambda: model.new_context(n_ctx=32), lambda: model.detokenize([1]),
                 lambda: ctx.generate("Hi", n_predict=1), lambda: model.load_lora("x.gguf")):
        with pytest.raises(StaleHandleError):
            call()
    assert pool[1].ping() > 0


def test_closed_handles_are_stale(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=64)
    ctx.close()
    ctx.close()
    with pytest.raises(StaleHandleError):
        ctx.generate("Hi", n_predict=1)


# -- wrong types and values at other entries ----------------------------------------------------------------
WRONG: list[tuple[str, Case, type[LloyalError]]] = [
    ("tokenize_int", lambda e: e.model.tokenize(5), BadRequestError),  # type: ignore[arg-type]
    ("tokenize_bytes", lambda e: e.model.tokenize(b"Hi"), BadRequestError),  # type: ignore[arg-type]
    ("detokenize_str", lambda e: e.model.detokenize("abc"), BadRequestError),  # type: ignore[arg-type]
    ("embed_in_generation_context", lambda e: e.ctx.embed("Hi"), ContextError),
    ("rerank_documents_str", lambda e: e.ctx.rerank("q", "doc"), BadRequestError),
    ("rerank_empty_query", lambda e: e.ctx.rerank(" ", ["doc"]), InvalidArgumentError),
    ("rerank_bad_prompt", lambda e: e.ctx.rerank("q", ["doc"], prompt="no placeholders"), InvalidArgumentError),
    ("score_one_token", lambda e: e.ctx.score([1]), InvalidArgumentError),
    ("score_choices_str", lambda e: e.ctx.score_choices("abc"), BadRequestError),
    ("empty_prompt", lambda e: e.ctx.generate("", n_predict=1), InvalidArgumentError),
    ("prompt_too_long", lambda e: e.ctx.generate(" word" * 200, n_predict=1), ContextOverflowError),
    ("eval_too_long", lambda e: e.ctx.eval([1] * 65), ContextOverflowError),
    ("draft_unknown", lambda e: e.ctx.generate_with_draft("Hi", draft="magic", n_predict=1), InvalidArgumentError),
    ("draft_itself", lambda e: e.ctx.generate_with_draft("Hi", draft=e.ctx, n_predict=1), InvalidArgumentError),
    ("set_lora_not_an_adapter", lambda e: e.ctx.set_lora([("x", 1.0)]), BadRequestError),  # type: ignore[list-item]
    ("chat_template_unknown_format", lambda e: e.model.apply_chat_template(
        [{"role": "user", "content": "Hi"}], template="no-such-format"), InvalidArgumentError),
    ("tool_choice_unknown", lambda e: e.ctx.chat(tool_choice="sometimes"), InvalidArgumentError),
    ("json_schema_bad", lambda e: e.model.instance.json_schema_to_grammar('{"type": 5}'), GrammarError),
    ("kv_remove_negative_seq", lambda e: e.bctx.kv.remove(-5), InvalidArgumentError),
    ("kv_pos_max_seq_out_of_range", lambda e: e.bctx.kv.pos_max(1000), InvalidArgumentError),
    ("clear_and_reseed_float", lambda e: e.bctx.clear_and_reseed([1.5], [2]), InvalidTokenError),  # type: ignore[list-item]
    ("sampler_params_unknown", lambda e: SamplerParams.of(None, {"temprature": 1.0}), BadRequestError),
    ("kv_seq_float", lambda e: e.bctx.kv.pos_max(1.7), BadRequestError),  # type: ignore[arg-type]
    ("kv_seq_str", lambda e: e.bctx.kv.free("0"), BadRequestError),  # type: ignore[arg-type]
    ("kv_copy_bool", lambda e: e.bctx.kv.copy(True, 1), BadRequestError),
    ("kv_remove_float_position", lambda e: e.bctx.kv.remove(0, 1.5), BadRequestError),  # type: ignore[arg-type]
    ("reseed_float", lambda e: _root(e).reseed_sampler(1.5), BadRequestError),  # type: ignore[arg-type]
    ("n_gpu_layers_str", lambda e: e.model.instance.load_model(e.model.path, n_gpu_layers="all"),
     BadRequestError),  # type: ignore[arg-type]
    ("n_draft_float", lambda e: e.ctx.generate_with_draft("Hi", n_draft=2.5, n_predict=1), BadRequestError),
    ("embed_bytes", lambda e: e.ectx.embed(b"Hi"), BadRequestError),  # type: ignore[arg-type]
    ("embed_none", lambda e: e.ectx.embed(None), BadRequestError),  # type: ignore[arg-type]
    ("embed_float_ids", lambda e: e.ectx.embed([[1, 2.5]]), InvalidTokenError),  # type: ignore[list-item]
    ("embed_id_out_of_range", lambda e: e.ectx.embed([1, N_VOCAB]), InvalidTokenError),
    ("embed_empty_list", lambda e: e.ectx.embed([]), InvalidArgumentError),
    ("generate_in_embedding_context", lambda e: e.ectx.generate("Hi", n_predict=1), ContextError),
    ("rerank_in_mean_pooling_context", lambda e: e.ectx.rerank("q", ["d"]), ContextError),
    ("chat_send_bytes", lambda e: e.ctx.chat(template="chatml").send(b"hi"), BadRequestError),  # type: ignore[arg-type]
    ("chat_add_int_content", lambda e: e.ctx.chat(template="chatml").add("user", 5), BadRequestError),  # type: ignore[arg-type]
    ("template_messages_str", lambda e: e.model.apply_chat_template("hi", template="chatml"), BadRequestError),  # type: ignore[arg-type]
    ("template_message_str", lambda e: e.model.apply_chat_template(["hi"], template="chatml"), BadRequestError),  # type: ignore[list-item]
    ("template_messages_int", lambda e: e.model.apply_chat_template(5, template="chatml"), BadRequestError),  # type: ignore[arg-type]
    ("template_message_without_role", lambda e: e.model.apply_chat_template([{"content": "x"}], template="chatml"),
     BadRequestError),
    ("template_content_int", lambda e: e.model.apply_chat_template([{"role": "user", "content": 5}],
                                                                   template="chatml"), BadRequestError),  # type: ignore[dict-item]
    ("new_context_params_str", lambda e: e.model.new_context("abc"), BadRequestError),  # type: ignore[arg-type]
    ("generate_params_int", lambda e: e.ctx.generate("Hi", 5), BadRequestError),  # type: ignore[arg-type]
    ("branch_params_generate_dict", lambda e: e.bctx.branch([1], {"temperature": 1.0}), BadRequestError),  # type: ignore[arg-type]
    ("on_piece_not_callable", lambda e: e.ctx.generate("Hi", n_predict=1, on_piece=5), BadRequestError),  # type: ignore[arg-type]
    ("progress_not_callable", lambda e: e.ctx.eval("Hi", progress="yes"), BadRequestError),  # type: ignore[arg-type]
    ("load_progress_not_callable", lambda e: e.model.instance.load_model(e.model.path, progress=1), BadRequestError),  # type: ignore[arg-type]
    ("load_state_str", lambda e: e.ctx.load_state("abc"), BadRequestError),  # type: ignore[arg-type]
    ("n_ctx_none", lambda e: e.model.new_context(n_ctx=None), ContextError),
    ("tokenize_add_special_str", lambda e: e.model.tokenize("x", add_special="yes"), BadRequestError),  # type: ignore[arg-type]
    ("stop_not_str", lambda e: e.ctx.generate("Hi", n_predict=1, stop=[5]), BadRequestError),
    ("grammar_int", lambda e: e.ctx.generate("Hi", n_predict=1, grammar=5), BadRequestError),
    ("n_predict_past_int64", lambda e: e.ctx.generate("Hi", n_predict=2**70), LloyalError),
]


@pytest.mark.parametrize(("case", "error"), [(c, err) for _, c, err in WRONG], ids=[n for n, _, _ in WRONG])
def test_wrong_types_and_values(clean: Env, case: Case, error: type[LloyalError]) -> None:
    with pytest.raises(error):
        case(clean)


# -- Pool options ----------------------------------------------------------------------------------------
BAD_POOL_OPTIONS: list[tuple[str, dict[str, Any], str]] = [
    ("threads_negative", {"threads_per_worker": -3}, "threads_per_worker"),
    ("threads_zero", {"threads_per_worker": 0}, "threads_per_worker"),
    ("threads_bool", {"threads_per_worker": True}, "threads_per_worker"),
    ("threads_float", {"threads_per_worker": 1.5}, "threads_per_worker"),
    ("threads_past_ggml", {"threads_per_worker": 513}, "threads_per_worker"),
    ("shm_negative", {"shm_bytes": -1}, "shm_bytes"),
    ("shm_zero", {"shm_bytes": 0}, "shm_bytes"),
    ("shm_tiny", {"shm_bytes": MIN_SIZE - 1}, "shm_bytes"),
    ("shm_str", {"shm_bytes": "64M"}, "shm_bytes"),
    ("shm_float", {"shm_bytes": 1e9}, "shm_bytes"),
    ("shm_petabyte", {"shm_bytes": 1 << 50}, "shm_bytes"),
    ("shm_backend_unknown", {"shm_backend": "nope"}, "shm_backend"),
    ("memory_limit_zero", {"memory_limit": 0}, "memory_limit"),
    ("memory_limit_str", {"memory_limit": "800M"}, "memory_limit"),
    ("memory_limit_bool", {"memory_limit": True}, "memory_limit"),
    ("start_timeout_negative", {"start_timeout": -1}, "start_timeout"),
    ("start_timeout_str", {"start_timeout": "5"}, "start_timeout"),
    ("start_timeout_nan", {"start_timeout": float("nan")}, "start_timeout"),
    ("log_level_unknown", {"native_log_level": "verbose"}, "native_log_level"),
    ("variant_unknown", {"variant": "metal"}, "unknown native variant 'metal'"),
    ("variant_int", {"variant": 5}, "variant"),
    ("strict_variant_str", {"strict_variant": "yes"}, "strict_variant"),
    ("sandbox_str", {"sandbox": "no"}, "sandbox"),  # "no" is truthy: it would have meant yes
    ("network_none", {"network": None}, "network"),
    ("recover_int", {"recover": 1}, "recover"),
    # A lone path would be taken as its characters, of which the first, "/", allows everything.
    ("allowed_dirs_str", {"allowed_dirs": "/tmp"}, r"allowed_dirs is a list of directories; got the single path"),
    ("writable_dirs_path", {"writable_dirs": Path("/tmp")}, "writable_dirs"),
    ("writable_dirs_int", {"writable_dirs": 5}, "writable_dirs"),
    ("writable_dirs_item", {"writable_dirs": ["/tmp", 5]}, "writable_dirs: 5 is not a path"),
]


@pytest.mark.parametrize("size", [-1, True, 1.5, "2", None])
def test_a_pool_of_a_negative_size_or_one_that_is_not_an_int_is_refused(size: Any) -> None:
    # Pool(0) is a pool for snapshots alone (tests/test_snapshot.py).
    with pytest.raises(InvalidArgumentError, match=f"workers >= 0 .*, got size={size!r}"):
        Pool(size)


@pytest.mark.parametrize(("kw", "name"), [(kw, n) for _, kw, n in BAD_POOL_OPTIONS],
                         ids=[n for n, _, _ in BAD_POOL_OPTIONS])
def test_bad_pool_options_are_refused_before_any_worker_starts(kw: dict[str, Any], name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        Pool(1, **kw)


def test_shm_bytes_past_the_available_memory_says_what_all_workers_need() -> None:
    size = 1 << 45
    with pytest.raises(InvalidArgumentError, match=f"shm_bytes={size} for 3 worker\\(s\\) needs {3 * size} bytes"):
        Pool(3, shm_bytes=size)


def test_shm_bytes_past_the_available_memory(tiny: Model) -> None:
    available = available_memory()
    assert available is not None  # Linux: /proc/meminfo
    with pytest.raises(InvalidArgumentError, match="available"):
        Pool(1, shm_bytes=available + (1 << 30))
    with pytest.raises(ValueError, match="shm_bytes"):  # what it is, for code that catches the built-in
        Pool(4, shm_bytes=available // 2)
    _still_serving(tiny)


# -- how many contexts a region holds --------------------------------------------------------------------
def test_a_full_region_is_a_context_error_saying_what_to_change(tiny_model: Path) -> None:
    row = row_bytes(N_VOCAB)
    assert row == 32 * 4096  # 32000 floats, rounded up to a page
    size = shm_bytes_for(N_VOCAB, 5)
    assert size == BULK_OFFSET + 5 * row
    with Pool(1, shm_bytes=size) as pool:
        model = pool[0].load_model(tiny_model)
        contexts = [model.new_context(n_ctx=16) for _ in range(5)]  # the documented number, exactly
        with pytest.raises(ContextError, match="shm_bytes") as info:
            model.new_context(n_ctx=16)
        message = str(info.value)
        assert f"{size + row} holds one more" in message
        contexts.pop().close()
        contexts.append(model.new_context(n_ctx=16))  # a freed row is used again
        with pytest.raises(BranchError, match="shm_bytes"):
            contexts[0].branch([1])  # a branch's snapshot is a row too
        _still_serving_in(model, contexts[0])
    with Pool(1, shm_bytes=size + row) as pool:  # what the message said
        model = pool[0].load_model(tiny_model)
        assert len([model.new_context(n_ctx=16) for _ in range(6)]) == 6


def _still_serving_in(model: Model, ctx: Context) -> None:
    model.instance.ping()
    assert ctx.generate("Hi", n_predict=2).n_decoded == 2


def test_shm_bytes_for_gemma_sized_vocabularies(pool: Pool) -> None:
    # The README's table: the default 64 MiB region holds 63 Gemma 3 rows and 511 of a 32k vocabulary.
    assert pool[0]._proc.region.size == 64 << 20
    assert ((64 << 20) - BULK_OFFSET) // row_bytes(262144) == 63
    assert ((64 << 20) - BULK_OFFSET) // row_bytes(32000) == 511
    assert shm_bytes_for(262144, 512) == BULK_OFFSET + 512 * (1 << 20)
    with pytest.raises(InvalidArgumentError):
        shm_bytes_for(0, 1)


def test_the_catalogue_is_large() -> None:
    n = (len(TOKEN_ENTRIES) * len(BAD_IDS) + len(PROMPT_ENTRIES) * len(BAD_PROMPTS) + len(BAD_PARAMS)
         + len(BAD_NATIVE_PARAMS) + 2 * len(BAD_GRAMMARS) + len(BRANCH_MISUSE) + len(STATE_BLOBS) + len(STATE_PATHS)
         + 2 * len(MODEL_FILES) + len(BAD_CONTEXT_PARAMS) + len(LIFECYCLE) + len(WRONG) + len(BAD_POOL_OPTIONS))
    assert n >= 150
