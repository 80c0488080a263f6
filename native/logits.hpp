// Whole-vocabulary passes over a logits row (logits.cpp): the per-token CPU work of branches and
// generate() outside llama_decode. At a 262k vocabulary each pass touches 1 MiB, so they are written
// to vectorise, and built twice (AVX2+FMA and the baseline) with the choice made once at run time:
// the module is compiled for plain x86-64, the machines it runs on mostly have AVX2.
#pragma once

#include "common.hpp"

#include <utility>
#include <vector>

namespace lloyal {

// dst[0:n] := src[0:n]; returns the maximum (NaNs never win; -inf when there is nothing else).
float copy_and_max(float * dst, const float * src, size_t n);
float max_of(const float * x, size_t n);

// log(sum(exp(x))) given max = max_of(x): max + log(sum(exp(x - max))). Not finite when max is not.
// exp is a polynomial good to about 2 ulp (the sum of 262k terms does not need libm's last bit).
float log_sum_exp(const float * x, size_t n, float max);

// Index of the first element equal to m (m taken from the same row), or LLAMA_TOKEN_NULL.
llama_token first_index_of(const float * x, int32_t n, float m);
// Index of the first maximum (NaNs never win), or LLAMA_TOKEN_NULL when every value is NaN or the row
// is empty.
llama_token first_argmax(const float * x, int32_t n);

// The k best tokens of x + bias, best first (ties: the lower id first), into out. `bias` is sorted by
// token and holds each token once (its summed bias). NaN logits are never chosen.
// One pass over x: a block is only looked at element by element when its maximum beats the worst
// token kept so far, which after the first few blocks is almost never.
void top_k_select(const float * x, int32_t n, int32_t k, const std::vector<std::pair<llama_token, float>> & bias,
                  std::vector<llama_token_data> & out);

// A chosen token's log-probability under a row, and the row's n_top most likely tokens with theirs (best
// first): the model's own distribution, log-softmax of the raw logits, before any sampler, bias or
// grammar (what OpenAI's logprobs and llama-server's n_probs report). max and lse: the row's.
struct token_logprobs {
    llama_token token = LLAMA_TOKEN_NULL;
    float logprob = 0.0f;
    std::vector<std::pair<llama_token, float>> top;
};
token_logprobs logprobs_of(const float * z, int32_t n_vocab, float max, float lse, llama_token token, int32_t n_top);

}  // namespace lloyal
