// The branch driver: forkable generation state inside one context (lloyal.node's Branch/BranchStore, done
// over our worker), and the context's raw KV sequences. The exact contract of each operation is the
// stub, lloyal_pool/worker/_native.pyi (bind_branch.cpp binds these methods there);
// docs/BRANCHES.md explains the semantics for users. Files: branch_store.cpp (handles and leases),
// branch.cpp (the tree, sampling state, produce), branch_decode.cpp (commit, prefill, step,
// clear_and_reseed), kv.cpp (raw sequences, pressure, per-sequence state).
//
// A branch owns one sequence id of its context's (unified) KV cache, leased from [0, n_seq_max), and
// its own machinery: a chain_sampler (PRNG and penalty history included, grammar, logit bias), a logits
// snapshot (n_vocab float32 in a block of the worker's shared memory that the branch owns, so the
// client reads it with no copy and no round trip), and perplexity sums. A fork shares the KV prefix with llama_memory_seq_cp (cells get
// one more tag, no tensor copy) and clones everything else; the snapshot copy is one memcpy.
//
// Sequence mode (Context::eval/generate on sequence 0) and branch mode exclude each other: a context
// holds either a plain history or branches (and detached sequences), never both. Creating a branch
// needs an empty history; eval/generate need a context without branches or detached sequences;
// reset() drops every branch and detached sequence.
//
// Branches need a decoder-only model and a KV cache that can drop any range of a sequence (commit and
// prefill roll back by removing the cells they added): not a recurrent or hybrid model, and for a
// sliding-window model (Gemma 3) swa_full=True, the default. branch_create refuses the others with
// ContextError.
#pragma once

#include "arena.hpp"
#include "common.hpp"
#include "context_core.hpp"
#include "logits.hpp"
#include "sampling.hpp"
#include "text_assembly.hpp"

#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace lloyal {


// One piece of a sequence's KV cells: positions [p0, p1) of the cells some branch decoded itself
// (origin). A branch's cells are its lineage: the segments it shares with its ancestors (capped at the
// position it was forked at) and its own. The union over the live branches counts cells exactly for a
// tree of forks. A detached seq keeps no lineage: adopted again (branch_adopt, a state load) it gets a
// fresh origin, so cells it still shares with former relatives count twice (an upper bound).
struct kv_segment {
    uint64_t origin;
    llama_pos p0;
    llama_pos p1;
};

// A branch's text, made as generate makes it (stop strings, UTF-8 hold-back, control tokens' text left out
// unless render_special), for a caller that hands it out as the branch produces (produce_text).
struct branch_text {
    text_assembly text;
    bool render_special = false;
    size_t handed = 0;  // text.text()[:handed] was handed out
    int32_t n_logprobs = -1;  // >= 0: produce_text reports each token's logprobs (logits.hpp)
};

struct branch {
    uint32_t handle = 0;
    uint64_t serial = 0;  // creation order
    llama_seq_id seq = -1;
    llama_pos position = 0;  // tokens in the seq: the next token goes here
    llama_pos fork_head = 0;
    uint32_t parent = 0;
    std::vector<uint32_t> children;
    std::vector<kv_segment> lineage;  // the last one is the branch's own

    std::unique_ptr<chain_sampler> sampler;
    region_arena::block block;  // the snapshot's memory in the shared region
    float * snapshot = nullptr;
    bool has_logits = false;
    float snap_max = 0.0f;
    float snap_lse = 0.0f;

    std::vector<llama_token> accepted;  // committed tokens (the penalty windows are re-primed from them)
    double nll_sum = 0.0;   // model surprisal sums (nats)
    int64_t nll_count = 0;
    double samp_sum = 0.0;  // sampling surprisal sums
    int64_t samp_count = 0;
    llama_token last_token = LLAMA_TOKEN_NULL;  // the last produced token
    float last_surprisal = 0.0f;
    bool sample_pending = false;  // last_token was produced from the current snapshot
    std::optional<branch_text> text;  // set_text; forks copy it
    int32_t n_logprobs = -1;  // set_logprobs: produce reports each token's logprobs with this many alternatives

    logits_row row() const { return {snapshot, snap_max, snap_lse}; }
};

// What sampling changes in branches (PRNGs, mirostat's mu, penalty windows, grammar; the last sample),
// kept so that a call that fails after sampling (an interrupt, a full cache) can put it back.
class sampling_checkpoint {
  public:
    explicit sampling_checkpoint(const std::vector<branch *> & bs);
    void restore();

  private:
    struct saved {
        std::unique_ptr<chain_sampler> sampler;
        llama_token last_token;
        float last_surprisal;
        bool sample_pending;
    };
    std::vector<branch *> bs_;
    std::vector<saved> saved_;
};

// The branches of one context: handle slots, sequence leases, the scratch candidate array.
// Handles are u32 (generation << 16 | slot); slot 0 is never used, so a handle is never 0; a freed
// slot's generation is bumped, so an old handle never resolves to a new branch (ABA-safe) until
// its 16-bit generation wraps. Leases: a seq is free, owned by a branch, or detached (raw).
class branch_store {
  public:
    explicit branch_store(uint32_t n_seq_max);

    branch * find(uint32_t handle);
    branch & get(uint32_t handle);  // StaleHandleError unless live

    branch & add(std::unique_ptr<branch> b);  // assigns handle and serial; b->seq already leased
    std::unique_ptr<branch> remove(uint32_t handle);  // the slot is freed; the lease stays with the caller
    // Every branch but keep (0: none) and every detached seq: slots freed, seqs back on the free list
    // (their cells are the caller's to clear). Returns the handles freed, in creation order.
    std::vector<uint32_t> release_all(uint32_t keep = 0);

    llama_seq_id lease();  // -1 when none is free; seq 0 first, then LIFO reuse
    void lease_detached(llama_seq_id seq);  // a free seq becomes detached (raw), taken off the free list
    void release(llama_seq_id seq);
    bool is_free(llama_seq_id seq) const { return owner_[static_cast<size_t>(seq)] == k_free; }
    bool is_detached(llama_seq_id seq) const { return owner_[static_cast<size_t>(seq)] == k_detached; }
    branch * owner(llama_seq_id seq);  // the branch that owns seq, or null

    size_t n_branches() const { return n_live_; }
    size_t n_detached() const;
    bool active() const { return n_live_ > 0 || n_detached() > 0; }
    std::vector<uint32_t> handles() const;  // creation order
    std::vector<llama_seq_id> detached() const;
    uint32_t n_leased() const;
    uint64_t new_origin() { return ++origins_; }

    // Candidate arrays for sampling, one per thread that samples (at least `threads` of them).
    std::vector<std::vector<llama_token_data>> & scratch(size_t threads) {
        if (scratch_.size() < threads) {
            scratch_.resize(threads);
        }
        return scratch_;
    }

  private:
    static constexpr int32_t k_free = -1;
    static constexpr int32_t k_detached = -2;

    struct slot {
        uint16_t generation = 1;
        std::unique_ptr<branch> b;
    };
    std::vector<slot> slots_;  // slots_[0] unused
    std::vector<uint32_t> free_slots_;
    std::vector<int32_t> owner_;  // per seq: k_free, k_detached or the owning slot
    std::vector<llama_seq_id> free_seqs_;
    size_t n_live_ = 0;
    uint64_t serial_ = 0;
    uint64_t origins_ = 0;
    std::vector<std::vector<llama_token_data>> scratch_;
};

// What the driver's calls return.
struct branch_created {
    uint32_t handle = 0;
    size_t logits_offset = 0;  // of its snapshot, in the region
};

struct branch_info {
    uint32_t handle = 0;
    llama_seq_id seq = -1;
    llama_pos position = 0;
    llama_pos fork_head = 0;
    uint32_t parent = 0;
    std::vector<uint32_t> children;
    bool has_logits = false;
    size_t n_accepted = 0;
    double perplexity = 0.0;           // inf before the first accepted token
    double sampling_perplexity = 0.0;  // inf when nothing counted
    llama_token last_token = LLAMA_TOKEN_NULL;
};

struct produced_token {
    llama_token token = LLAMA_TOKEN_NULL;  // NULL: nothing allowed
    std::string piece;                     // token_to_piece(special=true)
    bool is_stop = true;                   // end of generation, or NULL
    std::optional<token_logprobs> logprobs;  // a branch with set_logprobs, a token that is not a stop
};

// A produced token of a branch that makes text (set_text): what of its text became final with it, and
// what is held back after that (final only if the generation ends here). Text is left alone on a stop.
struct produced_text {
    llama_token token = LLAMA_TOKEN_NULL;  // NULL: nothing allowed
    bool is_stop = true;                   // end of generation, or NULL
    std::string text;
    std::string held;
    bool stop_string = false;  // a stop string completed with this token: the text ends before it
    std::optional<token_logprobs> logprobs;  // the branch asked for them, and the token is no stop
};

struct kv_pressure {
    uint32_t n_ctx = 0;
    uint64_t cells_used = 0;
    uint32_t remaining = 0;
    uint32_t n_seq_max = 0;
    uint32_t seqs_leased = 0;
    uint32_t seqs_free = 0;
};

// Branches and raw sequences of one context. Every method takes the context's busy guard; those that
// decode honour the interrupt word (checked before every llama_decode and inside it, through the abort
// callback). None touches Python: the bindings call them without the GIL.
class branch_driver : public kv_tenant {
  public:
    explicit branch_driver(context_core & core);
    ~branch_driver() override;
    std::string held() const override;
    bool active() const { return store_.active(); }  // branches or detached sequences exist
    void clear();  // every branch and detached sequence goes; the caller clears the KV memory

    // branch.cpp
    // request_id (create, adopt, set_grammar): the request's, so that an interrupt lands while a large
    // grammar is set up (InterruptedError, nothing changed); 0: none.
    branch_created create(const sampler_params & p, const std::optional<grammar_spec> & grammar,
                          uint64_t request_id = 0);
    branch_created adopt(int64_t seq, const sampler_params & p, const std::optional<grammar_spec> & grammar,
                         uint64_t request_id = 0);
    branch_created fork(uint32_t src);
    std::vector<uint32_t> prune(uint32_t h, bool subtree);
    std::vector<uint32_t> retain_only(uint32_t h);
    llama_seq_id detach(uint32_t h);
    branch_info info(uint32_t h);
    std::vector<uint32_t> handles();
    void set_params(uint32_t h, const sampler_params & p);
    void set_grammar(uint32_t h, const std::optional<grammar_spec> & grammar, uint64_t request_id = 0);
    void set_logit_bias(uint32_t h, std::vector<std::pair<llama_token, float>> bias);
    void reseed(uint32_t h, uint32_t seed);
    void set_logits(uint32_t h, const float * z);  // n_vocab floats
    void merge_logits(uint32_t dst, const std::vector<uint32_t> & experts, double alpha);
    std::vector<produced_token> produce(const std::vector<uint32_t> & handles, uint64_t request_id = 0);
    // From now on the branch makes text of what it produces, with these stop strings (none empty).
    void set_text(uint32_t h, std::vector<std::string> stops, bool render_special, int32_t n_logprobs = -1);
    // produce() for branches that make text: each token's text pushed, what became final handed out.
    std::vector<produced_text> produce_text(const std::vector<uint32_t> & handles, uint64_t request_id = 0);
    // From now on produce and step report each of h's tokens' logprobs with n alternatives (-1: none);
    // forks inherit it.
    void set_logprobs(uint32_t h, int32_t n_logprobs);

    // branch_decode.cpp
    void commit(const std::vector<std::pair<uint32_t, llama_token>> & pairs, uint64_t request_id);
    // items' tokens into their branches and, in the first decode, one committed token per commit pair.
    // loras: the adapter configuration these decodes run under (lora_config's checks; lora_error), when
    // not the context's: the caller keeps each branch's cells under one configuration.
    void prefill(const std::vector<std::pair<uint32_t, std::vector<llama_token>>> & items,
                 const std::vector<std::pair<uint32_t, llama_token>> & commits, uint64_t request_id,
                 const context_core::progress_fn & on_progress = nullptr,
                 const std::optional<std::vector<lora_weight>> & loras = std::nullopt);
    std::vector<produced_token> step(const std::vector<uint32_t> & handles, uint64_t request_id);
    void clear_and_reseed(std::vector<llama_token> sinks, const std::vector<llama_token> & tail, uint64_t request_id);


    // kv.cpp
    void free_seq(int64_t seq);
    void seq_cp(int64_t src, int64_t dst, llama_pos p0, llama_pos p1);
    void seq_keep(int64_t seq);
    bool seq_rm(int64_t seq, llama_pos p0, llama_pos p1);
    llama_pos seq_pos_min(int64_t seq);
    llama_pos seq_pos_max(int64_t seq);
    kv_pressure pressure();
    size_t state_size(int64_t seq);
    std::vector<uint8_t> state_get(int64_t seq);
    size_t state_set(int64_t seq, const uint8_t * data, size_t size);
    size_t state_save_file(int64_t seq, const std::string & path, const std::vector<llama_token> & tokens);
    std::pair<std::vector<llama_token>, size_t> state_load_file(int64_t seq, const std::string & path);

    // raw.cpp: lloyal.node's low-level loop. tokens decoded at positions pos, pos + 1, ... into seq, a
    // detached sequence (a free one is leased as detached), continuing it (pos is one past its last
    // position); the last token's logits become the context's logits row. All or nothing: a failed or
    // interrupted decode removes what it added. Returns the ms spent decoding.
    double raw_decode(const std::vector<llama_token> & toks, llama_pos pos, int64_t seq, uint64_t request_id);
    // Whether the context's logits row holds the last raw decode's logits (nothing decoded since).
    bool raw_logits_current() const { return raw_stamp_ == core_.n_decodes(); }
    // A token from those logits, with a chain of p kept across calls (rebuilt when p changes: the PRNG
    // and penalty windows go on while the params stay the same) and accepted into it. `grammar`: a
    // grammar handle's sampler, applied, then replaced by its state after the token.
    llama_token raw_sample(const sampler_params & p, sampler_ptr * grammar, uint64_t request_id);

  private:
    // The cells of every branch and detached sequence (a union over shared prefixes).
    uint64_t cells_used();
    // ContextOverflowError when a branch would pass n_ctx (as asked, not llama.cpp's padded cache),
    // DecodeError when the new cells do not fit beside those held: before anything is decoded.
    void check_room(const std::vector<std::pair<const branch *, size_t>> & adds);
    void check_branch_capable() const;  // ContextError: a history, or a cache that cannot roll back
    llama_seq_id lease_or_throw();
    // A branch record without a seq yet: sampler, grammar and snapshot block, all validated.
    // The grammar's sampler (nullptr for none), set up under request_id's interrupt.
    sampler_ptr set_up_grammar(const std::optional<grammar_spec> & grammar, uint64_t request_id);
    std::unique_ptr<branch> new_root(const sampler_params & p, sampler_ptr grammar);
    region_arena::block new_block() const;
    void free_branch(uint32_t handle);  // cells removed, seq and slot returned
    // Out of the store and the tree (its children become roots); null when not live. The seq stays leased.
    std::unique_ptr<branch> unlink_branch(uint32_t handle);
    void write_snapshot(branch & b, const float * src) const;
    // write_snapshot for each (branch, row), spread over the context's threads.
    void write_snapshots(const std::vector<std::pair<branch *, const float *>> & rows) const;
    // The threads this context computes with now: what its work between decodes may spread over.
    int32_t threads() const;
    // The branch of h, BranchError when this call named it before (seen: the branches it did).
    branch & distinct(uint32_t h, std::unordered_set<branch *> & seen, const char * call);
    std::vector<branch *> with_logits(const std::vector<uint32_t> & handles, const char * call);
    std::vector<llama_token> produce_tokens(const std::vector<branch *> & bs);
    // produce_tokens under request_id's interrupt; an interrupt leaves every branch as it was.
    std::vector<llama_token> produce_all_or_none(const std::vector<branch *> & bs, uint64_t request_id);
    // What bs produced (toks), with the logprobs of branches that report them: read from their snapshots,
    // so before a commit overwrites them.
    std::vector<produced_token> produced(const std::vector<branch *> & bs, const std::vector<llama_token> & toks) const;
    void commit_tokens(const std::vector<branch *> & bs, const std::vector<llama_token> & toks, uint64_t request_id);
    // A run of prompt tokens for one branch (prefill's items, checked).
    struct prompt_item {
        branch * b;
        const std::vector<llama_token> * toks;
    };
    // commit and prefill's decoding, all or nothing: one token per commit branch (accepted as a choice) in
    // the first decode, the items packed first-fit into n_batch chunks after them.
    void decode_batch(const std::vector<branch *> & cbs, const std::vector<llama_token> & ctoks,
                      const std::vector<prompt_item> & items, uint64_t request_id,
                      const context_core::progress_fn & on_progress);
    // commit's arguments checked (distinct, valid tokens, branches with logits) into bs and toks.
    void commit_args(const std::vector<std::pair<uint32_t, llama_token>> & pairs, std::unordered_set<branch *> & seen,
                     const char * call, std::vector<branch *> & bs, std::vector<llama_token> & toks);
    // What a committed token changes in its branch once its decode went through, but its new snapshot
    // (written after, by write_snapshot(s), from the row the decode gave it).
    void apply_commit(branch & b, llama_token t, sampler_ptr grammar);
    llama_seq_id seq_arg(int64_t seq) const;  // ValueError outside [0, n_seq_max)
    void check_raw_write(llama_seq_id seq);
    branch * load_target(llama_seq_id seq);  // the branch that adopts loaded state, or null (detached)
    void adopt_loaded(branch * b, llama_seq_id seq);

    context_core & core_;
    branch_store store_;
    uint64_t raw_stamp_ = ~uint64_t{0};  // core_.n_decodes() after the last raw decode
    std::unique_ptr<chain_sampler> raw_chain_;
    std::vector<llama_token_data> raw_scratch_;
};

}  // namespace lloyal

// The methods' contract, for Python and C++ readers alike, is the stub lloyal_pool/worker/_native.pyi,
// which the engine is type-checked against and stubtest checks this module against.
