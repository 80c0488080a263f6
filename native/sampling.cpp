// Sampling: the sampler fields, the stages of llama.cpp's common order built from them, and
// chain_sampler, the one sampler generate() and branches share (see sampling.hpp).
#include "common.hpp"
#include "errors.hpp"
#include "logits.hpp"
#include "sampling.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

namespace lloyal {

bool sampler_params::penalties_on() const {
    const bool repeat_on = repeat_penalty != 0.0f && repeat_penalty != 1.0f;
    return repeat_last_n != 0 && (repeat_on || presence_penalty != 0.0f || frequency_penalty != 0.0f);
}

bool sampler_params::dry_on() const { return dry_multiplier > 0.0f && dry_penalty_last_n != 0; }

bool sampler_params::operator==(const sampler_params & o) const {
#define LLOYAL_SAMPLER_EQ(type, name, rule) &&name == o.name
    return true LLOYAL_SAMPLER_FIELDS(LLOYAL_SAMPLER_EQ);
#undef LLOYAL_SAMPLER_EQ
}

std::vector<std::pair<llama_token, float>> normalized_bias(std::vector<std::pair<llama_token, float>> entries) {
    std::stable_sort(entries.begin(), entries.end(), [](const auto & a, const auto & b) { return a.first < b.first; });
    std::vector<std::pair<llama_token, float>> merged;
    for (const auto & e : entries) {
        if (!merged.empty() && merged.back().first == e.first) {
            merged.back().second += e.second;
        } else {
            merged.push_back(e);
        }
    }
    return merged;
}

const std::vector<std::string> & sampler_field_names() {
#define LLOYAL_SAMPLER_NAME(type, name, rule) #name,
    static const std::vector<std::string> names = {LLOYAL_SAMPLER_FIELDS(LLOYAL_SAMPLER_NAME)};
#undef LLOYAL_SAMPLER_NAME
    return names;
}

namespace {

// The stages of one chain: penalties and DRY apart (their windows are primed with past tokens), then
// the rest. Samplers that are off are left out, so an all-zero params gives an empty list.
struct chain_stages {
    sampler_ptr penalties;
    sampler_ptr dry;
    std::vector<sampler_ptr> rest;
    int32_t penalty_last_n = 0;  // window sizes, -1 resolved to n_ctx
    int32_t dry_last_n = 0;
    bool rest_starts_with_top_k = false;
};

std::vector<sampler_ptr> make_rest_stages(const sampler_params & p, int32_t n_vocab, bool * starts_with_top_k) {
    std::vector<sampler_ptr> rest;
    if (starts_with_top_k != nullptr) {
        *starts_with_top_k = false;
    }
    if (p.greedy()) {
        return rest;  // no truncation, no RNG: the caller takes the argmax
    }
    if (p.mirostat == 1 || p.mirostat == 2) {
        const float tau = p.mirostat_tau == 0.0f ? 5.0f : p.mirostat_tau;
        const float eta = p.mirostat_eta == 0.0f ? 0.1f : p.mirostat_eta;
        rest.emplace_back(llama_sampler_init_temp(p.temperature));
        if (p.mirostat == 1) {
            rest.emplace_back(llama_sampler_init_mirostat(n_vocab, p.seed, tau, eta, 100));
        } else {
            rest.emplace_back(llama_sampler_init_mirostat_v2(p.seed, tau, eta));
        }
        return rest;
    }
    if (p.top_n_sigma > 0.0f) {
        rest.emplace_back(llama_sampler_init_top_n_sigma(p.top_n_sigma));
    }
    if (p.top_k > 0) {
        if (starts_with_top_k != nullptr) {
            *starts_with_top_k = rest.empty();
        }
        rest.emplace_back(llama_sampler_init_top_k(p.top_k));
    }
    if (p.typical_p > 0.0f && p.typical_p < 1.0f) {
        rest.emplace_back(llama_sampler_init_typical(p.typical_p, 1));
    }
    if (p.top_p > 0.0f && p.top_p < 1.0f) {
        rest.emplace_back(llama_sampler_init_top_p(p.top_p, 1));
    }
    if (p.min_p > 0.0f) {
        rest.emplace_back(llama_sampler_init_min_p(p.min_p, 1));
    }
    if (p.xtc_probability > 0.0f && p.xtc_threshold <= 0.5f) {
        rest.emplace_back(llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, p.seed));
    }
    rest.emplace_back(llama_sampler_init_temp(p.temperature));
    rest.emplace_back(llama_sampler_init_dist(p.seed));
    return rest;
}

chain_stages make_chain_stages(const sampler_params & p, const Model & model, uint32_t n_ctx) {
    chain_stages st;
    const int32_t n_vocab = model.n_vocab();
    if (p.penalties_on()) {
        const bool repeat_on = p.repeat_penalty != 0.0f && p.repeat_penalty != 1.0f;
        st.penalty_last_n = p.repeat_last_n < 0 ? static_cast<int32_t>(n_ctx) : p.repeat_last_n;
        st.penalties.reset(llama_sampler_init_penalties(n_vocab, st.penalty_last_n, repeat_on ? p.repeat_penalty : 1.0f,
                                                        p.frequency_penalty, p.presence_penalty));
    }
    if (p.dry_on()) {
        st.dry_last_n = p.dry_penalty_last_n < 0 ? static_cast<int32_t>(n_ctx) : p.dry_penalty_last_n;
        std::vector<const char *> breakers;
        for (const auto & b : p.dry_sequence_breakers) {
            breakers.push_back(b.c_str());
        }
        st.dry.reset(llama_sampler_init_dry(model.vocab(), p.dry_multiplier, p.dry_base == 0.0f ? 1.75f : p.dry_base,
                                            p.dry_allowed_length, st.dry_last_n, breakers.data(), breakers.size()));
    }
    st.rest = make_rest_stages(p, n_vocab, &st.rest_starts_with_top_k);
    return st;
}

// Feeds a penalty or DRY window (s; null: nothing to do) the last last_n tokens of seen, so that it
// starts as if it had accepted them one by one.
void prime_window(llama_sampler * s, int32_t last_n, const std::vector<llama_token> & seen) {
    if (s == nullptr) {
        return;
    }
    const size_t want = std::min<size_t>(seen.size(), static_cast<size_t>(last_n));
    for (size_t i = seen.size() - want; i < seen.size(); ++i) {
        llama_sampler_accept(s, seen[i]);
    }
}



constexpr float k_neg_inf = -std::numeric_limits<float>::infinity();

// Past this the top-k selection is no cheaper than llama.cpp's own partial sort of all candidates.
constexpr int32_t k_max_direct_top_k = 4096;

bool banned(float logit) { return std::isinf(logit) && logit < 0.0f; }

// log(sum(exp(logit))) over candidates: gathered into a flat row for the vectorised kernel (a scalar
// exp over 262k candidates would cost more than the argmax it accompanies).
double candidates_lse(const llama_token_data * d, size_t n) {
    thread_local std::vector<float> z;
    z.resize(n);
    for (size_t i = 0; i < n; ++i) {
        z[i] = d[i].logit;
    }
    return log_sum_exp(z.data(), n, max_of(z.data(), n));
}

void apply(llama_sampler * s, llama_token_data_array & cur) {
    try {
        llama_sampler_apply(s, &cur);
    } catch (const std::exception & e) {
        throw lloyal_error(std::string("sampling failed: ") + e.what());
    }
}

}  // namespace

chain_sampler::chain_sampler(const sampler_params & p, const Model & model, uint32_t n_ctx,
                             const std::vector<llama_token> & seen)
    : model_(&model), n_ctx_(n_ctx), p_(p) {
    build(seen);
}

chain_sampler::~chain_sampler() = default;

void chain_sampler::build(const std::vector<llama_token> & seen) {
    chain_stages st = make_chain_stages(p_, *model_, n_ctx_);
    penalties_ = std::move(st.penalties);
    dry_ = std::move(st.dry);
    rest_ = std::move(st.rest);
    penalty_last_n_ = st.penalty_last_n;
    dry_last_n_ = st.dry_last_n;
    rest_starts_with_top_k_ = st.rest_starts_with_top_k;
    draws_.assign(rest_.size(), draw_count{});
    prime_window(penalties_.get(), penalty_last_n_, seen);
    prime_window(dry_.get(), dry_last_n_, seen);
}

std::unique_ptr<chain_sampler> chain_sampler::clone() const {
    std::unique_ptr<chain_sampler> c(new chain_sampler(*model_, n_ctx_));
    c->p_ = p_;
    c->penalties_.reset(llama_sampler_clone(penalties_.get()));
    c->dry_.reset(llama_sampler_clone(dry_.get()));
    c->rest_.reserve(rest_.size());
    for (const auto & s : rest_) {
        c->rest_.emplace_back(llama_sampler_clone(s.get()));
    }
    c->penalty_last_n_ = penalty_last_n_;
    c->dry_last_n_ = dry_last_n_;
    c->rest_starts_with_top_k_ = rest_starts_with_top_k_;
    c->draws_ = draws_;
    c->grammar_.reset(llama_sampler_clone(grammar_.get()));
    c->bias_ = bias_;
    return c;
}

void chain_sampler::set_params(const sampler_params & p, const std::vector<llama_token> & seen) {
    if (p == p_) {
        return;
    }
    p_ = p;
    build(seen);
}

void chain_sampler::reseed(uint32_t seed) {
    p_.seed = seed;
    // Only XTC, dist and mirostat hold state besides the windows, and all three are seeded.
    rest_ = make_rest_stages(p_, model_->n_vocab(), &rest_starts_with_top_k_);
    draws_.assign(rest_.size(), draw_count{});
}

void chain_sampler::replay_draws(const std::vector<draw_count> & draws) {
    if (draws.size() != rest_.size()) {
        throw std::invalid_argument("the sampler's draws name " + std::to_string(draws.size()) + " stages, its chain has " +
                                    std::to_string(rest_.size()));
    }
    // Two equal candidates: every stage keeps both (no threshold cuts a tie), so a later stage sees the
    // width the count says.
    std::array<llama_token_data, 2> two{};
    for (size_t i = 0; i < rest_.size(); ++i) {
        for (uint64_t k = 0; k < draws[i].narrow + draws[i].wide; ++k) {
            two = {llama_token_data{0, 0.0f, 0.5f}, llama_token_data{1, 0.0f, 0.5f}};
            llama_token_data_array cur{two.data(), k < draws[i].wide ? size_t{2} : size_t{1}, -1, false};
            apply(rest_[i].get(), cur);
        }
    }
    draws_ = draws;
}

void chain_sampler::fill(const float * z, std::vector<llama_token_data> & scratch) const {
    const int32_t n = model_->n_vocab();
    scratch.resize(static_cast<size_t>(n));
    llama_token_data * d = scratch.data();
    for (int32_t t = 0; t < n; ++t) {
        d[t] = llama_token_data{t, z[t], 0.0f};
    }
    for (const auto & b : bias_) {
        d[b.first].logit += b.second;
    }
}

chain_sampler::sample_result chain_sampler::finish(llama_token_data_array & cur, bool greedy) {
    sample_result r;
    if (greedy) {
        // llama.cpp's greedy sampler: the first maximum.
        size_t best = 0;
        for (size_t i = 1; i < cur.size; ++i) {
            if (cur.data[i].logit > cur.data[best].logit) {
                best = i;
            }
        }
        if (cur.size == 0 || banned(cur.data[best].logit) || std::isnan(cur.data[best].logit)) {
            return r;
        }
        r.token = cur.data[best].id;
        const double lse = candidates_lse(cur.data, cur.size);
        r.sampling_surprisal = static_cast<float>(std::max(0.0, lse - cur.data[best].logit));
        return r;
    }
    if (cur.size == 0) {
        return r;
    }
    // Everything banned (bias, penalties): no sampler that draws may see it (dist would divide 0 by 0).
    bool any = cur.sorted ? !banned(cur.data[0].logit) : false;
    for (size_t i = 0; i < cur.size && !any; ++i) {
        any = !banned(cur.data[i].logit) && !std::isnan(cur.data[i].logit);
    }
    if (!any) {
        return r;
    }
    for (size_t i = 0; i < rest_.size(); ++i) {
        ++(cur.size > 1 ? draws_[i].wide : draws_[i].narrow);
        apply(rest_[i].get(), cur);
    }
    if (cur.selected < 0 || static_cast<size_t>(cur.selected) >= cur.size) {
        return r;
    }
    const llama_token_data & chosen = cur.data[cur.selected];
    if (banned(chosen.logit)) {
        return r;
    }
    r.token = chosen.id;
    r.sampling_surprisal = chosen.p > 0.0f ? -std::log(chosen.p) : std::numeric_limits<float>::infinity();
    return r;
}

chain_sampler::sample_result chain_sampler::sample_free(const logits_row & row, std::vector<llama_token_data> & scratch) {
    const int32_t n = model_->n_vocab();
    const bool plain = penalties_ == nullptr && dry_ == nullptr;
    if (p_.greedy() && plain) {
        sample_result r;
        if (bias_.empty()) {
            if (banned(row.max)) {
                return r;
            }
            r.token = first_index_of(row.z, n, row.max);
            if (r.token == LLAMA_TOKEN_NULL) {
                // The row changed under its cached maximum (the snapshot is shared memory): scan it all.
                r.token = first_argmax(row.z, n);
                return r.token == LLAMA_TOKEN_NULL || banned(row.z[r.token]) ? sample_result{} : r;
            }
            r.sampling_surprisal = std::isfinite(row.lse) ? std::max(0.0f, row.lse - row.max) : 0.0f;
            return r;
        }
        // The raw winner, unless it carries a bias; then (rarely) the full scan.
        const llama_token raw = first_index_of(row.z, n, row.max);
        auto is_biased = [&](llama_token t) {
            auto it = std::lower_bound(bias_.begin(), bias_.end(), t,
                                       [](const std::pair<llama_token, float> & b, llama_token v) { return b.first < v; });
            return it != bias_.end() && it->first == t;
        };
        if (raw == LLAMA_TOKEN_NULL || is_biased(raw)) {
            fill(row.z, scratch);
            llama_token_data_array cur{scratch.data(), scratch.size(), -1, false};
            return finish(cur, true);
        }
        llama_token best = raw;
        float best_v = row.z[raw];
        for (const auto & b : bias_) {
            const float v = row.z[b.first] + b.second;
            if (v > best_v || (v == best_v && b.first < best)) {
                best_v = v;
                best = b.first;
            }
        }
        if (banned(best_v)) {
            return r;
        }
        r.token = best;
        // lse of the biased row from the cached one: only the biased terms change.
        double s = std::exp(static_cast<double>(row.lse) - row.max);
        for (const auto & b : bias_) {
            s -= std::exp(static_cast<double>(row.z[b.first]) - row.max);
            s += std::exp(static_cast<double>(row.z[b.first]) + b.second - row.max);
        }
        const double lse = s > 0.0 ? row.max + std::log(s) : static_cast<double>(best_v);
        r.sampling_surprisal = std::isfinite(lse) ? static_cast<float>(std::max(0.0, lse - best_v)) : 0.0f;
        return r;
    }
    if (!p_.greedy() && plain && rest_starts_with_top_k_ && p_.top_k <= k_max_direct_top_k && p_.top_k < n) {
        top_k_select(row.z, n, p_.top_k, bias_, scratch);
        if (scratch.empty() || banned(scratch.front().logit)) {
            return {};
        }
        llama_token_data_array cur{scratch.data(), scratch.size(), -1, true};
        return finish(cur, false);  // the top_k stage sees k sorted candidates: it only truncates
    }
    fill(row.z, scratch);
    llama_token_data_array cur{scratch.data(), scratch.size(), -1, false};
    if (penalties_) {
        apply(penalties_.get(), cur);
    }
    if (dry_) {
        apply(dry_.get(), cur);
    }
    return finish(cur, p_.greedy());
}

chain_sampler::sample_result chain_sampler::sample_masked(const logits_row & row, std::vector<llama_token_data> & scratch,
                                                          const stop_fn & stop) {
    fill(row.z, scratch);
    llama_token_data_array cur{scratch.data(), scratch.size(), -1, false};
    grammar_apply(grammar_.get(), cur, stop);
    if (penalties_) {
        apply(penalties_.get(), cur);
    }
    if (dry_) {
        apply(dry_.get(), cur);
    }
    return finish(cur, p_.greedy());
}

chain_sampler::sample_result chain_sampler::sample(const logits_row & row, std::vector<llama_token_data> & scratch,
                                                   const stop_fn & stop) {
    sample_result r = sample_free(row, scratch);
    if (grammar_ == nullptr || r.token == LLAMA_TOKEN_NULL) {
        return r;
    }
    llama_token_data one{r.token, 0.0f, 0.0f};
    llama_token_data_array one_p{&one, 1, -1, false};
    grammar_apply(grammar_.get(), one_p, stop);
    if (!banned(one.logit)) {
        return r;  // the grammar allows the free choice (a lazy grammar awaiting its trigger: always)
    }
    return sample_masked(row, scratch, stop);
}

sampler_ptr chain_sampler::grammar_after(llama_token token, const stop_fn & stop) const {
    if (grammar_ == nullptr) {
        return nullptr;
    }
    sampler_ptr g(llama_sampler_clone(grammar_.get()));
    llama_token_data one{token, 0.0f, 0.0f};
    llama_token_data_array one_p{&one, 1, -1, false};
    grammar_apply(g.get(), one_p, stop);
    if (banned(one.logit)) {
        throw grammar_error("token " + std::to_string(token) + " (" + model_->token_to_piece(token, true) +
                            ") is not allowed by the grammar here");
    }
    try {
        grammar_accept(g.get(), token, stop);
    } catch (const interrupted_error &) {
        throw;
    } catch (const std::exception & e) {
        throw grammar_error("token " + std::to_string(token) + " is not allowed by the grammar here: " + e.what());
    }
    return g;
}

void chain_sampler::accept(llama_token token) {
    if (penalties_) {
        llama_sampler_accept(penalties_.get(), token);
    }
    if (dry_) {
        llama_sampler_accept(dry_.get(), token);
    }
    for (auto & s : rest_) {
        llama_sampler_accept(s.get(), token);
    }
}


}  // namespace lloyal
