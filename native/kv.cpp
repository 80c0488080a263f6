// Raw KV sequence operations, KV pressure and per-sequence state (the contract is at the end of
// branch.hpp). Reading works on any sequence; writing only on detached ones, so that a branch's cells
// always match its records and a vacant seq never carries cells a later lease would inherit.
#include "common.hpp"
#include "branch.hpp"
#include "context.hpp"
#include "errors.hpp"

#include <algorithm>
#include <limits>
#include <map>

namespace lloyal {

namespace {

llama_pos pos_arg(py::handle v, const char * what) {
    long long x = 0;
    if (!strict_int(v, what, x) || x < std::numeric_limits<llama_pos>::min() || x > std::numeric_limits<llama_pos>::max()) {
        throw std::invalid_argument(std::string(what) + " does not fit an int32 position");
    }
    return static_cast<llama_pos>(x);
}

}  // namespace

llama_seq_id Context::seq_arg(py::handle seq) const {
    long long s = 0;
    std::string text;
    if (!strict_int(seq, "a sequence id", s, &text) || s < 0 || s >= static_cast<long long>(n_seq_max_)) {
        throw std::invalid_argument("sequence id " + text + " is outside [0, n_seq_max=" + std::to_string(n_seq_max_) +
                                    ")");
    }
    return static_cast<llama_seq_id>(s);
}

void Context::check_raw_write(llama_seq_id seq) {
    if (!history_.empty()) {
        throw context_error("this context holds a sequence-mode history: raw KV writes would put it out of step");
    }
    branch_store & st = store();
    if (const branch * b = st.owner(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " belongs to branch " + std::to_string(b->handle) +
                           ": detach the branch first");
    }
    if (st.is_free(seq)) {
        throw branch_error("sequence " + std::to_string(seq) +
                           " is not leased: raw writes go to detached sequences (branch_detach)");
    }
}

void Context::free_seq(py::handle seq_obj) {
    busy_guard busy(*this);
    const llama_seq_id seq = seq_arg(seq_obj);
    branch_store & st = store();
    if (const branch * b = st.owner(seq)) {
        throw branch_error("sequence " + std::to_string(seq) + " belongs to branch " + std::to_string(b->handle) +
                           ": prune the branch instead");
    }
    if (!st.is_detached(seq)) {
        throw std::invalid_argument("sequence " + std::to_string(seq) + " is not a detached sequence");
    }
    llama_memory_seq_rm(llama_get_memory(ctx_), seq, -1, -1);
    st.release(seq);
}

void Context::kv_seq_cp(py::handle src_obj, py::handle dst_obj, py::handle p0, py::handle p1) {
    busy_guard busy(*this);
    const llama_seq_id src = seq_arg(src_obj);
    const llama_seq_id dst = seq_arg(dst_obj);
    const llama_pos a = pos_arg(p0, "p0");
    const llama_pos b = pos_arg(p1, "p1");
    check_raw_write(dst);
    llama_memory_seq_cp(llama_get_memory(ctx_), src, dst, a, b);
}

void Context::kv_seq_keep(py::handle seq_obj) {
    busy_guard busy(*this);
    const llama_seq_id seq = seq_arg(seq_obj);
    check_raw_write(seq);
    if (store().n_branches() > 0) {
        throw branch_error("kv_seq_keep would empty the sequences of the " + std::to_string(store().n_branches()) +
                           " live branches (branch_retain_only keeps one branch)");
    }
    llama_memory_seq_keep(llama_get_memory(ctx_), seq);
}

bool Context::kv_seq_rm(py::handle seq_obj, py::handle p0, py::handle p1) {
    busy_guard busy(*this);
    const llama_seq_id seq = seq_arg(seq_obj);
    const llama_pos a = pos_arg(p0, "p0");
    const llama_pos b = pos_arg(p1, "p1");
    check_raw_write(seq);
    return llama_memory_seq_rm(llama_get_memory(ctx_), seq, a, b);
}

int32_t Context::kv_seq_pos_min(py::handle seq_obj) {
    busy_guard busy(*this);
    return llama_memory_seq_pos_min(llama_get_memory(ctx_), seq_arg(seq_obj));
}

int32_t Context::kv_seq_pos_max(py::handle seq_obj) {
    busy_guard busy(*this);
    return llama_memory_seq_pos_max(llama_get_memory(ctx_), seq_arg(seq_obj));
}

py::dict Context::kv_pressure() {
    busy_guard busy(*this);
    llama_memory_t mem = llama_get_memory(ctx_);
    uint64_t used = 0;
    uint32_t leased = 0;
    uint32_t room = n_cells_;
    if (branch_mode()) {
        // The union of the branches' lineages: every cell was decoded by one origin at one position.
        std::map<uint64_t, std::vector<std::pair<llama_pos, llama_pos>>> by_origin;
        branch_store & st = store();
        for (uint32_t h : st.handles()) {
            for (const kv_segment & s : st.get(h).lineage) {
                if (s.p1 > s.p0) {
                    by_origin[s.origin].emplace_back(s.p0, s.p1);
                }
            }
        }
        for (auto & [origin, iv] : by_origin) {
            (void) origin;
            std::sort(iv.begin(), iv.end());
            llama_pos end = std::numeric_limits<llama_pos>::min();
            for (const auto & [a, b] : iv) {
                const llama_pos from = std::max(a, end);
                if (b > from) {
                    used += static_cast<uint64_t>(b - from);
                }
                end = std::max(end, b);
            }
        }
        for (llama_seq_id s : st.detached()) {
            used += static_cast<uint64_t>(llama_memory_seq_pos_max(mem, s) + 1);
        }
        leased = st.n_leased();
    } else {
        // Sequence mode holds what was asked for (eval/generate enforce n_ctx, not the padded size).
        room = n_ctx_seq_;
        used = history_.size();
        leased = history_.empty() ? 0 : 1;
    }
    py::dict d;
    d["n_ctx"] = room;
    d["cells_used"] = used;
    d["remaining"] = used >= room ? 0 : room - used;
    d["n_seq_max"] = n_seq_max_;
    d["seqs_leased"] = leased;
    d["seqs_free"] = n_seq_max_ - leased;
    return d;
}

size_t Context::state_seq_size(py::handle seq_obj) {
    busy_guard busy(*this);
    return llama_state_seq_get_size(ctx_, seq_arg(seq_obj));
}

py::bytes Context::state_seq_get(py::handle seq_obj) {
    busy_guard busy(*this);
    const llama_seq_id seq = seq_arg(seq_obj);
    if (llama_memory_seq_pos_max(llama_get_memory(ctx_), seq) < 0) {
        throw context_error("sequence " + std::to_string(seq) + " is empty: no state to save");
    }
    std::string data;
    {
        gil_release nogil;
        data.resize(llama_state_seq_get_size(ctx_, seq));
        data.resize(llama_state_seq_get_data(ctx_, reinterpret_cast<uint8_t *>(data.data()), data.size(), seq));
    }
    if (data.empty()) {
        throw context_error("llama.cpp could not copy the state of sequence " + std::to_string(seq));
    }
    return py::bytes(data);
}

branch * Context::load_target(llama_seq_id seq) {
    if (!history_.empty()) {
        throw context_error("this context holds a sequence-mode history: state loads go to branches or detached "
                            "sequences");
    }
    branch_store & st = store();
    if (branch * b = st.owner(seq)) {
        if (b->position != 0 || !b->children.empty()) {
            throw branch_error("sequence " + std::to_string(seq) + " belongs to branch " + std::to_string(b->handle) +
                               ", which already has cells or children: load into a new branch or a detached sequence");
        }
        return b;
    }
    if (st.is_free(seq)) {
        throw branch_error("sequence " + std::to_string(seq) +
                           " is not leased: load into a new branch or a detached sequence");
    }
    return nullptr;
}

void Context::adopt_loaded(branch * b, llama_seq_id seq) {
    if (b == nullptr) {
        return;
    }
    llama_memory_t mem = llama_get_memory(ctx_);
    const llama_pos lo = std::max<llama_pos>(0, llama_memory_seq_pos_min(mem, seq));
    b->position = llama_memory_seq_pos_max(mem, seq) + 1;
    b->lineage = {{store().new_origin(), lo, b->position}};
    b->has_logits = false;
    b->sample_pending = false;
}

size_t Context::state_seq_set(py::handle seq_obj, py::handle data) {
    busy_guard busy(*this);
    const llama_seq_id seq = seq_arg(seq_obj);
    branch * target = load_target(seq);
    held_buffer buf(data, false);
    llama_memory_t mem = llama_get_memory(ctx_);
    const uint64_t mark = log_mark();
    size_t n = 0;
    {
        gil_release nogil;
        llama_memory_seq_rm(mem, seq, -1, -1);
        try {
            n = llama_state_seq_set_data(ctx_, static_cast<const uint8_t *>(buf.data()), buf.size(), seq);
        } catch (const std::exception &) {
            n = 0;
        }
        if (n == 0) {
            llama_memory_seq_rm(mem, seq, -1, -1);
        }
    }
    if (n == 0) {
        const std::string why = log_reason_since(mark);
        throw context_error("could not load the state into sequence " + std::to_string(seq) +
                            (why.empty() ? " (not a state of this model, or too small a cache)" : why));
    }
    adopt_loaded(target, seq);
    return n;
}

size_t Context::state_seq_save_file(py::handle seq_obj, const std::string & path, py::handle tokens) {
    busy_guard busy(*this);
    const llama_seq_id seq = seq_arg(seq_obj);
    const std::vector<llama_token> toks = tokens_from_py(tokens, *model_);
    if (llama_memory_seq_pos_max(llama_get_memory(ctx_), seq) < 0) {
        throw context_error("sequence " + std::to_string(seq) + " is empty: no state to save");
    }
    const uint64_t mark = log_mark();
    size_t n = 0;
    {
        gil_release nogil;
        try {
            n = llama_state_seq_save_file(ctx_, path.c_str(), seq, toks.data(), toks.size());
        } catch (const std::exception &) {
            n = 0;
        }
    }
    if (n == 0) {
        throw context_error("could not write the state of sequence " + std::to_string(seq) + " to '" + path + "'" +
                            log_reason_since(mark));
    }
    return n;
}

py::tuple Context::state_seq_load_file(py::handle seq_obj, const std::string & path) {
    busy_guard busy(*this);
    const llama_seq_id seq = seq_arg(seq_obj);
    branch * target = load_target(seq);
    llama_memory_t mem = llama_get_memory(ctx_);
    const uint64_t mark = log_mark();
    std::vector<llama_token> toks;
    size_t n = 0;
    {
        gil_release nogil;
        try {
            // First the token count alone (a null tokens_out loads nothing), then everything.
            size_t count = 0;
            if (llama_state_seq_load_file(ctx_, path.c_str(), seq, nullptr, 0, &count) != 0) {
                toks.resize(count);
                llama_memory_seq_rm(mem, seq, -1, -1);
                // A file saved with no tokens still needs a non-null tokens_out: null means "count only",
                // which would report success with nothing loaded.
                llama_token none = LLAMA_TOKEN_NULL;
                llama_token * out = toks.empty() ? &none : toks.data();
                n = llama_state_seq_load_file(ctx_, path.c_str(), seq, out, toks.size(), &count);
                toks.resize(count);
            }
        } catch (const std::exception &) {
            n = 0;
        }
        if (n == 0) {
            llama_memory_seq_rm(mem, seq, -1, -1);
        }
    }
    if (n == 0) {
        throw context_error("could not load the state file '" + path + "' into sequence " + std::to_string(seq) +
                            log_reason_since(mark));
    }
    adopt_loaded(target, seq);
    return py::make_tuple(toks, n);
}

void register_kv(py::class_<Context, std::shared_ptr<Context>> & cls) {
    cls.def("free_seq", &Context::free_seq, py::arg("seq"))
        .def("kv_seq_cp", &Context::kv_seq_cp, py::arg("src"), py::arg("dst"), py::arg("p0"), py::arg("p1"))
        .def("kv_seq_keep", &Context::kv_seq_keep, py::arg("seq"))
        .def("kv_seq_rm", &Context::kv_seq_rm, py::arg("seq"), py::arg("p0"), py::arg("p1"))
        .def("kv_seq_pos_min", &Context::kv_seq_pos_min, py::arg("seq"))
        .def("kv_seq_pos_max", &Context::kv_seq_pos_max, py::arg("seq"))
        .def("kv_pressure", &Context::kv_pressure)
        .def("state_seq_size", &Context::state_seq_size, py::arg("seq"))
        .def("state_seq_get", &Context::state_seq_get, py::arg("seq"))
        .def("state_seq_set", &Context::state_seq_set, py::arg("seq"), py::arg("data"))
        .def("state_seq_save_file", &Context::state_seq_save_file, py::arg("seq"), py::arg("path"),
             py::arg("tokens") = py::list())
        .def("state_seq_load_file", &Context::state_seq_load_file, py::arg("seq"), py::arg("path"));
}

}  // namespace lloyal
