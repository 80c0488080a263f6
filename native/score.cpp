// sequence_driver::score / score_choices: teacher-forced log-likelihoods (the stub's Context.score).
//
// Each scored token costs one output row of llama_decode, turned into -log softmax(row)[token] right
// here (max, log-sum-exp: logits.hpp), so no logits leave the process. llama.cpp keeps an output buffer
// as large as the most rows one decode asked for (n_vocab floats each, 1 MiB at Gemma's vocabulary), so
// the rows of one decode are capped by a byte budget, not by n_batch.
#include "errors.hpp"
#include "logits.hpp"
#include "sequence.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace lloyal {

namespace {

constexpr size_t k_rows_budget_bytes = size_t{64} << 20;

size_t rows_per_decode(const context_core & core) {
    const size_t row_bytes = static_cast<size_t>(core.model().n_vocab()) * sizeof(float);
    const size_t cap = std::max<size_t>(1, k_rows_budget_bytes / row_bytes);
    return std::max<size_t>(1, std::min<size_t>(cap, core.n_batch));
}

// -log softmax(row)[tok], with the log-sum-exp in float (good to ~1e-6 relative) and the difference in
// double.
double token_nll(const float * row, size_t n_vocab, llama_token tok) {
    const float m = max_of(row, n_vocab);
    const float lse = log_sum_exp(row, n_vocab, m);
    return static_cast<double>(lse) - static_cast<double>(row[tok]);
}

[[noreturn]] void throw_failed_decode(int32_t ret, size_t n, const context_core & core) {
    if (ret == 2) {
        throw interrupted_error("interrupted");
    }
    if (ret == 1) {
        throw decode_error("llama_decode found no KV slot for a batch of " + std::to_string(n) + " tokens (the cache has " +
                           std::to_string(core.n_cells) + " cells)");
    }
    throw decode_error("llama_decode failed (" + std::to_string(ret) + ")");
}

}  // namespace

score_result sequence_driver::score(const std::vector<llama_token> & toks, uint64_t request_id, int32_t n_logprobs) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("score");
    core_.reset_decode_timer();
    if (toks.size() < 2) {
        throw std::invalid_argument("score needs at least two tokens (the first has nothing to predict it), got " +
                                    std::to_string(toks.size()));
    }
    if (toks.size() > core_.n_ctx_seq) {
        throw context_overflow_error(std::to_string(toks.size()) + " tokens do not fit: n_ctx " +
                                     std::to_string(core_.n_ctx_seq));
    }
    // Every position needs its output row, so nothing in the cache can be reused: the text replaces
    // the history, as a prompt does, and stays in the context afterwards.
    truncate_to(0);
    has_logits_ = false;
    const size_t n_vocab = static_cast<size_t>(core_.model().n_vocab());
    const size_t rows = rows_per_decode(core_);
    score_result r;
    r.n_tokens = toks.size();
    context_core::request_scope req(core_, request_id);
    for (size_t pos0 = 0; pos0 < toks.size();) {
        if (core_.interrupt_requested()) {
            throw interrupted_error("interrupted: the context holds the first " + std::to_string(pos0) +
                                    " tokens of the text");
        }
        const size_t m = std::min(rows, toks.size() - pos0);
        for (size_t j = 0; j < m; ++j) {
            core_.put(j, toks[pos0 + j], static_cast<llama_pos>(pos0 + j), 0, true);
        }
        const int32_t ret = core_.decode(static_cast<int32_t>(m));
        if (ret != 0) {
            // On abort or a compute failure the ubatches already done stay: trim back to the history.
            truncate_to(pos0);
            if (ret == 2) {
                throw interrupted_error("interrupted: the context holds the first " + std::to_string(pos0) +
                                        " tokens of the text");
            }
            throw_failed_decode(ret, m, core_);
        }
        for (size_t j = 0; j < m && pos0 + j + 1 < toks.size(); ++j) {
            const float * row = llama_get_logits_ith(core_.get(), static_cast<int32_t>(j));
            if (row == nullptr) {
                throw lloyal_error("llama.cpp has no logits for position " + std::to_string(pos0 + j));
            }
            const llama_token next = toks[pos0 + j + 1];
            r.nll += token_nll(row, n_vocab, next);
            if (n_logprobs >= 0) {
                r.logprobs.push_back(logprobs_of(row, static_cast<int32_t>(n_vocab), max_of(row, n_vocab),
                                                 std::numeric_limits<float>::quiet_NaN(), next, n_logprobs));
            }
            ++r.n_scored;
        }
        append_history(toks.data() + pos0, m);
        pos0 += m;
    }
    has_logits_ = true;
    return r;
}

std::vector<score_result> sequence_driver::score_choices(const std::vector<std::vector<llama_token>> & choices,
                                                         uint64_t request_id) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("score_choices");
    core_.reset_decode_timer();
    if (choices.empty()) {
        throw std::invalid_argument("score_choices needs at least one choice");
    }
    for (size_t i = 0; i < choices.size(); ++i) {
        if (choices[i].empty()) {
            throw std::invalid_argument("choice " + std::to_string(i) + " has no tokens");
        }
    }
    if (history_.empty()) {
        throw context_error("score_choices scores continuations of what the context holds, and it holds nothing: "
                            "eval a prompt first");
    }
    if (!has_logits_) {
        throw context_error("score_choices needs the logits of the context's last position, which an interrupt "
                            "or a reset lost: eval the prompt again");
    }
    const size_t n = history_.size();
    const size_t n_vocab = static_cast<size_t>(core_.model().n_vocab());
    // A choice of L tokens decodes its first L-1 (the last one is only predicted).
    for (size_t i = 0; i < choices.size(); ++i) {
        if (n + choices[i].size() - 1 > core_.n_ctx_seq) {
            throw context_overflow_error("choice " + std::to_string(i) + " of " + std::to_string(choices[i].size()) +
                                         " tokens does not fit after the " + std::to_string(n) +
                                         " tokens the context holds: n_ctx " + std::to_string(core_.n_ctx_seq));
        }
    }
    // Sequence 0 itself takes a choice too, rolled back afterwards; not when a sliding-window cache that
    // is not swa_full could drop, while the choice is decoded, positions the history still needs.
    const bool seq0_ok = core_.swa_full || core_.n_swa <= 0;
    std::vector<llama_seq_id> seqs;
    for (uint32_t s = seq0_ok ? 0 : 1; s < core_.n_seq_max; ++s) {
        seqs.push_back(static_cast<llama_seq_id>(s));
    }
    if (seqs.empty()) {
        throw context_error("score_choices on a sliding-window model without swa_full needs n_seq_max > 1");
    }

    const float * last = last_logits();
    if (last == nullptr) {
        throw lloyal_error("llama.cpp has no logits for the last position");
    }
    keep_logits(last);
    std::vector<score_result> out(choices.size());
    for (size_t i = 0; i < choices.size(); ++i) {
        out[i].n_tokens = choices[i].size();
        out[i].n_scored = choices[i].size();
        out[i].nll = token_nll(kept_logits_.data(), n_vocab, choices[i][0]);
    }

    llama_memory_t mem = core_.memory();
    std::vector<llama_seq_id> in_use;
    auto roll_back = [&] {
        for (llama_seq_id s : in_use) {
            llama_memory_seq_rm(mem, s, s == 0 ? static_cast<llama_pos>(n) : -1, -1);
        }
        in_use.clear();
    };
    const size_t rows = rows_per_decode(core_);
    // Cells the choices of one group may take besides the shared history (a unified cache).
    const size_t cell_room = core_.n_cells > n ? core_.n_cells - n : 0;
    struct entry {
        size_t choice;
        size_t j;  // the token choices[choice][j], whose row predicts token j + 1
    };
    context_core::request_scope req(core_, request_id);
    try {
        size_t next = 0;
        while (next < choices.size()) {
            // A group: one choice per sequence, as many as fit the sequences and the free cells.
            std::vector<entry> todo;
            std::vector<llama_seq_id> seq_of(choices.size(), -1);
            size_t cells = 0;
            size_t k = 0;
            for (; next < choices.size() && k < seqs.size(); ++next) {
                const size_t need = choices[next].size() - 1;
                if (k > 0 && cells + need > cell_room) {
                    break;
                }
                if (need == 0) {
                    continue;  // a one-token choice: its first token's row is the history's
                }
                const llama_seq_id s = seqs[k++];
                if (s != 0) {
                    llama_memory_seq_cp(mem, 0, s, -1, -1);
                }
                in_use.push_back(s);
                seq_of[next] = s;
                for (size_t j = 0; j < need; ++j) {
                    todo.push_back({next, j});
                }
                cells += need;
            }
            for (size_t at = 0; at < todo.size();) {
                if (core_.interrupt_requested()) {
                    throw interrupted_error("interrupted: nothing was changed");
                }
                const size_t m = std::min(rows, todo.size() - at);
                for (size_t q = 0; q < m; ++q) {
                    const entry & e = todo[at + q];
                    core_.put(q, choices[e.choice][e.j], static_cast<llama_pos>(n + e.j), seq_of[e.choice], true);
                }
                const int32_t ret = core_.decode(static_cast<int32_t>(m));
                if (ret != 0) {
                    if (ret == 2) {
                        throw interrupted_error("interrupted: nothing was changed");
                    }
                    throw_failed_decode(ret, m, core_);
                }
                for (size_t q = 0; q < m; ++q) {
                    const entry & e = todo[at + q];
                    const float * row = llama_get_logits_ith(core_.get(), static_cast<int32_t>(q));
                    if (row == nullptr) {
                        throw lloyal_error("llama.cpp has no logits for a choice's row");
                    }
                    out[e.choice].nll += token_nll(row, n_vocab, choices[e.choice][e.j + 1]);
                }
                at += m;
            }
            roll_back();
        }
    } catch (...) {
        roll_back();
        keep_logits(kept_logits_.data());
        throw;
    }
    // The history's own logits are the kept row again (llama.cpp's now hold the choices' rows).
    keep_logits(kept_logits_.data());
    return out;
}

}  // namespace lloyal
