// sequence_driver::generate: prompt handling, the sampling loop, stop strings and streaming.
//
// Choices about what a result contains:
//  - tokens are the generated tokens that are part of the output. An EOG token that ends the
//    generation is neither in tokens nor in text (n_decoded counts it: it was sampled). The token that
//    completes a stop string *is* in tokens, although the stop string and anything after it are cut
//    from text: tokens say what the model produced, text what the caller asked to see.
//  - every token in tokens has also been decoded, so the context's history is prompt + tokens and
//    its logits are those after the last one: generate("") continues exactly where this call ended,
//    and a cache_prompt call with prompt + output reuses all of it. This costs one decode for the last
//    token, which llama.cpp's examples skip; generation stops ("length") rather than sample a token
//    there is no room left to decode.
#include "errors.hpp"
#include "logits.hpp"
#include "sequence.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <exception>
#include <string>

namespace lloyal {

namespace {

// Length of an incomplete but so far valid UTF-8 sequence at the end of s[from:], or 0.
// Only a *valid* prefix is held back: bytes that can never become a character are final already
// (the decoder replaces them the same whatever follows), and holding them would not help.
size_t incomplete_utf8_tail(const std::string & s, size_t from) {
    const size_t n = s.size();
    for (size_t back = 1; back <= 3 && back <= n - from; ++back) {
        const auto lead = static_cast<unsigned char>(s[n - back]);
        if ((lead & 0xC0) == 0x80) {
            continue;  // continuation byte: keep looking for the lead
        }
        size_t need = 0;
        if (lead >= 0xC2 && lead <= 0xDF) {
            need = 2;
        } else if (lead >= 0xE0 && lead <= 0xEF) {
            need = 3;
        } else if (lead >= 0xF0 && lead <= 0xF4) {
            need = 4;
        } else {
            return 0;  // ASCII or a byte that cannot start a sequence
        }
        if (back >= need) {
            return 0;  // complete
        }
        // The second byte's range depends on the lead (no overlongs, no surrogates, <= U+10FFFF).
        if (back >= 2) {
            const auto b1 = static_cast<unsigned char>(s[n - back + 1]);
            unsigned char lo = 0x80;
            unsigned char hi = 0xBF;
            if (lead == 0xE0) {
                lo = 0xA0;
            } else if (lead == 0xED) {
                hi = 0x9F;
            } else if (lead == 0xF0) {
                lo = 0x90;
            } else if (lead == 0xF4) {
                hi = 0x8F;
            }
            if (b1 < lo || b1 > hi) {
                return 0;
            }
        }
        return back;
    }
    return 0;
}

// Earliest start of any stop string in s[from:], or npos.
size_t find_stop(const std::string & s, size_t from, const std::vector<std::string> & stops) {
    size_t best = std::string::npos;
    for (const auto & stop : stops) {
        const size_t at = s.find(stop, from);
        if (at < best) {
            best = at;
        }
    }
    return best;
}

// Longest suffix of s[from:] that is a proper prefix of some stop string: text that may still turn
// out to be the start of a stop, so it cannot be streamed yet.
size_t stop_prefix_tail(const std::string & s, size_t from, const std::vector<std::string> & stops) {
    const size_t avail = s.size() - from;
    size_t hold = 0;
    for (const auto & stop : stops) {
        for (size_t k = std::min(stop.size() - 1, avail); k > hold; --k) {
            if (s.compare(s.size() - k, k, stop, 0, k) == 0) {
                hold = k;
                break;
            }
        }
    }
    return hold;
}

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

generate_result sequence_driver::generate(const prompt_input & prompt, const gen_params & p, uint64_t request_id,
                                          const piece_fn & on_piece) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("generate");
    core_.reset_decode_timer();
    const Model & model = core_.model();

    std::vector<llama_token> prompt_toks;
    if (prompt.is_text) {
        if (!prompt.text.empty()) {
            // With cache_prompt the prompt is the whole context, so it starts like one (BOS).
            prompt_toks = model.tokenize(prompt.text, history_.empty() || p.cache_prompt, true);
        }
    } else {
        prompt_toks = prompt.tokens;
    }
    const bool continue_only = prompt_toks.empty();
    if (continue_only && history_.empty()) {
        throw std::invalid_argument("empty prompt on an empty context: nothing to continue from");
    }

    size_t n_keep = history_.size();
    std::vector<llama_token> to_decode;
    if (continue_only) {
        // nothing to add
    } else if (p.cache_prompt) {
        n_keep = common_prefix(history_, prompt_toks);
        if (n_keep == prompt_toks.size()) {
            --n_keep;  // decode at least one token, for logits that belong to this prompt
        }
        n_keep = reuse_point(n_keep);
        to_decode.assign(prompt_toks.begin() + static_cast<std::ptrdiff_t>(n_keep), prompt_toks.end());
    } else {
        to_decode = prompt_toks;
    }
    const size_t room = core_.n_ctx_seq > n_keep ? core_.n_ctx_seq - n_keep : 0;
    if (to_decode.size() > room) {
        throw context_overflow_error("prompt of " + std::to_string(to_decode.size()) +
                                     " new tokens does not fit: n_ctx " + std::to_string(core_.n_ctx_seq) +
                                     ", n_past " + std::to_string(n_keep) + ", room " + std::to_string(room));
    }

    // Everything that can be refused (the grammar above all) is refused before the KV cache is touched.
    // The repetition penalties and DRY look back over the context, prompt included, as llama-server
    // does; the grammar sees only what is generated.
    std::vector<llama_token> seen(history_.begin(), history_.begin() + static_cast<std::ptrdiff_t>(n_keep));
    seen.insert(seen.end(), to_decode.begin(), to_decode.end());
    chain_sampler sampler(p, model, core_.n_ctx_seq, seen);
    if (p.grammar) {
        sampler.set_grammar(make_grammar_sampler(model, *p.grammar));
    }
    sampler.set_logit_bias(p.ignore_eos ? with_eog_banned(p.logit_bias, model) : p.logit_bias);
    std::vector<llama_token_data> scratch;

    generate_result res;
    std::string & gen = res.text;  // generated bytes
    size_t emitted = 0;            // gen[:emitted] is final: streamed, or would have been
    size_t text_end = std::string::npos;
    int32_t n_sampled = 0;
    size_t n_cached = p.cache_prompt && !continue_only ? n_keep : 0;
    std::string stop_reason;
    std::exception_ptr callback_error;
    const llama_vocab * vocab = model.vocab();
    const int32_t n_vocab = model.n_vocab();

    auto stream = [&](size_t end) {
        if (end <= emitted) {
            return;
        }
        const size_t begin = emitted;
        emitted = end;
        if (!on_piece || callback_error) {
            return;
        }
        try {
            on_piece(std::string_view(gen.data() + begin, end - begin));
        } catch (...) {
            callback_error = std::current_exception();
        }
    };

    {
        context_core::request_scope req(core_, request_id);
        const int64_t t0 = now_us();
        if (p.cache_prompt && !continue_only) {
            if (truncate_to(n_keep) != n_keep) {
                // The memory could not keep that prefix: it was cleared, so start over.
                to_decode = prompt_toks;
                n_cached = 0;
            }
        } else if (continue_only && !has_logits_) {
            // Continuing needs the logits after the last token (lost after an interrupt, reset of
            // a sampled-but-undecoded state, ...): decode that token again.
            const std::vector<llama_token> old = history_;
            if (truncate_to(old.size() - 1) == old.size() - 1) {
                to_decode.assign(1, old.back());
            } else {
                to_decode = old;
            }
        }
        const bool ok = decode_tokens(to_decode.data(), to_decode.size(), true);
        const int64_t t1 = now_us();
        res.prompt_ms = elapsed_ms(t0, t1);
        if (!ok) {
            stop_reason = "interrupted";
        }

        while (stop_reason.empty()) {
            if (core_.interrupt_requested()) {
                stop_reason = "interrupted";
                break;
            }
            if (p.n_predict > 0 && n_sampled >= p.n_predict) {
                stop_reason = "length";
                break;
            }
            if (history_.size() >= core_.n_ctx_seq) {
                stop_reason = "length";  // no room to decode another token
                break;
            }
            const float * z = last_logits();
            if (z == nullptr) {
                throw lloyal_error("no logits to sample from");
            }
            // The sampler needs the row's maximum (its greedy path finds the argmax from it); the
            // log-sum-exp is only for surprisals, which generate() does not report.
            const logits_row row{z, max_of(z, static_cast<size_t>(n_vocab)), std::numeric_limits<float>::quiet_NaN()};
            const llama_token tok = sampler.sample(row, scratch).token;
            if (tok == LLAMA_TOKEN_NULL) {
                if (sampler.has_grammar()) {
                    stop_reason = "eos";  // the grammar is complete and EOG is banned (ignore_eos)
                    break;
                }
                throw lloyal_error("no token can be sampled: logit_bias/ignore_eos ban every token");
            }
            if (sampler.has_grammar()) {
                sampler.set_grammar(sampler.grammar_after(tok));
            }
            sampler.accept(tok);
            ++n_sampled;
            if (!p.ignore_eos && llama_vocab_is_eog(vocab, tok)) {
                stop_reason = "eos";
                break;
            }
            res.tokens.push_back(tok);
            gen += model.token_to_piece(tok, true);

            const size_t match = find_stop(gen, emitted, p.stop);
            if (match != std::string::npos) {
                text_end = match;
                stop_reason = "stop";
                stream(match);
            } else {
                const size_t hold = std::max(stop_prefix_tail(gen, emitted, p.stop), incomplete_utf8_tail(gen, emitted));
                stream(gen.size() - hold);
            }
            if (callback_error) {
                break;  // not decoded: the history stays what it was before this token
            }
            if (!decode_tokens(&tok, 1, true)) {
                if (stop_reason.empty()) {
                    stop_reason = "interrupted";
                }
                break;
            }
        }
        if (text_end == std::string::npos) {
            text_end = gen.size();
        }
        // Whatever was held back is final now (a stop prefix that never completed, a truncated
        // UTF-8 sequence that becomes U+FFFD here exactly as in text).
        stream(text_end);
        res.decode_ms = elapsed_ms(t1, now_us());
    }
    if (callback_error) {
        std::rethrow_exception(callback_error);
    }
    gen.resize(text_end);
    res.n_prompt = prompt_toks.size();
    res.n_decoded = n_sampled;
    res.n_cached = n_cached;
    res.n_past = history_.size();
    res.stop_reason = stop_reason.empty() ? std::string("length") : stop_reason;
    return res;
}

}  // namespace lloyal
