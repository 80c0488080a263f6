// The sequence driver (sequence.hpp): eval, the history and what cache_prompt may reuse of it.
#include "sequence.hpp"
#include "errors.hpp"

#include <algorithm>
#include <cstring>

namespace lloyal {

bool sequence_driver::empty() const {
    std::lock_guard<std::mutex> lock(history_mu_);
    return history_.empty();
}

size_t sequence_driver::n_past() const {
    std::lock_guard<std::mutex> lock(history_mu_);
    return history_.size();
}

std::vector<llama_token> sequence_driver::tokens() const {
    std::lock_guard<std::mutex> lock(history_mu_);
    return history_;
}

void sequence_driver::clear() {
    set_history_size(0);
    has_logits_ = false;
}

std::string sequence_driver::held() const {
    return empty() ? std::string() : "a sequence-mode history of " + std::to_string(n_past()) + " tokens (reset it first)";
}

void sequence_driver::require_sequence_mode(const char * what) const {
    if (const std::string other = core_.held_by_others(this); !other.empty()) {
        throw context_error(std::string(what) + " works on a plain history, and this context holds " + other);
    }
}

void sequence_driver::set_history_size(size_t n) {
    fresh_upto_ = std::min(fresh_upto_, n);
    std::lock_guard<std::mutex> lock(history_mu_);
    history_.resize(n);
}

size_t sequence_driver::ubatch_floor(size_t pos) const {
    // A decode from position 0 in n_batch chunks, each split by llama.cpp into n_ubatch pieces,
    // starts its ubatches at k*n_batch + j*n_ubatch.
    const size_t chunk = pos / core_.n_batch * core_.n_batch;
    return chunk + (pos - chunk) / core_.n_ubatch * core_.n_ubatch;
}

size_t sequence_driver::reuse_point(size_t n_keep_max) const {
    // llama.cpp's CPU kernels are not batch-invariant: a row's result depends on which ubatch it was
    // computed in (e.g. the repacked Q4_K matmul runs groups of 4 rows through a GEMM and the rest
    // through a GEMV). Re-decoding only the tail of a cached prompt would therefore give slightly
    // different logits than decoding the prompt afresh, and a different greedy continuation now and
    // then. When the cache before the ubatch holding n_keep_max was computed exactly as a fresh decode
    // would have, going back to that ubatch's start (fewer than n_ubatch extra tokens) makes reusing
    // the cache result-neutral. Otherwise (e.g. generated tokens, decoded one at a time, lie before it)
    // the result cannot match a fresh decode anyway, and all of the prefix is kept.
    const size_t start = ubatch_floor(n_keep_max);
    return start <= fresh_upto_ ? start : n_keep_max;
}

void sequence_driver::append_history(const llama_token * toks, size_t n) {
    std::lock_guard<std::mutex> lock(history_mu_);
    history_.insert(history_.end(), toks, toks + n);
}

size_t sequence_driver::truncate_to(size_t n) {
    llama_memory_t mem = core_.memory();
    if (n > 0 && n >= history_.size() && llama_memory_seq_pos_max(mem, 0) < static_cast<llama_pos>(n)) {
        return history_.size();  // nothing past n: the cache is what a plain continuation has
    }
    has_logits_ = false;
    bool ok = n == 0 || llama_memory_seq_rm(mem, 0, static_cast<llama_pos>(n), -1);
    if (ok && n > 0) {
        // An SWA cache without swa_full keeps only the last n_swa positions; continuing at position n
        // needs those before n, which may have been dropped already.
        const llama_pos pos_min = llama_memory_seq_pos_min(mem, 0);
        const llama_pos need = std::max<llama_pos>(0, static_cast<llama_pos>(n) - core_.n_swa);
        ok = pos_min >= 0 && pos_min <= need;
    }
    if (!ok || n == 0) {
        llama_memory_clear(mem, true);
        n = 0;
    }
    set_history_size(n);
    return n;
}

bool sequence_driver::decode_tokens(const llama_token * toks, size_t n, bool want_logits, bool pausable) {
    if (n == 0) {
        return true;
    }
    has_logits_ = false;
    for (size_t i = 0; i < n;) {
        if (core_.interrupt_requested()) {
            return false;
        }
        if (pausable && i > 0 && core_.pause_requested()) {
            prompt_paused_ = true;
            return false;
        }
        const size_t pos0 = history_.size();
        // Chunks end where a decode from scratch would end its ubatches (n_batch chunks counted from
        // position 0, each split into n_ubatch pieces), so the numerics after a reuse point are those of a
        // fresh decode. One ubatch per llama_decode also gives an interrupt check and a progress report
        // per ubatch, at no cost: llama.cpp would split the batch the same way.
        const size_t batch_end = (pos0 / core_.n_batch + 1) * core_.n_batch;
        const size_t ubatch_end = std::min(batch_end, ubatch_floor(pos0) + core_.n_ubatch);
        const size_t m = std::min<size_t>(n - i, ubatch_end - pos0);
        const bool last_chunk = i + m == n;
        for (size_t j = 0; j < m; ++j) {
            core_.put(j, toks[i + j], static_cast<llama_pos>(pos0 + j), 0, want_logits && last_chunk && j == m - 1);
        }
        const int32_t ret = core_.decode(static_cast<int32_t>(m));
        if (ret == 0) {
            if (pos0 == fresh_upto_ && ubatch_floor(pos0) == pos0 && pos0 + m == ubatch_end) {
                // A whole ubatch from its start is exactly what a fresh decode computes; a partial one is
                // not (a fresh decode of a longer prompt would fill it up).
                fresh_upto_ = ubatch_end;
            }
            append_history(toks + i, m);
            i += m;
            core_.report_progress(i, n);
            continue;
        }
        // On abort and on fatal errors the ubatches already computed stay in the KV cache: trim
        // them so the cache holds exactly the committed history. (1 and -1 leave it untouched.)
        if (ret == 2) {
            truncate_to(pos0);
            return false;
        }
        if (ret == 1) {
            throw decode_error("llama_decode found no KV slot for a batch of " + std::to_string(m) +
                               " tokens (n_ctx " + std::to_string(core_.n_ctx) + ", n_past " + std::to_string(pos0) + ")");
        }
        if (ret == -1) {
            throw decode_error("llama_decode rejected the batch as invalid");
        }
        truncate_to(pos0);
        throw decode_error("llama_decode failed (" + std::to_string(ret) + ")");
    }
    has_logits_ = want_logits;
    return true;
}

eval_result sequence_driver::eval(const std::vector<llama_token> & toks, uint64_t request_id,
                                  const context_core::progress_fn & on_progress) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("eval");
    core_.reset_decode_timer();
    const size_t before = history_.size();
    const size_t room = core_.n_ctx_seq > before ? core_.n_ctx_seq - before : 0;
    if (toks.size() > room) {
        throw context_overflow_error(std::to_string(toks.size()) + " tokens do not fit: n_ctx " +
                                     std::to_string(core_.n_ctx_seq) + ", n_past " + std::to_string(before) +
                                     ", room " + std::to_string(room));
    }
    const int64_t t0 = now_us();
    bool done = true;
    {
        context_core::request_scope req(core_, request_id);
        context_core::progress_scope progress(core_, on_progress);
        done = decode_tokens(toks.data(), toks.size(), true);
    }
    eval_result r;
    const size_t after = history_.size();
    r.n_tokens = after > before ? after - before : 0;
    r.n_past = after;
    r.interrupted = !done;
    r.prompt_ms = elapsed_ms(t0, now_us());
    return r;
}

void sequence_driver::write_logits() {
    context_core::busy_guard busy(core_);
    if (!has_logits_) {
        throw lloyal_error("no logits: nothing has been decoded since the context was created, reset or interrupted");
    }
    const float * logits = last_logits();
    if (logits == nullptr) {
        throw lloyal_error("llama.cpp has no logits for the last position");
    }
    std::memcpy(core_.logits_block().floats(), logits, static_cast<size_t>(core_.model().n_vocab()) * sizeof(float));
}

}  // namespace lloyal
