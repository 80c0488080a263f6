// The branch driver's raw KV sequences, KV pressure and per-sequence state (branch.hpp). Reading works on
// any sequence; writing only on detached ones, so that a branch's cells always match its records and a
// vacant seq never carries cells a later lease would inherit.
#include "branch.hpp"
#include "errors.hpp"

#include <algorithm>
#include <limits>
#include <map>

namespace lloyal {

llama_seq_id branch_driver::seq_arg(int64_t seq) const {
    if (seq < 0 || seq >= static_cast<int64_t>(core_.n_seq_max)) {
        throw std::invalid_argument("sequence id " + std::to_string(seq) + " is outside [0, n_seq_max=" +
                                    std::to_string(core_.n_seq_max) + ")");
    }
    return static_cast<llama_seq_id>(seq);
}

void branch_driver::check_raw_write(llama_seq_id seq) {
    if (const std::string other = core_.held_by_others(this); !other.empty()) {
        throw context_error("raw KV writes would put it out of step: this context holds " + other);
    }
    branch_store & st = store_;
    if (const branch * b = st.owner(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " belongs to branch " + std::to_string(b->handle) +
                           ": detach the branch first");
    }
    if (st.is_free(seq)) {
        throw branch_error("sequence " + std::to_string(seq) +
                           " is not leased: raw writes go to detached sequences (branch_detach)");
    }
}

void branch_driver::free_seq(int64_t seq_obj) {
    context_core::busy_guard busy(core_);
    const llama_seq_id seq = seq_arg(seq_obj);
    branch_store & st = store_;
    if (const branch * b = st.owner(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " belongs to branch " + std::to_string(b->handle) +
                           ": prune the branch instead");
    }
    if (!st.is_detached(seq)) {
        throw std::invalid_argument("sequence " + std::to_string(seq) + " is not a detached sequence");
    }
    llama_memory_seq_rm(core_.memory(), seq, -1, -1);
    st.release(seq);
}

void branch_driver::seq_cp(int64_t src_obj, int64_t dst_obj, llama_pos a, llama_pos b) {
    context_core::busy_guard busy(core_);
    const llama_seq_id src = seq_arg(src_obj);
    const llama_seq_id dst = seq_arg(dst_obj);
    if (!core_.kv_unified && src != dst && (a > 0 || b >= 0)) {
        // llama.cpp copies between streams by whole buffers only (and aborts on a part).
        throw context_error("this context keeps each sequence in a cache stream of its own (batch_invariant): "
                            "kv.copy copies whole sequences only (p0 0, p1 -1)");
    }
    // A free destination is leased, as decode() leases one: lloyal.node's kvSeqCopy(0, n) needs no lease.
    const bool lease = store_.is_free(dst) && core_.held_by_others(this).empty();
    if (lease) {
        store_.lease_detached(dst);
    }
    try {
        check_raw_write(dst);
    } catch (...) {
        if (lease) {
            store_.release(dst);
        }
        throw;
    }
    llama_memory_seq_cp(core_.memory(), src, dst, a, b);
}

void branch_driver::seq_keep(int64_t seq_obj) {
    context_core::busy_guard busy(core_);
    const llama_seq_id seq = seq_arg(seq_obj);
    check_raw_write(seq);
    if (store_.n_branches() > 0) {
        throw branch_error("kv_seq_keep would empty the sequences of the " + std::to_string(store_.n_branches()) +
                           " live branches (branch_retain_only keeps one branch)");
    }
    llama_memory_seq_keep(core_.memory(), seq);
}

bool branch_driver::seq_rm(int64_t seq_obj, llama_pos a, llama_pos b) {
    context_core::busy_guard busy(core_);
    const llama_seq_id seq = seq_arg(seq_obj);
    check_raw_write(seq);
    return llama_memory_seq_rm(core_.memory(), seq, a, b);
}

llama_pos branch_driver::seq_pos_min(int64_t seq_obj) {
    context_core::busy_guard busy(core_);
    return llama_memory_seq_pos_min(core_.memory(), seq_arg(seq_obj));
}

llama_pos branch_driver::seq_pos_max(int64_t seq_obj) {
    context_core::busy_guard busy(core_);
    return llama_memory_seq_pos_max(core_.memory(), seq_arg(seq_obj));
}

uint64_t branch_driver::cells_used() {
    llama_memory_t mem = core_.memory();
    uint64_t used = 0;
    // The union of the branches' lineages: every cell was decoded by one origin at one position.
    std::map<uint64_t, std::vector<std::pair<llama_pos, llama_pos>>> by_origin;
    branch_store & st = store_;
    for (uint32_t h : st.handles()) {
        for (const kv_segment & s : st.get(h).lineage) {
            if (s.p1 > s.p0) {
                by_origin[s.origin].emplace_back(s.p0, s.p1);
            }
        }
    }
    for (auto & [origin, iv] : by_origin) {
        (void) origin;
        std::sort(iv.begin(), iv.end());
        llama_pos end = std::numeric_limits<llama_pos>::min();
        for (const auto & [a, b] : iv) {
            const llama_pos from = std::max(a, end);
            if (b > from) {
                used += static_cast<uint64_t>(b - from);
            }
            end = std::max(end, b);
        }
    }
    for (llama_seq_id s : st.detached()) {
        used += static_cast<uint64_t>(llama_memory_seq_pos_max(mem, s) + 1);
    }
    return used;
}

void branch_driver::check_room(const std::vector<std::pair<const branch *, size_t>> & adds) {
    // llama.cpp pads the cache to 256 cells: the extra cells would let branches grow past the n_ctx the
    // context was asked for. That n_ctx is the limit, for one branch's positions and for the cells all
    // of them hold together.
    const uint64_t n_ctx = core_.n_ctx;
    uint64_t more = 0;
    for (const auto & [b, n] : adds) {
        if (static_cast<uint64_t>(b->position) + n > n_ctx) {
            throw context_overflow_error("branch " + std::to_string(b->handle) + " at position " +
                                         std::to_string(b->position) + " cannot take " + std::to_string(n) +
                                         " more tokens: n_ctx " + std::to_string(n_ctx) + "; nothing was changed");
        }
        more += n;
    }
    const uint64_t used = cells_used();
    if (used + more > n_ctx) {
        throw decode_error("the context's cache is full: " + std::to_string(more) + " new cells do not fit beside the " +
                           std::to_string(used) + " its branches hold (n_ctx " + std::to_string(n_ctx) +
                           "); nothing was changed");
    }
}

kv_pressure branch_driver::pressure() {
    context_core::busy_guard busy(core_);
    uint64_t used = 0;
    uint32_t leased = 0;
    uint32_t room = core_.n_ctx;
    if (store_.active()) {
        used = cells_used();
        leased = store_.n_leased();
    } else {
        // Sequence mode holds what was asked for (eval/generate enforce n_ctx, not the padded size).
        room = core_.n_ctx_seq;
        used = core_.cells_held_by_others(this);
        leased = used == 0 ? 0 : 1;
    }
    kv_pressure d;
    d.n_ctx = room;
    d.cells_used = used;
    d.remaining = used >= room ? 0 : room - static_cast<uint32_t>(used);
    d.n_seq_max = core_.n_seq_max;
    d.seqs_leased = leased;
    d.seqs_free = core_.n_seq_max - leased;
    return d;
}

size_t branch_driver::state_size(int64_t seq_obj) {
    context_core::busy_guard busy(core_);
    return llama_state_seq_get_size(core_.get(), seq_arg(seq_obj));
}

std::vector<uint8_t> branch_driver::state_get(int64_t seq_obj) {
    context_core::busy_guard busy(core_);
    const llama_seq_id seq = seq_arg(seq_obj);
    if (llama_memory_seq_pos_max(core_.memory(), seq) < 0) {
        throw context_error("sequence " + std::to_string(seq) + " is empty: no state to save");
    }
    std::vector<uint8_t> data(llama_state_seq_get_size(core_.get(), seq));
    data.resize(llama_state_seq_get_data(core_.get(), data.data(), data.size(), seq));
    if (data.empty()) {
        throw context_error("llama.cpp could not copy the state of sequence " + std::to_string(seq));
    }
    return data;
}

branch * branch_driver::load_target(llama_seq_id seq) {
    if (const std::string other = core_.held_by_others(this); !other.empty()) {
        throw context_error("state loads go to branches or detached sequences, and this context holds " + other);
    }
    branch_store & st = store_;
    if (branch * b = st.owner(seq)) {
        if (b->position != 0 || !b->children.empty()) {
            throw branch_error("sequence " + std::to_string(seq) + " belongs to branch " + std::to_string(b->handle) +
                               ", which already has cells or children: load into a new branch or a detached sequence");
        }
        return b;
    }
    if (st.is_free(seq)) {
        throw branch_error("sequence " + std::to_string(seq) +
                           " is not leased: load into a new branch or a detached sequence");
    }
    return nullptr;
}

void branch_driver::adopt_loaded(branch * b, llama_seq_id seq) {
    if (b == nullptr) {
        return;
    }
    llama_memory_t mem = core_.memory();
    const llama_pos lo = std::max<llama_pos>(0, llama_memory_seq_pos_min(mem, seq));
    b->position = llama_memory_seq_pos_max(mem, seq) + 1;
    b->lineage = {{store_.new_origin(), lo, b->position}};
    b->has_logits = false;
    b->sample_pending = false;
}

size_t branch_driver::state_set(int64_t seq_obj, const uint8_t * data, size_t size) {
    context_core::busy_guard busy(core_);
    const llama_seq_id seq = seq_arg(seq_obj);
    branch * target = load_target(seq);
    llama_memory_t mem = core_.memory();
    const uint64_t mark = log_mark();
    size_t n = 0;
    llama_memory_seq_rm(mem, seq, -1, -1);
    try {
        n = llama_state_seq_set_data(core_.get(), data, size, seq);
    } catch (const std::exception &) {
        n = 0;
    }
    if (n == 0) {
        llama_memory_seq_rm(mem, seq, -1, -1);
    }
    if (n == 0) {
        const std::string why = log_reason_since(mark);
        throw context_error("could not load the state into sequence " + std::to_string(seq) +
                            (why.empty() ? " (not a state of this model, or too small a cache)" : why));
    }
    adopt_loaded(target, seq);
    return n;
}

size_t branch_driver::state_save_file(int64_t seq_obj, const std::string & path,
                                      const std::vector<llama_token> & toks) {
    context_core::busy_guard busy(core_);
    const llama_seq_id seq = seq_arg(seq_obj);
    for (llama_token t : toks) {
        core_.model().check_token(t);
    }
    if (llama_memory_seq_pos_max(core_.memory(), seq) < 0) {
        throw context_error("sequence " + std::to_string(seq) + " is empty: no state to save");
    }
    const uint64_t mark = log_mark();
    size_t n = 0;
    try {
        n = llama_state_seq_save_file(core_.get(), path.c_str(), seq, toks.data(), toks.size());
    } catch (const std::exception &) {
        n = 0;
    }
    if (n == 0) {
        throw context_error("could not write the state of sequence " + std::to_string(seq) + " to '" + path + "'" +
                            log_reason_since(mark));
    }
    return n;
}

std::pair<std::vector<llama_token>, size_t> branch_driver::state_load_file(int64_t seq_obj, const std::string & path) {
    context_core::busy_guard busy(core_);
    const llama_seq_id seq = seq_arg(seq_obj);
    branch * target = load_target(seq);
    llama_memory_t mem = core_.memory();
    const uint64_t mark = log_mark();
    std::vector<llama_token> toks;
    size_t n = 0;
    try {
        // First the token count alone (a null tokens_out loads nothing), then everything.
        size_t count = 0;
        if (llama_state_seq_load_file(core_.get(), path.c_str(), seq, nullptr, 0, &count) != 0) {
            toks.resize(count);
            llama_memory_seq_rm(mem, seq, -1, -1);
            // A file saved with no tokens still needs a non-null tokens_out: null means "count only",
            // which would report success with nothing loaded.
            llama_token none = LLAMA_TOKEN_NULL;
            llama_token * out = toks.empty() ? &none : toks.data();
            n = llama_state_seq_load_file(core_.get(), path.c_str(), seq, out, toks.size(), &count);
            toks.resize(count);
        }
    } catch (const std::exception &) {
        n = 0;
    }
    if (n == 0) {
        llama_memory_seq_rm(mem, seq, -1, -1);
    }
    if (n == 0) {
        throw context_error("could not load the state file '" + path + "' into sequence " + std::to_string(seq) +
                            log_reason_since(mark));
    }
    adopt_loaded(target, seq);
    return {toks, n};
}

}  // namespace lloyal
