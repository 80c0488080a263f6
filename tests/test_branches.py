"""Branches through a worker, on Gemma 3 270M (262k vocabulary, sliding-window attention): fork semantics,
batched commits, exact rollback, grammars, metrics, KV operations, errors that leave the worker serving."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lloyal_pool import (
    Branch,
    BranchError,
    Context,
    ContextError,
    ContextOverflowError,
    DecodeError,
    Grammar,
    GrammarError,
    InvalidTokenError,
    Model,
    SamplerParams,
    StaleHandleError,
    metrics,
)

PROMPT = "The three most interesting facts about octopuses are"
WARM = SamplerParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1234)


@pytest.fixture
def ctx(gemma: Model) -> Iterator[Context]:
    c = gemma.new_context(n_ctx=1024, n_seq_max=8)
    yield c
    c.close()


def _run(branch: Branch, n: int) -> list[int]:
    return [p.token for p in branch.iterate(n)]


def test_determinism_across_contexts_and_n_batch(gemma: Model) -> None:
    runs = []
    # n_ubatch fixed: llama.cpp's CPU kernels give rows computed in differently shaped ubatches
    # slightly different values, so only n_batch (how tokens are chunked into decodes) may vary.
    for n_batch in (512, 64, 16):
        c = gemma.new_context(n_ctx=512, n_seq_max=2, n_batch=n_batch, n_ubatch=16)
        try:
            root = c.branch(PROMPT, WARM)
            runs.append(_run(root, 16))
        finally:
            c.close()
    assert len(runs[0]) == 16
    assert runs[0] == runs[1] == runs[2]


def test_fork_siblings_reseed_and_parent_continuation(ctx: Context) -> None:
    root = ctx.branch(PROMPT, WARM)
    a, b = root.fork(), root.fork()
    c = root.fork(reseed=99)
    ta, tb, tc = _run(a, 12), _run(b, 12), _run(c, 12)
    assert ta == tb, "unreseeded siblings share the PRNG state, so they sample the same tokens"
    assert tc != ta, "a reseeded sibling diverges"
    # A fork continues exactly as its parent would have (same seed, same PRNG state).
    assert _run(root, 12) == ta


def test_child_decode_leaves_parent_logits_bitwise(ctx: Context) -> None:
    root = ctx.branch(PROMPT, WARM)
    before = root.logits.copy()
    child = root.fork()
    np.testing.assert_array_equal(child.logits, before)
    child.step()
    child.step()
    assert root.logits.tobytes() == before.tobytes()
    assert child.logits.tobytes() != before.tobytes()


def test_commit_twice_equals_prefill_of_both(ctx: Context) -> None:
    root = ctx.branch(PROMPT, WARM)
    t1, t2 = 1000, 2000
    fresh = root.fork()
    stepped = root.fork()
    stepped.commit(t1)
    stepped.commit(t2)
    fresh.prefill([t1, t2])
    assert stepped.position == fresh.position == root.position + 2
    assert stepped.logits.tobytes() == fresh.logits.tobytes()


def test_a_prefill_carries_commits_in_its_first_decode(ctx: Context) -> None:
    root = ctx.branch(PROMPT, WARM)
    going, twin, new = root.fork(), root.fork(), root.fork()
    tok = going.produce().token
    assert twin.produce().token == tok
    assert ctx.branches.prefill([(new, " and the rest of it")], commits=[(going, tok)]) > 0
    twin.commit(tok)
    assert (going.position, going.n_accepted, going.perplexity) == (twin.position, twin.n_accepted, twin.perplexity)
    assert new.position > root.position + 3 and going.position == root.position + 1
    np.testing.assert_allclose(going.logits, twin.logits, atol=1.0)  # a batch of other rows: rounding
    with pytest.raises(BranchError, match="twice"):
        ctx.branches.prefill([(new, [5])], commits=[(new, 6)])


def test_batched_commit_equals_single_commits(ctx: Context) -> None:
    root = ctx.branch(PROMPT, WARM)
    batched = [root.fork(reseed=i) for i in range(1, 4)]
    single = [root.fork(reseed=i) for i in range(1, 4)]
    for _ in range(4):
        produced = ctx.branches.produce(batched)
        assert ctx.branches.commit([(b, p.token) for b, p in zip(batched, produced, strict=True)]) > 0
        for b, p in zip(single, produced, strict=True):
            assert b.produce().token == p.token
            b.commit(p.token)
    for b, s in zip(batched, single, strict=True):
        assert b.position == s.position
        assert b.logits.tobytes() == s.logits.tobytes()
        assert b.perplexity == s.perplexity


def test_a_small_context_holds_what_was_asked_for_in_every_mode(gemma: Model) -> None:
    # llama.cpp pads the cache to 256 cells; n_ctx=32 still means 32 tokens, for branches as for eval.
    c = gemma.new_context(n_ctx=32)
    try:
        assert c.n_ctx == 32
        toks = gemma.tokenize(" ".join(["one two three four"] * 10))
        with pytest.raises(ContextOverflowError):
            c.eval(toks[:33])
        r = c.generate(toks[:30], n_predict=8, ignore_eos=True)
        assert r.n_prompt + r.n_decoded <= 32 and len(c.tokens()) <= 32  # generation stops at the window
        c.reset()
        b = c.branch(toks[:31])
        b.commit(b.produce().token)
        assert b.position == 32 and c.kv.pressure().remaining == 0
        with pytest.raises(ContextOverflowError):
            b.commit(b.produce().token)
        with pytest.raises(ContextOverflowError):
            c.branches.step([b])
        assert b.info().position == 32
        b.prune()
        assert c.generate(toks[:8], n_predict=2).n_decoded == 2  # still serving
    finally:
        c.close()


def test_rollback_when_the_kv_fills(gemma: Model) -> None:
    c = gemma.new_context(n_ctx=256, n_seq_max=8)
    try:
        hot = SamplerParams(temperature=1.0, seed=7)
        root = c.branch(gemma.tokenize("Once upon a time") + [1000] * 200, hot)
        branches = [root] + [root.fork(reseed=i) for i in range(1, 8)]
        failed = False
        for _ in range(64):
            before = [(b.info(), b.logits.copy()) for b in branches]
            produced = c.branches.produce(branches)
            try:
                c.branches.commit([(b, p.token) for b, p in zip(branches, produced, strict=True)])
            except DecodeError:
                failed = True
            else:
                continue
            for b, (info, logits) in zip(branches, before, strict=True):
                after = b.info()
                assert (after.position, after.n_accepted) == (info.position, info.n_accepted)
                assert after.perplexity == info.perplexity or (math.isinf(after.perplexity)
                                                               and math.isinf(info.perplexity))
                assert b.logits.tobytes() == logits.tobytes()
            # The next sample is the one the failed commit would have accepted: produce advanced the PRNG
            # and the failed commit changed nothing after it.
            break
        assert failed, "the KV cache never filled up"
        assert c.kv.pressure().remaining < len(branches)
        root.commit(produced[0].token)  # a single commit still fits
        assert root.position == branches[1].position + 1
    finally:
        c.close()


def test_json_schema_grammar_on_siblings_and_inheritance(ctx: Context) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    root = ctx.branch("A person as JSON: ", SamplerParams(temperature=0.7, seed=3), grammar=Grammar(json_schema=schema))
    kids = [root.fork(reseed=s) for s in (1, 2, 3)]
    texts = ["".join(p.text for p in k.iterate(60)) for k in kids]
    for text in texts:
        obj = json.loads(text)
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and isinstance(obj["name"], str)
    # A grammar swapped in mid-generation is inherited by later forks.
    other = ctx.branch("Answer yes or no: ", SamplerParams(temperature=0.7, seed=5))
    other.set_grammar('root ::= "yes" | "no"')
    fork = other.fork(reseed=8)
    assert "".join(p.text for p in fork.iterate(8)) in ("yes", "no")


def test_metrics_against_numpy(ctx: Context) -> None:
    root = ctx.branch(PROMPT, WARM)
    assert math.isinf(root.perplexity)
    surprisals = []
    for _ in range(6):
        z = root.logits.copy()
        p = root.produce()
        surprisals.append(metrics.surprisal(z, p.token))
        assert root.model_surprisal(p.token) == pytest.approx(metrics.surprisal(z, p.token))
        root.commit(p.token)
    nats = root.model_entropy()
    assert root.model_entropy("bits") == pytest.approx(nats / math.log(2))
    # numpy by hand from the same array
    z = root.logits.astype(np.float64)
    logp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    assert nats == pytest.approx(float(-(np.exp(logp) * logp).sum()), rel=1e-9)
    ppl = root.perplexity
    assert math.isfinite(ppl) and ppl >= 1.0
    assert ppl == pytest.approx(math.exp(sum(surprisals) / len(surprisals)), rel=1e-4)
    assert math.isfinite(root.sampling_perplexity) and root.sampling_perplexity >= 1.0


def test_logits_view_is_shared_memory(ctx: Context) -> None:
    root = ctx.branch(PROMPT)
    view = root.logits
    assert view.dtype == np.float32 and view.shape == (ctx.model.n_vocab,)
    assert not view.flags.writeable and not view.flags.owndata
    token = int(np.argmax(view))
    assert root.produce().token == token  # greedy by default
    np.testing.assert_array_equal(root.logits_at([token, 0]), view[[token, 0]])
    other = root.fork()
    other.set_logits(np.zeros(ctx.model.n_vocab, np.float32))
    other.merge_logits([root], 2.0)
    np.testing.assert_allclose(other.logits, 2.0 * root.logits)


def test_tree_prune_retain_and_detach(ctx: Context) -> None:
    root = ctx.branch(PROMPT)
    a = root.fork()
    b = root.fork()
    a1 = a.fork()
    assert root.children == [a, b] and a.parent is root and not a.is_leaf and a1.is_leaf
    with pytest.raises(BranchError, match="children"):
        a.prune()
    a.prune_subtree()
    assert not a.alive and not a1.alive and root.children == [b]
    with pytest.raises(StaleHandleError):
        a.produce()
    with pytest.raises(StaleHandleError):
        _ = a1.logits
    b.step()
    ctx.branches.retain_only(b)
    assert not root.alive and list(ctx.branches) == [b] and b.parent is None
    pos = b.position
    seq = b.detach()
    assert ctx.kv.pos_max(seq) == pos - 1
    assert ctx.kv.pressure().seqs_leased == 1
    ctx.kv.free(seq)
    assert ctx.kv.pressure().seqs_leased == 0 and ctx.kv.pos_max(seq) == -1


def test_kv_pressure_counts_shared_prefix_once(ctx: Context) -> None:
    root = ctx.branch(list(range(100, 140)))
    kids = [root.fork() for _ in range(3)]
    for k in kids:
        k.prefill([5, 6])
    p = ctx.kv.pressure()
    assert p.cells_used == 40 + 3 * 2
    assert p.remaining == p.n_ctx - p.cells_used and p.seqs_leased == 4 and p.seqs_free == p.n_seq_max - 4
    assert ctx.branches.available() == p.seqs_free


def test_state_save_and_load(ctx: Context, tmp_path: Path) -> None:
    root = ctx.branch(PROMPT)
    n_prompt = root.position
    ref = root.fork()
    ref.prefill([1000])
    expected = ref.logits.copy()
    ref.prune()
    seq = root.fork().detach()
    data = ctx.kv.save(seq)
    assert len(data) > 0 and ctx.kv.state_size(seq) == len(data)
    path = tmp_path / "state.bin"
    n = ctx.kv.save_file(seq, path, tokens=[1, 2, 3])
    assert n > 0 and path.stat().st_size > 0
    ctx.kv.free(seq)
    root.prune()
    # Into an emptied context; adopted as a branch, the restored sequence goes on exactly as before.
    for restore in ("bytes", "file"):
        ctx.reset()
        seq = ctx.branch().detach()
        if restore == "bytes":
            assert ctx.kv.load(seq, data) == len(data)
        else:
            assert ctx.kv.load_file(seq, path) == [1, 2, 3]
        assert ctx.kv.pos_max(seq) == n_prompt - 1
        again = ctx.branches.adopt(seq)
        assert again.position == n_prompt
        again.prefill([1000])
        np.testing.assert_allclose(again.logits, expected, rtol=0, atol=1e-3)
    # Into a fresh branch's own (empty) sequence: the branch takes the cells, and its handle knows it.
    ctx.reset()
    fresh = ctx.branch()
    assert fresh.position == 0
    ctx.kv.load(fresh.info().seq, data)
    assert fresh.position == n_prompt == fresh.info().position
    ctx.reset()


def test_clear_and_reseed_keeps_the_branch(ctx: Context) -> None:
    toks = ctx.model.tokenize(PROMPT + " they have three hearts, blue blood and")
    root = ctx.branch(toks, WARM)
    for _ in range(4):
        root.step()
    ppl = root.perplexity
    sinks, tail = toks[:4], toks[-6:]
    ctx.clear_and_reseed(sinks, tail)
    info = root.info()
    assert info.position == 10 and info.perplexity == ppl
    assert ctx.kv.pressure().cells_used == 10
    root.step()
    assert root.position == 11
    root.fork()
    with pytest.raises(BranchError):
        ctx.clear_and_reseed(sinks, tail)


def test_iterator_stops_anywhere_and_forks(ctx: Context) -> None:
    root = ctx.branch(PROMPT, WARM)
    start = root.position
    got = []
    for p in root:
        got.append(p.token)
        if len(got) == 10:
            break
    assert root.position == start + 10
    manual = ctx.branch(PROMPT, WARM)
    assert [manual.step().token for _ in range(10)] == got
    child = root.fork()
    assert child.position == root.position


def test_a_stop_token_adds_no_text(ctx: Context, gemma: Model) -> None:
    # Best-of-n joins each candidate's pieces: the token that ends a candidate must add nothing to it,
    # as generate leaves it out of its text. A bias makes the model end at once, on every CPU.
    eos = gemma.eog_tokens[0]
    root = ctx.branch(PROMPT, WARM)
    root.set_logit_bias({eos: 50.0})
    for produced in (root.produce(), ctx.branches.step([root])[0]):
        assert produced.is_stop and produced.token in gemma.eog_tokens
        assert (produced.text, produced.piece) == ("", b"")
    assert list(root) == []


def test_errors_are_typed_and_the_worker_keeps_serving(ctx: Context, gemma: Model) -> None:
    root = ctx.branch(PROMPT)
    fresh = ctx.branch()
    with pytest.raises(BranchError, match="logits"):
        fresh.produce()
    with pytest.raises(BranchError, match=r"twice|duplicate"):
        ctx.branches.commit([(root, 1), (root, 2)])
    with pytest.raises(InvalidTokenError):
        root.commit(gemma.n_vocab + 5)
    with pytest.raises(GrammarError):
        root.set_grammar('root ::= ("a" | "b"')
    with pytest.raises(GrammarError):
        root.set_grammar(Grammar(json_schema={"type": "nonsense-type"}))
    seq = root.info().seq
    with pytest.raises(BranchError):
        ctx.kv.remove(seq)
    with pytest.raises(ContextError):
        ctx.generate("no plain generation while branches exist", n_predict=1)
    kids = [root.fork() for _ in range(ctx.n_seq_max - 2)]
    with pytest.raises(BranchError, match="sequence"):
        root.fork()
    for k in kids:
        k.prune()
    other = gemma.new_context(n_ctx=256, n_seq_max=2)
    try:
        foreign = other.branch(PROMPT)
        with pytest.raises(BranchError, match="another context"):
            ctx.branches.commit([(foreign, 1)])
    finally:
        other.close()
    assert root.step().token >= 0  # still serving


def test_interrupted_prefill_changes_nothing(gemma: Model) -> None:
    import threading

    from lloyal_pool import InterruptedByClient

    c = gemma.new_context(n_ctx=8192, n_seq_max=2, n_batch=512, n_ubatch=64)
    try:
        root = c.branch(PROMPT, WARM)
        before = root.info()
        logits = root.logits.copy()
        errors: list[BaseException] = []

        started = threading.Event()  # an interrupt before the request is sent would bite nothing

        def long_prefill() -> None:
            try:
                root.prefill([1000 + i % 5000 for i in range(6000)], progress=lambda done, total: started.set())
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=long_prefill)
        t.start()
        assert started.wait(60)
        c.interrupt()
        t.join(timeout=60)
        assert len(errors) == 1 and isinstance(errors[0], InterruptedByClient), errors
        after = root.info()
        assert (after.position, after.n_accepted) == (before.position, before.n_accepted)
        assert root.logits.tobytes() == logits.tobytes()
        assert c.kv.pressure().cells_used == before.position
        root.step()  # still serving, from where it was
        assert root.position == before.position + 1
    finally:
        c.close()


def test_async_commit_and_kv_clear(ctx: Context) -> None:
    root = ctx.branch(PROMPT)
    kid = root.fork()
    token = kid.produce().token
    fut = ctx.branches.commit_async([(kid, token)])
    assert fut.result(timeout=60) > 0  # the ms spent inside llama_decode
    assert kid.position == root.position + 1
    ctx.branches.prefill_async([(root, [token])]).result(timeout=60)
    assert root.logits.tobytes() == kid.logits.tobytes()  # commit(t) and prefill([t]) decode the same row
    ctx.kv.clear()
    assert not root.alive and not kid.alive and len(ctx.branches) == 0
    assert ctx.kv.pressure().cells_used == 0


def test_handles_go_stale_with_their_model(tiny: Model) -> None:
    """Closing a model frees its contexts in the worker; their branches' cached state must not outlive
    that (StaleHandleError, as any other call on them)."""
    model = tiny.instance.load_model(tiny.path)
    ctx = model.new_context(n_ctx=128, n_seq_max=2)
    root = ctx.branch([1, 2, 3])
    assert root.position == 3
    model.close()
    assert ctx.closed and not root.alive
    with pytest.raises(StaleHandleError):
        _ = root.position
    with pytest.raises(StaleHandleError):
        ctx.generate("Hi", n_predict=1)


def test_branches_refuse_a_window_sized_sliding_window_cache(gemma) -> None:  # type: ignore[no-untyped-def]
    # Gemma 3 has sliding-window layers: with swa_full=False a rollback could need cells already dropped.
    ctx = gemma.new_context(n_ctx=256, swa_full=False)
    try:
        with pytest.raises(ContextError, match="swa_full=True"):
            ctx.branch("Hello")
        assert ctx.generate("Hello", n_predict=2).n_decoded == 2  # the context still serves
    finally:
        ctx.close()


def test_logit_bias_through_the_pool_bans_and_clears(tiny: Model) -> None:
    # The client's side of set_logit_bias (the native side has its own tests): a ban reaches the worker's
    # sampler, and None or {} clear it.
    ctx = tiny.new_context(n_ctx=256, n_seq_max=2)
    try:
        b = ctx.branch([1, 15043])  # greedy: produce() gives the top token, and changes nothing
        top = b.produce().token
        b.set_logit_bias({top: float("-inf")})
        banned = b.produce().token
        assert banned != top
        b.clear_logit_bias()
        assert b.produce().token == top
        b.set_logit_bias({banned: float("-inf"), top: float("-inf")})
        assert b.produce().token not in (top, banned)
        b.set_logit_bias({})
        assert b.produce().token == top
    finally:
        ctx.close()
