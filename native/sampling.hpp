#pragma once

#include "common.hpp"
#include "model.hpp"

#include <string>
#include <vector>

namespace lloyal {

// generate()'s params dict, validated. Every field starts at its zero value, which is what a missing
// key means (see the stub for what each zero does).
struct gen_params {
    int32_t n_predict = 0;
    float temperature = 0.0f;
    int32_t top_k = 0;
    float top_p = 0.0f;
    float min_p = 0.0f;
    float typical_p = 0.0f;
    float repeat_penalty = 0.0f;
    int32_t repeat_last_n = 0;
    float presence_penalty = 0.0f;
    float frequency_penalty = 0.0f;
    uint32_t seed = 0;
    int32_t mirostat = 0;
    float mirostat_tau = 0.0f;
    float mirostat_eta = 0.0f;
    bool ignore_eos = false;
    std::vector<llama_logit_bias> logit_bias;
    std::string grammar;
    std::vector<std::string> stop;
    bool cache_prompt = false;
};

// Raises ValueError/TypeError for bad values and unknown keys, InvalidTokenError for logit_bias ids.
gen_params parse_gen_params(const py::dict & params, const Model & model);

// A grammar sampler for gbnf, or GrammarError with llama.cpp's reason (grammar.cpp).
llama_sampler * make_grammar_sampler(const Model & model, const std::string & gbnf);

// The llama_sampler chain for one generate() call.
class sampler_chain {
  public:
    // Builds (and so validates: GrammarError) everything before the caller touches the KV cache.
    sampler_chain(const gen_params & p, const Model & model, uint32_t n_ctx);
    ~sampler_chain();
    sampler_chain(const sampler_chain &) = delete;
    sampler_chain & operator=(const sampler_chain &) = delete;

    // The repetition penalties look back over the context, prompt included, as llama-server does;
    // the grammar must not see these tokens, so they go to the penalties sampler alone.
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
    llama_sampler * grammar_ = nullptr;    // greedy only: outside chain_, owned here
    int32_t penalty_last_n_ = 0;
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
