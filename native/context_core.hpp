// The part of a context every way of driving it shares: the llama_context, the batch, llama_decode with
// the abort callback, the interrupt word, the one-call-at-a-time guard. The drivers hold a reference to
// it: sequence_driver (eval, generate: sequence.hpp) and branch_driver (branches and raw KV: branch.hpp),
// which never see each other: the cache holds one driver's state at a time, and context_core says whose.
#pragma once

#include "arena.hpp"
#include "common.hpp"
#include "lora.hpp"
#include "model.hpp"
#include "thread_governor.hpp"

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lloyal {

// A driver whose state lives in the KV cache: a plain history (sequence_driver), branches and detached
// sequences (branch_driver). The cache holds one driver's state at a time; a driver asks its context_core
// whether another holds anything (held_by_others) before it starts, so that no driver knows the others.
class kv_tenant {
  public:
    virtual ~kv_tenant() = default;
    // What the cache holds of this driver's state, as the end of another driver's error ("a
    // sequence-mode history of 12 tokens (reset it first)"); empty when it holds nothing.
    virtual std::string held() const = 0;
    // Cells of the cache the state takes, where the driver counts them itself (a plain history's n_past).
    virtual size_t cells_held() const { return 0; }
};

class context_core {
  public:
    // cp as parsed from the context params (bind_params.cpp); ContextError when llama.cpp refuses it, or
    // when its KV cache could never fit the machine's memory (CPU build), or for a pooling type on a
    // context without embeddings. An embedding context whose pooling is left unspecified gets the
    // model's own (GGUF <arch>.pooling_type), or mean pooling when the model declares none. arena: where the context's
    // logits row (and its branches' snapshots) live.
    // batch_invariant: a row's logits are the same whatever is decoded beside it (a CPU model loaded with
    // repack=False, flash attention on: bind_params; ggml's reference kernels: make_batch_invariant).
    context_core(std::shared_ptr<Model> model, const llama_context_params & cp, std::shared_ptr<region_arena> arena,
                 bool batch_invariant = false);
    ~context_core();
    context_core(const context_core &) = delete;
    context_core & operator=(const context_core &) = delete;

    llama_context * get() const { return ctx_; }
    llama_memory_t memory() const { return llama_get_memory(ctx_); }
    const Model & model() const { return *model_; }
    const std::shared_ptr<Model> & model_ptr() const { return model_; }
    region_arena & arena() const { return *arena_; }
    // The context's own logits row in the region: what Context.logits() reads.
    const region_arena::block & logits_block() const { return logits_; }

    uint32_t n_ctx = 0;      // as asked (llama.cpp pads the cells to a multiple of 256)
    uint32_t n_ctx_seq = 0;  // what one sequence may hold
    uint32_t n_batch = 0;
    uint32_t n_ubatch = 0;
    uint32_t n_seq_max = 0;
    int32_t n_threads = 0;
    int32_t n_threads_batch = 0;
    int32_t n_swa = 0;
    uint32_t n_cells = 0;  // the KV cache's real size
    bool swa_full = true;
    bool kv_unified = true;  // false: one cache stream per sequence (batch_invariant)
    // The context's adapter configuration (lora.cpp's set_loras): what its decodes run under, unless a
    // lora_scope names another for the decodes of one call.
    std::vector<lora_weight> loras;
    // The configuration of the decodes of one call (a batcher's group of requests on their own adapters),
    // in place of `loras` while the scope lives. The caller keeps each sequence's cells under one
    // configuration.
    class lora_scope {
      public:
        lora_scope(context_core & core, const std::vector<lora_weight> * config) : core_(core) {
            core_.decode_loras_ = config;
        }
        ~lora_scope() { core_.decode_loras_ = nullptr; }
        lora_scope(const lora_scope &) = delete;
        lora_scope & operator=(const lora_scope &) = delete;

      private:
        context_core & core_;
    };
    bool embeddings = false;  // an embedding context (embed.hpp): every token of a decode has an output row
    enum llama_pooling_type pooling = LLAMA_POOLING_TYPE_NONE;  // as llama.cpp resolved it

    // Why this context's cache cannot remove any range of a sequence (a recurrent state; a sliding-window
    // cache sized to the window, which may already have dropped the cells), or empty when it can. What
    // branches (commit and prefill roll back) and speculative decoding (rejected drafts) both need.
    std::string why_ranges_cannot_be_removed() const;

    // The drivers whose state lives in the cache register once (they outlive no context_core call).
    void add_tenant(const kv_tenant & tenant) { tenants_.push_back(&tenant); }
    // What the cache holds of the tenants other than `self` (null: of any tenant), or empty when nothing.
    std::string held_by_others(const kv_tenant * self = nullptr) const {
        for (const kv_tenant * t : tenants_) {
            if (t != self) {
                if (std::string what = t->held(); !what.empty()) {
                    return what;
                }
            }
        }
        return {};
    }
    size_t cells_held_by_others(const kv_tenant * self) const {
        size_t n = 0;
        for (const kv_tenant * t : tenants_) {
            n += t != self ? t->cells_held() : 0;
        }
        return n;
    }

    // Points the abort callback and the between-token checks at a u64 in shared memory (null: none).
    void set_interrupt_word(const uint64_t * word) { interrupt_word_ = word; }
    // True while the running request is the one the interrupt word names.
    bool interrupt_requested() const;
    // True while the word names the running request with k_pause_bit set: a generation asked to pause
    // at its next token boundary (a decode in progress is not aborted for it).
    bool pause_requested() const;
    static constexpr uint64_t k_pause_bit = uint64_t{1} << 63;

    // One call at a time: drivers run without the GIL, so a second thread could otherwise enter the
    // same llama_context concurrently.
    class busy_guard {
      public:
        explicit busy_guard(context_core & c);
        ~busy_guard();

      private:
        context_core & c_;
    };
    // The request id the abort callback and the between-token checks compare against, for the
    // duration of one call; 0 (no request) never matches.
    class request_scope {
      public:
        request_scope(context_core & c, uint64_t id) : c_(c) { c_.current_request_.store(id, std::memory_order_release); }
        ~request_scope() { c_.current_request_.store(0, std::memory_order_release); }

      private:
        context_core & c_;
    };

    // Progress of a long prompt evaluation: tokens decoded so far of those the call decodes. Set for the
    // duration of one call (the busy guard makes it the only one); may throw, which ends the call
    // between two chunks with the history consistent.
    using progress_fn = std::function<void(size_t done, size_t total)>;
    class progress_scope {
      public:
        progress_scope(context_core & c, progress_fn fn) : c_(c) { c_.progress_ = std::move(fn); }
        ~progress_scope() { c_.progress_ = nullptr; }
        progress_scope(const progress_scope &) = delete;
        progress_scope & operator=(const progress_scope &) = delete;

      private:
        context_core & c_;
    };
    bool wants_progress() const { return static_cast<bool>(progress_); }
    void report_progress(size_t done, size_t total) const {
        if (progress_) {
            progress_(done, total);
        }
    }

    // Entry j of the batch: one token of one sequence, with or without its output row.
    void put(size_t j, llama_token tok, llama_pos pos, llama_seq_id seq, bool logits) {
        batch_.token[j] = tok;
        batch_.pos[j] = pos;
        batch_.n_seq_id[j] = 1;
        batch_.seq_id[j][0] = seq;
        batch_.logits[j] = logits;
    }
    // llama_decode of batch[0:n] with the abort bookkeeping; returns llama_decode's code. Its time is
    // added to the decode timer, which every decoding call of a driver starts from zero.
    int32_t decode(int32_t n);
    void reset_decode_timer() { decode_us_ = 0; }
    // The threads llama.cpp computes with from now on (n_threads/n_threads_batch keep the values the
    // context was created with); the governor may use fewer while the machine is busy.
    void set_threads(int32_t n, int32_t n_batch);
    // Whether the governor may lower the threads (the adapt_threads context param; CPU builds only).
    void set_adapt_threads(bool on) { governor_.set_enabled(on); }
    // The threads the last decode computed with (0 before the first).
    int32_t last_decode_threads() const { return last_decode_threads_; }
    // How many llama_decode calls this context has made: logits kept aside (a state load, a scoring
    // pass) belong to the context only while no decode has replaced llama.cpp's output since.
    uint64_t n_decodes() const { return n_decodes_; }
    double decode_ms() const { return static_cast<double>(decode_us_) / 1000.0; }
    // The typed error for a failed decode that left nothing changed (ret 2: interrupted).
    [[noreturn]] void throw_decode_failure(int32_t ret, size_t n_tokens, uint64_t log_mark_before) const;

  private:
    static bool abort_callback(void * data);
    void make_batch_invariant();

    std::shared_ptr<Model> model_;
    std::shared_ptr<region_arena> arena_;
    region_arena::block logits_;
    llama_context * ctx_ = nullptr;
    llama_batch batch_{};  // all null until llama_batch_init: llama_batch_free is a no-op on it
    int64_t decode_us_ = 0;
    progress_fn progress_;
    uint64_t n_decodes_ = 0;
    thread_governor governor_;
    int32_t last_decode_threads_ = 0;

    std::atomic<bool> busy_{false};
    const uint64_t * interrupt_word_ = nullptr;
    std::atomic<uint64_t> current_request_{0};
    // What llama.cpp applies now, held here so that no adapter is freed while the llama_context points at
    // it; decode() changes it when the configuration its decode runs under differs.
    std::vector<lora_weight> applied_loras_;
    const std::vector<lora_weight> * decode_loras_ = nullptr;
    std::atomic<bool> aborting_{false};  // the abort callback said stop during the current llama_decode
    std::vector<const kv_tenant *> tenants_;
};

}  // namespace lloyal
