"""llama.cpp's own tokenizer suite (models/ggml-vocab-*.gguf with .inp/.out), reproduced through a worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MODELS_DIR
from vocab_cases import ADD_SPECIAL, PARSE_SPECIAL, unique_cases, vocab_files

from lloyal_pool import Pool

VOCABS = vocab_files(MODELS_DIR)


def test_the_vendored_tree_has_the_suite() -> None:
    assert len(VOCABS) >= 15, f"expected llama.cpp's vocab test files in {MODELS_DIR}"


@pytest.mark.parametrize("vocab", VOCABS, ids=lambda p: p.name.removeprefix("ggml-vocab-").removesuffix(".gguf"))
def test_vocab_matches_llama_cpp_expectations(pool: Pool, vocab: Path) -> None:
    model = pool[1].load_model(vocab, vocab_only=True)
    try:
        cases = unique_cases(vocab)
        assert cases
        mismatches = []
        for text, expected in cases:
            got = model.tokenize(text, add_special=ADD_SPECIAL, parse_special=PARSE_SPECIAL)
            if got != expected:
                mismatches.append((text, expected, got))
        assert not mismatches, f"{len(mismatches)}/{len(cases)} texts differ, first: {mismatches[0]!r}"
    finally:
        model.close()
