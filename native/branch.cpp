// The branch store and the branch methods of Context (the contract is at the end of branch.hpp).
#include "common.hpp"
#include "branch.hpp"
#include "context.hpp"
#include "errors.hpp"
#include "logits.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_set>

namespace lloyal {

// ---------------------------------------------------------------------------------------------------
// branch_store

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

branch & branch_store::get(py::handle handle) {
    long long v = 0;
    std::string text;
    if (!strict_int(handle, "a branch handle", v, &text) || v <= 0 || v > 0xFFFFFFFFll) {
        throw stale_handle_error("branch handle " + text + " is not live (handles are positive u32)");
    }
    return get(static_cast<uint32_t>(v));
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

// ---------------------------------------------------------------------------------------------------
// Context: branch mode

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

std::unique_ptr<held_buffer> snapshot_buffer(py::handle obj, int32_t n_vocab) {
    auto buf = std::make_unique<held_buffer>(obj, true);
    const size_t need = static_cast<size_t>(n_vocab) * sizeof(float);
    if (buf->size() < need) {
        throw std::invalid_argument("logits buffer has " + std::to_string(buf->size()) + " bytes, needs " +
                                    std::to_string(need) + " (n_vocab float32)");
    }
    if (reinterpret_cast<uintptr_t>(buf->data()) % alignof(float) != 0) {
        throw std::invalid_argument("logits buffer is not 4-byte aligned");
    }
    return buf;
}

std::vector<py::object> sequence_items(py::handle seq, const char * what) {
    const std::string must = std::string(what) + " must be a list";
    if (PyUnicode_Check(seq.ptr()) || PyBytes_Check(seq.ptr())) {
        throw py::type_error(must);
    }
    py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), must.c_str()));
    if (!fast) {
        throw py::error_already_set();
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    PyObject ** items = PySequence_Fast_ITEMS(fast.ptr());
    std::vector<py::object> out;
    out.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        out.push_back(py::reinterpret_borrow<py::object>(items[i]));
    }
    return out;
}

std::pair<py::object, py::object> pair_items(const py::object & item, const char * what) {
    if (!PySequence_Check(item.ptr()) || PyUnicode_Check(item.ptr())) {
        throw py::type_error(std::string(what) + " must be (branch, ...) pairs");
    }
    std::vector<py::object> two = sequence_items(item, what);
    if (two.size() != 2) {
        throw py::type_error(std::string(what) + " must be (branch, ...) pairs");
    }
    return {two[0], two[1]};
}

// The branch of h, BranchError when this call named it before (seen: the branches it did).
branch & distinct_branch(branch_store & st, py::handle h, std::unordered_set<branch *> & seen, const char * call) {
    branch & b = st.get(h);
    if (!seen.insert(&b).second) {
        throw branch_error("branch " + std::to_string(b.handle) + " appears twice in one " + call);
    }
    return b;
}

double perplexity(double sum, int64_t count) {
    return count > 0 ? std::exp(sum / static_cast<double>(count)) : std::numeric_limits<double>::infinity();
}

}  // namespace

branch_store & Context::store() {
    if (!store_) {
        store_ = std::make_unique<branch_store>(n_seq_max_);
    }
    return *store_;
}

bool Context::branch_mode() const { return store_ && store_->active(); }

void Context::require_sequence_mode(const char * what) const {
    if (branch_mode()) {
        throw context_error(std::string(what) + " works on a plain history, and this context holds branches or " +
                            "detached sequences (prune them, or reset the context)");
    }
}

void Context::drop_branches() {
    if (!store_) {
        return;
    }
    // The cache is cleared by the caller; only the records go (their buffer exports with them).
    store_->release_all();
}

std::unique_ptr<branch> Context::unlink_branch(uint32_t handle) {
    branch_store & st = store();
    std::unique_ptr<branch> b = st.remove(handle);
    if (!b) {
        return b;
    }
    if (branch * p = st.find(b->parent)) {
        p->children.erase(std::remove(p->children.begin(), p->children.end(), handle), p->children.end());
    }
    for (uint32_t c : b->children) {
        if (branch * child = st.find(c)) {
            child->parent = 0;
        }
    }
    return b;
}

void Context::free_branch(uint32_t handle) {
    std::unique_ptr<branch> b = unlink_branch(handle);
    if (!b) {
        return;
    }
    llama_memory_seq_rm(llama_get_memory(ctx_), b->seq, -1, -1);  // a whole sequence: never fails
    store().release(b->seq);
}

void Context::write_snapshot(branch & b, const float * src) {
    const size_t n = static_cast<size_t>(model_->n_vocab());
    b.snap_max = src == b.snapshot ? max_of(b.snapshot, n) : copy_and_max(b.snapshot, src, n);
    b.snap_lse = log_sum_exp(b.snapshot, n, b.snap_max);
    b.has_logits = true;
    b.sample_pending = false;
}

std::vector<branch *> Context::branch_list(py::handle handles) {
    branch_store & st = store();
    std::vector<branch *> out;
    std::unordered_set<branch *> seen;
    for (const py::object & h : sequence_items(handles, "branch handles")) {
        branch & b = distinct_branch(st, h, seen, "batch");
        if (!b.has_logits) {
            throw branch_error("branch " + std::to_string(b.handle) +
                               " has no logits yet: prefill or commit something first");
        }
        out.push_back(&b);
    }
    return out;
}

int32_t Context::decode_batch(int32_t n) {
    const int64_t t0 = now_us();
    const int32_t ret = decode_raw(n);
    decode_us_ += now_us() - t0;
    return ret;
}

void Context::throw_decode_failure(int32_t ret, size_t n_tokens, uint64_t mark) const {
    if (ret == 2) {
        throw interrupted_error("interrupted: nothing was changed");
    }
    if (ret == 1) {
        throw decode_error("llama_decode found no KV slot for a batch of " + std::to_string(n_tokens) +
                           " tokens (the cache has " + std::to_string(n_cells_) + " cells): nothing was changed");
    }
    const std::string why = log_reason_since(mark);
    if (ret == -1) {
        throw decode_error("llama_decode rejected the batch as invalid" + why);
    }
    throw decode_error("llama_decode failed (" + std::to_string(ret) + ")" + why + "; nothing was changed");
}

void Context::check_branch_capable() const {
    if (!history_.empty()) {
        throw context_error("this context holds a sequence-mode history of " + std::to_string(history_.size()) +
                            " tokens: reset it before creating branches");
    }
    const llama_model * lm = model_->get();
    if (llama_model_has_encoder(lm) || !llama_model_has_decoder(lm)) {
        throw context_error("branches need a decoder-only model");
    }
    if (llama_model_is_recurrent(lm) || llama_model_is_hybrid(lm)) {
        throw context_error("branches need a KV cache that can drop any range of a sequence; this model's "
                            "recurrent state cannot");
    }
    if (n_swa_ > 0 && !swa_full_) {
        throw context_error("branches on a sliding-window model need swa_full=True: commit and prefill roll back "
                            "by removing cells, which a window-sized cache may already have dropped");
    }
}

std::unique_ptr<branch> Context::new_root(py::handle logits, const py::dict & params, py::handle grammar) {
    const sampler_params p = parse_sampler_params(params);
    sampler_ptr g;
    if (!grammar.is_none()) {
        g.reset(make_grammar_sampler(*model_, parse_grammar_spec(grammar, *model_)));
    }
    auto b = std::make_unique<branch>();
    b->sampler = std::make_unique<branch_sampler>(p, *model_, n_ctx_seq_);
    b->sampler->set_grammar(std::move(g));
    b->buffer = snapshot_buffer(logits, model_->n_vocab());
    b->snapshot = static_cast<float *>(b->buffer->data());
    return b;
}

llama_seq_id Context::lease_or_throw(branch_store & st) const {
    const llama_seq_id seq = st.lease();
    if (seq < 0) {
        throw branch_error("no free sequence: all n_seq_max " + std::to_string(n_seq_max_) +
                           " are leased (prune a branch, or create the context with a larger n_seq_max)");
    }
    return seq;
}

uint32_t Context::branch_create(py::handle logits, const py::dict & params, py::handle grammar) {
    busy_guard busy(*this);
    check_branch_capable();
    std::unique_ptr<branch> b = new_root(logits, params, grammar);
    branch_store & st = store();
    const llama_seq_id seq = lease_or_throw(st);
    lease_guard guard(st, seq);
    b->seq = seq;
    b->lineage.push_back({st.new_origin(), 0, 0});
    llama_memory_seq_rm(llama_get_memory(ctx_), seq, -1, -1);  // a vacant seq has no cells; make sure
    guard.dismiss();
    return st.add(std::move(b)).handle;
}

uint32_t Context::branch_adopt(py::handle seq_obj, py::handle logits, const py::dict & params, py::handle grammar) {
    busy_guard busy(*this);
    const llama_seq_id seq = seq_arg(seq_obj);
    check_branch_capable();
    branch_store & st = store();
    if (const branch * owner = st.owner(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " already belongs to branch " +
                           std::to_string(owner->handle));
    }
    if (!st.is_detached(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " is not a detached sequence (branch_detach gives one)");
    }
    std::unique_ptr<branch> b = new_root(logits, params, grammar);
    llama_memory_t mem = llama_get_memory(ctx_);
    const llama_pos lo = std::max<llama_pos>(0, llama_memory_seq_pos_min(mem, seq));
    b->seq = seq;
    b->position = llama_memory_seq_pos_max(mem, seq) + 1;
    b->lineage.push_back({st.new_origin(), lo, b->position});
    return st.add(std::move(b)).handle;
}

uint32_t Context::branch_fork(py::handle src, py::handle logits) {
    busy_guard busy(*this);
    branch_store & st = store();
    branch & parent = st.get(src);
    auto buf = snapshot_buffer(logits, model_->n_vocab());
    const llama_seq_id seq = lease_or_throw(st);
    lease_guard guard(st, seq);
    auto b = std::make_unique<branch>();
    b->seq = seq;
    b->position = parent.position;
    b->fork_head = parent.position;
    b->parent = parent.handle;
    b->lineage = parent.lineage;
    b->lineage.push_back({st.new_origin(), parent.position, parent.position});
    b->sampler = parent.sampler->clone();
    b->buffer = std::move(buf);
    b->snapshot = static_cast<float *>(b->buffer->data());
    if (parent.has_logits) {
        std::memcpy(b->snapshot, parent.snapshot, static_cast<size_t>(model_->n_vocab()) * sizeof(float));
        b->has_logits = true;
        b->snap_max = parent.snap_max;
        b->snap_lse = parent.snap_lse;
    }
    b->accepted = parent.accepted;
    b->nll_sum = parent.nll_sum;
    b->nll_count = parent.nll_count;
    b->samp_sum = parent.samp_sum;
    b->samp_count = parent.samp_count;
    b->last_token = parent.last_token;
    b->last_surprisal = parent.last_surprisal;
    b->sample_pending = parent.sample_pending;
    llama_memory_t mem = llama_get_memory(ctx_);
    llama_memory_seq_rm(mem, seq, -1, -1);
    llama_memory_seq_cp(mem, parent.seq, seq, -1, -1);
    guard.dismiss();
    branch & child = st.add(std::move(b));
    parent.children.push_back(child.handle);
    return child.handle;
}

py::list Context::branch_prune(py::handle h, bool subtree) {
    busy_guard busy(*this);
    branch_store & st = store();
    branch & b = st.get(h);
    if (!subtree && !b.children.empty()) {
        throw branch_error("branch " + std::to_string(b.handle) + " has " + std::to_string(b.children.size()) +
                           " live children: prune them first, or prune with subtree=True");
    }
    // Post-order, leaves first: a parent goes after all of its children.
    std::vector<uint32_t> order;
    std::vector<std::pair<uint32_t, size_t>> stack{{b.handle, 0}};
    while (!stack.empty()) {
        auto & [handle, next] = stack.back();
        branch & cur = st.get(handle);
        if (next < cur.children.size()) {
            const uint32_t c = cur.children[next++];
            stack.push_back({c, 0});
        } else {
            order.push_back(handle);
            stack.pop_back();
        }
    }
    py::list freed;
    for (uint32_t handle : order) {
        free_branch(handle);
        freed.append(handle);
    }
    return freed;
}

py::list Context::branch_retain_only(py::handle h) {
    busy_guard busy(*this);
    branch_store & st = store();
    branch & w = st.get(h);
    llama_memory_seq_keep(llama_get_memory(ctx_), w.seq);
    py::list freed;
    for (uint32_t handle : st.release_all(w.handle)) {
        freed.append(handle);
    }
    w.parent = 0;
    w.fork_head = 0;
    w.children.clear();
    return freed;
}

int32_t Context::branch_detach(py::handle h) {
    busy_guard busy(*this);
    branch_store & st = store();
    return unlink_branch(st.get(h).handle)->seq;  // its seq stays leased: detached
}

py::dict Context::branch_info(py::handle h) {
    busy_guard busy(*this);
    branch & b = store().get(h);
    py::dict d;
    d["handle"] = b.handle;
    d["seq"] = b.seq;
    d["position"] = b.position;
    d["fork_head"] = b.fork_head;
    d["parent"] = b.parent;
    d["children"] = b.children;
    d["has_logits"] = b.has_logits;
    d["n_accepted"] = b.accepted.size();
    d["perplexity"] = perplexity(b.nll_sum, b.nll_count);
    d["sampling_perplexity"] = perplexity(b.samp_sum, b.samp_count);
    d["last_token"] = b.last_token;
    return d;
}

py::list Context::branches() {
    busy_guard busy(*this);
    py::list out;
    if (store_) {
        for (uint32_t h : store_->handles()) {
            out.append(h);
        }
    }
    return out;
}

void Context::branch_set_params(py::handle h, const py::dict & params) {
    busy_guard busy(*this);
    branch & b = store().get(h);
    const sampler_params p = parse_sampler_params(params);
    b.sampler->set_params(p, b.accepted);
}

void Context::branch_set_grammar(py::handle h, py::handle grammar) {
    busy_guard busy(*this);
    branch & b = store().get(h);
    sampler_ptr g;
    if (!grammar.is_none()) {
        g.reset(make_grammar_sampler(*model_, parse_grammar_spec(grammar, *model_)));
    }
    b.sampler->set_grammar(std::move(g));
}

void Context::branch_set_logit_bias(py::handle h, py::handle bias) {
    busy_guard busy(*this);
    branch & b = store().get(h);
    b.sampler->set_logit_bias(parse_logit_bias(bias, *model_));
}

void Context::branch_reseed(py::handle h, py::handle seed) {
    busy_guard busy(*this);
    branch & b = store().get(h);
    b.sampler->reseed(parse_seed(seed, "seed"));
}

void Context::branch_set_logits(py::handle h, py::handle src) {
    busy_guard busy(*this);
    branch & b = store().get(h);
    held_buffer buf(src, false);
    const size_t need = static_cast<size_t>(model_->n_vocab()) * sizeof(float);
    if (buf.size() != need) {
        throw std::invalid_argument("logits have " + std::to_string(buf.size()) + " bytes, need exactly " +
                                    std::to_string(need) + " (n_vocab float32)");
    }
    const float * z = static_cast<const float *>(buf.data());
    std::vector<float> aligned;
    if (reinterpret_cast<uintptr_t>(z) % alignof(float) != 0) {
        aligned.resize(static_cast<size_t>(model_->n_vocab()));
        std::memcpy(aligned.data(), z, need);
        z = aligned.data();
    }
    gil_release nogil;
    write_snapshot(b, z);
}

void Context::branch_merge_logits(py::handle dst, py::handle experts, double alpha) {
    busy_guard busy(*this);
    branch_store & st = store();
    branch & d = st.get(dst);
    if (!d.has_logits) {
        throw branch_error("branch " + std::to_string(d.handle) + " has no logits to merge into");
    }
    std::vector<branch *> es;
    for (const py::object & h : sequence_items(experts, "experts")) {
        branch & e = st.get(h);
        if (!e.has_logits) {
            throw branch_error("expert branch " + std::to_string(e.handle) + " has no logits");
        }
        es.push_back(&e);
    }
    if (!std::isfinite(alpha)) {
        throw std::invalid_argument("alpha must be finite");
    }
    const size_t n = static_cast<size_t>(model_->n_vocab());
    gil_release nogil;
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
#pragma omp simd
    for (size_t t = 0; t < n; ++t) {
        z[t] += fa * a[t];
    }
    write_snapshot(d, d.snapshot);
}

std::vector<llama_token> Context::produce_impl(const std::vector<branch *> & bs) {
    std::vector<llama_token> out;
    out.reserve(bs.size());
    gil_release nogil;
    auto & scratch = store().scratch();
    for (branch * b : bs) {
        const branch_sampler::sample_result r = b->sampler->sample(b->row(), scratch);
        b->last_token = r.token;
        b->last_surprisal = r.sampling_surprisal;
        b->sample_pending = r.token != LLAMA_TOKEN_NULL;
        out.push_back(r.token);
    }
    return out;
}

py::list Context::produce_result(const std::vector<llama_token> & out) {
    py::list result;
    for (const llama_token tok : out) {
        if (tok == LLAMA_TOKEN_NULL) {
            result.append(py::make_tuple(-1, py::bytes(""), true));
        } else {
            result.append(py::make_tuple(tok, py::bytes(model_->token_to_piece(tok, true)),
                                         llama_vocab_is_eog(model_->vocab(), tok)));
        }
    }
    return result;
}

py::list Context::produce(py::handle handles) {
    busy_guard busy(*this);
    const std::vector<branch *> bs = branch_list(handles);
    return produce_result(produce_impl(bs));
}

void Context::commit_impl(const std::vector<branch *> & bs, const std::vector<llama_token> & toks, uint64_t request_id) {
    const size_t n = bs.size();
    if (n == 0) {
        return;
    }
    if (n > n_batch_) {
        throw std::invalid_argument("a commit holds at most n_batch (" + std::to_string(n_batch_) + ") branches, got " +
                                    std::to_string(n));
    }
    // Everything that can refuse the commit runs before the decode: the grammar accepts each token on
    // a copy, swapped in only once the decode went through.
    std::vector<sampler_ptr> grammars(n);
    for (size_t i = 0; i < n; ++i) {
        grammars[i] = bs[i]->sampler->grammar_after(toks[i]);
    }
    request_scope req(*this, request_id);
    gil_release nogil;
    if (interrupt_requested()) {
        throw interrupted_error("interrupted before the decode: nothing was committed");
    }
    for (size_t i = 0; i < n; ++i) {
        put(i, toks[i], bs[i]->position, bs[i]->seq, true);
    }
    llama_memory_t mem = llama_get_memory(ctx_);
    auto rollback = [&] {
        for (const branch * b : bs) {
            llama_memory_seq_rm(mem, b->seq, b->position, -1);
        }
    };
    const uint64_t mark = log_mark();
    const int32_t ret = decode_batch(static_cast<int32_t>(n));
    if (ret != 0) {
        rollback();
        throw_decode_failure(ret, n, mark);
    }
    std::vector<const float *> rows(n);
    for (size_t i = 0; i < n; ++i) {
        rows[i] = llama_get_logits_ith(ctx_, static_cast<int32_t>(i));
        if (rows[i] == nullptr) {
            rollback();
            throw lloyal_error("llama.cpp returned no logits for a committed token: nothing was changed");
        }
    }
    for (size_t i = 0; i < n; ++i) {
        branch & b = *bs[i];
        const llama_token t = toks[i];
        // Model surprisal under the snapshot the token was chosen from, before it is overwritten.
        const float s = b.snap_lse - b.snapshot[t];
        if (std::isfinite(s)) {
            b.nll_sum += std::max(0.0f, s);
            ++b.nll_count;
        }
        if (b.sample_pending && b.last_token == t && std::isfinite(b.last_surprisal)) {
            b.samp_sum += b.last_surprisal;
            ++b.samp_count;
        }
        if (grammars[i]) {
            b.sampler->set_grammar(std::move(grammars[i]));
        }
        b.sampler->accept(t);
        b.accepted.push_back(t);
        b.position += 1;
        b.lineage.back().p1 = b.position;
        write_snapshot(b, rows[i]);
    }
}

void Context::commit(py::handle pairs, uint64_t request_id) {
    busy_guard busy(*this);
    decode_us_ = 0;
    branch_store & st = store();
    std::vector<branch *> bs;
    std::vector<llama_token> toks;
    std::unordered_set<branch *> seen;
    for (const py::object & item : sequence_items(pairs, "commit pairs")) {
        auto [h, t] = pair_items(item, "commit pairs");
        branch & b = distinct_branch(st, h, seen, "commit");
        toks.push_back(token_from_py(t, *model_));
        bs.push_back(&b);
    }
    for (const branch * b : bs) {
        if (!b->has_logits) {
            throw branch_error("branch " + std::to_string(b->handle) +
                               " has no logits yet: prefill or commit something first");
        }
    }
    commit_impl(bs, toks, request_id);
}

py::list Context::step(py::handle handles, uint64_t request_id) {
    busy_guard busy(*this);
    decode_us_ = 0;
    const std::vector<branch *> bs = branch_list(handles);
    // Sampling advances the PRNGs, mirostat's mu and the last sample: what would refuse the commit is
    // checked before, so that a step that commits nothing has consumed nothing either.
    if (bs.size() > n_batch_) {
        throw std::invalid_argument("a step holds at most n_batch (" + std::to_string(n_batch_) + ") branches, got " +
                                    std::to_string(bs.size()));
    }
    {
        request_scope req(*this, request_id);
        if (interrupt_requested()) {
            throw interrupted_error("interrupted before the decode: nothing was produced or committed");
        }
    }
    const auto out = produce_impl(bs);
    std::vector<branch *> go;
    std::vector<llama_token> toks;
    for (size_t i = 0; i < bs.size(); ++i) {
        const llama_token t = out[i];
        if (t != LLAMA_TOKEN_NULL && !llama_vocab_is_eog(model_->vocab(), t)) {
            go.push_back(bs[i]);
            toks.push_back(t);
        }
    }
    commit_impl(go, toks, request_id);
    return produce_result(out);
}

void Context::prefill(py::handle items_obj, uint64_t request_id) {
    busy_guard busy(*this);
    decode_us_ = 0;
    branch_store & st = store();
    struct item {
        branch * b;
        std::vector<llama_token> toks;
    };
    std::vector<item> items;
    std::unordered_set<branch *> seen;
    for (const py::object & it : sequence_items(items_obj, "prefill items")) {
        auto [h, t] = pair_items(it, "prefill items");
        branch & b = distinct_branch(st, h, seen, "prefill");
        std::vector<llama_token> toks = tokens_from_py(t, *model_);
        if (!toks.empty()) {
            items.push_back({&b, std::move(toks)});
        }
    }
    if (items.empty()) {
        return;
    }

    // First-fit packing of whole items into n_batch chunks; an item longer than n_batch gets chunks of
    // its own, appended in order (its pieces must reach the cache in position order).
    struct piece {
        size_t item;
        size_t off;
        size_t n;
    };
    std::vector<std::vector<piece>> chunks;
    std::vector<size_t> fill;
    std::vector<size_t> last_chunk(items.size());
    for (size_t k = 0; k < items.size(); ++k) {
        const size_t len = items[k].toks.size();
        if (len > n_batch_) {
            for (size_t off = 0; off < len; off += n_batch_) {
                const size_t m = std::min<size_t>(n_batch_, len - off);
                chunks.push_back({piece{k, off, m}});
                fill.push_back(m);
            }
            last_chunk[k] = chunks.size() - 1;
            continue;
        }
        size_t c = 0;
        while (c < chunks.size() && fill[c] + len > n_batch_) {
            ++c;
        }
        if (c == chunks.size()) {
            chunks.emplace_back();
            fill.push_back(0);
        }
        chunks[c].push_back(piece{k, 0, len});
        fill[c] += len;
        last_chunk[k] = c;
    }

    const size_t n_vocab = static_cast<size_t>(model_->n_vocab());
    std::vector<std::vector<float>> stash(items.size());  // rows of items done before the last chunk
    std::vector<int32_t> final_idx(items.size(), -1);      // batch index of rows in the last chunk
    request_scope req(*this, request_id);
    gil_release nogil;
    llama_memory_t mem = llama_get_memory(ctx_);
    auto rollback = [&] {
        for (const item & it : items) {
            llama_memory_seq_rm(mem, it.b->seq, it.b->position, -1);
        }
    };
    for (size_t c = 0; c < chunks.size(); ++c) {
        if (interrupt_requested()) {
            rollback();
            throw interrupted_error("interrupted: nothing was prefilled");
        }
        int32_t j = 0;
        for (const piece & p : chunks[c]) {
            const item & it = items[p.item];
            for (size_t i = 0; i < p.n; ++i, ++j) {
                put(static_cast<size_t>(j), it.toks[p.off + i], it.b->position + static_cast<llama_pos>(p.off + i),
                    it.b->seq, p.off + i + 1 == it.toks.size());
            }
        }
        const uint64_t mark = log_mark();
        const int32_t ret = decode_batch(j);
        if (ret != 0) {
            rollback();
            throw_decode_failure(ret, static_cast<size_t>(j), mark);
        }
        j = 0;
        for (const piece & p : chunks[c]) {
            const item & it = items[p.item];
            const size_t last = p.off + p.n;
            j += static_cast<int32_t>(p.n);
            if (last != it.toks.size()) {
                continue;
            }
            if (c + 1 == chunks.size()) {
                final_idx[p.item] = j - 1;
                continue;
            }
            const float * row = llama_get_logits_ith(ctx_, j - 1);
            if (row == nullptr) {
                rollback();
                throw lloyal_error("llama.cpp returned no logits for a prefilled item: nothing was changed");
            }
            stash[p.item].assign(row, row + n_vocab);
        }
    }
    std::vector<const float *> rows(items.size());
    for (size_t k = 0; k < items.size(); ++k) {
        rows[k] = final_idx[k] >= 0 ? llama_get_logits_ith(ctx_, final_idx[k]) : stash[k].data();
        if (rows[k] == nullptr) {
            rollback();
            throw lloyal_error("llama.cpp returned no logits for a prefilled item: nothing was changed");
        }
    }
    for (size_t k = 0; k < items.size(); ++k) {
        branch & b = *items[k].b;
        b.position += static_cast<llama_pos>(items[k].toks.size());
        b.lineage.back().p1 = b.position;
        write_snapshot(b, rows[k]);
    }
}

void Context::clear_and_reseed(py::handle sinks_obj, py::handle tail_obj, uint64_t request_id) {
    busy_guard busy(*this);
    decode_us_ = 0;
    branch_store & st = store();
    std::vector<llama_token> toks = tokens_from_py(sinks_obj, *model_);
    const std::vector<llama_token> tail = tokens_from_py(tail_obj, *model_);
    toks.insert(toks.end(), tail.begin(), tail.end());
    if (toks.empty()) {
        throw std::invalid_argument("clear_and_reseed needs sinks or tail tokens: both are empty");
    }
    if (st.n_branches() != 1 || st.n_detached() != 0) {
        throw branch_error("clear_and_reseed needs exactly one live branch and no detached sequences (there are " +
                           std::to_string(st.n_branches()) + " branches, " + std::to_string(st.n_detached()) +
                           " detached)");
    }
    branch & b = st.get(st.handles().front());
    llama_memory_t mem = llama_get_memory(ctx_);
    request_scope req(*this, request_id);
    gil_release nogil;
    if (interrupt_requested()) {
        throw interrupted_error("interrupted before the clear: nothing was changed");
    }
    // A copy of the branch's cells, put back if the reseed fails: all or nothing.
    std::vector<uint8_t> backup;
    if (llama_memory_seq_pos_max(mem, b.seq) >= 0) {
        backup.resize(llama_state_seq_get_size(ctx_, b.seq));
        backup.resize(llama_state_seq_get_data(ctx_, backup.data(), backup.size(), b.seq));
        if (backup.empty()) {
            throw context_error("could not copy the branch's state before clearing: nothing was changed");
        }
    }
    auto restore = [&] {
        llama_memory_clear(mem, true);
        if (!backup.empty() && llama_state_seq_set_data(ctx_, backup.data(), backup.size(), b.seq) == 0) {
            // Cannot happen short of memory corruption: the same cells fitted a moment ago.
            b.position = 0;
            b.fork_head = 0;
            b.has_logits = false;
            b.lineage = {{st.new_origin(), 0, 0}};
            throw context_error("clear_and_reseed failed and the branch's cells could not be restored: it is empty now");
        }
    };
    llama_memory_clear(mem, true);
    const int32_t n = static_cast<int32_t>(toks.size());
    int32_t last_idx = -1;
    for (int32_t i = 0; i < n;) {
        if (interrupt_requested()) {
            restore();
            throw interrupted_error("interrupted: the branch was restored, nothing was changed");
        }
        const int32_t m = std::min<int32_t>(static_cast<int32_t>(n_batch_), n - i);
        for (int32_t j = 0; j < m; ++j) {
            put(static_cast<size_t>(j), toks[static_cast<size_t>(i + j)], i + j, b.seq, i + j == n - 1);
        }
        const uint64_t mark = log_mark();
        const int32_t ret = decode_batch(m);
        if (ret != 0) {
            restore();
            throw_decode_failure(ret, static_cast<size_t>(m), mark);
        }
        last_idx = m - 1;
        i += m;
    }
    const float * row = llama_get_logits_ith(ctx_, last_idx);
    if (row == nullptr) {
        restore();
        throw lloyal_error("llama.cpp returned no logits after the reseed: the branch was restored");
    }
    b.position = n;
    b.fork_head = 0;
    b.lineage = {{st.new_origin(), 0, n}};
    write_snapshot(b, row);
}

void register_branches(py::class_<Context, std::shared_ptr<Context>> & cls) {
    cls.def("branch_create", &Context::branch_create, py::arg("logits"), py::arg("params"),
            py::arg("grammar") = py::none())
        .def("branch_adopt", &Context::branch_adopt, py::arg("seq"), py::arg("logits"), py::arg("params"),
             py::arg("grammar") = py::none())
        .def("branch_fork", &Context::branch_fork, py::arg("src"), py::arg("logits"))
        .def("branch_prune", &Context::branch_prune, py::arg("branch"), py::arg("subtree") = false)
        .def("branch_retain_only", &Context::branch_retain_only, py::arg("branch"))
        .def("branch_detach", &Context::branch_detach, py::arg("branch"))
        .def("branch_info", &Context::branch_info, py::arg("branch"))
        .def("branches", &Context::branches)
        .def("branch_set_params", &Context::branch_set_params, py::arg("branch"), py::arg("params"))
        .def("branch_set_grammar", &Context::branch_set_grammar, py::arg("branch"), py::arg("grammar"))
        .def("branch_set_logit_bias", &Context::branch_set_logit_bias, py::arg("branch"), py::arg("bias"))
        .def("branch_reseed", &Context::branch_reseed, py::arg("branch"), py::arg("seed"))
        .def("branch_set_logits", &Context::branch_set_logits, py::arg("branch"), py::arg("logits"))
        .def("branch_merge_logits", &Context::branch_merge_logits, py::arg("dst"), py::arg("experts"),
             py::arg("alpha"))
        .def("produce", &Context::produce, py::arg("branches"))
        .def("commit", &Context::commit, py::arg("pairs"), py::arg("request_id") = 0)
        .def("prefill", &Context::prefill, py::arg("items"), py::arg("request_id") = 0)
        .def("step", &Context::step, py::arg("branches"), py::arg("request_id") = 0)
        .def("clear_and_reseed", &Context::clear_and_reseed, py::arg("sinks"), py::arg("tail"),
             py::arg("request_id") = 0);
}

}  // namespace lloyal
