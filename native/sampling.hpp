#pragma once

#include "common.hpp"
#include "model.hpp"

#include <memory>
#include <string>
#include <vector>

namespace lloyal {

// How tokens are chosen: every llama.cpp sampler, shared by generate() and branches. Every field starts
// at its zero value, which is what a missing key means, and a zero means what it says (see
// lloyal_pool/params.py): temperature 0 is greedy, top_k 0 no top-k, seed 0 a fixed seed.
struct sampler_params {
    float temperature = 0.0f;  // <= 0: greedy (penalties and DRY still apply before the argmax)
    int32_t top_k = 0;
    float top_p = 0.0f;      // 0 or >= 1: off
    float min_p = 0.0f;
    float typical_p = 0.0f;  // 0 or >= 1: off
    float top_n_sigma = 0.0f;
    float xtc_probability = 0.0f;
    float xtc_threshold = 0.0f;  // > 0.5: XTC can never act (llama.cpp then leaves it out)
    float dry_multiplier = 0.0f;
    float dry_base = 0.0f;  // 0: 1.75
    int32_t dry_allowed_length = 0;
    int32_t dry_penalty_last_n = 0;  // -1: the context size, 0: off
    std::vector<std::string> dry_sequence_breakers;
    float repeat_penalty = 0.0f;  // 0 or 1: off
    int32_t repeat_last_n = 0;    // -1: the context size
    float presence_penalty = 0.0f;
    float frequency_penalty = 0.0f;
    uint32_t seed = 0;
    int32_t mirostat = 0;  // 1 or 2 replace the truncation samplers (temp -> mirostat)
    float mirostat_tau = 0.0f;  // 0: 5.0
    float mirostat_eta = 0.0f;  // 0: 0.1

    bool greedy() const { return temperature <= 0.0f; }
    bool penalties_on() const;
    bool dry_on() const;
    bool operator==(const sampler_params & o) const;
    bool operator!=(const sampler_params & o) const { return !(*this == o); }
};

// generate()'s params: the sampler plus what a whole generation needs.
struct gen_params : sampler_params {
    int32_t n_predict = 0;
    bool ignore_eos = false;
    std::vector<llama_logit_bias> logit_bias;
    std::string grammar;
    std::vector<std::string> stop;
    bool cache_prompt = false;
};

// Raise ValueError/TypeError for bad values and unknown keys, InvalidTokenError for logit_bias ids.
gen_params parse_gen_params(const py::dict & params, const Model & model);
// A branch's params: exactly the sampler keys (a generate-only key such as n_predict is a ValueError).
sampler_params parse_sampler_params(const py::dict & params);
// A seed in [0, 2**32-2] (llama.cpp reads 0xFFFFFFFF as "random"; here every seed is a seed).
uint32_t parse_seed(py::handle v, const std::string & what);

struct sampler_deleter {
    void operator()(llama_sampler * s) const { llama_sampler_free(s); }
};
using sampler_ptr = std::unique_ptr<llama_sampler, sampler_deleter>;

// The samplers of llama.cpp's common order, built from sampler_params: penalties -> DRY ->
// [grammar, logit bias: the caller's] -> top_n_sigma -> top_k -> typical -> top_p -> min_p -> XTC ->
// temperature -> dist(seed); mirostat: temperature -> mirostat; greedy: nothing after DRY (the caller
// takes the argmax). Samplers that are off are left out, so an all-zero params gives an empty list.
struct chain_stages {
    sampler_ptr penalties;
    sampler_ptr dry;
    std::vector<sampler_ptr> rest;
    int32_t penalty_last_n = 0;  // window sizes, -1 resolved to n_ctx
    int32_t dry_last_n = 0;
    bool rest_starts_with_top_k = false;
};
chain_stages make_chain_stages(const sampler_params & p, const Model & model, uint32_t n_ctx);
// Feeds a penalty or DRY window (s; null: nothing to do) the last last_n tokens of history[:n_history]
// followed by appended, so that it starts as if it had accepted them one by one.
void prime_window(llama_sampler * s, int32_t last_n, const std::vector<llama_token> & history, size_t n_history,
                  const std::vector<llama_token> & appended);
// Just the part after DRY (stateless but for the PRNGs of XTC, dist and mirostat): what a reseed rebuilds.
std::vector<sampler_ptr> make_rest_stages(const sampler_params & p, int32_t n_vocab, bool * starts_with_top_k);

// A grammar sampler for gbnf, or GrammarError with llama.cpp's reason (grammar.cpp). Lazy grammars get
// trigger patterns (regexes, searched in the generated text) and trigger tokens; an invalid regex is a
// GrammarError too.
llama_sampler * make_grammar_sampler(const Model & model, const std::string & gbnf, const std::string & root = "root",
                                     bool lazy = false, const std::vector<std::string> & trigger_patterns = {},
                                     const std::vector<llama_token> & trigger_tokens = {});

// The llama_sampler chain for one generate() call.
class sampler_chain {
  public:
    // Builds (and so validates: GrammarError) everything before the caller touches the KV cache.
    sampler_chain(const gen_params & p, const Model & model, uint32_t n_ctx);
    ~sampler_chain();
    sampler_chain(const sampler_chain &) = delete;
    sampler_chain & operator=(const sampler_chain &) = delete;

    // The repetition penalties and DRY look back over the context, prompt included, as llama-server
    // does; the grammar must not see these tokens, so they go to those samplers alone.
    void prime_penalties(const std::vector<llama_token> & history, size_t n_history_used,
                         const std::vector<llama_token> & appended);

    // Samples from the last output row of ctx and accepts the token into the chain.
    // Returns LLAMA_TOKEN_NULL when no token is allowed at all (every logit is -inf: the grammar is
    // complete and EOG is banned, or logit_bias bans everything).
    llama_token sample(llama_context * ctx);

    bool has_grammar() const { return has_grammar_; }

  private:
    llama_sampler * chain_ = nullptr;
    llama_sampler * penalties_ = nullptr;  // owned by chain_
    llama_sampler * dry_ = nullptr;        // owned by chain_
    llama_sampler * grammar_ = nullptr;    // greedy only: outside chain_, owned here
    int32_t penalty_last_n_ = 0;
    int32_t dry_last_n_ = 0;
    bool has_grammar_ = false;
    int32_t n_vocab_ = 0;
    std::vector<llama_token_data> cur_;
    // Greedy without penalties: the choice is the argmax of logits + bias, computed in place.
    bool direct_argmax_ = false;
    std::vector<llama_logit_bias> bias_;
    std::vector<uint8_t> biased_;  // n_vocab flags, only when bias_ is not empty

    llama_token argmax(const float * logits) const;
};

}  // namespace lloyal
