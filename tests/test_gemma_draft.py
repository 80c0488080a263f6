"""The truncated-Gemma draft model (tests/gemmadraft.py) that speculative decoding tests use."""

from __future__ import annotations

from pathlib import Path

from lloyal_pool import Model, Pool

SENTENCE = "Speculative decoding drafts tokens with a small model; the big one checks them. Ça marche !"


def test_the_draft_loads_shares_gemmas_vocabulary_and_generates(pool: Pool, gemma: Model,
                                                                gemma_draft_path: Path) -> None:
    draft = gemma.instance.load_model(gemma_draft_path)  # the same worker, as speculative decoding wants
    try:
        assert draft.info.n_layer == 4 and gemma.info.n_layer == 18
        assert draft.info.meta["general.architecture"] == "gemma3"
        assert draft.n_vocab == gemma.n_vocab
        assert (draft.info.bos, draft.info.eos, draft.eog_tokens) == (gemma.info.bos, gemma.info.eos,
                                                                        gemma.eog_tokens)
        assert draft.tokenize(SENTENCE) == gemma.tokenize(SENTENCE)
        tokens = gemma.tokenize(SENTENCE, add_special=False)
        assert draft.detokenize(tokens) == SENTENCE
        assert draft.info.size < gemma.info.size

        ctx = draft.new_context(n_ctx=256)
        try:
            r = ctx.generate("The capital of France is", n_predict=8, ignore_eos=True)
            assert r.n_decoded == 8 and len(r.tokens) == 8
            assert all(0 <= t < gemma.n_vocab for t in r.tokens)
        finally:
            ctx.close()
    finally:
        draft.close()

