// Branches: forkable generation state inside one Context (lloyal.node's Branch/BranchStore, done over
// our worker). The contract of the bound methods is the stub, lloyal_pool/worker/_native_cpu.pyi (see
// the end of this file); docs/BRANCHES.md explains the semantics for users.
//
// A branch owns one sequence id of its context's (unified) KV cache, leased from [0, n_seq_max), and
// its own machinery: sampler stages (PRNG and penalty history included), grammar, logit bias, a logits
// snapshot (n_vocab float32 in the worker's shared memory, so the client reads it with no copy and
// no round trip), and perplexity sums. A fork shares the KV prefix with llama_memory_seq_cp (cells get
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

#include "common.hpp"
#include "model.hpp"
#include "sampling.hpp"

#include <memory>
#include <utility>
#include <vector>

namespace lloyal {

class Context;

// Grammar spec of a branch (a Python dict on the wire):
//   {"gbnf": str, "root": str = "root",
//    "lazy": bool = False, "trigger_words": [str], "trigger_patterns": [str], "trigger_tokens": [int]}
// A lazy grammar samples unconstrained (at no extra cost) until a trigger fires: llama.cpp's
// llama_sampler_init_grammar_lazy_patterns (words are regex-escaped into patterns). An invalid grammar,
// pattern or token raises GrammarError / InvalidTokenError when it is set, never later; triggers
// without lazy=True, or lazy=True without a trigger, are a ValueError, as is an unknown key.
// (grammar.cpp)
struct grammar_spec {
    std::string gbnf;
    std::string root = "root";
    bool lazy = false;
    std::vector<std::string> trigger_patterns;  // words already escaped
    std::vector<llama_token> trigger_tokens;
};

grammar_spec parse_grammar_spec(const py::handle & spec, const Model & model);
llama_sampler * make_grammar_sampler(const Model & model, const grammar_spec & g);

// A logits row with what the samplers and the perplexity need of it, computed once when it is written.
struct logits_row {
    const float * z = nullptr;
    float max = 0.0f;  // the row's maximum
    float lse = 0.0f;  // log(sum(exp(z)))
};

// How a branch samples (branch_sampler.cpp): the stages of sampling.hpp's make_chain_stages, the
// grammar in front of them, the logit bias between the two. Sampling reads a logits row (the
// branch's snapshot) and never touches a llama_context.
//
// The grammar is applied the way llama.cpp's common sampler does it: the token is chosen without it
// and checked against it; only when the grammar refuses that token is the whole vocabulary masked
// (tens of ms at 262k tokens) and the token chosen again, with the chain's PRNGs drawn once more.
// The fast paths need no candidate array at all: greedy without penalties or DRY is the snapshot's
// first argmax (found from the maximum cached when the snapshot was written; a logit bias is folded in
// unless it falls on that argmax); a chain that starts with top_k (no penalties, DRY, top_n_sigma or
// mirostat) gets its top k straight from the snapshot in one pass, then the rest of the chain. Other
// chains fill the store's candidate array and run llama.cpp's samplers over the whole vocabulary,
// as generate() does (pure temperature, top_p, typical, top_n_sigma and mirostat cost 2-20 ms a
// token at 262k tokens, llama.cpp's own cost).
class branch_sampler {
  public:
    branch_sampler(const sampler_params & p, const Model & model, uint32_t n_ctx);
    ~branch_sampler();
    branch_sampler(const branch_sampler &) = delete;
    branch_sampler & operator=(const branch_sampler &) = delete;
    std::unique_ptr<branch_sampler> clone() const;  // PRNGs, penalty and DRY windows, grammar state included

    const sampler_params & params() const { return p_; }
    // A new chain: the PRNGs restart from p.seed, the penalty and DRY windows are re-primed from the
    // branch's accepted tokens. Params equal to the current ones change nothing (no PRNG restart).
    void set_params(const sampler_params & p, const std::vector<llama_token> & accepted);
    void set_grammar(sampler_ptr g) { grammar_ = std::move(g); }  // null removes it
    // Sorted by token, one entry per token (biases of a token summed; -inf bans it).
    void set_logit_bias(std::vector<std::pair<llama_token, float>> bias) { bias_ = std::move(bias); }
    // Every sampler that draws (XTC, dist, mirostat, whose mu restarts) starts again from seed;
    // greedy has none. The penalty and DRY windows are kept.
    void reseed(uint32_t seed);

    struct sample_result {
        llama_token token = LLAMA_TOKEN_NULL;  // NULL: nothing allowed (grammar complete, all banned)
        float sampling_surprisal = 0.0f;      // -log p(token) over the candidates the chain kept (nats)
    };
    // Grammar -> logit bias -> stages applied to row; advances the PRNGs (and mirostat's mu) like
    // llama.cpp's samplers do; accepts nothing. scratch: the store's one candidate array.
    sample_result sample(const logits_row & row, std::vector<llama_token_data> & scratch);

    // The grammar after accepting token, as a new sampler, or GrammarError (this one unchanged). Null
    // when there is no grammar. Checks the token with the grammar's own mask first: accepting an
    // end-of-generation token the grammar cannot end at would GGML_ABORT inside llama.cpp.
    sampler_ptr grammar_after(llama_token token) const;
    void accept(llama_token token);  // penalty and DRY windows; the grammar is swapped in by the caller

  private:
    branch_sampler(const Model & model, uint32_t n_ctx) : model_(&model), n_ctx_(n_ctx) {}
    void build(const std::vector<llama_token> & accepted);
    sample_result sample_free(const logits_row & row, std::vector<llama_token_data> & scratch);
    sample_result sample_masked(const logits_row & row, std::vector<llama_token_data> & scratch);
    sample_result finish(llama_token_data_array & cur, bool greedy);
    void fill(const float * z, std::vector<llama_token_data> & scratch) const;

    const Model * model_;
    uint32_t n_ctx_;
    sampler_params p_;
    sampler_ptr penalties_;
    sampler_ptr dry_;
    std::vector<sampler_ptr> rest_;
    bool rest_starts_with_top_k_ = false;
    sampler_ptr grammar_;
    std::vector<std::pair<llama_token, float>> bias_;
};

// The sum of each token's biases, sorted by token: what branch_sampler::set_logit_bias takes.
// Raises InvalidTokenError for a bad id, ValueError for +inf or NaN.
std::vector<std::pair<llama_token, float>> parse_logit_bias(const py::handle & bias, const Model & model);

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

struct branch {
    uint32_t handle = 0;
    uint64_t serial = 0;  // creation order
    llama_seq_id seq = -1;
    llama_pos position = 0;  // tokens in the seq: the next token goes here
    llama_pos fork_head = 0;
    uint32_t parent = 0;
    std::vector<uint32_t> children;
    std::vector<kv_segment> lineage;  // the last one is the branch's own

    std::unique_ptr<branch_sampler> sampler;
    std::unique_ptr<held_buffer> buffer;  // the snapshot's memory, pinned while the branch lives
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

    logits_row row() const { return {snapshot, snap_max, snap_lse}; }
};

// The branches of one context: handle slots, sequence leases, the scratch candidate array.
// Handles are u32 (generation << 16 | slot); slot 0 is never used, so a handle is never 0; a freed
// slot's generation is bumped, so an old handle never resolves to a new branch (ABA-safe) until
// its 16-bit generation wraps. Leases: a seq is free, owned by a branch, or detached (raw).
class branch_store {
  public:
    explicit branch_store(uint32_t n_seq_max);

    branch * find(uint32_t handle);
    branch & get(py::handle handle);  // StaleHandleError unless live; TypeError for a non-int
    branch & get(uint32_t handle);

    branch & add(std::unique_ptr<branch> b);  // assigns handle and serial; b->seq already leased
    std::unique_ptr<branch> remove(uint32_t handle);  // the slot is freed; the lease stays with the caller
    // Every branch but keep (0: none) and every detached seq: slots freed, seqs back on the free list
    // (their cells are the caller's to clear). Returns the handles freed, in creation order.
    std::vector<uint32_t> release_all(uint32_t keep = 0);

    llama_seq_id lease();  // -1 when none is free; seq 0 first, then LIFO reuse
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

    std::vector<llama_token_data> & scratch() { return scratch_; }

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
    std::vector<llama_token_data> scratch_;
};

}  // namespace lloyal

// The methods of Context that branch.cpp and kv.cpp bind, and their exact semantics (errors, all or
// nothing, what each call changes), are documented once: lloyal_pool/worker/_native_cpu.pyi, the stub
// the engine is type-checked against and stubtest checks this module against. Every one takes the
// context's busy guard; the ones that decode release the GIL and honour the interrupt word like eval
// does (checked before every llama_decode and inside it, through the abort callback).
