// Context::generate: prompt handling, the sampling loop, stop strings and streaming.
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
#include "common.hpp"
#include "context.hpp"
#include "errors.hpp"
#include "sampling.hpp"

#include <algorithm>
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

size_t common_prefix(const std::vector<llama_token> & a, const std::vector<llama_token> & b) {
    const size_t n = std::min(a.size(), b.size());
    size_t i = 0;
    while (i < n && a[i] == b[i]) {
        ++i;
    }
    return i;
}

}  // namespace

py::dict Context::generate(py::handle prompt, const py::dict & params, uint64_t request_id, const py::object & on_piece) {
    busy_guard busy(*this);
    require_sequence_mode("generate");
    if (!on_piece.is_none() && !PyCallable_Check(on_piece.ptr())) {
        throw py::type_error("on_piece must be callable or None");
    }
    const gen_params p = parse_gen_params(params, *model_);

    std::vector<llama_token> prompt_toks;
    if (PyUnicode_Check(prompt.ptr())) {
        const std::string text = prompt.cast<std::string>();
        if (!text.empty()) {
            // With cache_prompt the prompt is the whole context, so it starts like one (BOS).
            const bool add_special = history_.empty() || p.cache_prompt;
            gil_release nogil;
            prompt_toks = model_->tokenize(text, add_special, true);
        }
    } else {
        prompt_toks = tokens_from_py(prompt, *model_);
    }
    const bool continue_only = prompt_toks.empty();
    if (continue_only && history_.empty()) {
        throw std::invalid_argument("empty prompt on an empty context: nothing to continue from");
    }

    // Everything that can be refused is refused before the KV cache is touched.
    sampler_chain chain(p, *model_, n_ctx_seq_);

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
    const size_t room = n_ctx_seq_ > n_keep ? n_ctx_seq_ - n_keep : 0;
    if (to_decode.size() > room) {
        throw context_overflow_error("prompt of " + std::to_string(to_decode.size()) +
                                     " new tokens does not fit: n_ctx " + std::to_string(n_ctx_seq_) + ", n_past " +
                                     std::to_string(n_keep) + ", room " + std::to_string(room));
    }
    chain.prime_penalties(history_, n_keep, to_decode);

    std::string gen;             // generated bytes
    size_t emitted = 0;          // gen[:emitted] is final: streamed, or would have been
    size_t text_end = std::string::npos;
    std::vector<llama_token> out_tokens;
    int32_t n_sampled = 0;
    size_t n_cached = p.cache_prompt && !continue_only ? n_keep : 0;
    std::string stop_reason;
    std::exception_ptr callback_error;
    double prompt_ms = 0.0;
    double decode_ms = 0.0;
    const llama_vocab * vocab = model_->vocab();

    auto stream = [&](size_t end) {
        if (end <= emitted) {
            return;
        }
        const size_t begin = emitted;
        emitted = end;
        if (on_piece.is_none() || callback_error) {
            return;
        }
        gil_acquire gil;
        try {
            on_piece(decode_utf8_replace(gen.data() + begin, end - begin));
        } catch (...) {
            callback_error = std::current_exception();
        }
    };

    {
        request_scope req(*this, request_id);
        gil_release nogil;
        const int64_t t0 = now_us();
        bool ok = true;
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
        ok = decode_tokens(to_decode.data(), to_decode.size(), true);
        const int64_t t1 = now_us();
        prompt_ms = elapsed_ms(t0, t1);
        if (!ok) {
            stop_reason = "interrupted";
        }

        while (stop_reason.empty()) {
            if (interrupt_requested()) {
                stop_reason = "interrupted";
                break;
            }
            if (p.n_predict > 0 && n_sampled >= p.n_predict) {
                stop_reason = "length";
                break;
            }
            if (history_.size() >= n_ctx_seq_) {
                stop_reason = "length";  // no room to decode another token
                break;
            }
            const llama_token tok = chain.sample(ctx_);
            if (tok == LLAMA_TOKEN_NULL) {
                if (chain.has_grammar()) {
                    stop_reason = "eos";  // the grammar is complete and EOG is banned (ignore_eos)
                    break;
                }
                throw lloyal_error("no token can be sampled: logit_bias/ignore_eos ban every token");
            }
            ++n_sampled;
            if (!p.ignore_eos && llama_vocab_is_eog(vocab, tok)) {
                stop_reason = "eos";
                break;
            }
            out_tokens.push_back(tok);
            gen += model_->token_to_piece(tok, true);

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
        decode_ms = elapsed_ms(t1, now_us());
    }
    if (callback_error) {
        std::rethrow_exception(callback_error);
    }

    py::dict r;
    r["text"] = decode_utf8_replace(gen.data(), text_end);
    r["tokens"] = out_tokens;
    r["n_prompt"] = prompt_toks.size();
    r["n_decoded"] = n_sampled;
    r["n_cached"] = n_cached;
    r["n_past"] = history_.size();
    r["stop_reason"] = stop_reason.empty() ? std::string("length") : stop_reason;
    r["prompt_ms"] = prompt_ms;
    r["decode_ms"] = decode_ms;
    return r;
}

}  // namespace lloyal
