"""Loader for llama.cpp's tokenizer regression data (``models/ggml-vocab-*.gguf.{inp,out}``).

Format (established from ``vendor/llama.cpp/tests/test-tokenizer-0.cpp`` and the
writer in ``convert_hf_to_gguf_update.py``):

* ``.inp`` is UTF-8 text.  Every test text is written verbatim and followed by the
  separator ``"\\n__ggml_vocab_test__\\n"``.  The C++ reader splits the raw file on
  that separator (leftmost, non-overlapping matches) and does not keep the empty
  piece after the final separator.  A text may be empty or consist only of
  whitespace/newlines, so nothing may be stripped from the texts.
* ``.out`` holds one line per text: the expected token ids, each preceded by a
  space (``" 474 287 29871"``); an empty text gives an empty line.  The reader
  strips each line and splits on single spaces.

How the reference test tokenizes (``test-tokenizer-0.cpp``)::

    const bool add_special = false;
    common_tokenize(ctx, text, add_special, /*parse_special=*/ false);

i.e. ``llama_tokenize(vocab, text, len, ..., add_special=false, parse_special=false)``.
The expected ids were produced by HF ``tokenizer.encode(text, add_special_tokens=False)``,
so no BOS/EOS is present in ``.out`` (verified: no line begins with a BOS id).
Use :data:`ADD_SPECIAL` / :data:`PARSE_SPECIAL` so a test matches these flags.

The reference test loads each file with ``mparams.vocab_only = true``.

Note: the C++ test stores the cases in a ``std::map<std::string, ...>``, so a text
that appears twice is tested once (with the ids of its last occurrence).
:func:`load_cases` keeps every occurrence in file order; :func:`unique_cases`
reproduces the map semantics.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "ADD_SPECIAL",
    "PARSE_SPECIAL",
    "SEPARATOR",
    "VocabCaseError",
    "load_cases",
    "unique_cases",
    "vocab_files",
]

#: Flags test-tokenizer-0.cpp passes to common_tokenize / llama_tokenize.
ADD_SPECIAL = False
PARSE_SPECIAL = False

#: The .inp separator: it includes the newline before and after the marker line.
SEPARATOR = "\n__ggml_vocab_test__\n"

#: Files with .inp/.out data that the suite should not run, with the reason.
#: Empty: every vocab in the pinned tree with both files has matching counts and
#: is registered as a test-tokenizer-0 ctest in vendor/llama.cpp/tests/CMakeLists.txt.
SKIP: dict[str, str] = {}


class VocabCaseError(ValueError):
    """The .inp/.out pair is malformed (missing, or counts do not line up)."""


def vocab_files(models_dir: Path | str) -> list[Path]:
    """Every ``ggml-vocab-*.gguf`` in *models_dir* that has both ``.gguf.inp`` and ``.gguf.out``.

    Sorted by name.  Files named in :data:`SKIP` are left out.
    """
    d = Path(models_dir)
    out = []
    for p in sorted(d.glob("ggml-vocab-*.gguf")):
        if p.name in SKIP:
            continue
        if _inp(p).is_file() and _out(p).is_file():
            out.append(p)
    return out


def _inp(gguf_path: Path) -> Path:
    return gguf_path.with_name(gguf_path.name + ".inp")


def _out(gguf_path: Path) -> Path:
    return gguf_path.with_name(gguf_path.name + ".out")


def _split_inputs(raw: str) -> list[str]:
    # Mirrors read_tests(): pieces between separators; a trailing empty piece (file
    # ends with the separator) is not a test, but a non-empty tail without a final
    # separator is.
    if raw == "":
        return []
    parts = raw.split(SEPARATOR)
    if parts[-1] == "":
        parts.pop()
    return parts


def _parse_outputs(raw: str) -> list[list[int]]:
    # std::getline on '\n' only: a final newline does not start another line.
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    result = []
    for lineno, line in enumerate(lines, 1):
        s = line.strip()
        try:
            result.append([int(t) for t in s.split(" ")] if s else [])
        except ValueError as e:
            raise VocabCaseError(f"bad token id on line {lineno}: {line!r}") from e
    return result


def load_cases(gguf_path: Path | str) -> list[tuple[str, list[int]]]:
    """``(text, expected_ids)`` for every test in ``<gguf_path>.inp`` / ``.out``, in file order.

    Raises :class:`VocabCaseError` if a file is missing, empty, or the number of
    texts and result lines differ.
    """
    p = Path(gguf_path)
    inp, outp = _inp(p), _out(p)
    if not inp.is_file() or not outp.is_file():
        raise VocabCaseError(f"{p.name}: missing {inp.name} or {outp.name}")
    # Read bytes and decode: no universal-newline translation, texts are verbatim.
    texts = _split_inputs(inp.read_bytes().decode("utf-8"))
    ids = _parse_outputs(outp.read_bytes().decode("utf-8"))
    if len(texts) != len(ids):
        raise VocabCaseError(
            f"{p.name}: {len(texts)} texts in {inp.name} but {len(ids)} lines in {outp.name}"
        )
    if not texts:
        raise VocabCaseError(f"{p.name}: no tests found")
    return list(zip(texts, ids, strict=True))


def unique_cases(gguf_path: Path | str) -> list[tuple[str, list[int]]]:
    """Like :func:`load_cases` but with duplicate texts collapsed as the C++ test's std::map does
    (the last occurrence wins; order is that of first occurrence)."""
    d: dict[str, list[int]] = {}
    for text, ids in load_cases(gguf_path):
        d[text] = ids
    return list(d.items())
