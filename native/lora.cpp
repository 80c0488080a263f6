#include "lora.hpp"

#include "branch.hpp"
#include "context_core.hpp"
#include "errors.hpp"
#include "sequence.hpp"

#include "gguf.h"

#include <cmath>
#include <cstdlib>
#include <memory>

#include <sys/stat.h>

namespace lloyal {

namespace {

using meta_by_index_fn = int32_t (*)(const llama_adapter_lora *, int32_t, char *, size_t);

std::string adapter_meta_string(meta_by_index_fn fn, const llama_adapter_lora * adapter, int32_t i) {
    std::vector<char> buf(256);
    int32_t n = fn(adapter, i, buf.data(), buf.size());
    if (n < 0) {
        return {};
    }
    if (static_cast<size_t>(n) >= buf.size()) {
        buf.resize(static_cast<size_t>(n) + 1);
        n = fn(adapter, i, buf.data(), buf.size());
        if (n < 0) {
            return {};
        }
    }
    return std::string(buf.data(), static_cast<size_t>(n));
}

// llama.cpp reads these keys with gguf getters that abort the process on a value of another type, and
// multiplies lora_a/lora_b as matrices without checking that they are: refuse such files before it
// sees them.
void check_adapter_file(const std::string & path) {
    ggml_context * meta = nullptr;
    gguf_init_params params{};
    params.no_alloc = true;
    params.ctx = &meta;
    const uint64_t mark = log_mark();
    std::unique_ptr<gguf_context, void (*)(gguf_context *)> gguf(gguf_init_from_file(path.c_str(), params),
                                                                 &gguf_free);
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> tensors(meta, &ggml_free);
    if (!gguf) {
        throw lora_error("not a readable GGUF file: '" + path + "'" + log_reason_since(mark));
    }
    const std::pair<const char *, gguf_type> typed_keys[] = {
        {"general.type", GGUF_TYPE_STRING},
        {"general.architecture", GGUF_TYPE_STRING},
        {"adapter.type", GGUF_TYPE_STRING},
        {"adapter.lora.alpha", GGUF_TYPE_FLOAT32},
    };
    for (const auto & [key, type] : typed_keys) {
        const int64_t id = gguf_find_key(gguf.get(), key);
        if (id >= 0 && gguf_get_kv_type(gguf.get(), id) != type) {
            throw lora_error(std::string(key) + " must be a " + gguf_type_name(type) + ", but is a " +
                             gguf_type_name(gguf_get_kv_type(gguf.get(), id)) + ": '" + path + "'");
        }
    }
    for (ggml_tensor * t = ggml_get_first_tensor(meta); t != nullptr; t = ggml_get_next_tensor(meta, t)) {
        if (ggml_n_dims(t) > 2) {
            throw lora_error(std::string("LoRA tensor '") + ggml_get_name(t) + "' has " +
                             std::to_string(ggml_n_dims(t)) + " dimensions, not 2: '" + path + "'");
        }
    }
}

}  // namespace

lora_adapter::lora_adapter(std::shared_ptr<Model> model, const std::string & path)
    : model_(std::move(model)), path_(path) {
    if (!model_) {
        throw lora_error("model is None");
    }
    // llama.cpp's own message for these is a generic "failed to open".
    struct stat sb {};
    if (::stat(path.c_str(), &sb) != 0) {
        throw lora_error("LoRA adapter file not found: '" + path + "'");
    }
    if (S_ISDIR(sb.st_mode)) {
        throw lora_error("LoRA adapter path is a directory, not a GGUF file: '" + path + "'");
    }
    if (model_->vocab_only()) {
        throw lora_error("the model was loaded with vocab_only=True: it has no weights to adapt");
    }
    check_adapter_file(path);
    const uint64_t mark = log_mark();
    adapter_ = llama_adapter_lora_init(model_->get(), path.c_str());
    if (adapter_ == nullptr) {
        throw lora_error("failed to load LoRA adapter '" + path + "'" + log_reason_since(mark));
    }
    char buf[64];
    if (llama_adapter_meta_val_str(adapter_, "adapter.lora.alpha", buf, sizeof(buf)) > 0) {
        alpha_ = std::strtof(buf, nullptr);
    }
}

lora_adapter::~lora_adapter() {
    // Unregisters it from the model too, so llama_model_free does not free it a second time.
    llama_adapter_lora_free(adapter_);
}

std::vector<std::pair<std::string, std::string>> lora_adapter::meta() const {
    std::vector<std::pair<std::string, std::string>> out;
    const int32_t n = llama_adapter_meta_count(adapter_);
    for (int32_t i = 0; i < n; ++i) {
        out.emplace_back(adapter_meta_string(llama_adapter_meta_key_by_index, adapter_, i),
                         adapter_meta_string(llama_adapter_meta_val_str_by_index, adapter_, i));
    }
    return out;
}

bool same_lora_config(const std::vector<lora_weight> & a, const std::vector<lora_weight> & b) {
    if (a.size() != b.size()) {
        return false;
    }
    // Both hold distinct adapters, so equal sizes and every entry of a found in b is equality.
    for (const lora_weight & x : a) {
        bool found = false;
        for (const lora_weight & y : b) {
            if (x.adapter == y.adapter) {
                found = x.scale == y.scale;
                break;
            }
        }
        if (!found) {
            return false;
        }
    }
    return true;
}

void apply_loras(llama_context * ctx, const std::vector<lora_weight> & config) {
    std::vector<llama_adapter_lora *> ptrs;
    std::vector<float> scales;
    for (const lora_weight & w : config) {
        ptrs.push_back(w.adapter->get());
        scales.push_back(w.scale);
    }
    llama_set_adapters_lora(ctx, ptrs.empty() ? nullptr : ptrs.data(), ptrs.size(),
                            scales.empty() ? nullptr : scales.data());
}

std::vector<lora_weight> lora_config(const context_core & core, const std::vector<lora_weight> & weights) {
    std::vector<lora_weight> next;
    next.reserve(weights.size());
    for (size_t i = 0; i < weights.size(); ++i) {
        const lora_weight & w = weights[i];
        if (!w.adapter) {
            throw lora_error("LoRA entry " + std::to_string(i) + " has no adapter");
        }
        if (&w.adapter->model() != &core.model()) {
            // The graph's size is reserved from the adapters registered with the context's own model, and
            // the adapter's tensors were checked against that model's only.
            throw lora_error("the LoRA adapter '" + w.adapter->path() +
                             "' was loaded for another model: load it with this context's model");
        }
        if (!std::isfinite(w.scale)) {
            throw lora_error("the scale of LoRA adapter '" + w.adapter->path() + "' must be finite, got " +
                             std::to_string(w.scale));
        }
        for (size_t j = 0; j < i; ++j) {
            if (weights[j].adapter == w.adapter) {
                throw lora_error("LoRA adapter '" + w.adapter->path() +
                                 "' appears twice in one configuration: give it once, with the sum of the scales");
            }
        }
        if (w.scale != 0.0f) {
            next.push_back(w);
        }
    }

    return next;
}

bool set_loras(context_core & core, sequence_driver & sequence, branch_driver & branches,
               std::vector<lora_weight> weights) {
    std::vector<lora_weight> next = lora_config(core, weights);
    context_core::busy_guard busy(core);
    if (same_lora_config(core.loras, next)) {
        return false;
    }
    if (branches.active()) {
        throw lora_error("this context holds branches or detached sequences, whose KV cells were computed under "
                         "its current LoRA configuration: prune them or reset the context before changing it");
    }
    // Applied by the next decode (context_core::decode). The history was computed under the old
    // configuration: reusing it (cache_prompt, a continued generate) would mix two models in one sequence.
    llama_memory_clear(core.memory(), true);
    sequence.clear();
    core.loras = std::move(next);
    return true;
}

}  // namespace lloyal
