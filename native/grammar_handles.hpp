// Grammar handles of a context (lloyal.node's createSampler / cloneSampler / applySampler /
// acceptSamplerToken / freeSamplerHandle): a grammar's parse state kept by id, which says which tokens
// it allows next (as a mask any logits row can be added to) and moves on as tokens are accepted.
// Branches and generate() keep their grammars inside their samplers; these stand alone.
#pragma once

#include "arena.hpp"
#include "context_core.hpp"
#include "sampling.hpp"

#include <map>

namespace lloyal {

class grammar_handles {
  public:
    explicit grammar_handles(context_core & core) : core_(core) {}

    // GrammarError for a grammar that does not parse; request_id: an interrupt stops a long parse.
    uint32_t create(const grammar_spec & g, uint64_t request_id);
    uint32_t clone(uint32_t h);  // the same parse state, going on independently
    // Writes the handle's mask into its block of the region: 0 for each token the grammar allows next,
    // -inf for the others. Returns the block's offset.
    size_t mask(uint32_t h, uint64_t request_id);
    // GrammarError (nothing changed) for a token the grammar does not allow here.
    void accept(uint32_t h, llama_token token, uint64_t request_id);
    void free(uint32_t h);
    // The handle's sampler, which raw_sample applies and replaces (StaleHandleError for an unknown one).
    sampler_ptr & sampler(uint32_t h);

  private:
    struct entry {
        sampler_ptr grammar;
        region_arena::block mask;
    };
    entry & get(uint32_t h);
    uint32_t add(sampler_ptr g);

    context_core & core_;
    std::map<uint32_t, entry> handles_;
    uint32_t next_ = 1;
};

}  // namespace lloyal
