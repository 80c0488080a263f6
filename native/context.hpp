#pragma once

#include "common.hpp"
#include "model.hpp"

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

namespace lloyal {

struct branch;
class branch_store;

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
    double last_decode_ms() const { return static_cast<double>(decode_us_) / 1000.0; }
    const std::shared_ptr<Model> & model() const { return model_; }

    void set_interrupt_word(const py::object & control, int64_t index);
    size_t n_past() const;
    std::vector<llama_token> tokens() const;
    void reset();
    py::dict eval(py::handle tokens, uint64_t request_id);
    void logits_into(const py::object & out);
    // generate.cpp
    py::dict generate(py::handle prompt, const py::dict & params, uint64_t request_id, const py::object & on_piece);

    // branch.cpp (the contract is at the end of branch.hpp)
    uint32_t branch_create(py::handle logits, const py::dict & params, py::handle grammar);
    uint32_t branch_adopt(py::handle seq, py::handle logits, const py::dict & params, py::handle grammar);
    uint32_t branch_fork(py::handle src, py::handle logits);
    py::list branch_prune(py::handle h, bool subtree);
    py::list branch_retain_only(py::handle h);
    int32_t branch_detach(py::handle h);
    py::dict branch_info(py::handle h);
    py::list branches();
    void branch_set_params(py::handle h, const py::dict & params);
    void branch_set_grammar(py::handle h, py::handle grammar);
    void branch_set_logit_bias(py::handle h, py::handle bias);
    void branch_reseed(py::handle h, py::handle seed);
    void branch_set_logits(py::handle h, py::handle src);
    void branch_merge_logits(py::handle dst, py::handle experts, double alpha);
    py::list produce(py::handle handles);
    void commit(py::handle pairs, uint64_t request_id);
    void prefill(py::handle items, uint64_t request_id);
    py::list step(py::handle handles, uint64_t request_id);
    void clear_and_reseed(py::handle sinks, py::handle tail, uint64_t request_id);
    // kv.cpp
    void free_seq(py::handle seq);
    void kv_seq_cp(py::handle src, py::handle dst, py::handle p0, py::handle p1);
    void kv_seq_keep(py::handle seq);
    bool kv_seq_rm(py::handle seq, py::handle p0, py::handle p1);
    int32_t kv_seq_pos_min(py::handle seq);
    int32_t kv_seq_pos_max(py::handle seq);
    py::dict kv_pressure();
    size_t state_seq_size(py::handle seq);
    py::bytes state_seq_get(py::handle seq);
    size_t state_seq_set(py::handle seq, py::handle data);
    size_t state_seq_save_file(py::handle seq, const std::string & path, py::handle tokens);
    py::tuple state_seq_load_file(py::handle seq, const std::string & path);

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

    // Branch mode (branch.cpp, kv.cpp). The store exists from the first branch on.
    branch_store & store();
    llama_seq_id lease_or_throw(branch_store & st) const;
    bool branch_mode() const;                // branches or detached sequences exist
    void require_sequence_mode(const char * what) const;  // ContextError in branch mode
    void check_branch_capable() const;       // ContextError: a history, or a cache that cannot roll back
    // A branch record without a seq yet: sampler, grammar and snapshot buffer, all validated.
    std::unique_ptr<branch> new_root(py::handle logits, const py::dict & params, py::handle grammar);
    void drop_branches();                    // reset(): every branch and detached sequence goes
    void free_branch(uint32_t handle);       // cells removed, seq and slot returned
    // Out of the store and the tree (its children become roots); null when not live. The seq stays leased.
    std::unique_ptr<branch> unlink_branch(uint32_t handle);
    void write_snapshot(branch & b, const float * src);
    std::vector<branch *> branch_list(py::handle handles);  // distinct, all with logits
    std::vector<llama_token> produce_impl(const std::vector<branch *> & bs);
    py::list produce_result(const std::vector<llama_token> & out);
    void commit_impl(const std::vector<branch *> & bs, const std::vector<llama_token> & toks, uint64_t request_id);
    // Entry j of batch_: one token of one sequence, with or without its output row.
    void put(size_t j, llama_token tok, llama_pos pos, llama_seq_id seq, bool logits) {
        batch_.token[j] = tok;
        batch_.pos[j] = pos;
        batch_.n_seq_id[j] = 1;
        batch_.seq_id[j][0] = seq;
        batch_.logits[j] = logits;
    }
    // llama_decode of batch_[0:n] with the abort bookkeeping; returns llama_decode's code.
    int32_t decode_raw(int32_t n);
    // decode_raw, its time added to decode_us_ (branch mode's calls; eval/generate time themselves).
    int32_t decode_batch(int32_t n);
    [[noreturn]] void throw_decode_failure(int32_t ret, size_t n_tokens, uint64_t log_mark_before) const;
    llama_seq_id seq_arg(py::handle seq) const;  // ValueError outside [0, n_seq_max)
    void check_raw_write(llama_seq_id seq);
    branch * load_target(llama_seq_id seq);  // the branch that adopts loaded state, or null (detached)
    void adopt_loaded(branch * b, llama_seq_id seq);

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
    llama_batch batch_{};  // all null until llama_batch_init: llama_batch_free is a no-op on it

    uint32_t n_ctx_ = 0;
    uint32_t n_ctx_seq_ = 0;
    uint32_t n_batch_ = 0;
    uint32_t n_ubatch_ = 0;
    uint32_t n_seq_max_ = 0;
    int32_t n_threads_ = 0;
    int32_t n_threads_batch_ = 0;
    int32_t n_swa_ = 0;
    // Time inside llama_decode during the last commit, prefill, step or clear_and_reseed: what a
    // caller subtracts from its wall time to see the per-step overhead.
    int64_t decode_us_ = 0;

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

    uint32_t n_cells_ = 0;  // the KV cache's real size (llama.cpp pads n_ctx to 256)
    bool swa_full_ = true;
    std::unique_ptr<branch_store> store_;
};

// The methods of branch.cpp and kv.cpp, bound on the Context class by register_context.
void register_branches(py::class_<Context, std::shared_ptr<Context>> & cls);
void register_kv(py::class_<Context, std::shared_ptr<Context>> & cls);

}  // namespace lloyal
