// The sequence driver: a context as one growing history on sequence 0 (eval, generate, the logits of
// the last position, cache_prompt). A context holds either this history or branches (branch.hpp), never
// both: each driver refuses to work while the other holds anything.
#pragma once

#include "common.hpp"
#include "context_core.hpp"
#include "sampling.hpp"

#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace lloyal {

class branch_driver;

struct eval_result {
    size_t n_tokens = 0;  // of those given, now in the cache (fewer when interrupted)
    size_t n_past = 0;
    bool interrupted = false;
    double prompt_ms = 0.0;
};

// A prompt as text (tokenized here, with BOS when it starts the context) or as token ids (checked).
struct prompt_input {
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
    size_t n_past = 0;
    std::string stop_reason;  // "eos" | "length" | "stop" | "interrupted"
    double prompt_ms = 0.0;
    double decode_ms = 0.0;
};

// What score() and score_choices() report for one text (score.cpp).
struct score_result {
    size_t n_tokens = 0;  // tokens of the text (a choice's own tokens, for score_choices)
    size_t n_scored = 0;  // of them, how many had a prediction to score
    double nll = 0.0;     // sum of -log p(token | everything before it), nats
};

// Receives each piece of final text (bytes) as it is decided; may throw (the generation then stops
// with the history consistent, and the exception propagates).
using piece_fn = std::function<void(std::string_view)>;

class sequence_driver {
  public:
    explicit sequence_driver(context_core & core) : core_(core) {}
    void set_branches(const branch_driver * branches) { branches_ = branches; }

    bool empty() const;
    size_t n_past() const;
    std::vector<llama_token> tokens() const;
    // Forgets the history; the caller clears the KV memory.
    void clear();

    // Decodes toks at the end of the history in n_batch chunks without sampling; logits for the last one.
    // ContextOverflowError when they do not fit (nothing decoded). On interrupt the KV is trimmed back to
    // the last whole chunk.
    eval_result eval(const std::vector<llama_token> & toks, uint64_t request_id);
    // generate.cpp; the contract is the stub's Context.generate.
    generate_result generate(const prompt_input & prompt, const gen_params & p, uint64_t request_id,
                             const piece_fn & on_piece);
    // Copies the last position's logits into the context's row in the region; LloyalError when there are none.
    void write_logits();

    // state.cpp: the whole context (KV memory, history, last logits) to and from a file (the stub's
    // Context.save_state / load_state). load_state returns the restored n_past.
    size_t save_state(const std::string & path);
    size_t load_state(const std::string & path);
    // score.cpp: the contracts are the stub's Context.score / score_choices.
    score_result score(const std::vector<llama_token> & toks, uint64_t request_id);
    std::vector<score_result> score_choices(const std::vector<std::vector<llama_token>> & choices,
                                            uint64_t request_id);

  private:
    void require_sequence_mode(const char * what) const;  // ContextError in branch mode
    // Decodes toks at the end of sequence 0 in n_batch chunks, committing each chunk to the history
    // once llama_decode succeeded. want_logits: output row for the very last token only.
    // Returns false when interrupted (the KV trimmed back to the last committed chunk).
    bool decode_tokens(const llama_token * toks, size_t n, bool want_logits);
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
    const branch_driver * branches_ = nullptr;
    mutable std::mutex history_mu_;  // writers hold the busy guard too; this only orders them against readers
    std::vector<llama_token> history_;
    bool has_logits_ = false;
    // history_[:fresh_upto_] is in the KV cache exactly as a decode from scratch in n_batch chunks
    // would have put it there (same ubatches, so bit-identical); always a ubatch boundary.
    size_t fresh_upto_ = 0;
    std::vector<float> kept_logits_;
    uint64_t kept_at_ = 0;  // core_.n_decodes() when kept_logits_ was set
};

}  // namespace lloyal
