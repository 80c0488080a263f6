// LoRA adapters: an adapter GGUF loaded for one model (lora_adapter), and a context's adapter
// configuration (lora_config), which llama.cpp applies per context. A KV cache holds what the model
// computed under one configuration, so changing it empties the context's history (set_loras).
#pragma once

#include "common.hpp"
#include "model.hpp"

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lloyal {

class context_core;
class sequence_driver;
class branch_driver;

class lora_adapter {
  public:
    // lora_error when the file is missing or llama.cpp refuses it (not a GGUF, not a LoRA adapter, an
    // architecture or tensor shapes other than the model's), with llama.cpp's own reason.
    lora_adapter(std::shared_ptr<Model> model, const std::string & path);
    // Frees the adapter; the model (kept alive by this reference) frees nothing twice.
    ~lora_adapter();
    lora_adapter(const lora_adapter &) = delete;
    lora_adapter & operator=(const lora_adapter &) = delete;

    llama_adapter_lora * get() const { return adapter_; }
    const Model & model() const { return *model_; }
    const std::string & path() const { return path_; }
    // adapter.lora.alpha as the file says it (0: absent). llama.cpp scales each product by alpha / rank
    // when alpha is set, times the scale given to set_loras.
    float alpha() const { return alpha_; }
    // The adapter GGUF's scalar metadata as (key, value) strings.
    std::vector<std::pair<std::string, std::string>> meta() const;

  private:
    std::shared_ptr<Model> model_;  // declared first: outlives adapter_, which llama_model_free would free
    std::string path_;
    llama_adapter_lora * adapter_ = nullptr;
    float alpha_ = 0.0f;
};

struct lora_weight {
    std::shared_ptr<lora_adapter> adapter;
    float scale = 0.0f;
};

// The whole adapter configuration of a context: set semantics (an empty list clears it). Entries with
// scale 0 contribute nothing and are dropped, as llama.cpp drops them, so [(a, 0)] is the same
// configuration as []. lora_error for a null adapter, an adapter of another Model object, a
// non-finite scale, or one adapter twice. An equal configuration (same adapters at the same scales, in
// any order) changes nothing and keeps the cache. A different one needs a context without branches or
// detached sequences (lora_error otherwise, nothing changed), empties the history and the KV cache,
// and returns true.
bool set_loras(context_core & core, sequence_driver & sequence, branch_driver & branches,
               std::vector<lora_weight> weights);

// weights as one configuration for core's model: set_loras's checks (lora_error), scale-0 entries dropped.
std::vector<lora_weight> lora_config(const context_core & core, const std::vector<lora_weight> & weights);

// Whether two configurations (lora_config's) are the same adapters at the same scales, in any order.
bool same_lora_config(const std::vector<lora_weight> & a, const std::vector<lora_weight> & b);

// The configuration llama.cpp applies in ctx from its next decode on (context_core::decode calls it).
void apply_loras(llama_context * ctx, const std::vector<lora_weight> & config);

}  // namespace lloyal
