"""Embedding contexts (Context.embed) and Context.rerank, on real models: the tiny random llama (mechanics:
an embedding context on a causal LM is fine for those), a tiny random Qwen3 with a reranker's
classification head (pooling "rank"), and Gemma 3 270M (does the result mean anything)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import CACHE
from invariance import log_softmax
from tinymodel import tiny_model_path

from lloyal_pool import (
    ContextError,
    ContextOverflowError,
    InvalidTokenError,
    Pool,
    ResultTooLargeError,
)
from lloyal_pool.client import Model
from lloyal_pool.params import RERANK_PROMPT

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Embeddings map text to vectors.",
    "Stocks fell sharply on Tuesday after the central bank raised interest rates again.",
    "Hello",
]
# llama.cpp's CPU kernels are not batch invariant: a text's vector depends on which other texts share its
# decode (e.g. quantized matmuls run groups of rows through a GEMM and the rest through a GEMV). Batched
# against one at a time, the unit vectors agree to BATCH_ATOL per component with the tiny model's
# f16/f32 weights, and to a cosine similarity of at least BATCH_MIN_COSINE with Gemma's Q4_K_M
# (observed: 0.9987 pooled, 0.992 per token).
BATCH_ATOL = 2e-3
BATCH_MIN_COSINE = 0.99


def _serves(model: Model) -> None:
    """The worker still answers, and an embedding context still embeds."""
    ctx = model.new_context(n_ctx=256, embeddings=True)
    try:
        v = ctx.embed("still serving")
        assert v.shape == (model.info.n_embd,)
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def emb(tiny: Model):  # type: ignore[no-untyped-def]
    ctx = tiny.new_context(n_ctx=512, embeddings=True, pooling="mean")
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def tok_ctx(tiny: Model):  # type: ignore[no-untyped-def]
    ctx = tiny.new_context(n_ctx=512, embeddings=True, pooling="none")
    yield ctx
    ctx.close()


# -- shapes and pooling ---------------------------------------------------------------------------------
def test_defaults_of_an_embedding_context(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=512, embeddings=True)
    try:
        # The tiny llama declares no pooling type: an embedding context then means one vector per text.
        assert ctx.pooling == "mean" and ctx.embeddings
        assert ctx.n_batch == ctx.n_ubatch == 512
        assert ctx.n_seq_max == 16
    finally:
        ctx.close()
    gen = tiny.new_context(n_ctx=256)
    try:
        assert gen.pooling is None and not gen.embeddings and gen.n_seq_max == 1
    finally:
        gen.close()


def test_pooled_shapes(emb, tiny: Model) -> None:  # type: ignore[no-untyped-def]
    one = emb.embed(TEXTS[0])
    assert one.shape == (tiny.info.n_embd,) and one.dtype == np.float32
    many = emb.embed(TEXTS)
    assert many.shape == (len(TEXTS), tiny.info.n_embd)
    # Copies: the region's views are read-only.
    assert one.flags.writeable and many.flags.writeable


def test_none_pooling_gives_a_vector_per_token(tok_ctx, tiny: Model) -> None:  # type: ignore[no-untyped-def]
    one = tok_ctx.embed(TEXTS[1])
    assert one.shape == (len(tiny.tokenize(TEXTS[1])), tiny.info.n_embd)
    many = tok_ctx.embed(TEXTS)
    assert isinstance(many, list) and len(many) == len(TEXTS)
    for text, arr in zip(TEXTS, many, strict=True):
        assert arr.shape == (len(tiny.tokenize(text)), tiny.info.n_embd)


def test_token_ids_are_accepted(emb, tiny: Model) -> None:  # type: ignore[no-untyped-def]
    ids = tiny.tokenize(TEXTS[2])
    np.testing.assert_array_equal(emb.embed(ids), emb.embed(TEXTS[2]))
    both = emb.embed([ids, TEXTS[2]])
    assert both.shape == (2, tiny.info.n_embd)


def test_mean_equals_the_mean_of_the_token_vectors(emb, tok_ctx) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        tokens = tok_ctx.embed(text, normalize=False)
        mean = emb.embed(text, normalize=False)
        np.testing.assert_allclose(mean, tokens.mean(axis=0), rtol=1e-4, atol=1e-5)


def test_last_and_cls_pick_a_token_vector(tiny: Model, tok_ctx) -> None:  # type: ignore[no-untyped-def]
    tokens = tok_ctx.embed(TEXTS[1], normalize=False)
    for pooling, row in (("last", -1), ("cls", 0)):
        ctx = tiny.new_context(n_ctx=512, embeddings=True, pooling=pooling)
        try:
            np.testing.assert_allclose(ctx.embed(TEXTS[1], normalize=False), tokens[row], rtol=1e-4, atol=1e-5)
        finally:
            ctx.close()


def test_normalize(emb, tok_ctx) -> None:  # type: ignore[no-untyped-def]
    np.testing.assert_allclose(np.linalg.norm(emb.embed(TEXTS), axis=1), 1.0, atol=1e-5)
    for arr in tok_ctx.embed(TEXTS):
        np.testing.assert_allclose(np.linalg.norm(arr, axis=1), 1.0, atol=1e-5)
    raw = emb.embed(TEXTS[0], normalize=False)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3  # normalize=False really leaves the length alone
    np.testing.assert_allclose(emb.embed(TEXTS[0]), raw / np.linalg.norm(raw), atol=1e-6)


def test_identical_texts_identical_vectors(emb) -> None:  # type: ignore[no-untyped-def]
    np.testing.assert_array_equal(emb.embed(TEXTS[3]), emb.embed(TEXTS[3]))
    np.testing.assert_array_equal(emb.embed(TEXTS), emb.embed(TEXTS))
    same = emb.embed([TEXTS[0], TEXTS[0], TEXTS[1]])
    np.testing.assert_allclose(same[0], same[1], atol=BATCH_ATOL)


def test_batched_equals_one_at_a_time(emb, tok_ctx) -> None:  # type: ignore[no-untyped-def]
    batched = emb.embed(TEXTS)
    single = np.stack([emb.embed(t) for t in TEXTS])
    np.testing.assert_allclose(batched, single, atol=BATCH_ATOL)
    for b, t in zip(tok_ctx.embed(TEXTS), TEXTS, strict=True):
        np.testing.assert_allclose(b, tok_ctx.embed(t), atol=BATCH_ATOL)


@pytest.mark.parametrize("settings", [{"n_seq_max": 2}, {"n_batch": 32}, {"n_seq_max": 1, "n_batch": 32}])
def test_split_into_several_decodes(tiny: Model, emb, settings: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    """More texts than one decode takes (n_seq_max sequences, n_ubatch tokens) are split, in order."""
    ctx = tiny.new_context(n_ctx=512, embeddings=True, **settings)
    try:
        got = ctx.embed(TEXTS * 3)
        assert got.shape == (3 * len(TEXTS), tiny.info.n_embd)
        np.testing.assert_allclose(got, np.concatenate([emb.embed(TEXTS)] * 3), atol=BATCH_ATOL)
    finally:
        ctx.close()


# -- refusals: typed errors, and the worker goes on serving ------------------------------------------------
def test_a_text_longer_than_a_decode_is_refused(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=512, embeddings=True, n_batch=16)
    try:
        with pytest.raises(ContextOverflowError, match="input 1 has"):
            ctx.embed(["short", " ".join(["word"] * 40)])
        assert ctx.embed("short").shape == (tiny.info.n_embd,)
    finally:
        ctx.close()
    _serves(tiny)


def test_bad_inputs(emb, tiny: Model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="at least one"):
        emb.embed([])
    with pytest.raises(InvalidTokenError):
        emb.embed([1, 2, tiny.n_vocab])
    _serves(tiny)


def test_generation_and_embedding_contexts_refuse_each_other(tiny: Model) -> None:
    ectx = tiny.new_context(n_ctx=256, embeddings=True)
    gctx = tiny.new_context(n_ctx=256)
    try:
        with pytest.raises(ContextError, match="embeddings=True"):
            gctx.embed("hello")
        for call in (lambda: ectx.generate("hello", n_predict=2), lambda: ectx.eval("hello"),
                     lambda: ectx.logits(), lambda: ectx.branch("hello")):
            with pytest.raises(ContextError, match="needs a generation context"):
                call()
        with pytest.raises(ContextError, match="pooling='rank'"):
            ectx.rerank("q", ["d"])
        assert ectx.embed("hello").shape == (tiny.info.n_embd,)
        # What an embedding context does take besides embed: an embed leaves its cache empty.
        ectx.reset()
        assert ectx.n_past() == 0 and ectx.tokens() == [] and ectx.kv.pressure().cells_used == 0
        assert gctx.generate("hello", n_predict=2).n_decoded == 2
    finally:
        ectx.close()
        gctx.close()
    _serves(tiny)


@pytest.mark.parametrize(("params", "match"), [
    ({"embeddings": True, "pooling": "average"}, "'average' is not a pooling type"),
    ({"embeddings": True, "pooling": 1}, "pooling must be one of"),
    ({"pooling": "mean"}, "pass embeddings=True"),
    ({"embeddings": True, "pooling": "rank"}, "needs a reranker"),
])
def test_bad_pooling_is_refused_at_creation(tiny: Model, params: dict[str, object], match: str) -> None:
    with pytest.raises(ContextError, match=match):
        tiny.new_context(n_ctx=256, **params)
    _serves(tiny)


def test_a_result_too_large_for_shared_memory_is_refused(tiny_model: Path) -> None:
    # The context's logits row takes the bulk area but one page: 16 rows of 64 floats fit, no more.
    row_bytes = -(-32000 * 4 // 4096) * 4096
    with Pool(1, shm_bytes=8192 + row_bytes + 4096) as pool:
        model = pool[0].load_model(tiny_model)
        ctx = model.new_context(n_ctx=512, embeddings=True, pooling="none")
        with pytest.raises(ResultTooLargeError, match="shm_bytes"):
            ctx.embed(" ".join(["word"] * 40))
        assert ctx.embed("ok").shape[1] == model.info.n_embd  # the worker and the context go on
        assert len(ctx.embed(["a b c", "d e f"])) == 2


# -- rerank with a causal LM ---------------------------------------------------------------------------
DOCS = ["Paris is the capital of France.", "Bananas are rich in potassium.", "The Eiffel tower is in Paris."]
QUERY = "Where is Paris?"


def _query_likelihood_by_hand(model: Model, query: str, doc: str) -> float:
    """The definition, with eval and logits one token at a time: the mean log-probability of the
    query's tokens after the prompt holding the document."""
    head = RERANK_PROMPT[:-len("{query}")].replace("{document}", doc)
    full = model.tokenize(head + query, add_special=True)
    alone = model.tokenize(head.rstrip(), add_special=True)
    k = next((i for i, (a, b) in enumerate(zip(alone, full, strict=False)) if a != b), len(alone))
    ctx = model.new_context(n_ctx=512)
    try:
        ctx.eval(full[:k])
        total = 0.0
        for t in full[k:]:
            total += float(log_softmax(ctx.logits(copy=True))[t])
            ctx.eval([t])
        return total / (len(full) - k)
    finally:
        ctx.close()


def test_rerank_with_a_causal_lm(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=512, n_seq_max=4)
    one = tiny.new_context(n_ctx=512)
    try:
        scores = ctx.rerank(QUERY, DOCS)
        assert len(scores) == len(DOCS)
        assert all(np.isfinite(s) and s < 0.0 for s in scores)
        # One decode for all three, against one at a time (n_seq_max 1): the same up to batch invariance.
        np.testing.assert_allclose(scores, one.rerank(QUERY, DOCS), atol=1e-3)
        for doc, score in zip(DOCS, scores, strict=True):
            assert score == pytest.approx(_query_likelihood_by_hand(tiny, QUERY, doc), abs=1e-3)
        assert ctx.rerank(QUERY, []) == []
        # The cache is left empty: the context generates as a fresh one does.
        assert ctx.n_past() == 0
        assert ctx.generate("Once", n_predict=4).tokens == one.generate("Once", n_predict=4).tokens
    finally:
        ctx.close()
        one.close()


def test_rerank_refusals(tiny: Model) -> None:
    ctx = tiny.new_context(n_ctx=256, n_seq_max=2)
    try:
        ctx.eval("some history")
        with pytest.raises(ContextError, match="reset"):
            ctx.rerank("q", ["d"])
        ctx.reset()
        with pytest.raises(ValueError, match="end with"):
            ctx.rerank("q", ["d"], prompt="{query} then {document}")
        with pytest.raises(ValueError, match="empty"):
            ctx.rerank(" ", ["d"])
        with pytest.raises(TypeError):
            ctx.rerank("q", "d")  # type: ignore[arg-type]
        with pytest.raises(ContextOverflowError):
            ctx.rerank("q", [" ".join(["word"] * 300)])
        # Every query token keeps a row of logits: 256 MiB of them per decode at most (2048 at this vocabulary).
        big = tiny.new_context(n_ctx=4096, n_batch=4096)
        try:
            with pytest.raises(ContextOverflowError, match="rows of logits"):
                big.rerank(" ".join(["word"] * 2100), ["d"])
        finally:
            big.close()
        assert len(ctx.rerank("q", ["d", "e"])) == 2
    finally:
        ctx.close()
    _serves(tiny)


# -- rerank with a reranker (pooling "rank") ------------------------------------------------------------
@pytest.fixture(scope="module")
def ranker_path() -> Path:
    return tiny_model_path(CACHE, arch="qwen3", cls_labels=("yes", "no"))


@pytest.fixture(scope="module")
def ranker(pool: Pool, ranker_path: Path):  # type: ignore[no-untyped-def]
    m = pool[1].load_model(ranker_path)
    yield m
    m.close()


def test_rank_pooling_scores_with_the_classifier_head(ranker: Model, ranker_path: Path) -> None:
    ctx = ranker.new_context(n_ctx=512, embeddings=True)  # the GGUF declares pooling "rank"
    last = ranker.new_context(n_ctx=512, embeddings=True, pooling="last")
    try:
        assert ctx.pooling == "rank"
        query = "Where is Paris?"
        scores = ctx.rerank(query, DOCS)
        assert len(scores) == len(DOCS) and all(0.0 < s < 1.0 for s in scores)
        # What llama.cpp computes for a Qwen3 reranker: softmax over the labels of cls.output @ h, h the
        # last token's final hidden state, of the pair [BOS] query document (this vocabulary adds no EOS
        # and has no SEP).
        w = next(t for t in gguf.GGUFReader(ranker_path).tensors if t.name == "cls.output.weight")
        head = np.asarray(w.data, dtype=np.float64).reshape(2, ranker.info.n_embd)
        for doc, score in zip(DOCS, scores, strict=True):
            pair = [ranker.info.bos, *ranker.tokenize(query, add_special=False),
                    *ranker.tokenize(doc, add_special=False)]
            h = last.embed(pair, normalize=False).astype(np.float64)
            logits = head @ h
            expected = np.exp(logits[0] - np.logaddexp(logits[0], logits[1]))
            assert score == pytest.approx(expected, abs=1e-3)
        singles = [ctx.rerank(query, [d])[0] for d in DOCS]
        np.testing.assert_allclose(scores, singles, atol=1e-3)
        with pytest.raises(ContextError, match="use rerank"):
            ctx.embed("text")
        assert ctx.rerank(query, DOCS[:1])[0] == pytest.approx(scores[0], abs=1e-3)
    finally:
        ctx.close()
        last.close()


def test_rank_pairs_follow_the_models_rerank_template(pool: Pool) -> None:
    template = "<s>query: {query}\ndocument: {document}</s>"
    path = tiny_model_path(CACHE, arch="qwen3", cls_labels=("yes", "no"), rerank_template=template)
    model = pool[1].load_model(path)
    try:
        ctx = model.new_context(n_ctx=512, embeddings=True)
        last = model.new_context(n_ctx=512, embeddings=True, pooling="last")
        w = next(t for t in gguf.GGUFReader(path).tensors if t.name == "cls.output.weight")
        head = np.asarray(w.data, dtype=np.float64).reshape(2, model.info.n_embd)
        # A query holding "{document}" stays text: the placeholders are filled in one pass.
        query = "Where is {document}?"
        scores = ctx.rerank(query, DOCS)
        for doc, score in zip(DOCS, scores, strict=True):
            text = template.replace("{document}", doc).replace("{query}", query.replace("{document}", "\0"))
            tokens = model.tokenize(text.replace("\0", "{document}"), add_special=False, parse_special=True)
            assert tokens[0] == model.info.bos and tokens[-1] == model.info.eos  # "<s>", "</s>" parsed
            logits = head @ last.embed(tokens, normalize=False).astype(np.float64)
            assert score == pytest.approx(np.exp(logits[0] - np.logaddexp(logits[0], logits[1])), abs=1e-3)
    finally:
        model.close()


# -- Gemma: do the numbers mean something -------------------------------------------------------------
def test_gemma_embeddings_rank_a_paraphrase_above_an_unrelated_text(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=512, embeddings=True)
    try:
        texts = ["The cat is sleeping on the sofa.", "A cat naps on the couch.",
                 "Quarterly revenue grew by eight percent."]
        v = ctx.embed(texts)
        sim = v @ v.T
        assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[1, 2]
        single = np.stack([ctx.embed(t) for t in texts])
        assert float(np.min(np.sum(v * single, axis=1))) >= BATCH_MIN_COSINE
    finally:
        ctx.close()


def test_gemma_per_token_vectors_batched_and_alone(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=512, embeddings=True, pooling="none")
    try:
        batched = ctx.embed(TEXTS)
        for text, b in zip(TEXTS, batched, strict=True):
            alone = ctx.embed(text)
            assert b.shape == alone.shape == (len(gemma.tokenize(text)), gemma.info.n_embd)
            assert float(np.min(np.sum(b * alone, axis=1))) >= BATCH_MIN_COSINE
        np.testing.assert_array_equal(ctx.embed(TEXTS)[2], batched[2])  # the same call: the same bits
    finally:
        ctx.close()


@pytest.mark.parametrize(("query", "documents", "best"), [
    ("What is the capital of France?",
     ["Bananas are a good source of potassium.", "Paris is the capital of France.", "The stock market fell today."], 1),
    ("Where does the cat sleep?",
     ["Stock markets fell sharply today.", "Paris is the capital of France.", "The cat is sleeping on the sofa."], 2),
    ("How do I boil an egg?",
     ["The Eiffel Tower is tall.", "Put the egg in boiling water for eight minutes.", "Cats like fish."], 1),
])
def test_gemma_rerank_puts_the_relevant_document_first(gemma: Model, query: str, documents: list[str],
                                                       best: int) -> None:
    ctx = gemma.new_context(n_ctx=512, n_seq_max=4)
    try:
        scores = ctx.rerank(query, documents)
        assert int(np.argmax(scores)) == best, scores
    finally:
        ctx.close()


# -- interrupt ------------------------------------------------------------------------------------------
def test_interrupted_embed_and_rerank_raise_and_the_context_goes_on(tiny_model: Path) -> None:
    """In-process, with the interrupt word already naming the request: the check before each decode."""
    import lloyal_pool.worker._native as native
    from lloyal_pool.errors import InterruptedByClient
    from lloyal_pool.shm import BULK_OFFSET, PAGE, Region

    region = Region.anonymous(1 << 22)
    arena = native.Arena(region.view, BULK_OFFSET, PAGE)
    model = native.Model(str(tiny_model))
    word = np.zeros(1, dtype=np.uint64)
    word[0] = 7
    for params in ({"n_ctx": 256, "embeddings": True}, {"n_ctx": 256}):
        ctx = native.Context(model, params, arena)
        ctx.set_interrupt_word(memoryview(word))
        if params.get("embeddings"):
            with pytest.raises(InterruptedByClient):
                ctx.embed([[1, 100, 200]], True, 7)
            assert ctx.embed([[1, 100, 200]], True, 8)["rows"] == [1]
        else:
            with pytest.raises(InterruptedByClient):
                ctx.score_tails([[1, 100, 200]], [1], 7)
            assert len(ctx.score_tails([[1, 100, 200]], [1], 8)) == 1
            assert ctx.n_past() == 0
        ctx.set_interrupt_word(None)
