#include "common.hpp"
#include "logits.hpp"


#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace lloyal {

namespace {

constexpr float k_neg_inf = -std::numeric_limits<float>::infinity();

template <class To, class From> inline To bit_cast(const From & from) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
    To to;
    std::memcpy(&to, &from, sizeof(to));
    return to;
}

inline int32_t float_to_bits(float f) { return bit_cast<int32_t>(f); }

// exp(x) for x <= 0 (an argument already shifted by the row's maximum), eight at a time in GCC's
// generic vectors (AVX2 in one build of the kernels, pairs of SSE registers in the other): round x/ln2
// with the 1.5*2^23 trick (baseline x86-64 has no vector floor), Cephes' degree-6 polynomial on the
// remainder, 2^n put into the exponent bits. Arguments below -87 (and NaN) are clamped to -87: the
// result, ~1e-38 instead of 0, cannot move a sum that holds the maximum's 1. Written as plain scalar
// code, GCC turns the clamp into a branch (the clamped result is a constant) and vectorises nothing.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// In place (by reference: a vector passed by value gets a different ABI in the two builds).
inline void exp_nonpositive(v8f & x) {
    const v8f lo = v8f{} - 87.0f;
    x = x > lo ? x : lo;
    constexpr float shifter = 12582912.0f;  // 1.5 * 2^23
    const v8f t = x * 1.44269504088896341f + shifter;
    const v8f fn = t - shifter;
    v8i n;
    std::memcpy(&n, &t, sizeof(n));
    n -= float_to_bits(shifter);
    v8f r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    v8f p = v8f{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v8i e = (n + 127) << 23;
    v8f scale;
    std::memcpy(&scale, &e, sizeof(scale));
    x = p * scale;
}

// The kernels, written once and instantiated per instruction set by the wrappers below (always
// inlined there, so each copy is compiled, and vectorised, for its wrapper's target).
#define LLOYAL_KERNEL static inline __attribute__((always_inline))

LLOYAL_KERNEL float k_copy_and_max(float * __restrict dst, const float * __restrict src, size_t n) {
    float m = k_neg_inf;
#pragma omp simd reduction(max : m)
    for (size_t i = 0; i < n; ++i) {
        const float v = src[i];
        dst[i] = v;
        m = v > m ? v : m;
    }
    return m;
}

LLOYAL_KERNEL float k_max_of(const float * x, size_t n) {
    float m = k_neg_inf;
#pragma omp simd reduction(max : m)
    for (size_t i = 0; i < n; ++i) {
        m = x[i] > m ? x[i] : m;
    }
    return m;
}

LLOYAL_KERNEL float k_sum_exp(const float * x, size_t n, float max) {
    // Float partial sums per vector lane: the terms are at most 1 and the few large ones dominate, so
    // the rounding error stays around 1e-6 of the sum, far below what a perplexity can show.
    v8f acc = v8f{};
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        std::memcpy(&v, x + i, sizeof(v));
        v -= max;
        exp_nonpositive(v);
        acc += v;
    }
    float s = 0.0f;
    for (int j = 0; j < 8; ++j) {
        s += acc[j];
    }
    if (i < n) {
        float tail[8] = {};
        for (size_t j = 0; i + j < n; ++j) {
            tail[j] = x[i + j] - max;
        }
        v8f v;
        std::memcpy(&v, tail, sizeof(v));
        exp_nonpositive(v);
        for (size_t j = 0; i + j < n; ++j) {
            s += v[j];
        }
    }
    return s;
}

LLOYAL_KERNEL llama_token k_first_index_of(const float * x, int32_t n, float m) {
    // Blocks of 64: a vectorised "any equal" per block, then the scalar scan of the one that has it.
    constexpr int32_t block = 64;
    int32_t i = 0;
    for (; i + block <= n; i += block) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int32_t j = 0; j < block; ++j) {
            hit |= x[i + j] == m;
        }
        if (hit) {
            break;
        }
    }
    for (; i < n; ++i) {
        if (x[i] == m) {
            return i;
        }
    }
    return LLAMA_TOKEN_NULL;
}

// Ordering of candidates: higher logit first, then lower id.
inline bool better(const llama_token_data & a, const llama_token_data & b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

LLOYAL_KERNEL void k_top_k(const float * x, int32_t n, int32_t k, const std::vector<std::pair<llama_token, float>> & bias,
                           std::vector<llama_token_data> & out) {
    out.clear();
    if (k <= 0 || n <= 0) {
        return;
    }
    // A heap whose top is the worst token kept (std:: heaps put the "largest" under the comparator on
    // top, and under `better` the largest is the worst).
    auto is_biased = [&](llama_token t) {
        if (bias.empty()) {
            return false;
        }
        auto it = std::lower_bound(bias.begin(), bias.end(), t,
                                   [](const std::pair<llama_token, float> & b, llama_token v) { return b.first < v; });
        return it != bias.end() && it->first == t;
    };
    auto offer = [&](llama_token t, float v) {
        if (v != v) {
            return;  // NaN
        }
        const llama_token_data d{t, v, 0.0f};
        if (static_cast<int32_t>(out.size()) < k) {
            out.push_back(d);
            std::push_heap(out.begin(), out.end(), better);
        } else if (better(d, out.front())) {
            std::pop_heap(out.begin(), out.end(), better);
            out.back() = d;
            std::push_heap(out.begin(), out.end(), better);
        }
    };
    constexpr int32_t block = 64;
    int32_t i = 0;
    // Fill the heap first; from then on only values above its worst can enter. Scanning in id order,
    // an equal value later in the row loses the tie, so "strictly above" is exact.
    for (; i < n && static_cast<int32_t>(out.size()) < k; ++i) {
        if (!is_biased(i)) {
            offer(i, x[i]);
        }
    }
    for (; i < n && (i % block) != 0; ++i) {
        if (x[i] > out.front().logit && !is_biased(i)) {
            offer(i, x[i]);
        }
    }
    for (; i + block <= n; i += block) {
        float m = k_neg_inf;
#pragma omp simd reduction(max : m)
        for (int32_t j = 0; j < block; ++j) {
            m = x[i + j] > m ? x[i + j] : m;
        }
        if (!(m > out.front().logit)) {
            continue;
        }
        for (int32_t j = i; j < i + block; ++j) {
            if (x[j] > out.front().logit && !is_biased(j)) {
                offer(j, x[j]);
            }
        }
    }
    for (; i < n; ++i) {
        if (x[i] > out.front().logit && !is_biased(i)) {
            offer(i, x[i]);
        }
    }
    for (const auto & b : bias) {
        if (b.first >= 0 && b.first < n) {
            offer(b.first, x[b.first] + b.second);
        }
    }
    std::sort_heap(out.begin(), out.end(), better);  // ascending under `better`: best first
}

#define LLOYAL_AVX2 __attribute__((target("avx2,fma")))

LLOYAL_AVX2 float avx2_copy_and_max(float * dst, const float * src, size_t n) { return k_copy_and_max(dst, src, n); }
LLOYAL_AVX2 float avx2_max_of(const float * x, size_t n) { return k_max_of(x, n); }
LLOYAL_AVX2 float avx2_sum_exp(const float * x, size_t n, float max) { return k_sum_exp(x, n, max); }
LLOYAL_AVX2 llama_token avx2_first_index_of(const float * x, int32_t n, float m) { return k_first_index_of(x, n, m); }
LLOYAL_AVX2 void avx2_top_k(const float * x, int32_t n, int32_t k, const std::vector<std::pair<llama_token, float>> & bias,
                            std::vector<llama_token_data> & out) {
    k_top_k(x, n, k, bias, out);
}

float base_copy_and_max(float * dst, const float * src, size_t n) { return k_copy_and_max(dst, src, n); }
float base_max_of(const float * x, size_t n) { return k_max_of(x, n); }
float base_sum_exp(const float * x, size_t n, float max) { return k_sum_exp(x, n, max); }
llama_token base_first_index_of(const float * x, int32_t n, float m) { return k_first_index_of(x, n, m); }
void base_top_k(const float * x, int32_t n, int32_t k, const std::vector<std::pair<llama_token, float>> & bias,
                std::vector<llama_token_data> & out) {
    k_top_k(x, n, k, bias, out);
}

bool use_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return yes;
}

}  // namespace

float copy_and_max(float * dst, const float * src, size_t n) {
    return use_avx2() ? avx2_copy_and_max(dst, src, n) : base_copy_and_max(dst, src, n);
}

float max_of(const float * x, size_t n) { return use_avx2() ? avx2_max_of(x, n) : base_max_of(x, n); }

float log_sum_exp(const float * x, size_t n, float max) {
    if (!std::isfinite(max)) {
        return max;  // -inf: nothing is possible; +inf or NaN: no meaningful value
    }
    const float s = use_avx2() ? avx2_sum_exp(x, n, max) : base_sum_exp(x, n, max);
    return max + std::log(s);
}

llama_token first_index_of(const float * x, int32_t n, float m) {
    return use_avx2() ? avx2_first_index_of(x, n, m) : base_first_index_of(x, n, m);
}

llama_token first_argmax(const float * x, int32_t n) {
    const float m = max_of(x, static_cast<size_t>(std::max(n, 0)));
    if (m != m || n <= 0) {
        return LLAMA_TOKEN_NULL;
    }
    // Every value -inf: the max is -inf and index 0 holds it, unless some entries are NaN.
    return first_index_of(x, n, m);
}

void top_k_select(const float * x, int32_t n, int32_t k, const std::vector<std::pair<llama_token, float>> & bias,
                  std::vector<llama_token_data> & out) {
    if (use_avx2()) {
        avx2_top_k(x, n, k, bias, out);
    } else {
        base_top_k(x, n, k, bias, out);
    }
}

token_logprobs logprobs_of(const float * z, int32_t n_vocab, float max, float lse, llama_token token, int32_t n_top) {
    if (!std::isfinite(lse)) {
        lse = log_sum_exp(z, static_cast<size_t>(n_vocab), max);
    }
    token_logprobs out;
    out.token = token;
    out.logprob = z[token] - lse;
    if (n_top > 0) {
        std::vector<llama_token_data> best;
        top_k_select(z, n_vocab, std::min(n_top, n_vocab), {}, best);
        out.top.reserve(best.size());
        for (const llama_token_data & d : best) {
            out.top.emplace_back(d.id, z[d.id] - lse);
        }
    }
    return out;
}

}  // namespace lloyal
