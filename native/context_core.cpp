#include "context_core.hpp"
#include "devices.hpp"
#include "heartbeat.hpp"
#include "errors.hpp"
#include "llama-context.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string_view>

#include <unistd.h>

namespace lloyal {

namespace {

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

context_core::busy_guard::busy_guard(context_core & c) : c_(c) {
    if (c_.busy_.exchange(true, std::memory_order_acquire)) {
        throw lloyal_error("the context is busy: another call on it is still running");
    }
}

context_core::busy_guard::~busy_guard() { c_.busy_.store(false, std::memory_order_release); }

context_core::context_core(std::shared_ptr<Model> model, const llama_context_params & params,
                           std::shared_ptr<region_arena> arena, bool batch_invariant)
    : model_(std::move(model)), arena_(std::move(arena)) {
    if (model_->vocab_only()) {
        throw context_error("the model was loaded with vocab_only=True: it has no weights to run");
    }
    if (batch_invariant && model_->repack()) {
        throw context_error("batch_invariant needs the model loaded with repack=False: the kernels of repacked "
                            "weights compute a row differently by the rows beside it");
    }
    if (batch_invariant && (model_->n_gpu_layers() != 0 || gpu_device_count() > 0)) {
        throw context_error("batch_invariant is a CPU mode: the model has layers on a GPU, or the worker's variant "
                            "has a GPU");
    }
    llama_context_params cp = params;
    // Branches and detached sequences share one cache: a unified cache lets any sequence use all of it. A
    // batch-invariant context gives each sequence a stream of its own instead: flash attention visits a
    // row's cells in cache order, and only a stream of one sequence keeps that order its positions' order
    // (in a shared cache, new cells fill whatever holes other sequences left).
    cp.kv_unified = !batch_invariant;
    kv_unified = cp.kv_unified;
    cp.no_perf = true;
    const llama_model * lm = model_->get();
    constexpr int64_t i32_max = std::numeric_limits<int32_t>::max();
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
    if (!cp.embeddings && cp.pooling_type != LLAMA_POOLING_TYPE_UNSPECIFIED) {
        throw context_error("pooling applies to embedding contexts: pass embeddings=True as well");
    }
    if (cp.embeddings) {
        const std::string arch = model_meta(lm, "general.architecture");
        const std::string declared = arch.empty() ? std::string() : model_meta(lm, arch + ".pooling_type");
        if (cp.pooling_type == LLAMA_POOLING_TYPE_UNSPECIFIED && declared.empty()) {
            // llama.cpp would fall back to no pooling (a vector per token); one vector per text is what
            // an embedding context is asked for far more often.
            cp.pooling_type = LLAMA_POOLING_TYPE_MEAN;
        }
        // Without a classification head llama.cpp's rank pooling reads stray hidden-state values as scores.
        if (cp.pooling_type == LLAMA_POOLING_TYPE_RANK && declared != std::to_string(LLAMA_POOLING_TYPE_RANK)) {
            throw context_error("pooling 'rank' needs a reranker: a model whose GGUF declares pooling type rank "
                                "(it has a classification head); this one does not");
        }
    }
    if (cp.n_seq_max > n_batch_eff) {
        throw context_error("n_seq_max " + std::to_string(cp.n_seq_max) + " needs n_batch >= n_seq_max (n_batch is " +
                            std::to_string(n_batch_eff) + ")");
    }
    if (gpu_device_count() == 0) {
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
    logits_ = arena_->alloc(static_cast<size_t>(model_->n_vocab()) * sizeof(float));

    const uint64_t mark = log_mark();
    ctx_ = llama_init_from_model(model_->get(), cp);
    if (ctx_ == nullptr) {
        throw context_error("failed to create the llama context" + log_reason_since(mark));
    }

    if (batch_invariant) {
        make_batch_invariant();
    }
    // llama.cpp rounds the cache up to a multiple of 256 cells; the context still holds what was asked
    // for (n_ctx 64 means 64 tokens), the extra cells are left unused in sequence mode.
    const uint32_t asked = cp.n_ctx == 0 ? static_cast<uint32_t>(std::max(n_ctx_train, 1)) : cp.n_ctx;
    n_ctx = std::min(llama_n_ctx(ctx_), asked);
    n_ctx_seq = std::min(llama_n_ctx_seq(ctx_), asked);
    n_batch = llama_n_batch(ctx_);
    n_ubatch = llama_n_ubatch(ctx_);
    n_seq_max = llama_n_seq_max(ctx_);
    n_threads = llama_n_threads(ctx_);
    n_threads_batch = llama_n_threads_batch(ctx_);
    governor_.set_wanted(n_threads, n_threads_batch);
    // Elsewhere the decode's work is on a device, and the CPU time of its threads says nothing about it.
    governor_.set_enabled(gpu_device_count() == 0);
    n_swa = llama_model_n_swa(lm);
    n_cells = llama_n_ctx(ctx_);
    swa_full = cp.swa_full;
    embeddings = cp.embeddings;
    pooling = embeddings ? llama_pooling_type(ctx_) : LLAMA_POOLING_TYPE_NONE;

    batch_ = llama_batch_init(static_cast<int32_t>(n_batch), 0, 1);
    llama_set_abort_callback(ctx_, &context_core::abort_callback, this);
}

context_core::~context_core() {
    llama_batch_free(batch_);
    if (ctx_ != nullptr) {
        llama_free(ctx_);
    }
}

void context_core::make_batch_invariant() {
    // ggml's CPU reference path: one kernel per op whatever the batch (no tiled K-quant matmul, no tiled or
    // split-KV flash attention, no fused ops), so a row's logits do not depend on the rows decoded beside
    // it. llama.cpp has no switch for it; the CPU backend exports its setter by name.
    ggml_backend_sched_t sched = ctx_->get_sched();
    bool set = false;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        if (dev == nullptr || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            continue;
        }
        using set_use_ref_fn = void (*)(ggml_backend_t, bool);
        auto fn = reinterpret_cast<set_use_ref_fn>(
            ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_cpu_set_use_ref"));
        if (fn == nullptr) {
            break;
        }
        fn(backend, true);
        set = true;
    }
    if (!set) {
        llama_free(ctx_);
        ctx_ = nullptr;
        throw context_error("batch_invariant: this build's CPU backend has no reference mode");
    }
}

bool context_core::abort_callback(void * data) {
    auto * self = static_cast<context_core *>(data);
    if (!self->interrupt_requested()) {
        return false;
    }
    // ggml may ask again (from another compute thread) before llama_decode returns.
    if (!self->aborting_.exchange(true, std::memory_order_relaxed)) {
        log_abort_begin();
    }
    return true;
}

bool context_core::interrupt_requested() const {
    heartbeat();  // every interrupt check is also a sign of life
    const uint64_t id = current_request_.load(std::memory_order_acquire);
    if (id == 0 || interrupt_word_ == nullptr) {
        return false;
    }
    // The word lives in memory another process writes (shared memory): an atomic load, which the
    // GCC/Clang builtin gives on plain uint64_t storage (std::atomic_ref is C++20).
    return __atomic_load_n(interrupt_word_, __ATOMIC_ACQUIRE) == id;
}

bool context_core::pause_requested() const {
    const uint64_t id = current_request_.load(std::memory_order_acquire);
    if (id == 0 || interrupt_word_ == nullptr) {
        return false;
    }
    return __atomic_load_n(interrupt_word_, __ATOMIC_ACQUIRE) == (id | k_pause_bit);
}

void context_core::set_threads(int32_t n, int32_t n_batch) {
    governor_.set_wanted(n, n_batch);
    llama_set_n_threads(ctx_, n, n_batch);
}

int32_t context_core::decode(int32_t n) {
    const thread_governor::threads t = governor_.before_decode(now_us());
    if (t.n != llama_n_threads(ctx_) || t.n_batch != llama_n_threads_batch(ctx_)) {
        llama_set_n_threads(ctx_, t.n, t.n_batch);
    }
    last_decode_threads_ = n > 1 ? t.n_batch : t.n;
    if (const std::vector<lora_weight> & want = decode_loras_ != nullptr ? *decode_loras_ : loras;
        !same_lora_config(applied_loras_, want)) {
        apply_loras(ctx_, want);
        applied_loras_ = want;
    }
    const int64_t t0 = now_us();
    const cpu_usage use0 = governor_.enabled() ? process_cpu_usage() : cpu_usage{0, 0};
    batch_.n_tokens = n;
    ++n_decodes_;
    const int32_t ret = llama_decode(ctx_, batch_);
    const int64_t t1 = now_us();
    if (governor_.enabled()) {
        const cpu_usage use1 = process_cpu_usage();
        governor_.after_decode(n > 1, t1 - t0, use1.cpu_us - use0.cpu_us, use1.preempted - use0.preempted, t1);
    }
    if (aborting_.exchange(false, std::memory_order_relaxed)) {
        log_abort_end();
    }
    decode_us_ += t1 - t0;
    return ret;
}

void context_core::throw_decode_failure(int32_t ret, size_t n_tokens, uint64_t mark) const {
    if (ret == 2) {
        throw interrupted_error("interrupted: nothing was changed");
    }
    if (ret == 1) {
        throw decode_error("llama_decode found no KV slot for a batch of " + std::to_string(n_tokens) +
                           " tokens (the cache has " + std::to_string(n_cells) + " cells): nothing was changed");
    }
    const std::string why = log_reason_since(mark);
    if (ret == -1) {
        throw decode_error("llama_decode rejected the batch as invalid" + why);
    }
    throw decode_error("llama_decode failed (" + std::to_string(ret) + ")" + why + "; nothing was changed");
}

std::string context_core::why_ranges_cannot_be_removed() const {
    const llama_model * lm = model().get();
    if (llama_model_is_recurrent(lm) || llama_model_is_hybrid(lm)) {
        return "this model's recurrent state cannot drop a range of a sequence";
    }
    if (n_swa > 0 && !swa_full) {
        return "a sliding-window model needs swa_full=True (a window-sized cache may already have dropped the "
               "cells a rollback removes)";
    }
    return {};
}

}  // namespace lloyal
