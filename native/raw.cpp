// lloyal.node's low-level loop on a context: decode tokens at a position of a sequence, sample a token
// from the logits that left. The sequences it writes are the branch driver's detached ones, so raw
// decodes, raw KV operations and branches share one set of leases and never step on each other.
#include "branch.hpp"
#include "errors.hpp"
#include "logits.hpp"

namespace lloyal {

double branch_driver::raw_decode(const std::vector<llama_token> & toks, llama_pos pos, int64_t seq_obj,
                                 uint64_t request_id) {
    context_core::busy_guard busy(core_);
    core_.reset_decode_timer();
    const llama_seq_id seq = seq_arg(seq_obj);
    if (toks.empty()) {
        throw std::invalid_argument("decode needs at least one token");
    }
    for (llama_token t : toks) {
        core_.model().check_token(t);
    }
    if (const std::string other = core_.held_by_others(this); !other.empty()) {
        throw context_error("decode() writes sequences of their own; this context holds " + other);
    }
    if (const branch * b = store_.owner(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " belongs to branch " + std::to_string(b->handle) +
                           ": a branch decodes through commit or prefill (or detach it first)");
    }
    llama_memory_t mem = core_.memory();
    // llama.cpp refuses a batch whose positions do not continue the sequence; said here in our terms.
    const llama_pos end = llama_memory_seq_pos_max(mem, seq) + 1;
    if (pos != end) {
        throw std::invalid_argument("decode at position " + std::to_string(pos) + ": sequence " + std::to_string(seq) +
                                    (end == 0 ? " is empty, so it starts at 0"
                                              : " ends at " + std::to_string(end - 1) + ", so it goes on at " +
                                                    std::to_string(end)) +
                                    " (kv.remove drops positions to decode them again)");
    }
    const auto n = static_cast<int64_t>(toks.size());
    if (pos + n > static_cast<int64_t>(core_.n_ctx_seq)) {
        throw context_overflow_error("decode of " + std::to_string(n) + " tokens at position " + std::to_string(pos) +
                                     " passes the sequence's n_ctx " + std::to_string(core_.n_ctx_seq) +
                                     "; nothing was decoded");
    }
    const bool leased_here = store_.is_free(seq);
    store_.lease_detached(seq);
    context_core::request_scope req(core_, request_id);
    // All or nothing: what this call added goes again when a chunk fails or is interrupted.
    auto undo = [&] {
        llama_memory_seq_rm(mem, seq, pos, -1);
        if (leased_here) {
            store_.release(seq);
        }
    };
    int32_t last_idx = -1;
    for (int64_t i = 0; i < n;) {
        if (core_.interrupt_requested()) {
            undo();
            throw interrupted_error("interrupted: nothing was decoded");
        }
        const auto m = static_cast<int32_t>(std::min<int64_t>(core_.n_batch, n - i));
        for (int32_t j = 0; j < m; ++j) {
            core_.put(static_cast<size_t>(j), toks[static_cast<size_t>(i + j)], static_cast<llama_pos>(pos + i + j), seq,
                      i + j == n - 1);
        }
        const uint64_t mark = log_mark();
        const int32_t ret = core_.decode(m);
        if (ret != 0) {
            undo();
            core_.throw_decode_failure(ret, static_cast<size_t>(m), mark);
        }
        last_idx = m - 1;
        i += m;
    }
    const float * row = llama_get_logits_ith(core_.get(), last_idx);
    if (row == nullptr) {
        undo();
        throw lloyal_error("llama.cpp returned no logits for the decode's last token; nothing was decoded");
    }
    copy_and_max(core_.logits_block().floats(), row, static_cast<size_t>(core_.model().n_vocab()));
    raw_stamp_ = core_.n_decodes();
    return core_.decode_ms();
}

llama_token branch_driver::raw_sample(const sampler_params & p, sampler_ptr * grammar, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    const Model & model = core_.model();
    if (!raw_chain_) {
        raw_chain_ = std::make_unique<chain_sampler>(p, model, core_.n_ctx_seq);
    } else {
        raw_chain_->set_params(p, {});  // the same params keep the PRNG and the penalty windows going
    }
    const auto nv = static_cast<size_t>(model.n_vocab());
    logits_row row;
    row.z = core_.logits_block().floats();
    row.max = max_of(row.z, nv);
    row.lse = log_sum_exp(row.z, nv, row.max);
    context_core::request_scope req(core_, request_id);
    const stop_fn stop = [this] { return core_.interrupt_requested(); };
    const bool constrained = grammar != nullptr && *grammar != nullptr;
    if (constrained) {
        raw_chain_->set_grammar(sampler_ptr(llama_sampler_clone(grammar->get())));
    }
    struct without_grammar {
        chain_sampler & c;
        ~without_grammar() { c.set_grammar(nullptr); }
    } reset{*raw_chain_};
    const chain_sampler::sample_result r = raw_chain_->sample(row, raw_scratch_, stop);
    if (r.token == LLAMA_TOKEN_NULL) {
        throw grammar_error("no token can be sampled here: the grammar allows none (it is complete) or every token "
                            "is banned");
    }
    if (constrained) {
        *grammar = raw_chain_->grammar_after(r.token, stop);
    }
    raw_chain_->accept(r.token);
    return r.token;
}

}  // namespace lloyal
