// Blocks of the worker's shared-memory region (lloyal_pool/shm.py: the bulk area after the header and
// the interrupt words). The client reads what is written there with no copy; the native side owns
// the blocks: a context holds one for its logits row, every branch one for its snapshot, and each
// block goes back to the arena when its owner goes. Page-aligned, first fit; one arena per worker,
// shared by its contexts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace lloyal {

class region_arena : public std::enable_shared_from_this<region_arena> {
  public:
    // The region's memory (pinned by the caller for as long as this lives) and where its bulk area starts.
    region_arena(char * base, size_t size, size_t bulk_offset, size_t page);

    class block {
      public:
        block() = default;
        block(std::shared_ptr<region_arena> arena, size_t offset, size_t bytes)
            : arena_(std::move(arena)), offset_(offset), bytes_(bytes) {}
        ~block();
        block(block && o) noexcept;
        block & operator=(block && o) noexcept;
        block(const block &) = delete;
        block & operator=(const block &) = delete;

        float * floats() const { return reinterpret_cast<float *>(arena_->base_ + offset_); }
        size_t offset() const { return offset_; }  // from the start of the region

      private:
        void release();
        std::shared_ptr<region_arena> arena_;
        size_t offset_ = 0;
        size_t bytes_ = 0;
    };

    // lloyal_error naming Pool(shm_bytes=...) when the region has no room.
    block alloc(size_t nbytes);
    size_t free_bytes() const;
    // Where the blocks in use end: everything from here to the region's end is free. A forked worker
    // copies only the region up to here into its own (lloyal_pool/worker/zygote.py).
    size_t used_end() const;

  private:
    void free(size_t offset, size_t nbytes);
    size_t round_up(size_t n) const { return (n + page_ - 1) / page_ * page_; }

    char * base_;
    size_t size_;
    size_t page_;
    mutable std::mutex mu_;
    std::vector<std::pair<size_t, size_t>> free_;  // (offset, length), sorted, coalesced
};

}  // namespace lloyal
