#pragma once

#include "common.hpp"
#include "model.hpp"

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

namespace lloyal {

class Context {
  public:
    Context(std::shared_ptr<Model> model, const py::dict & params);
    ~Context();
    Context(const Context &) = delete;
    Context & operator=(const Context &) = delete;

    uint32_t n_ctx() const { return n_ctx_; }
    uint32_t n_batch() const { return n_batch_; }
    uint32_t n_ubatch() const { return n_ubatch_; }
    uint32_t n_seq_max() const { return n_seq_max_; }
    int32_t n_threads() const { return n_threads_; }
    int32_t n_threads_batch() const { return n_threads_batch_; }
    const std::shared_ptr<Model> & model() const { return model_; }

    void set_interrupt_word(const py::object & control, int64_t index);
    size_t n_past() const;
    std::vector<llama_token> tokens() const;
    void reset();
    py::dict eval(py::handle tokens, uint64_t request_id);
    void logits_into(const py::object & out);
    // generate.cpp
    py::dict generate(py::handle prompt, const py::dict & params, uint64_t request_id, const py::object & on_piece);

  private:
    // One call at a time: eval/generate run with the GIL released, so a second Python thread could
    // otherwise enter the same llama_context concurrently.
    class busy_guard {
      public:
        explicit busy_guard(Context & c);
        ~busy_guard();

      private:
        Context & c_;
    };
    // The request id the abort callback and the between-token checks compare against, for the
    // duration of one call; 0 (no request) never matches.
    class request_scope {
      public:
        request_scope(Context & c, uint64_t id) : c_(c) { c_.current_request_.store(id, std::memory_order_release); }
        ~request_scope() { c_.current_request_.store(0, std::memory_order_release); }

      private:
        Context & c_;
    };

    static bool abort_callback(void * data);
    bool interrupt_requested() const;

    // The rest runs with the GIL released.

    // Decodes toks at the end of sequence 0 in n_batch chunks, committing each chunk to the history
    // once llama_decode succeeded. want_logits: output row for the very last token only.
    // Returns false when interrupted (the KV trimmed back to the last committed chunk).
    bool decode_tokens(const llama_token * toks, size_t n, bool want_logits);
    // Keeps the first n tokens of sequence 0. Returns n, or 0 when the memory cannot keep exactly that
    // prefix (recurrent state, or an SWA cache that already dropped what position n needs): then
    // everything was cleared.
    size_t truncate_to(size_t n);
    void set_history_size(size_t n);
    // The start of the ubatch a decode from scratch would compute position pos in.
    size_t ubatch_floor(size_t pos) const;
    // How much of a common prefix of n_keep_max tokens cache_prompt keeps (see context.cpp).
    size_t reuse_point(size_t n_keep_max) const;
    void append_history(const llama_token * toks, size_t n);

    std::shared_ptr<Model> model_;
    llama_context * ctx_ = nullptr;
    llama_batch batch_{};
    bool batch_allocated_ = false;

    uint32_t n_ctx_ = 0;
    uint32_t n_ctx_seq_ = 0;
    uint32_t n_batch_ = 0;
    uint32_t n_ubatch_ = 0;
    uint32_t n_seq_max_ = 0;
    int32_t n_threads_ = 0;
    int32_t n_threads_batch_ = 0;
    int32_t n_swa_ = 0;

    std::atomic<bool> busy_{false};
    mutable std::mutex history_mu_;  // writers hold busy_ too; this only orders them against readers
    std::vector<llama_token> history_;
    bool has_logits_ = false;
    // history_[:fresh_upto_] is in the KV cache exactly as a decode from scratch in n_batch chunks
    // would have put it there (same ubatches, so bit-identical); always a ubatch boundary.
    size_t fresh_upto_ = 0;

    std::unique_ptr<held_buffer> control_;
    uint64_t * interrupt_word_ = nullptr;
    std::atomic<uint64_t> current_request_{0};
    std::atomic<bool> aborting_{false};  // the abort callback said stop during the current llama_decode
};

}  // namespace lloyal
