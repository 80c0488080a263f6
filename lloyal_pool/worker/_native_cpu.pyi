"""Stub of the native module (native/*.cpp), one build per GPU variant: _native_cpu, _native_cuda, ...

Only worker processes import it. Every call that decodes releases the GIL. C++ errors arrive as the
exception classes of lloyal_pool.errors (the module imports them at load time), so the engine raises the
same types in-process as the client raises after a round trip.
"""

from collections.abc import Callable, Sequence
from typing import Any

variant: str  # "cpu", "cuda", "vulkan"

def build_info() -> dict[str, Any]:
    """llama.cpp version/commit/compiler, ggml system info, default thread count, variant."""

def set_log_level(level: int) -> None:
    """Minimum llama.cpp log level written to fd 2 (0 debug, 1 info, 2 warn, 3 error, 4 none)."""

def json_schema_to_grammar(schema_json: str) -> str:
    """llama.cpp's own JSON-schema -> GBNF converter. Raises GrammarError on an invalid schema."""

class Model:
    n_vocab: int
    def __init__(
        self,
        path: str,
        *,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        vocab_only: bool = False,
        progress: Callable[[float], bool] | None = None,
    ) -> None:
        """Loads a GGUF (GIL released). progress(fraction) returning False cancels the load.
        Raises ModelLoadError (with llama.cpp's last error line) on failure."""
    def info(self) -> dict[str, Any]:
        """desc, n_params, size, n_ctx_train, n_embd, n_layer, n_head, n_head_kv, n_swa, n_vocab,
        has_encoder, has_decoder, bos, eos, add_bos, chat_template (str or None), meta (dict[str, str])."""
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...
    def detokenize(self, tokens: Sequence[int], remove_special: bool, unparse_special: bool) -> str:
        """Invalid UTF-8 becomes U+FFFD. Raises InvalidTokenError for ids outside [0, n_vocab)."""
    def token_to_piece(self, token: int, special: bool) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], template: str | None, add_assistant: bool
    ) -> str:
        """(role, content) pairs through llama_chat_apply_template; template None = the model's own."""

class Context:
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_threads: int
    def __init__(self, model: Model, params: dict[str, Any]) -> None:
        """params keys (all optional): n_ctx, n_batch, n_ubatch, n_threads, n_threads_batch, n_seq_max,
        embeddings, rope_freq_base, rope_freq_scale, type_k, type_v (ggml type names, e.g. "f16", "q8_0"),
        swa_full (default True), flash_attn ("auto"/"on"/"off"). n_ctx 0 = the model's n_ctx_train.
        Raises ContextError for invalid values."""
    def set_interrupt_word(self, control: memoryview, index: int) -> None:
        """Points the context at the aligned u64 control[index*8:(index+1)*8]. While a call that decodes
        runs with request id R, it stops as soon as the word equals R: between tokens, and inside
        llama_decode through llama.cpp's abort callback. Keeps a reference to the buffer."""
    def n_past(self) -> int:
        """Tokens in the KV cache of sequence 0 (the length of the context's token history)."""
    def tokens(self) -> list[int]:
        """The token history of sequence 0."""
    def reset(self) -> None:
        """Clears the KV cache and the token history."""
    def eval(self, tokens: Sequence[int], request_id: int = 0) -> dict[str, Any]:
        """Decodes tokens at the end of sequence 0 in n_batch chunks without sampling; logits only for the
        last position. -> {n_tokens, n_past, interrupted, prompt_ms}. On interrupt the KV is trimmed back to
        the last whole chunk, so n_past always matches what is cached. Raises InvalidTokenError,
        ContextOverflowError (more tokens than n_ctx has room for: nothing is decoded), DecodeError."""
    def logits_into(self, out: memoryview) -> None:
        """Copies the logits of the last decoded position (n_vocab float32) into out (writable, C-contiguous,
        at least n_vocab * 4 bytes). Raises LloyalError when nothing has been decoded yet."""
    def generate(
        self,
        prompt: str | Sequence[int],
        params: dict[str, Any],
        request_id: int = 0,
        on_piece: Callable[[str], None] | None = None,
    ) -> dict[str, Any]:
        """The generation loop, in C++ with the GIL released except while calling on_piece.

        prompt: text (tokenized with add_special when the context is empty or cache_prompt is set, and
        parse_special) or token ids. An empty prompt continues from the context's current state.
        params (go-llama Params, every value means what it says; missing keys take the zero value):
          n_predict (<= 0: until the context is full), temperature (<= 0: greedy, no truncation samplers),
          top_k (0 off), top_p (0 or >= 1 off), min_p (0 off), typical_p (0 or >= 1 off),
          repeat_penalty (0 or 1 off), repeat_last_n (0: no history), presence_penalty, frequency_penalty,
          seed (uint32, 0 is a fixed seed), mirostat (0/1/2), mirostat_tau (0: 5.0), mirostat_eta (0: 0.1),
          ignore_eos, logit_bias (dict[int, float], -inf forbids), grammar (GBNF str, "" none),
          stop (list[str], matched across token boundaries), cache_prompt (bool).
        on_piece receives text as it becomes final: a piece is held back while it could be the start of a
        stop string or ends inside a UTF-8 sequence, so the pieces always concatenate to result["text"].
        -> {text, tokens, n_prompt, n_decoded, n_cached, stop_reason ("eos"|"length"|"stop"|"interrupted"),
            prompt_ms, decode_ms}.
        Raises InvalidTokenError, ContextOverflowError (prompt longer than the room in n_ctx),
        GrammarError (grammar does not parse), DecodeError; an exception from on_piece propagates after the
        KV is left consistent."""
