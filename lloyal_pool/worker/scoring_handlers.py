"""The requests that read a model's judgement of a text instead of generating one: scoring, embeddings, rerank.

A rerank takes one of two paths. An embedding context with pooling='rank' (a reranker model) classifies
each (query, document) pair and reads its first output; a generation context (a causal LM) scores the
query's tokens after a prompt that holds the document, so the prompt must end with {query}.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from .. import protocol as p
from ..errors import ContextError
from ..params import Score
from .registry import Call, Registry, handles

_PLACEHOLDER = re.compile(r"\{query\}|\{document\}")


class ScoringHandlers(Registry):
    # -- scoring --------------------------------------------------------------------------------------
    @handles(p.ScoreText)
    def score(self, req: p.ScoreText, call: Call) -> Score:
        entry = self._context(req.context)
        tokens = self._prompt_tokens(entry, req.text, bos=True)
        n_logprobs = -1 if req.logprobs is None else req.logprobs
        return msgspec.convert(entry.native.score(tokens, call.request_id, n_logprobs), Score)

    @handles(p.ScoreChoices)
    def score_choices(self, req: p.ScoreChoices, call: Call) -> list[Score]:
        entry = self._context(req.context)
        choices = [self._prompt_tokens(entry, c, bos=False) for c in req.choices]
        return msgspec.convert(entry.native.score_choices(choices, call.request_id), list[Score])

    # -- embeddings and rerank ------------------------------------------------------------------------
    @handles(p.Embed)
    def embed(self, req: p.Embed, call: Call) -> p.Embedded:
        entry = self._context(req.context)
        if entry.native.pooling == "rank":
            raise ContextError("a pooling='rank' context scores (query, document) pairs: use rerank()")
        # Texts are data: special-token text in them stays text.
        inputs = [self._tokenize(entry.model_id, x, True, False) if isinstance(x, str) else x for x in req.inputs]
        r = entry.native.embed(inputs, req.normalize, call.request_id)
        return p.Embedded(offset=int(r["offset"]), rows=[int(n) for n in r["rows"]], width=int(r["width"]))

    @handles(p.Rerank)
    def rerank(self, req: p.Rerank, call: Call) -> list[float]:
        entry = self._context(req.context)
        native = entry.native
        if native.embeddings and native.pooling != "rank":
            raise ContextError(f"rerank in an embedding context needs pooling='rank' (a reranker model), this one "
                               f"pools with {native.pooling!r}; a causal LM reranks in a generation context")
        if not req.documents:
            return []
        if native.embeddings:
            info = self._model(entry.model_id).native.info()
            pairs = [self._rank_pair(entry.model_id, info, req.query, d) for d in req.documents]
            r = native.embed(pairs, False, call.request_id)
            width = int(r["width"])
            # The classifier's first output is the score (a reranker's "relevant" class).
            scores = self.region.floats(int(r["offset"]), len(pairs) * width)[::width]
            return [float(x) for x in scores]
        if not req.query.strip():
            raise ValueError("the query is empty")
        template = req.prompt.rstrip()
        if not template.endswith("{query}") or "{document}" not in template:
            raise ValueError("the rerank prompt must contain {document} and end with {query}")
        before = template[:-len("{query}")]
        prompts: list[list[int]] = []
        n_tail: list[int] = []
        for doc in req.documents:
            head = _fill(before, req.query, doc)
            full = self._tokenize(entry.model_id, head + req.query, True, False)
            # The query's tokens: what follows the longest common prefix with the prompt alone (a
            # space before the query may merge into its first token).
            alone = self._tokenize(entry.model_id, head.rstrip(), True, False)
            k = _common_prefix(alone, full)
            if k == len(full):
                raise ValueError("the query has no tokens")
            prompts.append(full)
            n_tail.append(len(full) - k)
        return [float(x) for x in native.score_tails(prompts, n_tail, call.request_id)]

    def _rank_pair(self, model: int, info: dict[str, Any], query: str, document: str) -> list[int]:
        """A (query, document) pair as a reranker takes it: the model's rerank template when its GGUF has
        one (special tokens parsed, as its author wrote them), else the BERT-style convention
        [BOS] query [EOS] [SEP] document [EOS], each marker where the vocabulary asks for it."""
        template = info.get("rerank_template")
        if template:
            return self._tokenize(model, _fill(template, query, document), False, True)
        eos = info["eos"] if info["eos"] >= 0 else info["sep"]
        out: list[int] = [info["bos"]] if info["add_bos"] and info["bos"] >= 0 else []
        out += self._tokenize(model, query, False, False)
        if info["add_eos"] and eos >= 0:
            out.append(eos)
        if info["add_sep"] and info["sep"] >= 0:
            out.append(info["sep"])
        out += self._tokenize(model, document, False, False)
        if info["add_eos"] and eos >= 0:
            out.append(eos)
        return out


def _common_prefix(x: Sequence[int], y: Sequence[int]) -> int:
    n = min(len(x), len(y))
    return next((i for i in range(n) if x[i] != y[i]), n)


def _fill(template: str, query: str, document: str) -> str:
    """template with {query} and {document} replaced in one pass (a query holding "{document}" stays text)."""
    return _PLACEHOLDER.sub(lambda m: query if m.group(0) == "{query}" else document, template)


__all__ = ["ScoringHandlers"]
