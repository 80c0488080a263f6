// The embed driver (embed.hpp): packing inputs into decodes, reading embeddings and answer logits.
#include "embed.hpp"
#include "errors.hpp"
#include "logits.hpp"
#include "sequence.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace lloyal {

namespace {

// Empties the cache when a call ends, however it ends: an embed or scoring call owns the whole cache
// for its duration and leaves nothing behind (a failed or interrupted decode may leave cells).
class clear_on_exit {
  public:
    explicit clear_on_exit(context_core & core) : core_(core) {}
    ~clear_on_exit() { llama_memory_clear(core_.memory(), true); }
    clear_on_exit(const clear_on_exit &) = delete;
    clear_on_exit & operator=(const clear_on_exit &) = delete;

  private:
    context_core & core_;
};

// The most logits one scoring decode may ask llama.cpp to keep.
constexpr size_t k_max_logits_bytes = size_t{256} << 20;

void normalize_row(float * row, size_t n) {
    double ss = 0.0;
    for (size_t i = 0; i < n; ++i) {
        ss += static_cast<double>(row[i]) * static_cast<double>(row[i]);
    }
    if (ss > 0.0) {
        const float inv = static_cast<float>(1.0 / std::sqrt(ss));
        for (size_t i = 0; i < n; ++i) {
            row[i] *= inv;
        }
    }
}

}  // namespace

std::vector<std::pair<size_t, size_t>> embed_driver::pack(const std::vector<std::vector<llama_token>> & inputs,
                                                          size_t max_tokens, const std::vector<size_t> & outputs,
                                                          size_t max_outputs) const {
    std::vector<std::pair<size_t, size_t>> groups;
    const size_t max_seqs = std::max<uint32_t>(core_.n_seq_max, 1);
    size_t begin = 0;
    size_t tokens = 0;
    size_t rows = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
        const size_t n = inputs[i].size();
        const size_t r = outputs.empty() ? 0 : outputs[i];
        if (n == 0) {
            throw std::invalid_argument("input " + std::to_string(i) + " has no tokens");
        }
        if (n > max_tokens) {
            throw context_overflow_error("input " + std::to_string(i) + " has " + std::to_string(n) +
                                         " tokens; one decode of this context takes at most " +
                                         std::to_string(max_tokens) + " (n_ctx " + std::to_string(core_.n_ctx) +
                                         ", n_batch " + std::to_string(core_.n_batch) + ", n_ubatch " +
                                         std::to_string(core_.n_ubatch) + ")");
        }
        if (r > max_outputs) {
            throw context_overflow_error("input " + std::to_string(i) + " needs " + std::to_string(r) +
                                         " rows of logits; one decode keeps at most " + std::to_string(max_outputs) +
                                         " (" + std::to_string(k_max_logits_bytes >> 20) + " MiB at this vocabulary)");
        }
        if (i > begin && (tokens + n > max_tokens || rows + r > max_outputs || i - begin >= max_seqs)) {
            groups.emplace_back(begin, i);
            begin = i;
            tokens = 0;
            rows = 0;
        }
        tokens += n;
        rows += r;
    }
    if (begin < inputs.size()) {
        groups.emplace_back(begin, inputs.size());
    }
    return groups;
}

std::vector<size_t> embed_driver::decode_group(const std::vector<std::vector<llama_token>> & inputs, size_t begin,
                                              size_t end, const std::vector<size_t> & first_output) {
    if (core_.interrupt_requested()) {
        throw interrupted_error("interrupted: nothing was returned");
    }
    llama_memory_clear(core_.memory(), true);
    std::vector<size_t> starts;
    size_t j = 0;
    for (size_t k = begin; k < end; ++k) {
        const auto & toks = inputs[k];
        const auto seq = static_cast<llama_seq_id>(k - begin);
        const size_t first = first_output.empty() ? 0 : first_output[k];
        starts.push_back(j);
        for (size_t t = 0; t < toks.size(); ++t) {
            core_.put(j++, toks[t], static_cast<llama_pos>(t), seq, t >= first);
        }
    }
    const uint64_t mark = log_mark();
    const int32_t ret = core_.decode(static_cast<int32_t>(j));
    if (ret != 0) {
        core_.throw_decode_failure(ret, j, mark);
    }
    return starts;
}

embed_result embed_driver::embed(const std::vector<std::vector<llama_token>> & inputs, bool normalize,
                                 uint64_t request_id) {
    context_core::busy_guard busy(core_);
    if (!core_.embeddings) {
        throw context_error("embed needs a context created with embeddings=True; this one generates");
    }
    if (inputs.empty()) {
        throw std::invalid_argument("embed needs at least one input");
    }
    core_.reset_decode_timer();
    const llama_model * model = core_.model().get();
    const bool per_token = core_.pooling == LLAMA_POOLING_TYPE_NONE;
    const bool rank = core_.pooling == LLAMA_POOLING_TYPE_RANK;
    embed_result r;
    r.width = static_cast<uint32_t>(rank ? llama_model_n_cls_out(model) : llama_model_n_embd_out(model));
    // Pooling is done per ubatch: an input is only pooled whole when a decode is one ubatch.
    const size_t max_tokens = std::min<size_t>(core_.n_ubatch, core_.n_ctx);
    const auto groups = pack(inputs, max_tokens, {}, 0);

    size_t n_rows = 0;
    r.rows.reserve(inputs.size());
    for (const auto & toks : inputs) {
        const size_t rows = per_token ? toks.size() : 1;
        r.rows.push_back(static_cast<uint32_t>(rows));
        n_rows += rows;
    }
    result_ = region_arena::block();  // the previous call's rows: the client has read them by now
    try {
        result_ = core_.arena().alloc(std::max<size_t>(n_rows * r.width * sizeof(float), 1));
    } catch (const region_full_error & e) {
        throw result_too_large_error(std::to_string(n_rows) + " rows of " + std::to_string(r.width) +
                                     " floats do not fit: " + e.what() + " (or embed fewer texts per call)");
    }
    r.offset = result_.offset();

    clear_on_exit clear(core_);
    context_core::request_scope req(core_, request_id);
    float * out = result_.floats();
    for (const auto & [begin, end] : groups) {
        decode_group(inputs, begin, end, {});
        size_t j = 0;
        for (size_t k = begin; k < end; ++k) {
            if (per_token) {
                for (size_t t = 0; t < inputs[k].size(); ++t, ++j) {
                    const float * e = llama_get_embeddings_ith(core_.get(), static_cast<int32_t>(j));
                    if (e == nullptr) {
                        throw decode_error("llama.cpp returned no embedding for token " + std::to_string(t) +
                                           " of input " + std::to_string(k));
                    }
                    std::memcpy(out, e, r.width * sizeof(float));
                    if (normalize) {
                        normalize_row(out, r.width);
                    }
                    out += r.width;
                }
            } else {
                const float * e = llama_get_embeddings_seq(core_.get(), static_cast<llama_seq_id>(k - begin));
                if (e == nullptr) {
                    throw decode_error("llama.cpp returned no pooled embedding for input " + std::to_string(k));
                }
                std::memcpy(out, e, r.width * sizeof(float));
                if (normalize && !rank) {
                    normalize_row(out, r.width);
                }
                out += r.width;
            }
        }
    }
    return r;
}

std::vector<double> embed_driver::score_tails(const std::vector<std::vector<llama_token>> & prompts,
                                              const std::vector<size_t> & n_tail, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    if (core_.embeddings) {
        throw context_error("scoring text with a causal LM needs a generation context; this one was created with "
                            "embeddings=True");
    }
    if (!core_.held_by_others().empty()) {
        throw context_error("rerank on a generation context uses its whole cache: it must hold nothing (no "
                            "history, no branches); reset() it first");
    }
    if (n_tail.size() != prompts.size()) {
        throw std::invalid_argument("n_tail must hold one count per prompt");
    }
    std::vector<size_t> first_output(prompts.size());
    for (size_t k = 0; k < prompts.size(); ++k) {
        if (n_tail[k] == 0 || n_tail[k] >= prompts[k].size()) {
            throw std::invalid_argument("prompt " + std::to_string(k) + " has " + std::to_string(prompts[k].size()) +
                                        " tokens: it needs at least one before its " + std::to_string(n_tail[k]) +
                                        " scored ones, and at least one scored");
        }
        // The logits at position t predict token t + 1.
        first_output[k] = prompts[k].size() - n_tail[k] - 1;
    }
    if (prompts.empty()) {
        return {};
    }
    core_.reset_decode_timer();
    const size_t max_tokens = std::min<size_t>(core_.n_batch, core_.n_ctx);
    const int32_t n_vocab = core_.model().n_vocab();
    // llama.cpp keeps every output row's logits: bound them per decode (a long query times many
    // documents at a 262k vocabulary would otherwise ask for gigabytes).
    const size_t max_outputs =
        std::max<size_t>(1, k_max_logits_bytes / (static_cast<size_t>(n_vocab) * sizeof(float)));
    const auto groups = pack(prompts, max_tokens, n_tail, max_outputs);

    std::vector<double> scores;
    scores.reserve(prompts.size());
    clear_on_exit clear(core_);
    sequence_.clear();  // llama.cpp's logits are the scoring's now, not the (empty) history's
    context_core::request_scope req(core_, request_id);
    for (const auto & [begin, end] : groups) {
        const std::vector<size_t> starts = decode_group(prompts, begin, end, first_output);
        for (size_t k = begin; k < end; ++k) {
            const auto & toks = prompts[k];
            double sum = 0.0;
            for (size_t t = first_output[k]; t + 1 < toks.size(); ++t) {
                const float * logits = llama_get_logits_ith(core_.get(), static_cast<int32_t>(starts[k - begin] + t));
                if (logits == nullptr) {
                    throw decode_error("llama.cpp returned no logits for prompt " + std::to_string(k));
                }
                const float m = max_of(logits, static_cast<size_t>(n_vocab));
                sum += static_cast<double>(logits[toks[t + 1]]) -
                       static_cast<double>(log_sum_exp(logits, static_cast<size_t>(n_vocab), m));
            }
            scores.push_back(sum / static_cast<double>(n_tail[k]));
        }
    }
    return scores;
}

}  // namespace lloyal
