// branch_sampler: how one branch chooses its next token (see branch.hpp).
#include "common.hpp"
#include "branch.hpp"
#include "errors.hpp"
#include "logits.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace lloyal {

namespace {

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

branch_sampler::branch_sampler(const sampler_params & p, const Model & model, uint32_t n_ctx)
    : model_(&model), n_ctx_(n_ctx), p_(p) {
    build({});
}

branch_sampler::~branch_sampler() = default;

void branch_sampler::build(const std::vector<llama_token> & accepted) {
    chain_stages st = make_chain_stages(p_, *model_, n_ctx_);
    penalties_ = std::move(st.penalties);
    dry_ = std::move(st.dry);
    rest_ = std::move(st.rest);
    rest_starts_with_top_k_ = st.rest_starts_with_top_k;
    prime_window(penalties_.get(), st.penalty_last_n, accepted, accepted.size(), {});
    prime_window(dry_.get(), st.dry_last_n, accepted, accepted.size(), {});
}

std::unique_ptr<branch_sampler> branch_sampler::clone() const {
    std::unique_ptr<branch_sampler> c(new branch_sampler(*model_, n_ctx_));
    c->p_ = p_;
    c->penalties_.reset(llama_sampler_clone(penalties_.get()));
    c->dry_.reset(llama_sampler_clone(dry_.get()));
    c->rest_.reserve(rest_.size());
    for (const auto & s : rest_) {
        c->rest_.emplace_back(llama_sampler_clone(s.get()));
    }
    c->rest_starts_with_top_k_ = rest_starts_with_top_k_;
    c->grammar_.reset(llama_sampler_clone(grammar_.get()));
    c->bias_ = bias_;
    return c;
}

void branch_sampler::set_params(const sampler_params & p, const std::vector<llama_token> & accepted) {
    if (p == p_) {
        return;
    }
    p_ = p;
    build(accepted);
}

void branch_sampler::reseed(uint32_t seed) {
    p_.seed = seed;
    // Only XTC, dist and mirostat hold state besides the windows, and all three are seeded.
    rest_ = make_rest_stages(p_, model_->n_vocab(), &rest_starts_with_top_k_);
}

void branch_sampler::fill(const float * z, std::vector<llama_token_data> & scratch) const {
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

branch_sampler::sample_result branch_sampler::finish(llama_token_data_array & cur, bool greedy) {
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
    for (auto & s : rest_) {
        apply(s.get(), cur);
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

branch_sampler::sample_result branch_sampler::sample_free(const logits_row & row, std::vector<llama_token_data> & scratch) {
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

branch_sampler::sample_result branch_sampler::sample_masked(const logits_row & row, std::vector<llama_token_data> & scratch) {
    fill(row.z, scratch);
    llama_token_data_array cur{scratch.data(), scratch.size(), -1, false};
    apply(grammar_.get(), cur);
    if (penalties_) {
        apply(penalties_.get(), cur);
    }
    if (dry_) {
        apply(dry_.get(), cur);
    }
    return finish(cur, p_.greedy());
}

branch_sampler::sample_result branch_sampler::sample(const logits_row & row, std::vector<llama_token_data> & scratch) {
    sample_result r = sample_free(row, scratch);
    if (grammar_ == nullptr || r.token == LLAMA_TOKEN_NULL) {
        return r;
    }
    llama_token_data one{r.token, 0.0f, 0.0f};
    llama_token_data_array one_p{&one, 1, -1, false};
    apply(grammar_.get(), one_p);
    if (!banned(one.logit)) {
        return r;  // the grammar allows the free choice (a lazy grammar awaiting its trigger: always)
    }
    return sample_masked(row, scratch);
}

sampler_ptr branch_sampler::grammar_after(llama_token token) const {
    if (grammar_ == nullptr) {
        return nullptr;
    }
    sampler_ptr g(llama_sampler_clone(grammar_.get()));
    llama_token_data one{token, 0.0f, 0.0f};
    llama_token_data_array one_p{&one, 1, -1, false};
    apply(g.get(), one_p);
    if (banned(one.logit)) {
        throw grammar_error("token " + std::to_string(token) + " (" + model_->token_to_piece(token, true) +
                            ") is not allowed by the grammar here");
    }
    try {
        llama_sampler_accept(g.get(), token);
    } catch (const std::exception & e) {
        throw grammar_error("token " + std::to_string(token) + " is not allowed by the grammar here: " + e.what());
    }
    return g;
}

void branch_sampler::accept(llama_token token) {
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

std::vector<std::pair<llama_token, float>> parse_logit_bias(const py::handle & bias, const Model & model) {
    std::vector<std::pair<llama_token, float>> out;
    if (bias.is_none()) {
        return out;
    }
    py::object items = PyDict_Check(bias.ptr()) ? bias.attr("items")() : py::reinterpret_borrow<py::object>(bias);
    if (!py::isinstance<py::iterable>(items)) {
        throw py::type_error("logit bias must be a dict of token -> float or a list of (token, float) pairs");
    }
    for (auto it : py::iter(items)) {
        py::object pair = py::reinterpret_borrow<py::object>(it);
        if (!PySequence_Check(pair.ptr()) || PySequence_Size(pair.ptr()) != 2) {
            throw py::type_error("logit bias must be a dict of token -> float or a list of (token, float) pairs");
        }
        const llama_token tok = token_from_py(pair[py::int_(0)], model);
        py::object bv = pair[py::int_(1)];
        if (PyBool_Check(bv.ptr())) {
            throw py::type_error("logit bias values must be floats");
        }
        const double b = PyFloat_AsDouble(bv.ptr());
        if (b == -1.0 && PyErr_Occurred()) {
            throw py::error_already_set();
        }
        // -inf forbids a token; +inf or NaN would turn the softmax into NaNs.
        if (std::isnan(b) || b == std::numeric_limits<double>::infinity()) {
            throw std::invalid_argument("logit bias values must be finite or -inf");
        }
        out.emplace_back(tok, static_cast<float>(b));
    }
    std::stable_sort(out.begin(), out.end(), [](const auto & a, const auto & b) { return a.first < b.first; });
    std::vector<std::pair<llama_token, float>> merged;
    for (const auto & e : out) {
        if (!merged.empty() && merged.back().first == e.first) {
            merged.back().second += e.second;
        } else {
            merged.push_back(e);
        }
    }
    return merged;
}

}  // namespace lloyal
