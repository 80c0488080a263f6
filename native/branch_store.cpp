// The branch store (branch.hpp): handle slots with generations, sequence leases.
#include "branch.hpp"
#include "errors.hpp"

#include <algorithm>

namespace lloyal {

branch_store::branch_store(uint32_t n_seq_max) : slots_(1), owner_(n_seq_max, k_free) {
    // Popped from the back: seq 0 is leased first, freed seqs are reused last-in first-out.
    for (uint32_t s = n_seq_max; s-- > 0;) {
        free_seqs_.push_back(static_cast<llama_seq_id>(s));
    }
}

branch * branch_store::find(uint32_t handle) {
    const uint32_t idx = handle & 0xFFFFu;
    const uint32_t gen = handle >> 16;
    if (idx == 0 || idx >= slots_.size()) {
        return nullptr;
    }
    slot & s = slots_[idx];
    return s.b != nullptr && s.generation == gen ? s.b.get() : nullptr;
}

branch & branch_store::get(uint32_t handle) {
    branch * b = find(handle);
    if (b == nullptr) {
        throw stale_handle_error("branch handle " + std::to_string(handle) +
                                 " is not live (pruned, retained away, detached, reset, or never issued)");
    }
    return *b;
}

branch & branch_store::add(std::unique_ptr<branch> b) {
    uint32_t idx = 0;
    if (!free_slots_.empty()) {
        idx = free_slots_.back();
        free_slots_.pop_back();
    } else {
        if (slots_.size() > 0xFFFFu) {
            throw branch_error("too many branches: 65535 slots in use");
        }
        idx = static_cast<uint32_t>(slots_.size());
        slots_.emplace_back();
    }
    slot & s = slots_[idx];
    b->handle = static_cast<uint32_t>(s.generation) << 16 | idx;
    b->serial = ++serial_;
    owner_[static_cast<size_t>(b->seq)] = static_cast<int32_t>(idx);
    s.b = std::move(b);
    ++n_live_;
    return *s.b;
}

std::unique_ptr<branch> branch_store::remove(uint32_t handle) {
    if (find(handle) == nullptr) {
        return nullptr;
    }
    const uint32_t idx = handle & 0xFFFFu;
    slot & s = slots_[idx];
    std::unique_ptr<branch> b = std::move(s.b);
    // Generations cycle through 1..65535: every handle is at least 0x10000, never mistaken for a seq id.
    s.generation = static_cast<uint16_t>(s.generation == 0xFFFFu ? 1 : s.generation + 1);
    free_slots_.push_back(idx);
    owner_[static_cast<size_t>(b->seq)] = k_detached;  // the caller releases it or keeps it raw
    --n_live_;
    return b;
}

std::vector<uint32_t> branch_store::release_all(uint32_t keep) {
    std::vector<uint32_t> freed;
    for (uint32_t h : handles()) {
        if (h == keep) {
            continue;
        }
        release(remove(h)->seq);
        freed.push_back(h);
    }
    for (llama_seq_id s : detached()) {
        release(s);
    }
    return freed;
}

llama_seq_id branch_store::lease() {
    if (free_seqs_.empty()) {
        return -1;
    }
    const llama_seq_id s = free_seqs_.back();
    free_seqs_.pop_back();
    owner_[static_cast<size_t>(s)] = k_detached;  // until add() names its branch
    return s;
}

void branch_store::lease_detached(llama_seq_id seq) {
    if (owner_[static_cast<size_t>(seq)] != k_free) {
        return;
    }
    owner_[static_cast<size_t>(seq)] = k_detached;
    free_seqs_.erase(std::find(free_seqs_.begin(), free_seqs_.end(), seq));
}

void branch_store::release(llama_seq_id seq) {
    if (owner_[static_cast<size_t>(seq)] == k_free) {
        return;
    }
    owner_[static_cast<size_t>(seq)] = k_free;
    free_seqs_.push_back(seq);
}

branch * branch_store::owner(llama_seq_id seq) {
    const int32_t o = owner_[static_cast<size_t>(seq)];
    return o > 0 ? slots_[static_cast<size_t>(o)].b.get() : nullptr;
}

size_t branch_store::n_detached() const {
    // A leased seq that no slot names: detached (a lease between lease() and add() never outlives a call).
    return static_cast<size_t>(std::count(owner_.begin(), owner_.end(), k_detached));
}

std::vector<uint32_t> branch_store::handles() const {
    std::vector<const branch *> live;
    for (const auto & s : slots_) {
        if (s.b) {
            live.push_back(s.b.get());
        }
    }
    std::sort(live.begin(), live.end(), [](const branch * a, const branch * b) { return a->serial < b->serial; });
    std::vector<uint32_t> out;
    out.reserve(live.size());
    for (const branch * b : live) {
        out.push_back(b->handle);
    }
    return out;
}

std::vector<llama_seq_id> branch_store::detached() const {
    std::vector<llama_seq_id> out;
    for (size_t s = 0; s < owner_.size(); ++s) {
        if (owner_[s] == k_detached) {
            out.push_back(static_cast<llama_seq_id>(s));
        }
    }
    return out;
}

uint32_t branch_store::n_leased() const {
    return static_cast<uint32_t>(owner_.size() - free_seqs_.size());
}

}  // namespace lloyal
