#include "arena.hpp"
#include "errors.hpp"

#include <algorithm>
#include <string>

namespace lloyal {

region_arena::region_arena(char * base, size_t size, size_t bulk_offset, size_t page)
    : base_(base), size_(size), page_(page) {
    if (bulk_offset % page != 0 || bulk_offset > size) {
        throw std::invalid_argument("the bulk area must start at a page boundary inside the region");
    }
    if (size - bulk_offset >= page) {
        free_.emplace_back(bulk_offset, (size - bulk_offset) / page * page);
    }
}

region_arena::block region_arena::alloc(size_t nbytes) {
    const size_t need = round_up(nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second >= need) {
            const size_t offset = it->first;
            if (it->second == need) {
                free_.erase(it);
            } else {
                it->first += need;
                it->second -= need;
            }
            return block(shared_from_this(), offset, need);
        }
    }
    throw region_full_error("the worker's shared-memory region has no room for " + std::to_string(need) +
                       " more bytes; create the Pool with a larger shm_bytes");
}

void region_arena::free(size_t offset, size_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::lower_bound(free_.begin(), free_.end(), std::make_pair(offset, size_t{0}));
    it = free_.insert(it, {offset, nbytes});
    // Coalesce with the next, then with the previous neighbour.
    if (auto next = it + 1; next != free_.end() && it->first + it->second == next->first) {
        it->second += next->second;
        free_.erase(next);
    }
    if (it != free_.begin()) {
        auto prev = it - 1;
        if (prev->first + prev->second == it->first) {
            prev->second += it->second;
            free_.erase(it);
        }
    }
}

size_t region_arena::free_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto & f : free_) {
        n += f.second;
    }
    return n;
}

region_arena::block::~block() { release(); }

region_arena::block::block(block && o) noexcept
    : arena_(std::move(o.arena_)), offset_(o.offset_), bytes_(o.bytes_) {
    o.arena_.reset();
}

region_arena::block & region_arena::block::operator=(block && o) noexcept {
    if (this != &o) {
        release();
        arena_ = std::move(o.arena_);
        offset_ = o.offset_;
        bytes_ = o.bytes_;
        o.arena_.reset();
    }
    return *this;
}

void region_arena::block::release() {
    if (arena_) {
        arena_->free(offset_, bytes_);
        arena_.reset();
    }
}

size_t region_arena::used_end() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty() && free_.back().first + free_.back().second >= size_ / page_ * page_) {
        return free_.back().first;
    }
    return size_;
}

}  // namespace lloyal
