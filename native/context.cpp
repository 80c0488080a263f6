#include "common.hpp"
#include "branch.hpp"
#include "context.hpp"
#include "errors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <set>
#include <string_view>

#include <unistd.h>

namespace lloyal {

namespace {

const std::set<std::string> & known_context_keys() {
    static const std::set<std::string> keys = {
        "n_ctx",      "n_batch",         "n_ubatch", "n_threads", "n_threads_batch", "n_seq_max", "embeddings",
        "rope_freq_base", "rope_freq_scale", "type_k", "type_v",  "swa_full",        "flash_attn",
    };
    return keys;
}

int64_t ctx_int(const py::dict & d, const char * key, int64_t lo, int64_t hi) {
    return dict_int<context_error, context_error>(d, key, lo, hi, key);
}

float ctx_float(const py::dict & d, const char * key) {
    py::object v = d[key];
    if (PyBool_Check(v.ptr()) || PyUnicode_Check(v.ptr())) {
        throw context_error(std::string(key) + " must be a number");
    }
    const double x = PyFloat_AsDouble(v.ptr());
    if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        throw context_error(std::string(key) + " must be a number");
    }
    if (!std::isfinite(x) || x < 0.0 || x > std::numeric_limits<float>::max()) {
        throw context_error(std::string(key) + " must be a finite number >= 0 (0: the model's value)");
    }
    return static_cast<float>(x);
}

bool ctx_bool(const py::dict & d, const char * key) {
    py::object v = d[key];
    if (!PyBool_Check(v.ptr())) {
        throw context_error(std::string(key) + " must be a bool");
    }
    return v.ptr() == Py_True;
}

ggml_type ctx_cache_type(const py::dict & d, const char * key) {
    py::object v = d[key];
    if (!PyUnicode_Check(v.ptr())) {
        throw context_error(std::string(key) + " must be a ggml type name such as \"f16\" or \"q8_0\"");
    }
    const std::string name = v.cast<std::string>();
    // The cache types llama.cpp's own tools accept.
    static const ggml_type allowed[] = {GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                        GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1};
    std::string names;
    for (ggml_type t : allowed) {
        if (name == ggml_type_name(t)) {
            return t;
        }
        names += names.empty() ? "" : ", ";
        names += ggml_type_name(t);
    }
    throw context_error(std::string(key) + " '" + name + "' is not a KV cache type (one of: " + names + ")");
}

std::string model_meta(const llama_model * model, const std::string & key) {
    char buf[128];
    const int32_t n = llama_model_meta_val_str(model, key.c_str(), buf, sizeof(buf));
    if (n < 0 || static_cast<size_t>(n) >= sizeof(buf)) {
        return {};
    }
    return std::string(buf, static_cast<size_t>(n));
}

// Upper bound of the KV cache's size, for refusing an n_ctx whose cache could never fit: on the CPU
// the allocation itself may well succeed (overcommit) and the process die later, touching the pages.
double kv_cache_bytes_estimate(const llama_model * model, uint64_t n_ctx, ggml_type type_k, ggml_type type_v) {
    const std::string arch = model_meta(model, "general.architecture");
    const int64_t n_head = std::max<int32_t>(1, llama_model_n_head(model));
    const int64_t n_head_kv = std::max<int32_t>(1, llama_model_n_head_kv(model));
    int64_t k_len = llama_model_n_embd(model) / n_head;
    int64_t v_len = k_len;
    if (!arch.empty()) {
        const std::string kl = model_meta(model, arch + ".attention.key_length");
        const std::string vl = model_meta(model, arch + ".attention.value_length");
        if (!kl.empty()) {
            k_len = std::max<int64_t>(1, std::atoll(kl.c_str()));
        }
        if (!vl.empty()) {
            v_len = std::max<int64_t>(1, std::atoll(vl.c_str()));
        }
    }
    const double k_bytes = static_cast<double>(ggml_type_size(type_k)) / static_cast<double>(ggml_blck_size(type_k));
    const double v_bytes = static_cast<double>(ggml_type_size(type_v)) / static_cast<double>(ggml_blck_size(type_v));
    return static_cast<double>(n_ctx) * static_cast<double>(llama_model_n_layer(model)) *
           static_cast<double>(n_head_kv) * (static_cast<double>(k_len) * k_bytes + static_cast<double>(v_len) * v_bytes);
}

double physical_memory_bytes() {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page_size = ::sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page_size <= 0) {
        return 0.0;
    }
    return static_cast<double>(pages) * static_cast<double>(page_size);
}

}  // namespace

Context::busy_guard::busy_guard(Context & c) : c_(c) {
    if (c_.busy_.exchange(true, std::memory_order_acquire)) {
        throw lloyal_error("the context is busy: another call on it is still running");
    }
}

Context::busy_guard::~busy_guard() { c_.busy_.store(false, std::memory_order_release); }

Context::Context(std::shared_ptr<Model> model, const py::dict & params) : model_(std::move(model)) {
    if (!model_) {
        throw context_error("model is None");
    }
    if (model_->vocab_only()) {
        throw context_error("the model was loaded with vocab_only=True: it has no weights to run");
    }
    for (auto item : params) {
        if (!PyUnicode_Check(item.first.ptr())) {
            throw context_error("context params keys must be str");
        }
        const std::string key = item.first.cast<std::string>();
        if (known_context_keys().count(key) == 0) {
            throw context_error("unknown context param '" + key + "'");
        }
    }
    auto has = [&](const char * key) { return params.contains(key) && !params[key].is_none(); };
    constexpr int64_t i32_max = std::numeric_limits<int32_t>::max();

    llama_context_params cp = llama_context_default_params();
    const llama_model * lm = model_->get();
    if (has("n_ctx")) {
        cp.n_ctx = static_cast<uint32_t>(ctx_int(params, "n_ctx", 0, i32_max));
    }
    if (has("n_batch")) {
        cp.n_batch = static_cast<uint32_t>(ctx_int(params, "n_batch", 1, i32_max));
    }
    if (has("n_ubatch")) {
        cp.n_ubatch = static_cast<uint32_t>(ctx_int(params, "n_ubatch", 1, i32_max));
    }
    // More threads than ggml can run would only fail deeper down.
    cp.n_threads = default_threads();
    if (has("n_threads")) {
        cp.n_threads = static_cast<int32_t>(ctx_int(params, "n_threads", 1, GGML_MAX_N_THREADS));
    }
    cp.n_threads_batch = cp.n_threads;
    if (has("n_threads_batch")) {
        cp.n_threads_batch = static_cast<int32_t>(ctx_int(params, "n_threads_batch", 1, GGML_MAX_N_THREADS));
    }
    if (has("n_seq_max")) {
        cp.n_seq_max = static_cast<uint32_t>(
            ctx_int(params, "n_seq_max", 1, static_cast<int64_t>(llama_max_parallel_sequences())));
    }
    if (has("embeddings")) {
        cp.embeddings = ctx_bool(params, "embeddings");
    }
    if (has("rope_freq_base")) {
        cp.rope_freq_base = ctx_float(params, "rope_freq_base");
    }
    if (has("rope_freq_scale")) {
        cp.rope_freq_scale = ctx_float(params, "rope_freq_scale");
    }
    if (has("type_k")) {
        cp.type_k = ctx_cache_type(params, "type_k");
    }
    if (has("type_v")) {
        cp.type_v = ctx_cache_type(params, "type_v");
    }
    cp.swa_full = true;
    if (has("swa_full")) {
        cp.swa_full = ctx_bool(params, "swa_full");
    }
    swa_full_ = cp.swa_full;
    if (has("flash_attn")) {
        py::object fa = params["flash_attn"];
        if (PyBool_Check(fa.ptr())) {
            cp.flash_attn_type = fa.ptr() == Py_True ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        } else if (PyUnicode_Check(fa.ptr())) {
            const std::string v = fa.cast<std::string>();
            if (v == "auto") {
                cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
            } else if (v == "on") {
                cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
            } else if (v == "off") {
                cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            } else {
                throw context_error("flash_attn must be \"auto\", \"on\" or \"off\", got '" + v + "'");
            }
        } else {
            throw context_error("flash_attn must be \"auto\", \"on\" or \"off\"");
        }
    }
    // Only sequence 0 is ever decoded here; a unified cache lets it use all of n_ctx.
    cp.kv_unified = true;
    cp.no_perf = true;

    const int32_t n_ctx_train = llama_model_n_ctx_train(lm);
    uint64_t n_ctx_eff = cp.n_ctx == 0 ? static_cast<uint64_t>(std::max(n_ctx_train, 0)) : cp.n_ctx;
    n_ctx_eff = (n_ctx_eff + 255) / 256 * 256;  // llama.cpp pads n_ctx to 256
    if (n_ctx_eff == 0) {
        throw context_error("n_ctx is 0 and the model does not say its training context length: pass n_ctx");
    }
    if (n_ctx_eff > static_cast<uint64_t>(i32_max)) {
        throw context_error("n_ctx " + std::to_string(n_ctx_eff) + " does not fit llama.cpp's int32 positions");
    }
    // llama.cpp reserves one output row per sequence within n_batch (itself at most n_ctx) and aborts the
    // process when they do not fit.
    const uint64_t n_batch_eff = std::min<uint64_t>(cp.n_batch, n_ctx_eff);
    if (cp.n_seq_max > n_batch_eff) {
        throw context_error("n_seq_max " + std::to_string(cp.n_seq_max) + " needs n_batch >= n_seq_max (n_batch is " +
                            std::to_string(n_batch_eff) + ")");
    }
    if (std::string_view(LLOYAL_VARIANT_NAME) == "cpu") {
        const double need = kv_cache_bytes_estimate(lm, n_ctx_eff, cp.type_k, cp.type_v);
        const double have = physical_memory_bytes();
        if (have > 0.0 && need > have) {
            char msg[256];
            std::snprintf(msg, sizeof(msg),
                          "n_ctx %llu needs about %.1f GiB of KV cache, more than this machine's %.1f GiB of memory",
                          static_cast<unsigned long long>(n_ctx_eff), need / (1u << 30), have / (1u << 30));
            throw context_error(msg);
        }
    }

    const uint64_t mark = log_mark();
    {
        gil_release nogil;
        ctx_ = llama_init_from_model(model_->get(), cp);
    }
    if (ctx_ == nullptr) {
        throw context_error("failed to create the llama context" + log_reason_since(mark));
    }

    // llama.cpp rounds the cache up to a multiple of 256 cells; the context still holds what was asked
    // for (n_ctx 64 means 64 tokens), the extra cells are left unused.
    const uint32_t asked = cp.n_ctx == 0 ? static_cast<uint32_t>(std::max(n_ctx_train, 1)) : cp.n_ctx;
    n_ctx_ = std::min(llama_n_ctx(ctx_), asked);
    n_ctx_seq_ = std::min(llama_n_ctx_seq(ctx_), asked);
    n_batch_ = llama_n_batch(ctx_);
    n_ubatch_ = llama_n_ubatch(ctx_);
    n_seq_max_ = llama_n_seq_max(ctx_);
    n_threads_ = llama_n_threads(ctx_);
    n_threads_batch_ = llama_n_threads_batch(ctx_);
    n_swa_ = llama_model_n_swa(lm);
    n_cells_ = llama_n_ctx(ctx_);

    batch_ = llama_batch_init(static_cast<int32_t>(n_batch_), 0, 1);
    llama_set_abort_callback(ctx_, &Context::abort_callback, this);
}

Context::~Context() {
    store_.reset();  // the branches' buffer exports, released while the GIL is held (it is, here)
    llama_batch_free(batch_);
    if (ctx_ != nullptr) {
        llama_free(ctx_);
    }
}

bool Context::abort_callback(void * data) {
    auto * self = static_cast<Context *>(data);
    if (!self->interrupt_requested()) {
        return false;
    }
    // ggml may ask again (from another compute thread) before llama_decode returns.
    if (!self->aborting_.exchange(true, std::memory_order_relaxed)) {
        log_abort_begin();
    }
    return true;
}

bool Context::interrupt_requested() const {
    const uint64_t id = current_request_.load(std::memory_order_acquire);
    if (id == 0 || interrupt_word_ == nullptr) {
        return false;
    }
    // The word lives in memory another process writes (shared memory): an atomic load, which the
    // GCC/Clang builtin gives on plain uint64_t storage (std::atomic_ref is C++20).
    return __atomic_load_n(interrupt_word_, __ATOMIC_ACQUIRE) == id;
}

void Context::set_interrupt_word(const py::object & control, int64_t index) {
    busy_guard busy(*this);
    if (control.is_none()) {
        // Detach: releases the buffer export (a SharedMemory cannot close while one is held).
        interrupt_word_ = nullptr;
        control_.reset();
        return;
    }
    if (index < 0) {
        throw std::invalid_argument("index must be >= 0");
    }
    auto buf = std::make_unique<held_buffer>(control, false);
    if (static_cast<uint64_t>(index) >= buf->size() / 8) {
        throw std::invalid_argument("index " + std::to_string(index) + " is past the end of a " +
                                    std::to_string(buf->size()) + "-byte buffer");
    }
    auto * word = reinterpret_cast<uint64_t *>(static_cast<char *>(buf->data()) + static_cast<size_t>(index) * 8);
    if (reinterpret_cast<uintptr_t>(word) % alignof(uint64_t) != 0) {
        throw std::invalid_argument("the interrupt word is not 8-byte aligned");
    }
    interrupt_word_ = word;
    control_ = std::move(buf);
}

size_t Context::n_past() const {
    std::lock_guard<std::mutex> lock(history_mu_);
    return history_.size();
}

std::vector<llama_token> Context::tokens() const {
    std::lock_guard<std::mutex> lock(history_mu_);
    return history_;
}

void Context::set_history_size(size_t n) {
    fresh_upto_ = std::min(fresh_upto_, n);
    std::lock_guard<std::mutex> lock(history_mu_);
    history_.resize(n);
}

size_t Context::ubatch_floor(size_t pos) const {
    // A decode from position 0 in n_batch chunks, each split by llama.cpp into n_ubatch pieces,
    // starts its ubatches at k*n_batch + j*n_ubatch.
    const size_t chunk = pos / n_batch_ * n_batch_;
    return chunk + (pos - chunk) / n_ubatch_ * n_ubatch_;
}

size_t Context::reuse_point(size_t n_keep_max) const {
    // llama.cpp's CPU kernels are not batch-invariant: a row's result depends on which ubatch it was
    // computed in (e.g. the repacked Q4_K matmul runs groups of 4 rows through a GEMM and the rest
    // through a GEMV). Re-decoding only the tail of a cached prompt would therefore give slightly
    // different logits than decoding the prompt afresh, and a different greedy continuation now and
    // then. When the cache before the ubatch holding n_keep_max was computed exactly as a fresh decode
    // would have, going back to that ubatch's start (fewer than n_ubatch extra tokens) makes reusing
    // the cache result-neutral. Otherwise (e.g. generated tokens, decoded one at a time, lie before it)
    // the result cannot match a fresh decode anyway, and all of the prefix is kept.
    const size_t start = ubatch_floor(n_keep_max);
    return start <= fresh_upto_ ? start : n_keep_max;
}

void Context::append_history(const llama_token * toks, size_t n) {
    std::lock_guard<std::mutex> lock(history_mu_);
    history_.insert(history_.end(), toks, toks + n);
}

void Context::reset() {
    busy_guard busy(*this);
    drop_branches();
    llama_memory_clear(llama_get_memory(ctx_), true);
    set_history_size(0);
    has_logits_ = false;
}

size_t Context::truncate_to(size_t n) {
    llama_memory_t mem = llama_get_memory(ctx_);
    if (n > 0 && n >= history_.size() && llama_memory_seq_pos_max(mem, 0) < static_cast<llama_pos>(n)) {
        return history_.size();  // nothing past n: the cache is what a plain continuation has
    }
    has_logits_ = false;
    bool ok = n == 0 || llama_memory_seq_rm(mem, 0, static_cast<llama_pos>(n), -1);
    if (ok && n > 0) {
        // An SWA cache without swa_full keeps only the last n_swa positions; continuing at position n
        // needs those before n, which may have been dropped already.
        const llama_pos pos_min = llama_memory_seq_pos_min(mem, 0);
        const llama_pos need = std::max<llama_pos>(0, static_cast<llama_pos>(n) - n_swa_);
        ok = pos_min >= 0 && pos_min <= need;
    }
    if (!ok || n == 0) {
        llama_memory_clear(mem, true);
        n = 0;
    }
    set_history_size(n);
    return n;
}

int32_t Context::decode_raw(int32_t n) {
    batch_.n_tokens = n;
    const int32_t ret = llama_decode(ctx_, batch_);
    if (aborting_.exchange(false, std::memory_order_relaxed)) {
        log_abort_end();
    }
    return ret;
}

bool Context::decode_tokens(const llama_token * toks, size_t n, bool want_logits) {
    if (n == 0) {
        return true;
    }
    has_logits_ = false;
    for (size_t i = 0; i < n;) {
        if (interrupt_requested()) {
            return false;
        }
        const size_t pos0 = history_.size();
        // Chunks end at multiples of n_batch counted from position 0, as in a decode from scratch, so
        // the ubatches (and so the numerics) after a reuse point are those of a fresh decode.
        const size_t chunk_end = (pos0 / n_batch_ + 1) * n_batch_;
        const size_t m = std::min<size_t>(n - i, chunk_end - pos0);
        const bool last_chunk = i + m == n;
        for (size_t j = 0; j < m; ++j) {
            put(j, toks[i + j], static_cast<llama_pos>(pos0 + j), 0, want_logits && last_chunk && j == m - 1);
        }
        const int32_t ret = decode_raw(static_cast<int32_t>(m));
        if (ret == 0) {
            if (pos0 == fresh_upto_ && ubatch_floor(pos0) == pos0) {
                // A complete chunk is exactly a fresh decode's; of a partial one only the full ubatches
                // are (a fresh decode of a longer prompt would fill the last one up).
                fresh_upto_ = pos0 + m == chunk_end ? chunk_end : pos0 + m / n_ubatch_ * n_ubatch_;
            }
            append_history(toks + i, m);
            i += m;
            continue;
        }
        // On abort and on fatal errors the ubatches already computed stay in the KV cache: trim
        // them so the cache holds exactly the committed history. (1 and -1 leave it untouched.)
        if (ret == 2) {
            truncate_to(pos0);
            return false;
        }
        if (ret == 1) {
            throw decode_error("llama_decode found no KV slot for a batch of " + std::to_string(m) +
                               " tokens (n_ctx " + std::to_string(n_ctx_) + ", n_past " + std::to_string(pos0) + ")");
        }
        if (ret == -1) {
            throw decode_error("llama_decode rejected the batch as invalid");
        }
        truncate_to(pos0);
        throw decode_error("llama_decode failed (" + std::to_string(ret) + ")");
    }
    has_logits_ = want_logits;
    return true;
}

py::dict Context::eval(py::handle tokens, uint64_t request_id) {
    busy_guard busy(*this);
    require_sequence_mode("eval");
    const std::vector<llama_token> toks = tokens_from_py(tokens, *model_);
    const size_t before = history_.size();
    const size_t room = n_ctx_seq_ > before ? n_ctx_seq_ - before : 0;
    if (toks.size() > room) {
        throw context_overflow_error(std::to_string(toks.size()) + " tokens do not fit: n_ctx " +
                                     std::to_string(n_ctx_seq_) + ", n_past " + std::to_string(before) + ", room " +
                                     std::to_string(room));
    }
    bool done = true;
    const int64_t t0 = now_us();
    {
        request_scope req(*this, request_id);
        gil_release nogil;
        done = decode_tokens(toks.data(), toks.size(), true);
    }
    const int64_t t1 = now_us();
    const size_t after = history_.size();
    py::dict r;
    r["n_tokens"] = after > before ? after - before : 0;
    r["n_past"] = after;
    r["interrupted"] = !done;
    r["prompt_ms"] = elapsed_ms(t0, t1);
    return r;
}

void Context::logits_into(const py::object & out) {
    busy_guard busy(*this);
    if (!has_logits_) {
        throw lloyal_error("no logits: nothing has been decoded since the context was created, reset or interrupted");
    }
    held_buffer buf(out, true);
    const size_t need = static_cast<size_t>(model_->n_vocab()) * sizeof(float);
    if (buf.size() < need) {
        throw std::invalid_argument("logits buffer has " + std::to_string(buf.size()) + " bytes, needs " +
                                    std::to_string(need) + " (n_vocab float32)");
    }
    const float * logits = llama_get_logits_ith(ctx_, -1);
    if (logits == nullptr) {
        throw lloyal_error("llama.cpp has no logits for the last position");
    }
    std::memcpy(buf.data(), logits, need);
}

void register_context(py::module_ & m) {
    py::class_<Context, std::shared_ptr<Context>> cls(m, "Context");
    cls
        .def(py::init<std::shared_ptr<Model>, const py::dict &>(), py::arg("model"), py::arg("params"))
        .def_property_readonly("n_ctx", &Context::n_ctx)
        .def_property_readonly("n_batch", &Context::n_batch)
        .def_property_readonly("n_ubatch", &Context::n_ubatch)
        .def_property_readonly("n_seq_max", &Context::n_seq_max)
        .def_property_readonly("n_threads", &Context::n_threads)
        .def_property_readonly("n_threads_batch", &Context::n_threads_batch)
        .def_property_readonly("last_decode_ms", &Context::last_decode_ms)
        .def_property_readonly("model", &Context::model)
        .def("set_interrupt_word", &Context::set_interrupt_word, py::arg("control"), py::arg("index") = 0)
        .def("n_past", &Context::n_past)
        .def("tokens", &Context::tokens)
        .def("reset", &Context::reset)
        .def("eval", &Context::eval, py::arg("tokens"), py::arg("request_id") = 0)
        .def("logits_into", &Context::logits_into, py::arg("out"))
        .def("generate", &Context::generate, py::arg("prompt"), py::arg("params"), py::arg("request_id") = 0,
             py::arg("on_piece") = py::none());
    register_branches(cls);
    register_kv(cls);
}

}  // namespace lloyal
