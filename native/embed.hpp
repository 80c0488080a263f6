// Many short token sequences decoded side by side, one sequence each, packed into as few llama_decode
// calls as the context allows: the embeddings of an embeddings=True context, and the query likelihoods
// rerank() asks of a causal LM in a generation context. Every call starts from an empty cache and
// leaves it empty: nothing of one call is seen by the next.
#pragma once

#include "arena.hpp"
#include "common.hpp"
#include "context_core.hpp"

#include <vector>

namespace lloyal {

class sequence_driver;

struct embed_result {
    size_t offset = 0;           // of the first row in the region
    std::vector<uint32_t> rows;  // per input: its rows (its token count with pooling none, else 1)
    uint32_t width = 0;          // floats per row: n_embd_out, or n_cls_out with pooling rank
};

class embed_driver {
  public:
    // sequence: whose history a rerank on a generation context forgets (the logits become the scoring's).
    embed_driver(context_core & core, sequence_driver & sequence) : core_(core), sequence_(sequence) {}

    // An embeddings=True context: the rows of every input, written one after the other into a block
    // of the region that stays the context's until its next embed call. normalize: each row scaled
    // to L2 norm 1 (a zero row stays zero). ContextError on a generation context; ContextOverflowError
    // for an input longer than one decode takes; ResultTooLargeError when the rows do not fit the
    // region (checked before anything is decoded); InterruptedByClient.
    embed_result embed(const std::vector<std::vector<llama_token>> & inputs, bool normalize, uint64_t request_id);

    // A generation context holding nothing (no history, no branches): per prompt, the mean log-probability
    // of its last n_tail[k] tokens, each given every token before it (the rerank of a causal LM: the
    // query's likelihood after a prompt holding the document).
    std::vector<double> score_tails(const std::vector<std::vector<llama_token>> & prompts,
                                    const std::vector<size_t> & n_tail, uint64_t request_id);

  private:
    // [begin, end) ranges of inputs, each decoded in one llama_decode: at most max_tokens tokens,
    // n_seq_max sequences and (when outputs is not empty) max_outputs output rows, outputs[i] being
    // input i's. ContextOverflowError (naming the input) for one that alone exceeds a limit.
    std::vector<std::pair<size_t, size_t>> pack(const std::vector<std::vector<llama_token>> & inputs,
                                                size_t max_tokens, const std::vector<size_t> & outputs,
                                                size_t max_outputs) const;
    // Clears the cache and decodes inputs[begin, end), input k as sequence k - begin from position 0,
    // with an output row for each of its tokens from first_output[k] on (empty: every token). Returns
    // the batch index of each input's first token.
    std::vector<size_t> decode_group(const std::vector<std::vector<llama_token>> & inputs, size_t begin, size_t end,
                                     const std::vector<size_t> & first_output);

    context_core & core_;
    sequence_driver & sequence_;
    region_arena::block result_;  // the last embed call's rows
};

}  // namespace lloyal
