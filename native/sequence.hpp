// The sequence driver: a context as one growing history on sequence 0 (eval, generate, the logits of
// the last position, cache_prompt). A context holds either this history or branches (branch.hpp), never
// both: each driver refuses to work while the other holds anything.
#pragma once

#include "common.hpp"
#include "context_core.hpp"
#include "logits.hpp"
#include "sampling.hpp"

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace lloyal {

class sequence_driver;
class chain_sampler;
class generation_output;
struct generation_state;

// A paused generation in portable form (sequence_driver::suspension/adopt): with the context's state and
// the generation's params, what another worker needs to go on with it exactly.
struct suspended_generation {
    std::vector<llama_token> tokens;  // generated so far (the end of the history)
    int32_t n_sampled = 0;
    size_t emitted = 0;  // bytes of text streamed
    std::vector<chain_sampler::draw_count> draws;
    size_t n_prompt = 0;
    size_t n_cached = 0;
    double prompt_ms = 0.0;
};

struct eval_result {
    size_t n_tokens = 0;  // of those given, now in the cache (fewer when interrupted)
    size_t n_past = 0;
    bool interrupted = false;
    double prompt_ms = 0.0;
};

// A prompt as text (tokenized here, with BOS when it starts the context) or as token ids (checked).
// By default it is the whole input: the history is replaced by it (cache_prompt keeps the common
// prefix). append: it is added to the history instead (an empty one continues).
struct prompt_input {
    bool append = false;
    bool is_text = false;
    std::string text;
    std::vector<llama_token> tokens;
};

struct generate_result {
    std::string text;  // bytes; the binding decodes them (invalid UTF-8 -> U+FFFD)
    std::vector<llama_token> tokens;
    size_t n_prompt = 0;
    int32_t n_decoded = 0;
    size_t n_cached = 0;
    size_t n_drafted = 0;   // speculative: tokens a drafter proposed
    size_t n_accepted = 0;  // ... of which the target's sampler chose the same
    size_t n_past = 0;
    std::string stop_reason;  // "eos" | "length" | "stop" | "interrupted"
    double prompt_ms = 0.0;
    double decode_ms = 0.0;
    int32_t n_threads = 0;  // the threads the call's last decode computed with (thread_governor.hpp)
    std::vector<token_logprobs> logprobs;  // gen_params::n_logprobs >= 0: one per token of `tokens`
};

// What score() and score_choices() report for one text (score.cpp).
struct score_result {
    size_t n_tokens = 0;  // tokens of the text (a choice's own tokens, for score_choices)
    size_t n_scored = 0;  // of them, how many had a prediction to score
    double nll = 0.0;     // sum of -log p(token | everything before it), nats
    std::vector<token_logprobs> logprobs;  // score with n_logprobs >= 0: one per scored token
};

// Receives each piece of final text (bytes) as it is decided; may throw (the generation then stops
// with the history consistent, and the exception propagates).
using piece_fn = std::function<void(std::string_view)>;

// Proposes up to n tokens to follow `context` (the target's history and its next token), for
// speculative decoding (speculative.cpp). Fewer or none is fine.
class drafter {
  public:
    virtual ~drafter() = default;
    virtual std::vector<llama_token> draft(const std::vector<llama_token> & context, size_t n) = 0;
};

// speculative.cpp. ngram: prompt lookup over the context, matching its last n_max down to n_min tokens.
// A model drafter holds the draft context's busy guard while it lives; ContextError when the draft model's
// vocabulary is not the target's, ValueError when draft is target.
std::unique_ptr<drafter> make_ngram_drafter(size_t n_min, size_t n_max);
std::unique_ptr<drafter> make_model_drafter(sequence_driver & target, sequence_driver & draft);

class sequence_driver : public kv_tenant {
  public:
    explicit sequence_driver(context_core & core) : core_(core) { core.add_tenant(*this); }
    std::string held() const override;
    size_t cells_held() const override { return n_past(); }

    bool empty() const;
    size_t n_past() const;
    std::vector<llama_token> tokens() const;
    // Forgets the history; the caller clears the KV memory.
    void clear();

    // Decodes toks at the end of the history in n_batch chunks without sampling; logits for the last one.
    // ContextOverflowError when they do not fit (nothing decoded). On interrupt the KV is trimmed back to
    // the last whole chunk.
    eval_result eval(const std::vector<llama_token> & toks, uint64_t request_id,
                     const context_core::progress_fn & on_progress = nullptr);
    // generate.cpp; the contract is the stub's Context.generate. on_progress: the prompt's decode only.
    generate_result generate(const prompt_input & prompt, const gen_params & p, uint64_t request_id,
                             const piece_fn & on_piece, const context_core::progress_fn & on_progress = nullptr);
    // speculative.cpp: generate, with each step's continuation proposed by `draft` (at most n_draft
    // tokens) and verified in one batched decode; every token is still the target sampler's choice.
    generate_result generate_with_draft(const prompt_input & prompt, const gen_params & p, drafter & draft,
                                        size_t n_draft, uint64_t request_id, const piece_fn & on_piece,
                                        const context_core::progress_fn & on_progress = nullptr);
    // For a draft context (speculative.cpp): brings the history to `context` (reusing the common prefix)
    // and returns up to n greedy tokens after it. The caller holds this context's busy guard.
    std::vector<llama_token> draft_greedy(const std::vector<llama_token> & context, size_t n);
    context_core & core() const { return core_; }
    // Copies the last position's logits into the context's row in the region; LloyalError when there are none.
    void write_logits();

    // Pause and resume (generate.cpp). A generation whose request the interrupt word names with
    // context_core::k_pause_bit stops at its next token boundary, everything it emitted decoded, with
    // stop_reason "paused", and keeps its sampler, text and budget here; resume goes on with them as if
    // it had never stopped (ContextError when nothing is paused, or the context no longer holds what it
    // held at the pause). suspension() is the paused generation's portable form (ContextError when
    // nothing is paused, or for mirostat, whose mu does not travel); adopt() takes one in, for the
    // params it was generated with, on a context that holds the same history (its state loaded).
    // origin: the id of the request that started the generation (0: whichever is paused).
    generate_result resume(uint64_t request_id, uint64_t origin, const piece_fn & on_piece);
    bool paused() const { return suspended_ != nullptr; }
    // The paused generation's n_logprobs (-1 when none is paused): what its result reports.
    int32_t paused_logprobs() const;
    suspended_generation suspension() const;
    void adopt(const gen_params & p, const suspended_generation & s, uint64_t origin);

    // state.cpp: the whole context (KV memory, history, last logits) to and from a file (the stub's
    // Context.save_state / load_state). load_state returns the restored n_past.
    size_t save_state(const std::string & path);
    size_t load_state(const std::string & path);
    // score.cpp: the contracts are the stub's Context.score / score_choices.
    // n_logprobs >= 0: each scored token's log-probability and its n_logprobs most likely alternatives too.
    score_result score(const std::vector<llama_token> & toks, uint64_t request_id, int32_t n_logprobs = -1);
    std::vector<score_result> score_choices(const std::vector<std::vector<llama_token>> & choices,
                                            uint64_t request_id);

  private:
    // A generation's prompt: its tokens, what of the history stays, what is decoded (generate.cpp).
    struct prompt_plan {
        std::vector<llama_token> tokens;
        std::vector<llama_token> to_decode;
        size_t n_keep = 0;
        size_t n_cached = 0;
        bool continue_only = false;  // append with an empty prompt
    };
    // Checks the prompt (ValueError when empty, ContextOverflowError) and plans it; changes nothing.
    prompt_plan plan_prompt(const prompt_input & prompt, const gen_params & p) const;
    // The tokens the penalty and DRY windows start with.
    std::vector<llama_token> seen_tokens(const prompt_plan & plan) const;
    // Trims the history as planned and decodes the rest; false when interrupted, or paused between two
    // ubatches of a whole prompt (prompt_paused_ then says so).
    bool take_prompt(prompt_plan & plan, bool append, const context_core::progress_fn & on_progress,
                     bool pausable = false);
    // The generation loop of generate (draft null) and generate_with_draft (generate.cpp); the caller holds
    // the busy guard and has checked the mode.
    generate_result run_generation(const prompt_input & prompt, const gen_params & p, drafter * draft, size_t n_draft,
                                   uint64_t request_id, const piece_fn & on_piece,
                                   const context_core::progress_fn & on_progress);
    // The rounds of a generation until it ends or pauses; then its result (generate.cpp).
    generate_result run_rounds(const std::shared_ptr<generation_state> & st, drafter * draft, size_t n_draft,
                               const stop_fn & stop, int64_t t_start);
    // One speculative step after the sampler chose tok (speculative.cpp): drafts, one batched decode of tok
    // and the drafts, the sampler's choices row by row, the rejected drafts removed. False when there was
    // nothing to draft (tok is not decoded yet); true when tok and the kept choices are decoded (or the
    // generation stopped).
    bool speculate(llama_token tok, drafter & draft, size_t n_draft, chain_sampler & sampler,
                   std::vector<llama_token_data> & scratch, generation_output & out, generate_result & res);
    // One llama_decode of toks at the end of sequence 0 with a logits row for every one of them (at most
    // n_batch); committed to the history on success. False when interrupted (nothing committed).
    bool decode_all_rows(const std::vector<llama_token> & toks);
    void require_sequence_mode(const char * what) const;  // ContextError in branch mode
    // Decodes toks at the end of sequence 0 in n_batch chunks, committing each chunk to the history
    // once llama_decode succeeded. want_logits: output row for the very last token only.
    // Returns false when interrupted (the KV trimmed back to the last committed chunk); with pausable, also
    // when a pause is asked for after the first chunk (prompt_paused_ set; every chunk so far committed).
    bool decode_tokens(const llama_token * toks, size_t n, bool want_logits, bool pausable = false);
    // Keeps the first n tokens of sequence 0. Returns n, or 0 when the memory cannot keep exactly that
    // prefix (recurrent state, or an SWA cache that already dropped what position n needs): then
    // everything was cleared.
    size_t truncate_to(size_t n);
    void set_history_size(size_t n);
    // The start of the ubatch a decode from scratch would compute position pos in.
    size_t ubatch_floor(size_t pos) const;
    // How much of a common prefix of n_keep_max tokens cache_prompt keeps (see sequence.cpp).
    size_t reuse_point(size_t n_keep_max) const;
    void append_history(const llama_token * toks, size_t n);
    // The logits of the last position: llama.cpp's output, or the row kept aside by a state load or a
    // scoring pass, as long as no decode came since. Meaningful only while has_logits_.
    const float * last_logits() const;
    // Keeps the current last logits aside (before a pass that decodes other rows and rolls back).
    void keep_logits(const float * row);

    context_core & core_;
    mutable std::mutex history_mu_;  // writers hold the busy guard too; this only orders them against readers
    std::vector<llama_token> history_;
    bool has_logits_ = false;
    std::shared_ptr<generation_state> suspended_;  // a paused generation (resume)
    // The last prompt stopped by a pause between two ubatches: nothing is suspended, and the same
    // whole-prompt request sent again goes on from there (its cache holds the chunks decoded, which end
    // where a decode from scratch ends its ubatches).
    bool prompt_paused_ = false;
    // history_[:fresh_upto_] is in the KV cache exactly as a decode from scratch in n_batch chunks
    // would have put it there (same ubatches, so bit-identical); always a ubatch boundary.
    size_t fresh_upto_ = 0;
    std::vector<float> kept_logits_;
    uint64_t kept_at_ = 0;  // core_.n_decodes() when kept_logits_ was set
};

}  // namespace lloyal
