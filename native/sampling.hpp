// How tokens are chosen, for generate() and for branches alike: the sampler fields, the chain of
// llama.cpp samplers built from them, grammars, and chain_sampler, which applies all of it to a logits
// row (sampler.cpp).
#pragma once

#include "common.hpp"
#include "model.hpp"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lloyal {

// Every sampler field, declared once: (C++ type, name, the rule its value must follow; bind_params.cpp
// reads and checks each one by its rule). Every field starts at its zero value, which is what a missing
// key means, and a zero means what it says (see lloyal_pool/params.py, whose SamplerParams has these
// fields in this order; a test compares the two): temperature 0 is greedy, top_k 0 no top-k, seed 0 a
// fixed seed.
#define LLOYAL_SAMPLER_FIELDS(X)                                                                                 \
    X(float, temperature, any_float)       /* <= 0: greedy (penalties and DRY still apply before the argmax) */  \
    X(int32_t, top_k, count)                                                                                     \
    X(float, top_p, non_negative)          /* 0 or >= 1: off */                                                  \
    X(float, min_p, unit)                                                                                        \
    X(float, typical_p, non_negative)      /* 0 or >= 1: off */                                                  \
    X(float, top_n_sigma, non_negative)                                                                          \
    X(float, xtc_probability, unit)                                                                              \
    X(float, xtc_threshold, unit)          /* > 0.5: XTC can never act (llama.cpp then leaves it out) */         \
    X(float, dry_multiplier, non_negative)                                                                       \
    X(float, dry_base, dry_base)           /* 0: 1.75 */                                                         \
    X(int32_t, dry_allowed_length, count)                                                                        \
    X(int32_t, dry_penalty_last_n, window) /* -1: the context size, 0: off */                                    \
    X(std::vector<std::string>, dry_sequence_breakers, breakers)                                                 \
    X(float, repeat_penalty, non_negative) /* 0 or 1: off */                                                     \
    X(int32_t, repeat_last_n, window)      /* -1: the context size */                                            \
    X(float, presence_penalty, any_float)                                                                        \
    X(float, frequency_penalty, any_float)                                                                       \
    X(uint32_t, seed, seed)                                                                                      \
    X(int32_t, mirostat, mirostat)         /* 1 or 2 replace the truncation samplers (temp -> mirostat) */       \
    X(float, mirostat_tau, non_negative)   /* 0: 5.0 */                                                          \
    X(float, mirostat_eta, non_negative)   /* 0: 0.1 */

struct sampler_params {
#define LLOYAL_SAMPLER_MEMBER(type, name, rule) type name{};
    LLOYAL_SAMPLER_FIELDS(LLOYAL_SAMPLER_MEMBER)
#undef LLOYAL_SAMPLER_MEMBER

    bool greedy() const { return temperature <= 0.0f; }
    bool penalties_on() const;
    bool dry_on() const;
    bool operator==(const sampler_params & o) const;
    bool operator!=(const sampler_params & o) const { return !(*this == o); }
};

// The sampler fields' names, in declaration order.
const std::vector<std::string> & sampler_field_names();

// A grammar: GBNF text and how it applies. A lazy grammar samples unconstrained (at no extra cost)
// until a trigger fires: llama.cpp's llama_sampler_init_grammar_lazy_patterns (trigger words are
// regex-escaped into patterns by the parser).
struct grammar_spec {
    std::string gbnf;
    std::string root = "root";
    bool lazy = false;
    std::vector<std::string> trigger_patterns;
    std::vector<llama_token> trigger_tokens;
    // Text the prompt already ends with that the grammar must accept first (not lazy grammars): a
    // tool-call grammar of llama.cpp's chat formats starts with the assistant's generation prompt.
    std::string prefill;
};

// generate()'s params: the sampler plus what a whole generation needs.
struct gen_params : sampler_params {
    int32_t n_predict = 0;
    bool ignore_eos = false;
    std::vector<std::pair<llama_token, float>> logit_bias;  // sorted by token, one entry per token
    std::optional<grammar_spec> grammar;
    std::vector<std::string> stop;
    bool cache_prompt = false;
    // cache_prompt keeps only what leaves the logits bit-identical to decoding the prompt afresh: back to
    // the start of the micro-batch the common prefix ends in (sequence.cpp, reuse_point).
    bool cache_bit_exact = false;
    bool render_special = false;  // text shows control tokens and markers (Model::text_piece)
    // >= 0: each generated token's log-probability and its n_logprobs best alternatives (logits.hpp).
    int32_t n_logprobs = -1;
};

// A logit bias in its one form: sorted by token, one entry per token (a token's biases summed; -inf
// stays -inf). What chain_sampler::set_logit_bias takes.
std::vector<std::pair<llama_token, float>> normalized_bias(std::vector<std::pair<llama_token, float>> entries);

struct sampler_deleter {
    void operator()(llama_sampler * s) const { llama_sampler_free(s); }
};
using sampler_ptr = std::unique_ptr<llama_sampler, sampler_deleter>;

// Asked between the slices of a long grammar step: true stops it with InterruptedError, the grammar
// unchanged. Null: never.
using stop_fn = std::function<bool()>;
// A grammar sampler, or GrammarError with llama.cpp's reason (grammar.cpp); an invalid trigger
// pattern is a GrammarError too. With `stop`, a large grammar is parsed on a thread of its own while
// `stop` is asked every 2 ms: true throws InterruptedError at once and leaves the parse to end there.
sampler_ptr make_grammar_sampler(const Model & model, const grammar_spec & g, const stop_fn & stop = nullptr);
// Waits for the parses make_grammar_sampler left running (before a model is freed, and at fork).
void join_abandoned_grammar_parses();
// llama.cpp's grammar apply and accept on a sampler of make_grammar_sampler's, in slices with `stop`
// asked between them; the results are those of llama.cpp's single calls (grammar.cpp).
void grammar_apply(llama_sampler * grammar, llama_token_data_array & cur, const stop_fn & stop);
void grammar_accept(llama_sampler * grammar, llama_token token, const stop_fn & stop);
// Test only: the tokens llama.cpp's own grammar sampler allows (first) and ours, sliced and cloned at
// every step (second), before and after accepting each of tokens in turn.
std::vector<std::pair<std::vector<llama_token>, std::vector<llama_token>>>
grammar_slices_check(const Model & model, const std::string & gbnf, const std::vector<llama_token> & tokens);
// llama.cpp's own JSON-schema -> GBNF converter; GrammarError on an invalid schema (grammar.cpp).
std::string json_schema_to_gbnf(const std::string & schema_json);

// A logits row with what the samplers and the perplexity need of it, computed once when it is written.
struct logits_row {
    const float * z = nullptr;
    float max = 0.0f;  // the row's maximum
    float lse = 0.0f;  // log(sum(exp(z))); NaN when not computed (then no sampling surprisal)
};

// How one sequence of choices samples: the samplers of llama.cpp's common order built from
// sampler_params (penalties -> DRY -> top_n_sigma -> top_k -> typical -> top_p -> min_p -> XTC ->
// temperature -> dist(seed); mirostat: temperature -> mirostat; greedy: the argmax after DRY), the
// grammar in front of them and the logit bias between the two. It reads a logits row and never
// touches a llama_context. Branches own one each; generate() builds one per call.
//
// The grammar is applied the way llama.cpp's common sampler does it: the token is chosen without it
// and checked against it; only when the grammar refuses that token is the whole vocabulary masked
// (tens of ms at 262k tokens) and the token chosen again, with the chain's PRNGs drawn once more.
// The fast paths need no candidate array at all: greedy without penalties or DRY is the row's first
// argmax (found from its cached maximum; a logit bias is folded in unless it falls on that argmax); a
// chain that starts with top_k (no penalties, DRY, top_n_sigma or mirostat) gets its top k straight
// from the row in one pass, then the rest of the chain. Other chains fill the candidate array and run
// llama.cpp's samplers over the whole vocabulary (pure temperature, top_p, typical, top_n_sigma and
// mirostat cost 2-20 ms a token at 262k tokens, llama.cpp's own cost).
class chain_sampler {
  public:
    // `seen`: tokens the penalty and DRY windows start with, as if accepted one by one.
    chain_sampler(const sampler_params & p, const Model & model, uint32_t n_ctx,
                  const std::vector<llama_token> & seen = {});
    ~chain_sampler();
    chain_sampler(const chain_sampler &) = delete;
    chain_sampler & operator=(const chain_sampler &) = delete;
    std::unique_ptr<chain_sampler> clone() const;  // PRNGs, penalty and DRY windows, grammar state included

    const sampler_params & params() const { return p_; }
    // A new chain: the PRNGs restart from p.seed, the penalty and DRY windows are re-primed from `seen`.
    // Params equal to the current ones change nothing (no PRNG restart).
    void set_params(const sampler_params & p, const std::vector<llama_token> & seen);
    void set_grammar(sampler_ptr g) { grammar_ = std::move(g); }  // null removes it
    bool has_grammar() const { return grammar_ != nullptr; }
    // Sorted by token, one entry per token (biases of a token summed; -inf bans it).
    void set_logit_bias(std::vector<std::pair<llama_token, float>> bias) { bias_ = std::move(bias); }
    // Every sampler that draws (XTC, dist, mirostat, whose mu restarts) starts again from seed;
    // greedy has none. The penalty and DRY windows are kept.
    void reseed(uint32_t seed);

    struct sample_result {
        llama_token token = LLAMA_TOKEN_NULL;  // NULL: nothing allowed (grammar complete, all banned)
        float sampling_surprisal = 0.0f;      // -log p(token) over the candidates the chain kept (nats)
    };
    // Grammar -> logit bias -> stages applied to row; advances the PRNGs (and mirostat's mu) like
    // llama.cpp's samplers do; accepts nothing. scratch: a candidate array the caller keeps.
    // stop: asked inside long grammar steps (InterruptedError; the PRNGs may have drawn).
    sample_result sample(const logits_row & row, std::vector<llama_token_data> & scratch,
                         const stop_fn & stop = nullptr);

    // The grammar after accepting token, as a new sampler, or GrammarError (this one unchanged). Null
    // when there is no grammar. Checks the token with the grammar's own mask first: accepting an
    // end-of-generation token the grammar cannot end at would GGML_ABORT inside llama.cpp.
    sampler_ptr grammar_after(llama_token token, const stop_fn & stop = nullptr) const;
    void accept(llama_token token);  // penalty and DRY windows; the grammar is swapped in by the caller

    // Where the chain's PRNGs stand, portably: per stage after the penalties and DRY, how often it was
    // applied to one candidate and to several. llama.cpp's dist draws once per apply whatever the
    // width, XTC once per apply to two or more candidates, the other stages hold no PRNG: a chain
    // built again from the same params and seed is at the same point after replay_draws (a generation
    // moved to another worker goes on with the draws its sampler would have made). Mirostat also
    // keeps mu, which this does not carry: portable() is false for it.
    struct draw_count {
        uint64_t narrow = 0;  // applies to one candidate
        uint64_t wide = 0;    // applies to two or more
    };
    const std::vector<draw_count> & draws() const { return draws_; }
    void replay_draws(const std::vector<draw_count> & draws);
    bool portable() const { return p_.mirostat != 1 && p_.mirostat != 2; }

  private:
    chain_sampler(const Model & model, uint32_t n_ctx) : model_(&model), n_ctx_(n_ctx) {}
    void build(const std::vector<llama_token> & seen);
    sample_result sample_free(const logits_row & row, std::vector<llama_token_data> & scratch);
    sample_result sample_masked(const logits_row & row, std::vector<llama_token_data> & scratch, const stop_fn & stop);
    sample_result finish(llama_token_data_array & cur, bool greedy);
    void fill(const float * z, std::vector<llama_token_data> & scratch) const;

    const Model * model_;
    uint32_t n_ctx_;
    sampler_params p_;
    sampler_ptr penalties_;
    sampler_ptr dry_;
    std::vector<sampler_ptr> rest_;
    int32_t penalty_last_n_ = 0;  // window sizes, -1 resolved to n_ctx
    int32_t dry_last_n_ = 0;
    bool rest_starts_with_top_k_ = false;
    std::vector<draw_count> draws_;  // one per stage of rest_
    sampler_ptr grammar_;
    std::vector<std::pair<llama_token, float>> bias_;
};

}  // namespace lloyal
