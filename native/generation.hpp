// What the plain and the speculative generation loop share (generate.cpp, speculative.cpp): the sampler a
// generation starts with, the choice of one token from a logits row, and the output built token by token
// (tokens, text cut at stop strings, pieces streamed as they become final).
#pragma once

#include "sampling.hpp"
#include "sequence.hpp"
#include "text_assembly.hpp"

#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace lloyal {

// The generation's sampler: params, logit bias (EOG banned under ignore_eos), grammar, and the penalty
// and DRY windows started with `seen` (the context, prompt included, as llama-server does; the grammar
// sees only what is generated). GrammarError before anything is decoded.
std::unique_ptr<chain_sampler> make_generation_sampler(const gen_params & p, const Model & model, uint32_t n_ctx,
                                                       const std::vector<llama_token> & seen, const stop_fn & stop = nullptr);

// The sampler's token for one logits row (n_vocab floats), accepted into the sampler (grammar state,
// penalty windows). LLAMA_TOKEN_NULL when a complete grammar allows nothing more (EOG banned); an
// error when logit_bias bans every token. stop: asked inside long grammar steps (InterruptedError).
llama_token choose_token(chain_sampler & sampler, const float * logits, int32_t n_vocab,
                         std::vector<llama_token_data> & scratch, const stop_fn & stop = nullptr);

class generation_output {
  public:
    enum class verdict {
        more,          // decode the token and go on
        last_decoded,  // a stop string completed: decode the token (it is in tokens), then stop
        stop,          // end-of-generation token (not in tokens) or on_piece failed: do not decode it
    };

    generation_output(const gen_params & p, const Model & model, const piece_fn & on_piece, generate_result & res)
        : p_(p), model_(model), on_piece_(on_piece), res_(res), text_(p.stop) {}

    // One sampled token (LLAMA_TOKEN_NULL: the grammar is complete, which ends the generation like EOG).
    verdict push(llama_token tok);
    // Ends the generation with reason, unless it has one already.
    void stop(const char * reason) {
        if (stop_reason_.empty()) {
            stop_reason_ = reason;
        }
    }
    bool stopped() const { return !stop_reason_.empty(); }
    const gen_params & params() const { return p_; }
    int32_t n_sampled() const { return n_sampled_; }
    // Whether n_predict leaves room for another token.
    bool may_sample() const { return p_.n_predict <= 0 || n_sampled_ < p_.n_predict; }
    // Streams what was held back, cuts the text, sets stop_reason and n_decoded; rethrows an on_piece error.
    void finish();
    // At a pause: the text streamed so far (what was held back stays held).
    std::string streamed_text() const { return text_.text().substr(0, emitted_); }
    size_t emitted() const { return emitted_; }
    // A paused generation taken over from elsewhere: its tokens, pushed again without streaming (no
    // stop string completed among them), n_sampled and the bytes of text it had streamed.
    void restore(const std::vector<llama_token> & tokens, int32_t n_sampled, size_t emitted);

  private:
    void stream(size_t end);

    const gen_params & p_;
    const Model & model_;
    const piece_fn & on_piece_;
    generate_result & res_;
    text_assembly text_;
    size_t emitted_ = 0;  // text_.text()[:emitted_] was streamed, or would have been
    int32_t n_sampled_ = 0;
    std::string stop_reason_;
    std::exception_ptr callback_error_;
};

// A generation between two of its rounds: what generate() builds and its loop runs on, and what a pause
// keeps (sequence_driver::resume goes on with it). Heap-held and never moved: out refers to p, on_piece
// and res.
struct generation_state {
    generation_state(const gen_params & params, const Model & model) : p(params), out(p, model, on_piece, res) {}
    generation_state(const generation_state &) = delete;
    generation_state & operator=(const generation_state &) = delete;

    gen_params p;
    piece_fn on_piece;  // replaced by each resume
    generate_result res;
    generation_output out;
    std::unique_ptr<chain_sampler> sampler;
    std::vector<llama_token> history;  // the context's at the pause: resume checks it still holds this
    uint64_t origin = 0;  // the id of the request that started it: which stream a resume is for
};

}  // namespace lloyal
