"""The requests that decode a prompt into a context and generate from it: Eval, Generate and its draft form,
and a paused generation's Resume and AdoptGeneration.

A streaming request sends each piece as an EVENT as it is produced. A generation paused by an interrupt
sends its portable form with the pause, so that the client can take it on elsewhere (AdoptGeneration in
another context, after a move or a crash) as well as Resume it here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from .. import protocol as p
from ..errors import ContextError
from ..params import EvalResult, Result
from .grammar_trie import factor_literal_alternations
from .registry import Call, ContextEntry, Registry, handles


class GenerationHandlers(Registry):
    @handles(p.Eval)
    def eval(self, req: p.Eval, call: Call) -> EvalResult:
        entry = self._context(req.context)
        tokens = req.tokens or []
        if req.text is not None:
            add_special = entry.native.n_past() == 0 if req.add_special is None else req.add_special
            tokens = self._tokenize(entry.model_id, req.text, add_special, req.parse_special)
        # Token ids are checked (InvalidTokenError) by the native side, before anything is decoded.
        return msgspec.convert(entry.native.eval(tokens, call.request_id, call.prompt_progress(req.progress)),
                               EvalResult)

    @handles(p.Generate)
    def generate(self, req: p.Generate, call: Call) -> Result:
        entry = self._context(req.context)
        on_piece = self._on_piece(call) if req.stream else None
        return self._generated(entry, call, entry.native.generate(
            req.prompt, self._gen_params(req.params), call.request_id, on_piece, req.append,
            call.prompt_progress(req.progress)))

    @handles(p.Resume)
    def resume(self, req: p.Resume, call: Call) -> Result:
        entry = self._context(req.context)
        on_piece = self._on_piece(call) if req.stream else None
        return self._generated(entry, call, entry.native.resume(call.request_id, on_piece, req.origin))

    @handles(p.AdoptGeneration)
    def adopt_generation(self, req: p.AdoptGeneration, call: Call) -> None:
        self._context(req.context).native.adopt(self._gen_params(req.params), req.suspension, req.origin)

    def _generated(self, entry: ContextEntry, call: Call, result: dict[str, Any]) -> Result:
        if result["stop_reason"] == "paused" and call.emit is not None:
            # Its portable form travels with the pause, so that the client can go on with it elsewhere
            # (a move, or this worker's crash); a mirostat generation has none. One paused inside its
            # prompt holds nothing: the same request sent again goes on.
            suspension: dict[str, Any] | None = {"prompt": True}
            if entry.native.paused():
                try:
                    suspension = entry.native.suspension()
                except ContextError:
                    suspension = None
            call.emit({"paused": suspension})
        return msgspec.convert(result, Result)

    @handles(p.GenerateWithDraft)
    def generate_with_draft(self, req: p.GenerateWithDraft, call: Call) -> Result:
        entry = self._context(req.context)
        draft: str | Any = req.draft
        if isinstance(req.draft, int):
            if req.draft == req.context:
                raise ValueError("the draft context must be another context than the target")
            draft = self._context(req.draft).native
            if draft.embeddings:
                raise ContextError("the draft context is an embedding context: drafting needs a generation context")
        on_piece = self._on_piece(call) if req.stream else None
        return msgspec.convert(entry.native.generate_with_draft(
            req.prompt, self._gen_params(req.params), draft, req.n_draft, req.ngram_min, req.ngram_max,
            call.request_id, on_piece, req.append, call.prompt_progress(req.progress)), Result)

    def _gen_params(self, params: dict[str, Any]) -> dict[str, Any]:
        grammar = params.get("grammar")
        if isinstance(grammar, dict):
            return {**params, "grammar": self._grammar(grammar)}
        if isinstance(grammar, str) and grammar:
            return {**params, "grammar": factor_literal_alternations(grammar)}
        return params

    @staticmethod
    def _on_piece(call: Call) -> Callable[[str], None] | None:
        emit = call.emit
        if emit is None:
            return None

        def on_piece(piece: str) -> None:
            emit({"piece": piece})

        return on_piece


__all__ = ["GenerationHandlers"]
