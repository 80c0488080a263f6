"""The requests on a model: loading and freeing it, its vocabulary and chat templates, its LoRA adapters.

A model owns its contexts and its adapters in this worker: freeing it frees them. Everything here but
SetLora (which configures a context) needs no context, and none of it decodes.
"""

from __future__ import annotations

import msgspec

from .. import protocol as p
from ..chat import ChatMessage, ToolCall, template_source
from ..errors import LoraError, ModelLoadError
from ..params import ModelInfo
from .file_checks import check_gguf_file
from .memory_cap import name_memory_limit_load
from .registry import Call, LoraEntry, ModelEntry, Registry, handles


class ModelHandlers(Registry):
    # -- models ---------------------------------------------------------------------------------------
    @handles(p.LoadModel)
    def load_model(self, req: p.LoadModel, call: Call) -> p.ModelLoaded:
        check_gguf_file(req.path)
        last = [-1.0]
        emit = call.emit

        def progress(fraction: float) -> bool:
            # llama.cpp reports hundreds of steps; a percent is enough for a progress bar.
            if emit is not None and (fraction - last[0] >= 0.01 or fraction >= 1.0):
                last[0] = fraction
                emit({"progress": fraction})
            return True

        try:
            native = self.native.Model(req.path, n_gpu_layers=req.n_gpu_layers, use_mmap=req.use_mmap,
                                       vocab_only=req.vocab_only, repack=req.repack, progress=progress)
        except (ModelLoadError, MemoryError) as exc:
            raise name_memory_limit_load(exc) from None
        model_id = self._new_id()
        self._models[model_id] = ModelEntry(native, req.path, int(native.n_vocab), set())
        return p.ModelLoaded(model=model_id, info=msgspec.convert(native.info(), ModelInfo))

    @handles(p.FreeModel)
    def free_model(self, req: p.FreeModel, call: Call) -> None:
        entry = self._model(req.model)
        for ctx in list(entry.contexts):
            self._free_context(ctx)
        for lora in [k for k, v in self._loras.items() if v.model_id == req.model]:
            del self._loras[lora]
        del self._models[req.model]

    # -- vocabulary and chat --------------------------------------------------------------------------
    @handles(p.Tokenize)
    def tokenize(self, req: p.Tokenize, call: Call) -> list[int]:
        return self._tokenize(req.model, req.text, req.add_special, req.parse_special)

    @handles(p.Detokenize)
    def detokenize(self, req: p.Detokenize, call: Call) -> str:
        return str(self._model(req.model).native.detokenize(req.tokens, req.remove_special, req.unparse_special))

    @handles(p.TokenToPiece)
    def token_to_piece(self, req: p.TokenToPiece, call: Call) -> bytes:
        return bytes(self._model(req.model).native.token_to_piece(req.token, req.special))

    @handles(p.ApplyChatTemplate)
    def apply_chat_template(self, req: p.ApplyChatTemplate, call: Call) -> str:
        native = self._model(req.model).native
        return str(native.apply_chat_template(req.messages, template_source(req.template), req.add_generation_prompt,
                                              req.tools))

    @handles(p.ChatFormat)
    def chat_format(self, req: p.ChatFormat, call: Call) -> p.ChatPrompt:
        native = self._model(req.model).native
        d = native.format_chat(req.messages, template_source(req.template), req.add_generation_prompt, req.tools,
                               req.tool_choice)
        return msgspec.convert(d, p.ChatPrompt)

    @handles(p.ParseChatOutput)
    def parse_chat_output(self, req: p.ParseChatOutput, call: Call) -> ChatMessage:
        native = self._model(req.model).native
        # The parser expects what follows the generation prompt, which a conversation ending in a user turn
        # yields: one stands in when the caller gives none.
        messages = req.messages or '[{"role": "user", "content": "?"}]'
        content, reasoning, calls = native.parse_chat(messages, template_source(req.template), req.tools,
                                                      req.tool_choice, req.text, req.partial)
        return ChatMessage(content=content, reasoning=reasoning,
                           tool_calls=[ToolCall(name=n, arguments=a, id=i) for n, a, i in calls])

    @handles(p.JsonSchemaToGrammar)
    def json_schema_to_grammar(self, req: p.JsonSchemaToGrammar, call: Call) -> str:
        return str(self.native.json_schema_to_grammar(req.schema))

    # -- LoRA adapters --------------------------------------------------------------------------------
    @handles(p.LoadLora)
    def load_lora(self, req: p.LoadLora, call: Call) -> p.LoraLoaded:
        model = self._model(req.model)
        check_gguf_file(req.path, LoraError, "LoRA adapter")
        native = self.native.Lora(model.native, req.path)
        lora_id = self._new_id()
        self._loras[lora_id] = LoraEntry(native, req.model)
        return p.LoraLoaded(lora=lora_id, alpha=float(native.alpha), meta=dict(native.meta()))

    @handles(p.FreeLora)
    def free_lora(self, req: p.FreeLora, call: Call) -> None:
        self._lora(req.lora)
        users = sorted(c for c, e in self._contexts.items() if req.lora in e.loras)
        if users:
            # The native adapter would live on inside those contexts: a closed adapter still in effect.
            raise LoraError(f"LoRA adapter {req.lora} is applied by context(s) {users}: set_lora([]) there "
                            f"(or close them) before closing it")
        del self._loras[req.lora]

    @handles(p.SetLora)
    def set_lora(self, req: p.SetLora, call: Call) -> bool:
        entry = self._context(req.context)
        weights = [(self._lora(lora).native, float(scale)) for lora, scale in req.adapters]
        # The native side checks the model, the scales and duplicates, and refuses a change under branches.
        changed = bool(entry.native.set_lora(weights))
        entry.loras = frozenset(lora for lora, scale in req.adapters if scale != 0.0)
        return changed


__all__ = ["ModelHandlers"]
