// sequence_driver::generate: prompt handling, the sampling loop, stop strings and streaming.
//
// Choices about what a result contains:
//  - tokens are the generated tokens that are part of the output. An EOG token that ends the
//    generation is neither in tokens nor in text (n_decoded counts it: it was sampled). The token that
//    completes a stop string *is* in tokens, although the stop string and anything after it are cut
//    from text: tokens say what the model produced, text what the caller asked to see.
//  - every token in tokens has also been decoded, so the context's history is prompt + tokens and
//    its logits are those after the last one: generate("", append=True) continues where this call ended,
//    and a cache_prompt call with prompt + output reuses all of it. This costs one decode for the last
//    token, which llama.cpp's examples skip; generation stops ("length") rather than sample a token
//    there is no room left to decode.
#include "errors.hpp"
#include "generation.hpp"
#include "logits.hpp"
#include "sequence.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <exception>
#include <string>

namespace lloyal {

namespace {

// The caller's logit bias with every end-of-generation token banned (ignore_eos).
std::vector<std::pair<llama_token, float>> with_eog_banned(std::vector<std::pair<llama_token, float>> bias,
                                                            const Model & model) {
    for (llama_token t : model.eog_tokens()) {
        bias.emplace_back(t, -std::numeric_limits<float>::infinity());
    }
    return normalized_bias(std::move(bias));
}

size_t common_prefix(const std::vector<llama_token> & a, const std::vector<llama_token> & b) {
    const size_t n = std::min(a.size(), b.size());
    size_t i = 0;
    while (i < n && a[i] == b[i]) {
        ++i;
    }
    return i;
}

}  // namespace

std::unique_ptr<chain_sampler> make_generation_sampler(const gen_params & p, const Model & model, uint32_t n_ctx,
                                                       const std::vector<llama_token> & seen, const stop_fn & stop) {
    auto sampler = std::make_unique<chain_sampler>(p, model, n_ctx, seen);
    if (p.grammar) {
        sampler->set_grammar(make_grammar_sampler(model, *p.grammar, stop));
    }
    sampler->set_logit_bias(p.ignore_eos ? with_eog_banned(p.logit_bias, model) : p.logit_bias);
    return sampler;
}

llama_token choose_token(chain_sampler & sampler, const float * z, int32_t n_vocab,
                         std::vector<llama_token_data> & scratch, const stop_fn & stop) {
    if (z == nullptr) {
        throw lloyal_error("no logits to sample from");
    }
    // The sampler needs the row's maximum (its greedy path finds the argmax from it); the log-sum-exp
    // is only for surprisals, which a generation does not report.
    const logits_row row{z, max_of(z, static_cast<size_t>(n_vocab)), std::numeric_limits<float>::quiet_NaN()};
    const llama_token tok = sampler.sample(row, scratch, stop).token;
    if (tok == LLAMA_TOKEN_NULL) {
        if (sampler.has_grammar()) {
            return tok;  // the grammar is complete and EOG is banned (ignore_eos)
        }
        throw lloyal_error("no token can be sampled: logit_bias/ignore_eos ban every token");
    }
    if (sampler.has_grammar()) {
        sampler.set_grammar(sampler.grammar_after(tok, stop));
    }
    sampler.accept(tok);
    return tok;
}

void generation_output::stream(size_t end) {
    if (end <= emitted_) {
        return;
    }
    const size_t begin = emitted_;
    emitted_ = end;
    if (!on_piece_ || callback_error_) {
        return;
    }
    try {
        on_piece_(std::string_view(text_.text().data() + begin, end - begin));
    } catch (...) {
        callback_error_ = std::current_exception();
    }
}

generation_output::verdict generation_output::push(llama_token tok) {
    if (tok == LLAMA_TOKEN_NULL) {
        stop("eos");
        return verdict::stop;
    }
    ++n_sampled_;
    if (!p_.ignore_eos && llama_vocab_is_eog(model_.vocab(), tok)) {
        stop("eos");
        return verdict::stop;
    }
    res_.tokens.push_back(tok);
    const bool stop_string = text_.push(model_.text_piece(tok, p_.render_special));
    if (stop_string) {
        stop("stop");
    }
    stream(text_.final_end());
    if (callback_error_) {
        stop("stop");  // the error is what the caller gets (finish)
        return verdict::stop;
    }
    return stop_string ? verdict::last_decoded : verdict::more;
}

void generation_output::restore(const std::vector<llama_token> & tokens, int32_t n_sampled, size_t emitted) {
    for (llama_token t : tokens) {
        res_.tokens.push_back(t);
        if (text_.push(model_.text_piece(t, p_.render_special))) {
            throw std::invalid_argument("a paused generation cannot hold a completed stop string");
        }
    }
    if (emitted > text_.final_end()) {
        throw std::invalid_argument("a paused generation streamed more text than its tokens make");
    }
    n_sampled_ = n_sampled;
    emitted_ = emitted;
}

void generation_output::finish() {
    // Whatever was held back is final now (a stop prefix that never completed, a truncated UTF-8
    // sequence that becomes U+FFFD here exactly as in text).
    stream(text_.end());
    if (callback_error_) {
        std::rethrow_exception(callback_error_);
    }
    res_.text = text_.text().substr(0, text_.end());
    res_.n_decoded = n_sampled_;
    res_.stop_reason = stop_reason_.empty() ? std::string("length") : stop_reason_;
}

sequence_driver::prompt_plan sequence_driver::plan_prompt(const prompt_input & prompt, const gen_params & p) const {
    const Model & model = core_.model();
    prompt_plan plan;
    if (prompt.is_text) {
        if (!prompt.text.empty()) {
            // A whole input starts like one (BOS); appended text does only on an empty context.
            plan.tokens = model.tokenize(prompt.text, !prompt.append || history_.empty(), true);
            // A chat template usually writes the BOS itself ("<bos>..."): keep one, not two.
            const llama_token bos = llama_vocab_bos(model.vocab());
            if (plan.tokens.size() >= 2 && bos != LLAMA_TOKEN_NULL && plan.tokens[0] == bos && plan.tokens[1] == bos) {
                plan.tokens.erase(plan.tokens.begin());
            }
        }
    } else {
        plan.tokens = prompt.tokens;
    }
    plan.continue_only = prompt.append && plan.tokens.empty();
    if (plan.tokens.empty() && !plan.continue_only) {
        throw std::invalid_argument("empty prompt: pass append=True to continue from what the context holds");
    }
    if (plan.continue_only && history_.empty()) {
        throw std::invalid_argument("empty prompt on an empty context: nothing to continue from");
    }

    // What of the history stays: all of it when appending, the longest common prefix with the prompt
    // under cache_prompt, nothing otherwise.
    plan.n_keep = history_.size();
    if (prompt.append) {
        plan.to_decode = plan.tokens;
        plan.n_cached = plan.n_keep;  // the whole history is kept: the new tokens attend to it undecoded
    } else {
        plan.n_keep = 0;
        if (p.cache_prompt) {
            plan.n_keep = common_prefix(history_, plan.tokens);
            if (plan.n_keep == plan.tokens.size() && !(plan.n_keep == history_.size() && has_logits_)) {
                --plan.n_keep;  // decode at least the last token, for logits that belong to this prompt
            }
            if (p.cache_bit_exact) {
                plan.n_keep = reuse_point(plan.n_keep);
            }
        }
        plan.n_cached = plan.n_keep;
        plan.to_decode.assign(plan.tokens.begin() + static_cast<std::ptrdiff_t>(plan.n_keep), plan.tokens.end());
    }
    const size_t room = core_.n_ctx_seq > plan.n_keep ? core_.n_ctx_seq - plan.n_keep : 0;
    if (plan.to_decode.size() > room) {
        throw context_overflow_error("prompt of " + std::to_string(plan.to_decode.size()) +
                                     " new tokens does not fit: n_ctx " + std::to_string(core_.n_ctx_seq) +
                                     ", n_past " + std::to_string(plan.n_keep) + ", room " + std::to_string(room));
    }
    return plan;
}

std::vector<llama_token> sequence_driver::seen_tokens(const prompt_plan & plan) const {
    std::vector<llama_token> seen(history_.begin(), history_.begin() + static_cast<std::ptrdiff_t>(plan.n_keep));
    seen.insert(seen.end(), plan.to_decode.begin(), plan.to_decode.end());
    return seen;
}

bool sequence_driver::take_prompt(prompt_plan & plan, bool append, const context_core::progress_fn & on_progress,
                                  bool pausable) {
    if (!append) {
        if (truncate_to(plan.n_keep) != plan.n_keep) {
            // The memory could not keep that prefix (an SWA cache without swa_full that has already
            // dropped what position n_keep needs): it was cleared, so start over.
            plan.to_decode = plan.tokens;
            plan.n_cached = 0;
        }
    } else if (plan.continue_only && !has_logits_) {
        // Continuing needs the logits after the last token (lost after an interrupt, reset of a
        // sampled-but-undecoded state, ...): decode that token again.
        const std::vector<llama_token> old = history_;
        if (truncate_to(old.size() - 1) == old.size() - 1) {
            plan.to_decode.assign(1, old.back());
            plan.n_cached = old.size() - 1;
        } else {
            plan.to_decode = old;
            plan.n_cached = 0;
        }
    }
    context_core::progress_scope progress(core_, on_progress);
    return decode_tokens(plan.to_decode.data(), plan.to_decode.size(), true, pausable && !append);
}

generate_result sequence_driver::generate(const prompt_input & prompt, const gen_params & p, uint64_t request_id,
                                          const piece_fn & on_piece, const context_core::progress_fn & on_progress) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("generate");
    return run_generation(prompt, p, nullptr, 0, request_id, on_piece, on_progress);
}

generate_result sequence_driver::run_generation(const prompt_input & prompt, const gen_params & p, drafter * draft,
                                                size_t n_draft, uint64_t request_id, const piece_fn & on_piece,
                                                const context_core::progress_fn & on_progress) {
    core_.reset_decode_timer();
    const Model & model = core_.model();
    prompt_plan plan = plan_prompt(prompt, p);
    suspended_.reset();  // a new generation: a paused one can no longer resume
    prompt_paused_ = false;

    auto st = std::make_shared<generation_state>(p, model);
    st->on_piece = on_piece;
    st->origin = request_id;
    generate_result res;
    {
        context_core::request_scope req(core_, request_id);
        const stop_fn stop = [this] { return core_.interrupt_requested(); };
        // Everything that can be refused (the grammar above all) is refused before the KV cache is
        // touched; the parse of a large grammar already takes an interrupt.
        try {
            st->sampler = make_generation_sampler(p, model, core_.n_ctx_seq, seen_tokens(plan), stop);
        } catch (const interrupted_error &) {
            st->out.stop("interrupted");
        }
        const int64_t t0 = now_us();
        // A pause inside the prompt goes on when the same request, sent again, reuses what was decoded.
        const bool pausable = draft == nullptr && p.cache_prompt && !p.cache_bit_exact;
        if (!st->out.stopped() && !take_prompt(plan, prompt.append, on_progress, pausable) && !prompt_paused_) {
            st->out.stop("interrupted");
        }
        const int64_t t1 = now_us();
        st->res.prompt_ms = elapsed_ms(t0, t1);
        st->res.n_prompt = plan.tokens.size();
        st->res.n_cached = plan.n_cached;
        if (prompt_paused_) {  // nothing sampled, nothing kept: the request sent again goes on
            res = st->res;
            res.n_past = history_.size();
            res.stop_reason = "paused";
            return res;
        }
        res = run_rounds(st, draft, n_draft, stop, t1);
    }
    return res;
}

generate_result sequence_driver::run_rounds(const std::shared_ptr<generation_state> & st, drafter * draft, size_t n_draft,
                                            const stop_fn & stop, int64_t t_start) {
    const Model & model = core_.model();
    generation_output & out = st->out;
    generate_result & res = st->res;
    const gen_params & p = st->p;
    std::vector<llama_token_data> scratch;
    bool paused = false;
    // At the top of each round everything emitted is decoded, and the last logits are the history's.
    while (!out.stopped()) {
        if (core_.interrupt_requested()) {
            out.stop("interrupted");
            break;
        }
        if (!out.may_sample() || history_.size() >= core_.n_ctx_seq) {
            out.stop("length");  // n_predict reached, or no room to decode another token
            break;
        }
        if (draft == nullptr && core_.pause_requested()) {
            paused = true;
            break;
        }
        llama_token tok = LLAMA_TOKEN_NULL;
        const float * row = last_logits();
        try {
            tok = choose_token(*st->sampler, row, model.n_vocab(), scratch, stop);
        } catch (const interrupted_error &) {
            out.stop("interrupted");  // inside a long grammar step: nothing of this token was kept
            break;
        }
        const size_t n_kept = res.tokens.size();
        const generation_output::verdict v = out.push(tok);
        if (p.n_logprobs >= 0 && res.tokens.size() > n_kept) {  // the token joined the result
            const float m = max_of(row, static_cast<size_t>(model.n_vocab()));
            res.logprobs.push_back(logprobs_of(row, model.n_vocab(), m, std::numeric_limits<float>::quiet_NaN(),
                                               tok, p.n_logprobs));
        }
        if (v == generation_output::verdict::stop) {
            break;  // not decoded: the history stays what it was before this token
        }
        if (draft != nullptr && v == generation_output::verdict::more &&
            speculate(tok, *draft, n_draft, *st->sampler, scratch, out, res)) {
            continue;  // tok, and what of the drafts the sampler chose, are decoded
        }
        if (!decode_tokens(&tok, 1, true)) {
            out.stop("interrupted");
        }
    }
    res.decode_ms += elapsed_ms(t_start, now_us());
    res.n_past = history_.size();
    res.n_threads = core_.last_decode_threads();
    if (paused) {
        st->history = history_;
        suspended_ = st;
        generate_result part = res;  // what the caller has so far; the text held back stays held
        part.text = out.streamed_text();
        part.n_decoded = out.n_sampled();
        part.stop_reason = "paused";
        return part;
    }
    out.finish();
    return std::move(res);  // the state ends here: its result is not needed again
}

generate_result sequence_driver::resume(uint64_t request_id, uint64_t origin, const piece_fn & on_piece) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("resume");
    if (suspended_ == nullptr) {
        throw context_error("nothing to resume: no generation is paused on this context (a generation started "
                            "since the pause drops it)");
    }
    if (origin != 0 && origin != suspended_->origin) {
        throw context_error("nothing to resume: the generation paused on this context is another one (a generation "
                            "started since the pause drops it)");
    }
    const std::shared_ptr<generation_state> st = std::move(suspended_);
    suspended_.reset();
    if (st->history != history_ || !has_logits_) {
        throw context_error("the paused generation cannot resume: the context changed since it paused");
    }
    core_.reset_decode_timer();
    st->on_piece = on_piece;
    context_core::request_scope req(core_, request_id);
    const stop_fn stop = [this] { return core_.interrupt_requested(); };
    return run_rounds(st, nullptr, 0, stop, now_us());
}

int32_t sequence_driver::paused_logprobs() const { return suspended_ == nullptr ? -1 : suspended_->p.n_logprobs; }

suspended_generation sequence_driver::suspension() const {
    if (suspended_ == nullptr) {
        throw context_error("no generation is paused on this context");
    }
    const generation_state & st = *suspended_;
    if (!st.sampler->portable()) {
        throw context_error("a mirostat generation keeps state that does not travel: it pauses and resumes in its "
                            "own context only");
    }
    suspended_generation s;
    s.tokens = st.res.tokens;
    s.n_sampled = st.out.n_sampled();
    s.emitted = st.out.emitted();
    s.draws = st.sampler->draws();
    s.n_prompt = st.res.n_prompt;
    s.n_cached = st.res.n_cached;
    s.prompt_ms = st.res.prompt_ms;
    return s;
}

void sequence_driver::adopt(const gen_params & p, const suspended_generation & s, uint64_t origin) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("adopt");
    const Model & model = core_.model();
    if (!has_logits_ || history_.size() < s.tokens.size() ||
        !std::equal(s.tokens.rbegin(), s.tokens.rend(), history_.rbegin())) {
        throw context_error("the context does not end with the paused generation's tokens: load its state first");
    }
    if (s.n_sampled < static_cast<int32_t>(s.tokens.size())) {
        throw std::invalid_argument("a paused generation samples at least the tokens it holds");
    }
    auto st = std::make_shared<generation_state>(p, model);
    // The windows start from the whole history, as they stood after accepting the generated tokens
    // one by one; the grammar sees only what was generated.
    st->sampler = make_generation_sampler(p, model, core_.n_ctx_seq, history_);
    if (!st->sampler->portable()) {
        throw context_error("a mirostat generation cannot be taken over");
    }
    if (st->sampler->has_grammar()) {
        for (llama_token t : s.tokens) {
            st->sampler->set_grammar(st->sampler->grammar_after(t));
        }
    }
    st->sampler->replay_draws(s.draws);
    st->out.restore(s.tokens, s.n_sampled, s.emitted);
    st->res.n_prompt = s.n_prompt;
    st->res.n_cached = s.n_cached;
    st->res.prompt_ms = s.prompt_ms;
    st->history = history_;
    st->origin = origin;
    suspended_ = std::move(st);
}

}  // namespace lloyal
