"""Stub of the native module (native/*.cpp): llama.cpp, with ggml's backends loaded at run time from the
module's folder (one CPU backend per instruction-set level, a GPU backend where one was built).

Only worker processes import it. Every call that decodes releases the GIL. C++ errors arrive as the
exception classes of lloyal_pool.errors (the module imports them at load time), so the engine raises the
same types in-process as the client raises after a round trip. Bad argument values that are not one of
those (an unknown generate param, seed 0xFFFFFFFF, a too-small buffer) raise ValueError; wrong types
TypeError.
"""

from collections.abc import Callable, Sequence
from typing import Any

from lloyal_pool.errors import ContextError

def backend_dir() -> str:
    """The folder the module was loaded from, where ggml's backends lie."""

def cpu_levels() -> list[dict[str, Any]]:
    """Every CPU backend of the build (libggml-cpu-<level>.so), best first for this CPU: name, path, score
    (ggml's; 0 when this CPU lacks an instruction set the level needs)."""

def load_cpu_backend(level: str = "auto") -> dict[str, Any]:
    """Loads the CPU kernels, once per process: "auto" is the best level this CPU runs (a level whose
    kernels use AMX only where amx_usable()), a name is that level. Returns kernels (the level), requested,
    reason (one line: why this level, and what was passed over), path, features (the backend's instruction
    sets, name -> "1"). Asking again for the same level (or "auto") returns the first choice. ValueError for
    a level the build does not hold; RuntimeError for one this CPU cannot run, or a second, other level.
    Everything that needs a device loads "auto" (or LLOYAL_POOL_CPU's level) first if nothing was loaded."""

def load_gpu_backend(name: str) -> tuple[int, str]:
    """Loads GPU backend name ("cuda", "vulkan") from backend_dir(): (its GPU devices, why there are none:
    the file missing, a library or the driver that did not load, no device visible). A backend without a
    device is unloaded again."""

def amx_usable() -> tuple[bool, str]:
    """(whether AMX tile instructions run in this process, why not): the CPU has them, the kernel grants
    their tile data (arch_prctl), and a tile instruction does not kill a child process that tries one."""

def gpu_device_count() -> int:
    """The GPU devices (gpu or igpu) of the backends loaded."""

def build_info() -> dict[str, Any]:
    """llama.cpp version/commit/compiler, ggml system info, default thread count, the CPU kernels.

    Keys: cpu (load_cpu_backend's dict), llama_cpp (one summary line), llama_version, build_number, commit,
    build_info, compiler, build_target, ggml_version, ggml_commit, system_info, default_threads, hardware_concurrency,
    supports_mmap, supports_mlock,
    supports_gpu_offload, max_devices, max_parallel_sequences."""

def devices() -> list[dict[str, Any]]:
    """The devices ggml's backend registry holds, in its order: name, description, backend, type ("cpu",
    "gpu", "igpu", "accel"), memory_free, memory_total (bytes), kernels (the CPU's: the level loaded; a
    GPU's: its backend)."""

def set_log_level(level: int) -> None:
    """Minimum llama.cpp log level written to fd 2 (0 debug, 1 info, 2 warn, 3 error, 4 none); default 2.
    Lines look like "[llama.cpp W] ...". Warnings and errors are remembered whatever the level, for the
    messages of ModelLoadError/ContextError/GrammarError. ValueError outside [0, 4]."""

def _test_ggml_assert(value: int) -> None:
    """Test only: a real GGML_ASSERT that fails for 0x6a6d, aborting the process (SIGABRT) after writing
    "lloyal worker: GGML abort: <file:line: GGML_ASSERT(...) failed>" to fd 2."""

def _grammar_slices_check(model: Model, gbnf: str, tokens: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Test only: before and after accepting each token in turn, the tokens llama.cpp's own grammar
    sampler allows over the whole vocabulary, and those ours allows (sliced, interruptible)."""

def json_schema_to_grammar(schema_json: str) -> str:
    """llama.cpp's own JSON-schema -> GBNF converter. Raises GrammarError on an invalid schema."""

class Model:
    @property
    def n_vocab(self) -> int: ...
    @property
    def path(self) -> str: ...
    def __init__(
        self,
        path: str,
        *,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        vocab_only: bool = False,
        repack: bool = True,
        progress: Callable[[float], bool] | None = None,
    ) -> None:
        """Loads a GGUF (GIL released). progress(fraction) returning False cancels the load (None or a
        truthy value continues; an exception from it cancels the load and propagates).
        Raises ModelLoadError (with llama.cpp's last error line(s)) on failure. n_gpu_layers < 0: all.
        repack=False keeps the weights as the file has them (no CPU repacking, no AMX buffers): what a
        batch_invariant context needs."""
    def info(self) -> dict[str, Any]:
        """desc, n_params, size, n_ctx_train, n_embd, n_layer, n_head, n_head_kv, n_swa, n_vocab,
        has_encoder, has_decoder, bos, eos, add_bos, chat_template (str or None), meta (dict[str, str]).
        Also: path, vocab_only, ftype, vocab_type, is_recurrent, is_hybrid, eot, add_eos, eog_tokens,
        hidden_tokens, sep, add_sep, n_embd_out (the width of an embedding), rerank_template (the GGUF's
        tokenizer.chat_template.rerank, or None).
        Token ids (bos, eos, eot) are -1 when the vocabulary has none. meta leaves out array values."""
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...
    def detokenize(self, tokens: Sequence[int], remove_special: bool, unparse_special: bool) -> str:
        """Invalid UTF-8 becomes U+FFFD. Raises InvalidTokenError for ids outside [0, n_vocab)."""
    def token_to_piece(self, token: int, special: bool) -> bytes:
        """Raises InvalidTokenError for an id outside [0, n_vocab)."""
    def is_eog(self, token: int) -> bool:
        """Raises InvalidTokenError for an id outside [0, n_vocab)."""
    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], template_source: str, add_generation_prompt: bool,
        tools_json: str
    ) -> str:
        """(role, content) pairs through llama.cpp's Jinja chat engine (common/chat); template_source "" =
        the model's own. tools_json: an OpenAI-style tools array ("" none). TemplateError when the model has
        no template and none is given (llama.cpp itself would silently use ChatML), or the template does
        not parse or render."""
    def format_chat(
        self, messages_json: str, template_source: str, add_generation_prompt: bool, tools_json: str,
        tool_choice: str
    ) -> dict[str, Any]:
        """OpenAI-style messages (a JSON array) through common/chat: prompt, format, grammar, grammar_lazy,
        trigger_words, trigger_patterns (anchored where the format matches whole outputs), trigger_tokens,
        preserved_tokens, additional_stops, generation_prompt. TemplateError as apply_chat_template;
        ValueError for a tool_choice other than "auto", "required" or "none"."""
    def parse_chat(
        self, messages_json: str, template_source: str, tools_json: str, tool_choice: str, text: str,
        partial: bool
    ) -> tuple[str, str, list[tuple[str, str, str]]]:
        """An assistant turn generated after the messages, through the parser of the template's format:
        (content, reasoning, [(name, arguments JSON, id)]). TemplateError for text the format cannot
        parse (unless partial)."""

class Lora:
    """A LoRA adapter loaded for one model; it keeps that model alive and is freed when the last reference
    (this object, or a context applying it) goes."""
    def __init__(self, model: Model, path: str) -> None:
        """Loads a LoRA adapter GGUF (GIL released). Raises LoraError, with llama.cpp's reason, for a
        missing file, a directory, a file that is not a LoRA adapter GGUF, an adapter of another
        architecture or with tensors the model lacks or shapes other than the model's, or a vocab_only
        model."""
    @property
    def path(self) -> str: ...
    @property
    def alpha(self) -> float:
        """adapter.lora.alpha (0.0 when the file has none)."""
    def meta(self) -> dict[str, str]:
        """The adapter GGUF's scalar metadata as strings (array values left out)."""

def set_heartbeat_word(buffer: memoryview | None, index: int = 0) -> None:
    """Points the heartbeat (advanced at every interrupt check) at u64 word `index` of a writable buffer;
    None detaches it."""

def sampler_fields() -> list[str]:
    """The sampler params' names in the order native/sampling.hpp declares them (LLOYAL_SAMPLER_FIELDS)."""

class RegionFullError(ContextError):
    """No room in the worker's shared-memory region for a context's logits row (Context's constructor).
    The engine turns it into a ContextError naming the shm_bytes that would hold one more."""

class Arena:
    """The bulk area of a worker's shared region, in page-aligned blocks the native side hands out: one
    per context (its logits row) and one per branch (its snapshot), each freed with its owner. One per
    worker, shared by its contexts; the region's buffer export is held while the arena or any context
    made with it lives. LloyalError naming Pool(shm_bytes=...) when it is full (BranchError for a branch)."""
    def __init__(self, region: Any, bulk_offset: int, page: int) -> None:
        """region: a writable buffer, 8-byte aligned; blocks start at bulk_offset (a multiple of page)."""
    @property
    def free_bytes(self) -> int: ...
    @property
    def used_end(self) -> int:
        """Where the blocks in use end (from the region's start): the rest of the region is free."""

class Context:
    @property
    def n_ctx(self) -> int:
        """As asked (0: n_ctx_train), although llama.cpp allocates cells to a multiple of 256."""
    @property
    def n_batch(self) -> int:
        """As llama.cpp applies it (at most its 256-padded n_ctx)."""
    @property
    def n_ubatch(self) -> int:
        """At most n_batch."""
    @property
    def n_seq_max(self) -> int: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def n_threads_batch(self) -> int: ...
    def set_threads(self, n_threads: int, n_threads_batch: int) -> None:
        """The threads llama.cpp computes with from now on (at most: see adapt_threads); n_threads and
        n_threads_batch keep the values the context was created with. ValueError below 1."""
    @property
    def last_decode_ms(self) -> float:
        """Time inside llama_decode during the last call that decoded (eval, generate, commit, prefill, step,
        clear_and_reseed)."""
    @property
    def model(self) -> Model: ...
    @property
    def logits_offset(self) -> int:
        """Where the context's logits row (write_logits) lies in the region."""
    @property
    def embeddings(self) -> bool:
        """Created with embeddings=True: an embedding context."""
    @property
    def pooling(self) -> str | None:
        """An embedding context's pooling as llama.cpp resolved it ("none", "mean", "cls", "last", "rank");
        None for a generation context."""
    def __init__(self, model: Model, params: dict[str, Any], arena: Arena) -> None:
        """params keys (all optional): n_ctx, n_batch, n_ubatch, n_threads, n_threads_batch, n_seq_max,
        embeddings, pooling ("none", "mean", "cls", "last", "rank"; embeddings=True only), rope_freq_base,
        rope_freq_scale, type_k, type_v (ggml type names, e.g. "f16", "q8_0"), swa_full (default True),
        flash_attn ("auto"/"on"/"off"), adapt_threads (default True: in a CPU build, decode with fewer
        threads while other processes hold the cores; native/thread_governor.hpp). n_ctx 0 = the model's
        n_ctx_train. Raises ContextError for invalid values.

        With embeddings=True: pooling missing = the model's GGUF pooling_type, or "mean" when it declares
        none; n_batch and n_ubatch default to 512 together, or both to the one given (llama.cpp pools per
        ubatch); n_seq_max defaults to min(16, n_batch). pooling "rank" needs a model whose GGUF declares
        rank pooling (a reranker), and any pooling needs embeddings=True: ContextError otherwise.

        A missing (or None) key takes llama.cpp's default (n_ctx 512, n_batch 2048, n_ubatch 512,
        n_seq_max 1, f16 cache, flash_attn "auto"), threads: build_info()["default_threads"],
        n_threads_batch: n_threads. rope_freq_base/scale 0 = the model's. Unknown keys, wrong types,
        n_ctx < 0, n_batch/n_ubatch/n_threads < 1, n_threads > 512, n_seq_max outside
        [1, max_parallel_sequences], an n_ctx whose KV cache would not fit the machine's memory (CPU build)
        or int32 positions, a vocab_only model, and llama.cpp refusing the context all raise ContextError."""
    def set_interrupt_word(self, control: memoryview | None, index: int = 0) -> None:
        """Points the context at the aligned u64 control[index*8:(index+1)*8]. While a call that decodes
        runs with request id R, it stops as soon as the word equals R: between tokens, and inside
        llama_decode through llama.cpp's abort callback. Keeps a reference to the buffer.

        Any C-contiguous buffer works. The buffer export is held until the next call or the context is
        freed (a SharedMemory cannot close while it is): set_interrupt_word(None) releases it.
        ValueError if the word is past the end or not 8-byte aligned."""
    def n_past(self) -> int:
        """Tokens in the KV cache of sequence 0 (the length of the context's token history)."""
    def tokens(self) -> list[int]:
        """The token history of sequence 0."""
    def memory_breakdown(self) -> list[dict[str, Any]]:
        """Per ggml buffer type, the bytes the context and its model hold: buffer, device ("" when none),
        host, model (weights), context (KV cache), compute (GIL released)."""
    def reset(self) -> None:
        """Clears the KV cache and the token history."""
    def set_lora(self, adapters: Sequence[tuple[Lora, float]]) -> bool:
        """Replaces the context's whole LoRA configuration ([] clears it). Entries of scale 0 count as absent.
        The same configuration again (any order) changes nothing and returns False. A different one
        empties the token history and the KV cache and returns True; LoraError, with nothing changed,
        while the context holds branches or detached sequences. LoraError also for an adapter loaded
        for another Model object, a non-finite scale, or one adapter twice; TypeError for entries that
        are not (Lora, float) pairs."""
    def eval(self, tokens: Sequence[int], request_id: int = 0,
             on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Decodes tokens at the end of sequence 0, one ubatch per llama_decode, without sampling; logits
        only for the last position; on_progress(done, total) after each ubatch.
        -> {n_tokens, n_past, interrupted, prompt_ms, n_threads (of its last decode)}. On interrupt the KV
        is trimmed back to the last whole chunk, so n_past always matches what is cached. Raises InvalidTokenError,
        ContextOverflowError (more tokens than n_ctx has room for: nothing is decoded), DecodeError.

        n_tokens: how many of these tokens are now in the cache (fewer than given when interrupted).
        (With an SWA cache without swa_full, trimming may have to clear the whole cache: n_past says.)"""
    def generate_with_draft(
        self,
        prompt: str | Sequence[int],
        params: dict[str, Any],
        draft: str | Context,
        n_draft: int = 8,
        ngram_min: int = 2,
        ngram_max: int = 4,
        request_id: int = 0,
        on_piece: Callable[[str], None] | None = None,
        append: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """generate with speculative decoding: each step, the drafter proposes up to n_draft tokens to follow
        the target's next token; the target decodes them in one batch (logits for every row) and its own
        sampler chain walks the rows, keeping drafts while it chooses the same token. Every emitted token is
        the target sampler's choice, so the arguments, contract and result are generate()'s, plus n_drafted
        and n_accepted. draft: "ngram" (the latest earlier occurrence of the context's last ngram_max down
        to ngram_min tokens, and what followed it) or another Context whose model has the same vocabulary
        (ContextError otherwise), used greedily and held busy for the call. ValueError for n_draft outside
        [1, 1024], bad ngram sizes, or draft being this context; ContextError on a recurrent model or a
        sliding-window one without swa_full."""
    def write_logits(self) -> None:
        """Copies the logits of the last decoded position (n_vocab float32) into the context's row of the
        region, at logits_offset. Raises LloyalError when nothing has been decoded yet (also after a
        reset, or a decode that was interrupted)."""
    def resume(self, request_id: int = 0, on_piece: Callable[[str], None] | None = None,
               origin: int = 0) -> dict[str, Any]:
        """Goes on with the generation paused on this context: one whose request the interrupt word named
        with bit 63 set stopped at a token boundary (stop_reason "paused", everything it streamed decoded)
        and kept its sampler, text and budget. The result is the whole generation's, as generate's.
        ContextError when nothing is paused, the paused one is not ``origin``'s (the id of the request that
        started it; 0: any), or the context changed since the pause (another call)."""
    def paused(self) -> bool:
        """Whether a paused generation waits on this context."""
    def suspension(self) -> dict[str, Any]:
        """The paused generation's portable form: {tokens, n_sampled, emitted (bytes of text streamed),
        draws (per sampler stage after penalties and DRY: (applies to one candidate, to several)),
        n_prompt, n_cached, prompt_ms}. ContextError when nothing is paused, or it samples with mirostat."""
    def adopt(self, params: dict[str, Any], suspension: dict[str, Any], origin: int = 0) -> None:
        """Takes in a paused generation from another context (suspension(), with the params it was
        generated with) on a context that holds the same history and its logits (its state loaded):
        resume() then goes on with it exactly (the sampler rebuilt, its windows primed from the history,
        the grammar fed the generated tokens, the PRNG draws replayed). ContextError when the history does
        not end with its tokens, ValueError for a malformed suspension."""
    def generate(
        self,
        prompt: str | Sequence[int],
        params: dict[str, Any],
        request_id: int = 0,
        on_piece: Callable[[str], None] | None = None,
        append: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """The generation loop, in C++ with the GIL released except while calling on_piece/on_progress.

        prompt: text (tokenized with parse_special, and with add_special unless it is appended to a
        non-empty history) or token ids. It is the whole input: the history is replaced by it (see
        cache_prompt). append=True adds it to the history instead; an empty prompt then continues from
        the context's current state (empty without append: ValueError). on_progress(done, total): the
        prompt's decode, after each ubatch.
        params (go-llama Params, every value means what it says; missing keys take the zero value):
          n_predict (<= 0: until the context is full), temperature (<= 0: greedy, no truncation samplers),
          top_k (0 off), top_p (0 or >= 1 off), min_p (0 off), typical_p (0 or >= 1 off),
          repeat_penalty (0 or 1 off), repeat_last_n (0: no history), presence_penalty, frequency_penalty,
          top_n_sigma (0 off), xtc_probability (0 off, at most 1), xtc_threshold ([0, 1]; > 0.5 never acts),
          dry_multiplier (0 off), dry_base (0: 1.75, else >= 1), dry_allowed_length,
          dry_penalty_last_n (-1: the context size, 0 off), dry_sequence_breakers (list[str], each 1-40
          bytes; missing: none),
          seed (uint32, 0 is a fixed seed), mirostat (0/1/2), mirostat_tau (0: 5.0), mirostat_eta (0: 0.1),
          ignore_eos, logit_bias (dict[int, float], -inf forbids), grammar (GBNF str, "" none, or a grammar
          dict as branches take it, lazy triggers included),
          stop (list[str], matched across token boundaries), cache_prompt (bool), cache_bit_exact (bool),
          render_special (bool: text shows control tokens and markers such as <start_of_image>),
          logprobs (int in [0, 20]: each generated token's log-probability and that many alternatives).
        on_piece receives text as it becomes final: a piece is held back while it could be the start of a
        stop string or ends inside a UTF-8 sequence, so the pieces always concatenate to result["text"].
        -> {text, tokens, n_prompt, n_decoded, n_cached, stop_reason ("eos"|"length"|"stop"|"interrupted"),
            prompt_ms, decode_ms, logprobs (with the logprobs param: one (token, logprob, piece,
            [(token, logprob, piece), ...]) per token, log-softmax of the raw logits it was sampled from)}.
        Raises InvalidTokenError, ContextOverflowError (prompt longer than the room in n_ctx),
        GrammarError (grammar does not parse), DecodeError; an exception from on_piece propagates after the
        KV is left consistent.

        Details:
          - A key present with value None counts as missing; an unknown key is a ValueError. seed must be
            in [0, 2**32-2] (llama.cpp reads 0xFFFFFFFF as "random"). repeat_last_n -1: the whole context.
            stop may also be one str; empty stop strings are a ValueError. logit_bias values: finite or
            -inf. ignore_eos bans every EOG token (bias -inf), not only eos.
          - temperature <= 0 wins over mirostat (greedy). Tokens are chosen by the sampler branches use
            (native/sampling.hpp, chain_sampler): logit_bias, penalties, DRY, then greedy | temp+mirostat |
            top_n_sigma, top_k, typical, top_p, min_p, XTC, temp, dist(seed); a grammar checks the free
            choice and masks the vocabulary only when it refuses it. So a generate and a branch with the
            same params and seed choose the same tokens from the same logits. The penalties and DRY also
            see the context's last repeat_last_n / dry_penalty_last_n tokens before the generation
            (prompt included).
          - Everything that can be refused (params, tokens, grammar, overflow) is refused before the KV
            cache is touched.
          - cache_prompt: the longest common prefix of the history and the prompt is kept and only the
            rest decoded (n_cached = tokens kept). The prompt's last token is decoded again for its logits,
            unless the history is exactly the prompt and its logits are still there (nothing decoded). If
            the cache cannot keep that prefix (an SWA cache without swa_full that already dropped what
            the prefix needs) it is cleared and the whole prompt decoded (n_cached 0). Without
            cache_prompt the history is cleared and the whole prompt decoded.
            llama.cpp's CPU kernels are not batch-invariant (a row's logits depend on the ubatch it was
            computed in), so re-decoding just the tail of a cached prompt can change a greedy result on
            a near tie. cache_bit_exact: when the cache up to the start of the ubatch that holds the
            prefix's end is exactly what a decode from scratch produces, the prefix is cut back to that
            ubatch start (< n_ubatch more tokens to decode), and the result equals an uncached run;
            otherwise (generated tokens in the prefix) the whole prefix is kept. Chunks follow the
            ubatches of a decode from position 0.
          - tokens: the generated tokens, excluding a final EOG token (which is not in text either), but
            including the token that completed a stop string (the stop string and what follows it are
            cut from text). Every token in tokens is also decoded, so afterwards the history is prompt +
            tokens and generate("", append=True) continues exactly. n_decoded counts sampled tokens, the EOG included.
          - "length": n_predict reached, or no room left to decode another token.
          - Also in the result: n_past (the history length afterwards).
          - ValueError for an empty prompt (without append, or on an empty context)."""

    def embed(self, inputs: Sequence[Sequence[int]], normalize: bool, request_id: int = 0) -> dict[str, Any]:
        """An embedding context's vectors of each token list in inputs, one sequence per input, as few
        llama_decode calls as n_seq_max and n_ubatch (at most n_ctx tokens) allow, starting from an empty
        cache and leaving it empty. -> {offset, rows, width}: the float32 rows of every input, one after
        the other, at offset of the region (a block the context holds until its next embed call); rows[i]
        is input i's count (its token count with pooling "none", else 1); width is n_embd_out, or the
        classifier's n_cls_out with pooling "rank". normalize: each row to L2 norm 1 (not with "rank").
        Raises ContextError (a generation context), ContextOverflowError (an input longer than one decode
        takes), ResultTooLargeError (the rows do not fit the region; nothing is decoded),
        InvalidTokenError, ValueError (no inputs, or an empty one), DecodeError, InterruptedByClient."""
    def score_tails(self, prompts: Sequence[Sequence[int]], n_tail: Sequence[int], request_id: int = 0) -> list[float]:
        """A generation context that holds nothing (no history, no branches, else ContextError): per prompt,
        the mean log-probability of its last n_tail[i] tokens, each given all the tokens before it. The
        prompts are decoded side by side, one sequence each, n_seq_max and n_batch (at most n_ctx) tokens
        per llama_decode; the cache is empty again afterwards. Raises ContextError (an embedding context),
        ValueError (n_tail[i] not in [1, len(prompts[i]) - 1]), ContextOverflowError (a prompt longer than
        one decode takes, or an n_tail needing more than 256 MiB of logits rows; the prompts are spread over
        decodes to keep each within that), InvalidTokenError, DecodeError, InterruptedByClient."""

    # -- whole-context state (native/state.cpp) and scoring (native/score.cpp) -------------------------
    def save_state(self, path: str) -> int:
        """Writes the sequence-mode context to path (created or truncated; mapped, so llama.cpp writes the
        KV memory straight into it) and returns its size: a 256-byte header (magic "LLOYALST", format
        version, total size, a checksum of the whole file, the model's fingerprint: a hash of its
        description and scalar GGUF metadata, n_params, size, n_vocab, n_embd, n_layer, n_head_kv; the
        history length, n_batch/n_ubatch and how much of the history is a fresh decode), the token
        history, the logits of the last position (when there are any), then llama_state_get_data's bytes.
        ContextError when the context holds branches or nothing; StateError when the file cannot be
        written (no room: reserved with posix_fallocate before it is mapped)."""
    def load_state(self, path: str) -> int:
        """Replaces the context's cache, history and last logits with a file save_state wrote; returns
        the history length. Checked before anything changes: StateError for a missing or unreadable file,
        garbage, a truncated or corrupted file (size, checksum), another format version or another model
        (fingerprint); ContextOverflowError for a history longer than n_ctx; ContextError when the context
        holds branches. What llama.cpp refuses after that (a cache of another type or layout) puts the
        context's previous state back and raises StateError. A history whose chunks were cut with the same
        n_batch/n_ubatch keeps its fresh-decode mark (cache_prompt's reuse stays result-neutral)."""
    def score(self, tokens: Sequence[int], request_id: int = 0, n_logprobs: int = -1) -> dict[str, Any]:
        """Replaces the history with tokens (decoded from position 0, every position with its output row,
        at most 64 MiB of logits per llama_decode) and scores each token after the first by the log-softmax
        of the row before it, computed here. -> {n_tokens, n_scored (n_tokens - 1), nll (sum, nats),
        perplexity (exp(nll / n_scored))}. Afterwards the context holds tokens, with the last position's
        logits. ValueError for fewer than two tokens, ContextOverflowError past n_ctx, ContextError with
        branches, InterruptedByClient (the history then holds the whole chunks decoded before).
        n_logprobs >= 0 adds ``logprobs``: per scored token (token, logprob, piece, top n_logprobs)."""
    def score_choices(self, choices: Sequence[Sequence[int]], request_id: int = 0) -> list[dict[str, Any]]:
        """Scores each choice as the continuation of the history: its first token by the kept logits of the
        last position, each further token by the row of the one before it, so n_scored = n_tokens. The
        history's prefix is shared with sequences 1.. (llama_memory_seq_cp) and the choices decoded
        together, one per sequence (sequence 0 included, unless a sliding-window cache is not swa_full),
        as many per group as there are sequences and free cells; with n_seq_max 1 one at a time. Every
        sequence is rolled back afterwards and the last logits kept, so the context is as before.
        ValueError for no choices or an empty one, ContextOverflowError for a choice past n_ctx,
        ContextError for an empty context, one without last logits, or branches; InterruptedByClient
        (nothing changed)."""

    # -- branches: this stub is their contract (docs/BRANCHES.md explains them to users) -----------------
    # Every method takes the context's busy guard; those that decode release the GIL and honour the
    # interrupt word (checked before every llama_decode and inside it, through the abort callback).
    # Handles are u32 (generation << 16 | slot), never 0; a handle that is not live raises
    # StaleHandleError. Sampler params of a branch: exactly the sampler keys of generate() (temperature,
    # top_k, top_p, min_p, typical_p, top_n_sigma, xtc_probability, xtc_threshold, dry_multiplier,
    # dry_base, dry_allowed_length, dry_penalty_last_n, dry_sequence_breakers, repeat_penalty,
    # repeat_last_n, presence_penalty, frequency_penalty, seed, mirostat, mirostat_tau, mirostat_eta);
    # anything else (n_predict, grammar, ...) is a ValueError. A grammar is a dict {"gbnf": str,
    # "root": str = "root", "lazy": bool = False, "trigger_words": [str], "trigger_patterns": [str],
    # "trigger_tokens": [int]}, checked when it is set (GrammarError, InvalidTokenError, ValueError).
    # create, adopt and fork return (handle, offset): the branch's snapshot is the n_vocab float32 at that
    # offset of the arena's region, owned by the branch and freed with it (BranchError when the region
    # is full).
    def branch_create(self, params: dict[str, Any], grammar: dict[str, Any] | None = None,
                      request_id: int = 0) -> tuple[int, int]:
        """A root at position 0 without logits. BranchError when no sequence is free; ContextError for a
        sequence-mode history or a cache that cannot roll back (recurrent model, sliding window without
        swa_full). With request_id, interrupting it while a large grammar is set up raises
        InterruptedError (nothing created)."""
    def branch_adopt(self, seq: int, params: dict[str, Any],
                     grammar: dict[str, Any] | None = None, request_id: int = 0) -> tuple[int, int]:
        """A root over a detached sequence (detached, or loaded with state_seq_set/_load_file), at
        pos_max + 1, without logits until its next prefill/commit. BranchError for a free sequence or a
        branch's. request_id as for branch_create."""
    def branch_fork(self, src: int) -> tuple[int, int]:
        """A child sharing the parent's KV cells, with a copy of its sampler (PRNG included), grammar, bias,
        perplexity sums and snapshot. BranchError when no sequence is free."""
    def branch_prune(self, branch: int, subtree: bool = False) -> list[int]:
        """Frees the branch (and with subtree its descendants, leaves first); returns the handles freed.
        BranchError when it has children and subtree is False."""
    def branch_retain_only(self, branch: int) -> list[int]:
        """Keeps only this branch's cells; every other branch and detached sequence goes (handles
        returned). The branch becomes a root."""
    def branch_detach(self, branch: int) -> int:
        """Frees the branch but keeps its sequence and cells as a raw (detached) sequence: its id."""
    def free_seq(self, seq: int) -> None:
        """Frees a detached sequence. BranchError for a branch's sequence, ValueError for a free one."""
    def branch_info(self, branch: int) -> dict[str, Any]:
        """handle, seq, position, fork_head, parent (0 none), children, has_logits, n_accepted,
        perplexity (inf before the first commit), sampling_perplexity (inf when nothing counted),
        last_token (the last produced token, -1 none)."""
    def branches(self) -> list[int]:
        """Live handles in creation order."""
    def branch_set_params(self, branch: int, params: dict[str, Any]) -> None:
        """A new sampler chain (PRNGs from params' seed, penalty/DRY windows re-primed from the committed
        tokens); params equal to the current ones change nothing."""
    def branch_set_grammar(self, branch: int, grammar: dict[str, Any] | None, request_id: int = 0) -> None:
        """request_id as for branch_create: interrupted, the branch keeps the grammar it had."""
    def branch_set_logit_bias(self, branch: int, bias: dict[int, float] | Sequence[tuple[int, float]] | None) -> None:
        """Replaces the bias (a token's entries add up; -inf bans; +inf and NaN are a ValueError)."""
    def branch_reseed(self, branch: int, seed: int) -> None:
        """Restarts every sampler that draws (dist, XTC, mirostat) from seed; penalty windows are kept."""
    def branch_set_logits(self, branch: int, logits: Any) -> None:
        """snapshot := logits (a buffer of exactly n_vocab float32)."""
    def branch_merge_logits(self, dst: int, experts: Sequence[int], alpha: float) -> None:
        """dst.snapshot += alpha * sum(expert snapshots); every branch needs logits (BranchError; dst may be
        one of the experts). After set_logits/merge_logits a produced-but-uncommitted sample no longer
        counts for the sampling perplexity."""
    def produce(self, branches: Sequence[int], request_id: int = 0) -> list[tuple[int, bytes, bool, Any]]:
        """(token, piece, is_stop, logprobs) per branch, sampled from its snapshot; nothing but the PRNGs
        changes. logprobs: (token, logprob, piece, top) for a branch with branch_set_logprobs, else None.
        Token -1 (piece b"", is_stop True) when nothing is allowed. BranchError: duplicates, no logits.
        InterruptedByClient when the interrupt word names request_id during a long grammar step: then
        no branch changed."""
    def branch_set_logprobs(self, branch: int, logprobs: int) -> None:
        """From now on produce and step report each of the branch's tokens' logprobs with that many
        alternatives (at most 20; -1: none); forks inherit it. ValueError out of range."""
    def branch_set_text(self, branch: int, stop: Sequence[str], render_special: bool = False,
                        logprobs: int = -1) -> None:
        """From now on the branch makes text of what it produces, as generate does: stop strings matched
        across tokens, what could still become one or is an incomplete UTF-8 sequence held back, control
        tokens' text left out unless render_special; logprobs >= 0 (at most 20): produce_text reports each
        token's logprobs with that many alternatives. ValueError for an empty stop string."""
    def produce_text(self, branches: Sequence[int], request_id: int = 0) -> list[tuple[int, bool, bytes, bytes, bool,
                                                                                       Any]]:
        """produce() for branches that make text (branch_set_text; BranchError for one that does not):
        (token, is_stop, text that became final, text held back after it, stop string completed,
        logprobs) per branch. A stop token adds no text (and no logprobs); after a stop string the
        branch's text ends before it. logprobs: (token, logprob, piece, [(token, logprob, piece), ...]),
        of the raw logits the token was sampled from (log-softmax), or None."""
    def commit(self, pairs: Sequence[tuple[int, int]], request_id: int = 0) -> None:
        """One llama_decode for every (branch, token) (at most n_batch, else ValueError). All or nothing:
        GrammarError (a token the grammar refuses), DecodeError (KV full), InterruptedByClient leave every
        branch exactly as it was. BranchError: duplicates, no logits yet.

        Per branch, before the decode: the grammar accepts the token on a clone; the model surprisal is
        max(0, lse - z[token]) under the pre-decode snapshot (skipped when not finite). After a successful
        decode: the grammar clone is swapped in, the chain accepts, the perplexity sums grow (the sampling
        surprisal counts when the token is the one just produced from this snapshot), snapshot := the
        branch's row, position += 1. A failed decode removes the cells it added (seq_rm)."""
    def prefill(self, items: Sequence[tuple[int, Sequence[int]]], request_id: int = 0,
                on_progress: Callable[[int, int], None] | None = None,
                commits: Sequence[tuple[int, int]] = (), loras: Sequence[tuple[Lora, float]] | None = None) -> None:
        """Tokens into each branch (on_progress(done, total) after each chunk), packed first-fit into
        n_batch chunks (an item longer than n_batch gets chunks of its own, in order); logits for each
        item's last token; no grammar/penalty/perplexity accept (prefill is context, not a choice).
        ``commits`` (branch, token) are committed exactly as commit() does, their tokens at the head of the
        first chunk (more than n_batch: ValueError). All or nothing like commit. Empty items are skipped;
        a branch named twice in items and commits raises BranchError. ``loras``: the (adapter, scale)
        configuration these decodes run under instead of the context's (set_lora's checks, LoraError); the
        caller keeps each branch's cells under one configuration."""
    def step(self, branches: Sequence[int], request_id: int = 0) -> list[tuple[int, bytes, bool, Any]]:
        """produce, then one commit of every branch whose token is not a stop. More than n_batch branches
        (ValueError) or an interrupt already requested (InterruptedByClient) fail before sampling: a step
        that commits nothing leaves the PRNGs and last samples as they were."""
    def clear_and_reseed(self, sinks: Sequence[int], tail: Sequence[int], request_id: int = 0) -> None:
        """With exactly one branch and no detached sequence (else BranchError): clears the cache and
        decodes sinks + tail from position 0 into it, keeping handle, sampler, grammar and perplexity.
        ValueError when both are empty. On failure the branch's cells are restored."""
    def decode(self, tokens: Sequence[int], pos: int, seq: int, request_id: int = 0) -> float:
        """Decodes tokens at positions pos, pos + 1, ... of seq, a detached sequence (a free one is
        leased as detached), which they continue: ValueError unless pos is one past its last position.
        The last token's logits go to the context's row (write_logits leaves them). BranchError for a
        branch's sequence, ContextError in sequence mode, ContextOverflowError past n_ctx; a failed or
        interrupted decode removes what it added. Returns the ms spent decoding."""
    def sample(self, params: dict[str, Any], grammar: int | None = None, request_id: int = 0) -> int:
        """A token from the context's last logits (a decode()'s, else eval's or generate's) with a chain
        of params kept across calls while params stay the same, and accepted into it. grammar: a grammar
        handle applied first and moved on by the token. GrammarError when nothing can be sampled."""
    def grammar_new(self, grammar: dict[str, Any] | None, request_id: int = 0) -> int:
        """A grammar handle of this context (positive). GrammarError for one that does not parse."""
    def grammar_clone(self, handle: int) -> int: ...
    def grammar_mask(self, handle: int, request_id: int = 0) -> int:
        """Writes n_vocab float32 (0 allowed next, -inf not) into the handle's block; its offset."""
    def grammar_accept(self, handle: int, token: int, request_id: int = 0) -> None:
        """Moves the grammar on by token; GrammarError (unchanged) for a token it does not allow."""
    def grammar_free(self, handle: int) -> None:
        """StaleHandleError (as every grammar_* call) for a handle that is not live."""
    def kv_seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Raw KV writes (cp, keep, rm) only go to detached sequences: BranchError for a branch's or a free
        sequence (and for keep while branches live), ContextError in sequence mode, ValueError for a seq
        outside [0, n_seq_max)."""
    def kv_seq_keep(self, seq: int) -> None: ...
    def kv_seq_rm(self, seq: int, p0: int, p1: int) -> bool: ...
    def kv_seq_pos_min(self, seq: int) -> int:
        """-1 when empty (any sequence can be read)."""
    def kv_seq_pos_max(self, seq: int) -> int:
        """-1 when empty (any sequence can be read)."""
    def kv_pressure(self) -> dict[str, int]:
        """n_ctx, cells_used, remaining, n_seq_max, seqs_leased, seqs_free. In branch mode n_ctx is the
        cells the cache really has (llama.cpp pads to 256: where a commit runs out of room) and cells_used
        counts the branches' cells (shared prefixes once) plus pos_max + 1 per detached sequence; in
        sequence mode they are the context's n_ctx and the history length. Cells a detached sequence or a
        branch adopted from one (branch_adopt, a state load) still shares with other sequences count once
        for each of them: an upper bound then, exact for a tree of forks."""
    def state_seq_size(self, seq: int) -> int:
        """Bytes state_seq_get(seq) would return (llama_state_seq_get_size)."""
    def state_seq_get(self, seq: int) -> bytes:
        """The sequence's cells (llama_state_seq_get_data). ContextError when it is empty."""
    def state_seq_set(self, seq: int, data: bytes) -> int:
        """Loads cells into a detached sequence or a branch that has none yet (which then continues from
        them, without logits until its next prefill/commit). Bytes read. BranchError for any other
        branch's or a free sequence, ContextError when llama.cpp refuses the data."""
    def state_seq_save_file(self, seq: int, path: str, tokens: Sequence[int] = ()) -> int:
        """llama_state_seq_save_file: bytes written. ContextError when empty or unwritable."""
    def state_seq_load_file(self, seq: int, path: str) -> tuple[list[int], int]:
        """Like state_seq_set, from a file: (tokens saved with it, bytes read)."""
