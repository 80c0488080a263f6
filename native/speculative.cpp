// Speculative decoding (go-llama's GenerateWithDraft): a drafter proposes how the text goes on, the target
// decodes its next token and the proposal in one batch, and its own sampler chain walks the rows in order,
// keeping drafted tokens for as long as it chooses the same ones. Every emitted token is the target
// sampler's choice from the target's logits, so greedy output is that of generate() (up to the batch
// non-invariance of llama.cpp's kernels) and sampled output has the target's distribution; the drafter
// only decides how many tokens one target decode yields.
//
// Drafters: "ngram" (prompt lookup: the latest earlier occurrence of the context's last few tokens, and
// what followed it) and a context of a smaller model with the same vocabulary in the same worker.
#include "errors.hpp"
#include "generation.hpp"
#include "sequence.hpp"

#include <algorithm>
#include <cstring>

namespace lloyal {

namespace {

class ngram_drafter final : public drafter {
  public:
    ngram_drafter(size_t n_min, size_t n_max) : n_min_(n_min), n_max_(n_max) {}

    std::vector<llama_token> draft(const std::vector<llama_token> & ctx, size_t n) override {
        const size_t size = ctx.size();
        for (size_t k = std::min(n_max_, size > 0 ? size - 1 : 0); k >= n_min_ && k > 0; --k) {
            const llama_token * key = ctx.data() + (size - k);
            // The latest earlier occurrence: the text most likely repeats what it did last time.
            for (size_t i = size - k; i-- > 0;) {
                if (std::memcmp(ctx.data() + i, key, k * sizeof(llama_token)) != 0) {
                    continue;
                }
                // Continue from what followed; past the end of the context the proposal continues
                // itself, so a loop shorter than n is proposed as a loop.
                std::vector<llama_token> out;
                out.reserve(n);
                for (size_t j = i + k; out.size() < n; ++j) {
                    out.push_back(j < size ? ctx[j] : out[j - size]);
                }
                return out;
            }
        }
        return {};
    }

  private:
    size_t n_min_;
    size_t n_max_;
};

// A draft context: its own history tracks the target's, its greedy continuation is the proposal.
class model_drafter final : public drafter {
  public:
    explicit model_drafter(sequence_driver & d) : d_(d), busy_(d.core()) {}

    std::vector<llama_token> draft(const std::vector<llama_token> & ctx, size_t n) override {
        return d_.draft_greedy(ctx, n);
    }

  private:
    sequence_driver & d_;
    context_core::busy_guard busy_;  // for the whole generation: nobody else moves the draft's cache
};

llama_token argmax(const float * z, int32_t n) {
    return static_cast<llama_token>(std::max_element(z, z + n) - z);
}

}  // namespace

std::unique_ptr<drafter> make_ngram_drafter(size_t n_min, size_t n_max) {
    if (n_min < 1 || n_max < n_min) {
        throw std::invalid_argument("ngram sizes must satisfy 1 <= ngram_min <= ngram_max");
    }
    return std::make_unique<ngram_drafter>(n_min, n_max);
}

std::unique_ptr<drafter> make_model_drafter(sequence_driver & target, sequence_driver & draft) {
    if (&target == &draft) {
        throw std::invalid_argument("the draft context must be another context than the target");
    }
    const Model & a = target.core().model();
    const Model & b = draft.core().model();
    bool same = a.n_vocab() == b.n_vocab();
    // Token ids must mean the same text: compare a spread of them (all 262k would cost milliseconds).
    for (llama_token t = 0; same && t < a.n_vocab(); t += 97) {
        same = std::strcmp(llama_vocab_get_text(a.vocab(), t), llama_vocab_get_text(b.vocab(), t)) == 0;
    }
    if (!same) {
        throw context_error("the draft model's vocabulary is not the target's: speculative decoding needs the same "
                            "tokens (n_vocab " + std::to_string(b.n_vocab()) + " vs " + std::to_string(a.n_vocab()) + ")");
    }
    return std::make_unique<model_drafter>(draft);
}

std::vector<llama_token> sequence_driver::draft_greedy(const std::vector<llama_token> & ctx, size_t n) {
    require_sequence_mode("drafting");
    if (ctx.empty() || n == 0) {
        return {};
    }
    // Keep what the history shares with ctx (the last round's accepted drafts included), decode the rest.
    size_t keep = 0;
    while (keep < ctx.size() && keep < history_.size() && history_[keep] == ctx[keep]) {
        ++keep;
    }
    if (keep == ctx.size() && !(keep == history_.size() && has_logits_)) {
        --keep;
    }
    if (truncate_to(keep) != keep) {
        keep = 0;
    }
    // A draft context smaller than the target's stops proposing when it is full.
    const size_t room = core_.n_ctx_seq > ctx.size() ? core_.n_ctx_seq - ctx.size() : 0;
    n = std::min(n, room);
    if (n == 0 || !decode_tokens(ctx.data() + keep, ctx.size() - keep, true)) {
        return {};
    }
    const int32_t n_vocab = core_.model().n_vocab();
    std::vector<llama_token> out;
    while (out.size() < n) {
        const llama_token t = argmax(last_logits(), n_vocab);
        out.push_back(t);
        if (out.size() == n || llama_vocab_is_eog(core_.model().vocab(), t) || !decode_tokens(&t, 1, true)) {
            break;
        }
    }
    return out;
}

bool sequence_driver::decode_all_rows(const std::vector<llama_token> & toks) {
    const size_t pos0 = history_.size();
    for (size_t j = 0; j < toks.size(); ++j) {
        core_.put(j, toks[j], static_cast<llama_pos>(pos0 + j), 0, true);
    }
    has_logits_ = false;
    const int32_t ret = core_.decode(static_cast<int32_t>(toks.size()));
    if (ret == 0) {
        append_history(toks.data(), toks.size());
        has_logits_ = true;
        return true;
    }
    truncate_to(pos0);
    if (ret == 2) {
        return false;
    }
    throw decode_error("llama_decode failed (" + std::to_string(ret) + ") on a batch of " + std::to_string(toks.size()) +
                       " drafted tokens");
}

generate_result sequence_driver::generate_with_draft(const prompt_input & prompt, const gen_params & p, drafter & draft,
                                                     size_t n_draft, uint64_t request_id, const piece_fn & on_piece,
                                                     const context_core::progress_fn & on_progress) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("generate_with_draft");
    if (n_draft < 1) {
        throw std::invalid_argument("n_draft must be at least 1");
    }
    // Rejected drafts are removed from the cache, which not every cache can do.
    if (const std::string why = core_.why_ranges_cannot_be_removed(); !why.empty()) {
        throw context_error("speculative decoding removes rejected drafts from the cache: " + why);
    }
    // The target decodes its next token and the drafts in one batch.
    n_draft = std::min<size_t>(n_draft, core_.n_batch - 1);
    return run_generation(prompt, p, &draft, n_draft, request_id, on_piece, on_progress);
}

bool sequence_driver::speculate(llama_token tok, drafter & draft, size_t n_draft, chain_sampler & sampler,
                                std::vector<llama_token_data> & scratch, generation_output & out,
                                generate_result & res) {
    using verdict = generation_output::verdict;
    // Room for tok, the drafts, and a token after them; no more drafts than n_predict can use.
    size_t n = std::min(n_draft, core_.n_ctx_seq - history_.size() - 1);
    if (out.params().n_predict > 0) {
        n = std::min<size_t>(n, static_cast<size_t>(out.params().n_predict - out.n_sampled()));
    }
    if (n == 0) {
        return false;
    }
    std::vector<llama_token> batch = history_;
    batch.push_back(tok);
    std::vector<llama_token> drafts = draft.draft(batch, n);
    if (drafts.empty()) {
        return false;
    }
    drafts.resize(std::min(drafts.size(), n));
    batch.assign(1, tok);
    batch.insert(batch.end(), drafts.begin(), drafts.end());
    const size_t pos0 = history_.size();
    if (!decode_all_rows(batch)) {
        out.stop("interrupted");
        return true;
    }
    res.n_drafted += drafts.size();
    const int32_t n_vocab = core_.model().n_vocab();
    // Row i holds the logits after batch[i]: the target's choice there is checked against drafts[i].
    for (size_t i = 0; i < drafts.size(); ++i) {
        if (!out.may_sample()) {
            truncate_to(pos0 + 1 + i);
            out.stop("length");
            return true;
        }
        const llama_token s = choose_token(sampler, llama_get_logits_ith(core_.get(), static_cast<int32_t>(i)), n_vocab,
                                           scratch);
        const verdict vs = out.push(s);
        if (s == drafts[i] && vs != verdict::stop) {
            ++res.n_accepted;
            if (vs == verdict::last_decoded) {
                truncate_to(pos0 + 2 + i);
                return true;
            }
            continue;  // all drafts kept: the next choice comes from the last row, at the top
        }
        // Rejected (or the end): drop the drafts from i on; a different choice is decoded now.
        truncate_to(pos0 + 1 + i);
        if (vs != verdict::stop && !decode_tokens(&s, 1, true)) {
            out.stop("interrupted");
        }
        return true;
    }
    return true;
}

}  // namespace lloyal
