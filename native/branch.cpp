// The branch driver's tree and sampling state (branch.hpp): create, adopt, fork, prune, retain_only,
// detach, info, sampler/grammar/bias/logits setters, produce.
#include "branch.hpp"
#include "errors.hpp"
#include "logits.hpp"
#include "parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_set>

namespace lloyal {

namespace {

// A lease that goes back to the store unless the branch took it.
class lease_guard {
  public:
    lease_guard(branch_store & st, llama_seq_id seq) : st_(st), seq_(seq) {}
    ~lease_guard() {
        if (seq_ >= 0) {
            st_.release(seq_);
        }
    }
    void dismiss() { seq_ = -1; }

  private:
    branch_store & st_;
    llama_seq_id seq_;
};

double perplexity(double sum, int64_t count) {
    return count > 0 ? std::exp(sum / static_cast<double>(count)) : std::numeric_limits<double>::infinity();
}

}  // namespace

branch_driver::branch_driver(context_core & core) : core_(core), store_(core.n_seq_max) { core.add_tenant(*this); }

branch_driver::~branch_driver() = default;

void branch_driver::clear() {
    store_.release_all();
    raw_chain_.reset();
    raw_stamp_ = ~uint64_t{0};
}

std::unique_ptr<branch> branch_driver::unlink_branch(uint32_t handle) {
    std::unique_ptr<branch> b = store_.remove(handle);
    if (!b) {
        return b;
    }
    if (branch * p = store_.find(b->parent)) {
        p->children.erase(std::remove(p->children.begin(), p->children.end(), handle), p->children.end());
    }
    for (uint32_t c : b->children) {
        if (branch * child = store_.find(c)) {
            child->parent = 0;
        }
    }
    return b;
}

void branch_driver::free_branch(uint32_t handle) {
    std::unique_ptr<branch> b = unlink_branch(handle);
    if (!b) {
        return;
    }
    llama_memory_seq_rm(core_.memory(), b->seq, -1, -1);  // a whole sequence: never fails
    store_.release(b->seq);
}

void branch_driver::write_snapshot(branch & b, const float * src) const {
    const size_t n = static_cast<size_t>(core_.model().n_vocab());
    b.snap_max = src == b.snapshot ? max_of(b.snapshot, n) : copy_and_max(b.snapshot, src, n);
    b.snap_lse = log_sum_exp(b.snapshot, n, b.snap_max);
    b.has_logits = true;
    b.sample_pending = false;
}

void branch_driver::write_snapshots(const std::vector<std::pair<branch *, const float *>> & rows) const {
    parallel_for(rows.size(), threads(), [&](size_t i, size_t) { write_snapshot(*rows[i].first, rows[i].second); });
}

int32_t branch_driver::threads() const { return llama_n_threads(core_.get()); }

branch & branch_driver::distinct(uint32_t h, std::unordered_set<branch *> & seen, const char * call) {
    branch & b = store_.get(h);
    if (!seen.insert(&b).second) {
        throw branch_error("branch " + std::to_string(b.handle) + " appears twice in one " + call);
    }
    return b;
}

std::vector<branch *> branch_driver::with_logits(const std::vector<uint32_t> & handles, const char * call) {
    std::vector<branch *> out;
    std::unordered_set<branch *> seen;
    for (uint32_t h : handles) {
        branch & b = distinct(h, seen, call);
        if (!b.has_logits) {
            throw branch_error("branch " + std::to_string(b.handle) +
                               " has no logits yet: prefill or commit something first");
        }
        out.push_back(&b);
    }
    return out;
}

std::string branch_driver::held() const {
    return active() ? "branches or detached sequences (prune them, or reset the context)" : std::string();
}

void branch_driver::check_branch_capable() const {
    if (const std::string other = core_.held_by_others(this); !other.empty()) {
        throw context_error("branches need a context of their own, and this context holds " + other);
    }
    const llama_model * lm = core_.model().get();
    if (llama_model_has_encoder(lm) || !llama_model_has_decoder(lm)) {
        throw context_error("branches need a decoder-only model");
    }
    if (const std::string why = core_.why_ranges_cannot_be_removed(); !why.empty()) {
        throw context_error("branches roll back (commit, prefill) by removing cells from the cache: " + why);
    }
}

region_arena::block branch_driver::new_block() const {
    try {
        return core_.arena().alloc(static_cast<size_t>(core_.model().n_vocab()) * sizeof(float));
    } catch (const region_full_error & e) {
        throw branch_error(std::string(e.what()) + " (every branch keeps its " +
                           std::to_string(static_cast<size_t>(core_.model().n_vocab()) * sizeof(float) >> 10) +
                           " KiB logits snapshot there)");
    }
}

sampler_ptr branch_driver::set_up_grammar(const std::optional<grammar_spec> & grammar, uint64_t request_id) {
    if (!grammar) {
        return nullptr;
    }
    context_core::request_scope req(core_, request_id);
    const stop_fn stop = [this] { return core_.interrupt_requested(); };
    return make_grammar_sampler(core_.model(), *grammar, request_id != 0 ? stop : stop_fn());
}

std::unique_ptr<branch> branch_driver::new_root(const sampler_params & p, sampler_ptr g) {
    const Model & model = core_.model();
    auto b = std::make_unique<branch>();
    b->sampler = std::make_unique<chain_sampler>(p, model, core_.n_ctx_seq);
    b->sampler->set_grammar(std::move(g));
    b->block = new_block();
    b->snapshot = b->block.floats();
    return b;
}

llama_seq_id branch_driver::lease_or_throw() {
    const llama_seq_id seq = store_.lease();
    if (seq < 0) {
        throw branch_error("no free sequence: all n_seq_max " + std::to_string(core_.n_seq_max) +
                           " are leased (prune a branch, or create the context with a larger n_seq_max)");
    }
    return seq;
}

branch_created branch_driver::create(const sampler_params & p, const std::optional<grammar_spec> & grammar,
                                     uint64_t request_id) {
    context_core::busy_guard busy(core_);
    check_branch_capable();
    std::unique_ptr<branch> b = new_root(p, set_up_grammar(grammar, request_id));
    const llama_seq_id seq = lease_or_throw();
    lease_guard guard(store_, seq);
    b->seq = seq;
    b->lineage.push_back({store_.new_origin(), 0, 0});
    llama_memory_seq_rm(core_.memory(), seq, -1, -1);  // a vacant seq has no cells; make sure
    guard.dismiss();
    branch & added = store_.add(std::move(b));
    return {added.handle, added.block.offset()};
}

branch_created branch_driver::adopt(int64_t seq_arg_, const sampler_params & p, const std::optional<grammar_spec> & grammar,
                                    uint64_t request_id) {
    context_core::busy_guard busy(core_);
    const llama_seq_id seq = seq_arg(seq_arg_);
    check_branch_capable();
    if (const branch * owner = store_.owner(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " already belongs to branch " +
                           std::to_string(owner->handle));
    }
    if (!store_.is_detached(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " is not a detached sequence (branch_detach gives one)");
    }
    std::unique_ptr<branch> b = new_root(p, set_up_grammar(grammar, request_id));
    llama_memory_t mem = core_.memory();
    const llama_pos lo = std::max<llama_pos>(0, llama_memory_seq_pos_min(mem, seq));
    b->seq = seq;
    b->position = llama_memory_seq_pos_max(mem, seq) + 1;
    b->lineage.push_back({store_.new_origin(), lo, b->position});
    branch & added = store_.add(std::move(b));
    return {added.handle, added.block.offset()};
}

branch_created branch_driver::fork(uint32_t src) {
    context_core::busy_guard busy(core_);
    branch & parent = store_.get(src);
    region_arena::block block = new_block();
    const llama_seq_id seq = lease_or_throw();
    lease_guard guard(store_, seq);
    auto b = std::make_unique<branch>();
    b->seq = seq;
    b->position = parent.position;
    b->fork_head = parent.position;
    b->parent = parent.handle;
    b->lineage = parent.lineage;
    b->lineage.push_back({store_.new_origin(), parent.position, parent.position});
    b->sampler = parent.sampler->clone();
    b->block = std::move(block);
    b->snapshot = b->block.floats();
    if (parent.has_logits) {
        std::memcpy(b->snapshot, parent.snapshot, static_cast<size_t>(core_.model().n_vocab()) * sizeof(float));
        b->has_logits = true;
        b->snap_max = parent.snap_max;
        b->snap_lse = parent.snap_lse;
    }
    b->accepted = parent.accepted;
    b->text = parent.text;
    b->n_logprobs = parent.n_logprobs;
    b->nll_sum = parent.nll_sum;
    b->nll_count = parent.nll_count;
    b->samp_sum = parent.samp_sum;
    b->samp_count = parent.samp_count;
    b->last_token = parent.last_token;
    b->last_surprisal = parent.last_surprisal;
    b->sample_pending = parent.sample_pending;
    llama_memory_t mem = core_.memory();
    llama_memory_seq_rm(mem, seq, -1, -1);
    llama_memory_seq_cp(mem, parent.seq, seq, -1, -1);
    guard.dismiss();
    branch & child = store_.add(std::move(b));
    parent.children.push_back(child.handle);
    return {child.handle, child.block.offset()};
}

std::vector<uint32_t> branch_driver::prune(uint32_t h, bool subtree) {
    context_core::busy_guard busy(core_);
    branch & b = store_.get(h);
    if (!subtree && !b.children.empty()) {
        throw branch_error("branch " + std::to_string(b.handle) + " has " + std::to_string(b.children.size()) +
                           " live children: prune them first, or prune with subtree=True");
    }
    // Post-order, leaves first: a parent goes after all of its children.
    std::vector<uint32_t> order;
    std::vector<std::pair<uint32_t, size_t>> stack{{b.handle, 0}};
    while (!stack.empty()) {
        auto & [handle, next] = stack.back();
        branch & cur = store_.get(handle);
        if (next < cur.children.size()) {
            const uint32_t c = cur.children[next++];
            stack.push_back({c, 0});
        } else {
            order.push_back(handle);
            stack.pop_back();
        }
    }
    for (uint32_t handle : order) {
        free_branch(handle);
    }
    return order;
}

std::vector<uint32_t> branch_driver::retain_only(uint32_t h) {
    context_core::busy_guard busy(core_);
    branch & w = store_.get(h);
    llama_memory_seq_keep(core_.memory(), w.seq);
    std::vector<uint32_t> freed = store_.release_all(w.handle);
    w.parent = 0;
    w.fork_head = 0;
    w.children.clear();
    return freed;
}

llama_seq_id branch_driver::detach(uint32_t h) {
    context_core::busy_guard busy(core_);
    return unlink_branch(store_.get(h).handle)->seq;  // its seq stays leased: detached
}

branch_info branch_driver::info(uint32_t h) {
    context_core::busy_guard busy(core_);
    const branch & b = store_.get(h);
    branch_info i;
    i.handle = b.handle;
    i.seq = b.seq;
    i.position = b.position;
    i.fork_head = b.fork_head;
    i.parent = b.parent;
    i.children = b.children;
    i.has_logits = b.has_logits;
    i.n_accepted = b.accepted.size();
    i.perplexity = perplexity(b.nll_sum, b.nll_count);
    i.sampling_perplexity = perplexity(b.samp_sum, b.samp_count);
    i.last_token = b.last_token;
    return i;
}

std::vector<uint32_t> branch_driver::handles() {
    context_core::busy_guard busy(core_);
    return store_.handles();
}

void branch_driver::set_params(uint32_t h, const sampler_params & p) {
    context_core::busy_guard busy(core_);
    branch & b = store_.get(h);
    b.sampler->set_params(p, b.accepted);
}

void branch_driver::set_grammar(uint32_t h, const std::optional<grammar_spec> & grammar, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    branch & b = store_.get(h);
    b.sampler->set_grammar(set_up_grammar(grammar, request_id));
}

void branch_driver::set_logit_bias(uint32_t h, std::vector<std::pair<llama_token, float>> bias) {
    context_core::busy_guard busy(core_);
    store_.get(h).sampler->set_logit_bias(std::move(bias));
}

void branch_driver::reseed(uint32_t h, uint32_t seed) {
    context_core::busy_guard busy(core_);
    store_.get(h).sampler->reseed(seed);
}

void branch_driver::set_logits(uint32_t h, const float * z) {
    context_core::busy_guard busy(core_);
    write_snapshot(store_.get(h), z);
}

void branch_driver::merge_logits(uint32_t dst, const std::vector<uint32_t> & experts, double alpha) {
    context_core::busy_guard busy(core_);
    branch & d = store_.get(dst);
    if (!d.has_logits) {
        throw branch_error("branch " + std::to_string(d.handle) + " has no logits to merge into");
    }
    std::vector<branch *> es;
    for (uint32_t h : experts) {
        branch & e = store_.get(h);
        if (!e.has_logits) {
            throw branch_error("expert branch " + std::to_string(e.handle) + " has no logits");
        }
        es.push_back(&e);
    }
    if (!std::isfinite(alpha)) {
        throw std::invalid_argument("alpha must be finite");
    }
    const size_t n = static_cast<size_t>(core_.model().n_vocab());
    // Summed first, so that dst may be one of the experts.
    std::vector<float> acc(n, 0.0f);
    for (const branch * e : es) {
        const float * z = e->snapshot;
        float * a = acc.data();
#pragma omp simd
        for (size_t t = 0; t < n; ++t) {
            a[t] += z[t];
        }
    }
    const float fa = static_cast<float>(alpha);
    float * z = d.snapshot;
    const float * a = acc.data();
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    constexpr float top = std::numeric_limits<float>::max();
    // A token banned (-inf) in dst or in any expert stays banned: alpha * -inf would otherwise turn into
    // +inf (alpha < 0) or NaN (alpha 0, or -inf + inf), and the sampler's distribution into NaNs. A finite
    // sum that overflows is clamped for the same reason.
#pragma omp simd
    for (size_t t = 0; t < n; ++t) {
        const float v = z[t] + fa * a[t];
        z[t] = (z[t] == neg_inf || a[t] == neg_inf) ? neg_inf : std::min(std::max(v, -top), top);
    }
    write_snapshot(d, d.snapshot);
}

sampling_checkpoint::sampling_checkpoint(const std::vector<branch *> & bs) : bs_(bs) {
    saved_.reserve(bs.size());
    for (const branch * b : bs) {
        saved_.push_back({b->sampler->clone(), b->last_token, b->last_surprisal, b->sample_pending});
    }
}

void sampling_checkpoint::restore() {
    for (size_t i = 0; i < bs_.size() && i < saved_.size(); ++i) {
        bs_[i]->sampler = std::move(saved_[i].sampler);
        bs_[i]->last_token = saved_[i].last_token;
        bs_[i]->last_surprisal = saved_[i].last_surprisal;
        bs_[i]->sample_pending = saved_[i].sample_pending;
    }
    saved_.clear();
}

std::vector<llama_token> branch_driver::produce_tokens(const std::vector<branch *> & bs) {
    // A grammar step can take seconds (a grammar of thousands of alternatives): it asks between slices.
    const stop_fn stop = [this] { return core_.interrupt_requested(); };
    // Each branch samples with its own chain, PRNG and grammar: the order they run in changes nothing.
    const int32_t team = threads();
    std::vector<std::vector<llama_token_data>> & scratch = store_.scratch(static_cast<size_t>(std::max(team, 1)));
    std::vector<llama_token> out(bs.size(), LLAMA_TOKEN_NULL);
    parallel_for(bs.size(), team, [&](size_t i, size_t slot) {
        branch * b = bs[i];
        const chain_sampler::sample_result r = b->sampler->sample(b->row(), scratch[slot], stop);
        b->last_token = r.token;
        b->last_surprisal = r.sampling_surprisal;
        b->sample_pending = r.token != LLAMA_TOKEN_NULL;
        out[i] = r.token;
    });
    return out;
}

std::vector<produced_token> branch_driver::produced(const std::vector<branch *> & bs,
                                                    const std::vector<llama_token> & toks) const {
    const Model & model = core_.model();
    std::vector<produced_token> out(toks.size());
    for (size_t i = 0; i < toks.size(); ++i) {
        if (toks[i] != LLAMA_TOKEN_NULL) {
            out[i] = {toks[i], model.token_to_piece(toks[i], true), llama_vocab_is_eog(model.vocab(), toks[i]), {}};
            const branch & b = *bs[i];
            if (b.n_logprobs >= 0 && !out[i].is_stop) {
                out[i].logprobs = logprobs_of(b.snapshot, model.n_vocab(), b.snap_max, b.snap_lse, toks[i], b.n_logprobs);
            }
        }
    }
    return out;
}

std::vector<llama_token> branch_driver::produce_all_or_none(const std::vector<branch *> & bs, uint64_t request_id) {
    sampling_checkpoint saved(bs);  // an interrupt halfway through the branches changes none of them
    try {
        context_core::request_scope req(core_, request_id);
        return produce_tokens(bs);
    } catch (...) {
        saved.restore();
        throw;
    }
}

std::vector<produced_token> branch_driver::produce(const std::vector<uint32_t> & handles, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    const std::vector<branch *> bs = with_logits(handles, "batch");
    return produced(bs, produce_all_or_none(bs, request_id));
}

void branch_driver::set_logprobs(uint32_t h, int32_t n_logprobs) {
    context_core::busy_guard busy(core_);
    store_.get(h).n_logprobs = n_logprobs;
}

void branch_driver::set_text(uint32_t h, std::vector<std::string> stops, bool render_special, int32_t n_logprobs) {
    for (const std::string & stop : stops) {
        if (stop.empty()) {
            throw std::invalid_argument("a stop string must not be empty");
        }
    }
    context_core::busy_guard busy(core_);
    store_.get(h).text = branch_text{text_assembly(std::move(stops)), render_special, 0, n_logprobs};
}

std::vector<produced_text> branch_driver::produce_text(const std::vector<uint32_t> & handles, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    const std::vector<branch *> bs = with_logits(handles, "produce_text");
    for (const branch * b : bs) {
        if (!b->text) {
            throw branch_error("branch " + std::to_string(b->handle) + " makes no text: set_text first");
        }
    }
    const std::vector<llama_token> toks = produce_all_or_none(bs, request_id);
    const Model & model = core_.model();
    std::vector<produced_text> out(bs.size());
    for (size_t i = 0; i < bs.size(); ++i) {
        branch_text & bt = *bs[i]->text;
        produced_text & o = out[i];
        o.token = toks[i];
        o.is_stop = toks[i] == LLAMA_TOKEN_NULL || llama_vocab_is_eog(model.vocab(), toks[i]);
        if (!o.is_stop) {
            o.stop_string = bt.text.push(model.text_piece(toks[i], bt.render_special));
            if (bt.n_logprobs >= 0) {  // the row it was sampled from: the snapshot, until the commit
                const branch & b = *bs[i];
                o.logprobs = logprobs_of(b.snapshot, model.n_vocab(), b.snap_max, b.snap_lse, toks[i], bt.n_logprobs);
            }
        }
        const std::string & s = bt.text.text();
        o.text = s.substr(bt.handed, bt.text.final_end() - bt.handed);
        bt.handed = bt.text.final_end();
        o.held = s.substr(bt.handed, bt.text.end() - bt.handed);
    }
    return out;
}

}  // namespace lloyal
