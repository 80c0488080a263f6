#include "common.hpp"
#include "errors.hpp"
#include "logits.hpp"
#include "sampling.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>

namespace lloyal {

namespace {

// llama.cpp reads LLAMA_DEFAULT_SEED (0xFFFFFFFF) as "pick a random seed"; here every seed is a seed.
constexpr uint64_t k_max_seed = 0xFFFFFFFEull;
// llama.cpp truncates longer DRY sequence breakers (with a log line); here they are refused.
constexpr size_t k_max_breaker_bytes = 40;

const std::set<std::string> & sampler_keys() {
    static const std::set<std::string> keys = {
        "temperature",     "top_k",          "top_p",           "min_p",
        "typical_p",       "top_n_sigma",    "xtc_probability", "xtc_threshold",
        "dry_multiplier",  "dry_base",       "dry_allowed_length", "dry_penalty_last_n",
        "dry_sequence_breakers", "repeat_penalty", "repeat_last_n", "presence_penalty",
        "frequency_penalty", "seed",         "mirostat",        "mirostat_tau",
        "mirostat_eta",
    };
    return keys;
}

const std::set<std::string> & generate_only_keys() {
    static const std::set<std::string> keys = {"n_predict", "ignore_eos", "logit_bias", "grammar", "stop",
                                               "cache_prompt"};
    return keys;
}

// Reads one dict with the messages naming it `what` ("generate param", "sampler param").
class param_reader {
  public:
    param_reader(const py::dict & d, std::string what) : d_(d), what_(std::move(what)) {}

    // A key that is present but None means the same as a missing one: the zero value.
    bool has(const char * key) const { return d_.contains(key) && !d_[key].is_none(); }

    int64_t get_int(const char * key, int64_t lo, int64_t hi) const {
        return dict_int<py::type_error, std::invalid_argument>(d_, key, lo, hi, name(key));
    }

    float get_float(const char * key) const {
        py::object v = d_[key];
        if (PyBool_Check(v.ptr()) || PyUnicode_Check(v.ptr())) {
            throw py::type_error(name(key) + " must be a number");
        }
        const double x = PyFloat_AsDouble(v.ptr());
        if (x == -1.0 && PyErr_Occurred()) {
            throw py::error_already_set();
        }
        if (!std::isfinite(x) || std::fabs(x) > std::numeric_limits<float>::max()) {
            throw std::invalid_argument(std::string(key) + " must be a finite float");
        }
        return static_cast<float>(x);
    }

    float get_float_in(const char * key, float lo, float hi) const {
        const float x = get_float(key);
        if (x < lo || x > hi) {
            throw std::invalid_argument(std::string(key) + " must be in [" + fmt(lo) + ", " + fmt(hi) + "]");
        }
        return x;
    }

    float get_non_negative(const char * key) const {
        const float x = get_float(key);
        if (x < 0.0f) {
            throw std::invalid_argument(std::string(key) + " must be >= 0");
        }
        return x;
    }

    bool get_bool(const char * key) const {
        py::object v = d_[key];
        if (!PyBool_Check(v.ptr())) {
            throw py::type_error(name(key) + " must be a bool");
        }
        return v.ptr() == Py_True;
    }

    // A list of str; a bare str is one item (iterating it would make every character an item).
    std::vector<std::string> get_strings(const char * key) const {
        py::object s = d_[key];
        std::vector<py::object> items;
        if (PyUnicode_Check(s.ptr())) {
            items.push_back(s);
        } else {
            if (!py::isinstance<py::iterable>(s)) {
                throw py::type_error(name(key) + " must be a list of str");
            }
            for (auto it : py::iter(s)) {
                items.push_back(py::reinterpret_borrow<py::object>(it));
            }
        }
        std::vector<std::string> out;
        for (const auto & it : items) {
            if (!PyUnicode_Check(it.ptr())) {
                throw py::type_error(name(key) + " must be a list of str");
            }
            out.push_back(it.cast<std::string>());
        }
        return out;
    }

    const py::dict & dict() const { return d_; }
    std::string name(const char * key) const { return what_ + " '" + key + "'"; }

  private:
    static std::string fmt(float x) {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(x));
        return buf;
    }

    const py::dict & d_;
    std::string what_;
};

void check_keys(const py::dict & d, const std::string & what, bool allow_generate_only) {
    for (auto item : d) {
        if (!PyUnicode_Check(item.first.ptr())) {
            throw py::type_error(what + " keys must be str");
        }
        const std::string key = item.first.cast<std::string>();
        if (sampler_keys().count(key) != 0) {
            continue;
        }
        if (generate_only_keys().count(key) != 0) {
            if (allow_generate_only) {
                continue;
            }
            throw std::invalid_argument("'" + key + "' is a generate() param, not a sampler param");
        }
        throw std::invalid_argument("unknown " + what + " '" + key + "'");
    }
}

void read_sampler_fields(const param_reader & r, sampler_params & p) {
    constexpr int64_t i32_max = std::numeric_limits<int32_t>::max();
    if (r.has("temperature")) {
        p.temperature = r.get_float("temperature");
    }
    if (r.has("top_k")) {
        p.top_k = static_cast<int32_t>(r.get_int("top_k", 0, i32_max));
    }
    if (r.has("top_p")) {
        p.top_p = r.get_non_negative("top_p");
    }
    if (r.has("min_p")) {
        p.min_p = r.get_float_in("min_p", 0.0f, 1.0f);
    }
    if (r.has("typical_p")) {
        p.typical_p = r.get_non_negative("typical_p");
    }
    if (r.has("top_n_sigma")) {
        p.top_n_sigma = r.get_non_negative("top_n_sigma");
    }
    if (r.has("xtc_probability")) {
        p.xtc_probability = r.get_float_in("xtc_probability", 0.0f, 1.0f);
    }
    if (r.has("xtc_threshold")) {
        p.xtc_threshold = r.get_float_in("xtc_threshold", 0.0f, 1.0f);
    }
    if (r.has("dry_multiplier")) {
        p.dry_multiplier = r.get_non_negative("dry_multiplier");
    }
    if (r.has("dry_base")) {
        p.dry_base = r.get_float("dry_base");
        // Below 1 the penalty would shrink as the repetition grows (llama.cpp silently turns DRY off).
        if (p.dry_base != 0.0f && p.dry_base < 1.0f) {
            throw std::invalid_argument("dry_base must be 0 (1.75) or >= 1");
        }
    }
    if (r.has("dry_allowed_length")) {
        p.dry_allowed_length = static_cast<int32_t>(r.get_int("dry_allowed_length", 0, i32_max));
    }
    if (r.has("dry_penalty_last_n")) {
        p.dry_penalty_last_n = static_cast<int32_t>(r.get_int("dry_penalty_last_n", -1, i32_max));
    }
    if (r.has("dry_sequence_breakers")) {
        p.dry_sequence_breakers = r.get_strings("dry_sequence_breakers");
        for (const auto & b : p.dry_sequence_breakers) {
            if (b.empty() || b.size() > k_max_breaker_bytes) {
                throw std::invalid_argument("dry_sequence_breakers must be non-empty strings of at most " +
                                            std::to_string(k_max_breaker_bytes) + " bytes");
            }
        }
    }
    if (r.has("repeat_penalty")) {
        p.repeat_penalty = r.get_non_negative("repeat_penalty");
    }
    if (r.has("repeat_last_n")) {
        // -1: the whole context, as in llama.cpp.
        p.repeat_last_n = static_cast<int32_t>(r.get_int("repeat_last_n", -1, i32_max));
    }
    if (r.has("presence_penalty")) {
        p.presence_penalty = r.get_float("presence_penalty");
    }
    if (r.has("frequency_penalty")) {
        p.frequency_penalty = r.get_float("frequency_penalty");
    }
    if (r.has("seed")) {
        p.seed = parse_seed(r.dict()["seed"], r.name("seed"));
    }
    if (r.has("mirostat")) {
        p.mirostat = static_cast<int32_t>(r.get_int("mirostat", 0, 2));
    }
    if (r.has("mirostat_tau")) {
        p.mirostat_tau = r.get_non_negative("mirostat_tau");
    }
    if (r.has("mirostat_eta")) {
        p.mirostat_eta = r.get_non_negative("mirostat_eta");
    }
}

}  // namespace

bool sampler_params::penalties_on() const {
    const bool repeat_on = repeat_penalty != 0.0f && repeat_penalty != 1.0f;
    return repeat_last_n != 0 && (repeat_on || presence_penalty != 0.0f || frequency_penalty != 0.0f);
}

bool sampler_params::dry_on() const { return dry_multiplier > 0.0f && dry_penalty_last_n != 0; }

bool sampler_params::operator==(const sampler_params & o) const {
    return temperature == o.temperature && top_k == o.top_k && top_p == o.top_p && min_p == o.min_p &&
           typical_p == o.typical_p && top_n_sigma == o.top_n_sigma && xtc_probability == o.xtc_probability &&
           xtc_threshold == o.xtc_threshold && dry_multiplier == o.dry_multiplier && dry_base == o.dry_base &&
           dry_allowed_length == o.dry_allowed_length && dry_penalty_last_n == o.dry_penalty_last_n &&
           dry_sequence_breakers == o.dry_sequence_breakers && repeat_penalty == o.repeat_penalty &&
           repeat_last_n == o.repeat_last_n && presence_penalty == o.presence_penalty &&
           frequency_penalty == o.frequency_penalty && seed == o.seed && mirostat == o.mirostat &&
           mirostat_tau == o.mirostat_tau && mirostat_eta == o.mirostat_eta;
}

uint32_t parse_seed(py::handle v, const std::string & what) {
    long long s = 0;
    if (!strict_int(v, what, s) || s < 0 || static_cast<uint64_t>(s) > k_max_seed) {
        throw std::invalid_argument("seed must be in [0, 2**32-2]");
    }
    return static_cast<uint32_t>(s);
}

sampler_params parse_sampler_params(const py::dict & d) {
    check_keys(d, "sampler param", false);
    sampler_params p;
    read_sampler_fields(param_reader(d, "sampler param"), p);
    return p;
}

gen_params parse_gen_params(const py::dict & d, const Model & model) {
    check_keys(d, "generate param", true);
    const param_reader r(d, "generate param");
    gen_params p;
    read_sampler_fields(r, p);
    if (r.has("n_predict")) {
        // Anything <= 0 means "until the context is full"; clamp the rest into int32.
        const int64_t n = r.get_int("n_predict", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
        p.n_predict = static_cast<int32_t>(std::clamp<int64_t>(n, -1, std::numeric_limits<int32_t>::max()));
    }
    if (r.has("ignore_eos")) {
        p.ignore_eos = r.get_bool("ignore_eos");
    }
    if (r.has("cache_prompt")) {
        p.cache_prompt = r.get_bool("cache_prompt");
    }
    if (r.has("grammar")) {
        py::object g = d["grammar"];
        if (!PyUnicode_Check(g.ptr())) {
            throw py::type_error("generate param 'grammar' must be a str");
        }
        p.grammar = g.cast<std::string>();
    }
    if (r.has("stop")) {
        p.stop = r.get_strings("stop");
        for (const auto & s : p.stop) {
            if (s.empty()) {
                throw std::invalid_argument("stop strings must not be empty");
            }
        }
    }
    if (r.has("logit_bias")) {
        py::object lb = d["logit_bias"];
        py::object items;
        if (PyDict_Check(lb.ptr())) {
            items = lb.attr("items")();
        } else {
            items = lb;  // also accept an iterable of (token, bias) pairs
        }
        for (auto it : py::iter(items)) {
            py::tuple pair = py::reinterpret_borrow<py::object>(it).cast<py::tuple>();
            if (pair.size() != 2) {
                throw py::type_error("logit_bias must map token ids to floats");
            }
            const llama_token tok = token_from_py(pair[0], model);
            const double b = PyFloat_AsDouble(pair[1].ptr());
            if (b == -1.0 && PyErr_Occurred()) {
                throw py::error_already_set();
            }
            // -inf forbids a token; +inf or NaN would turn the softmax into NaNs.
            if (std::isnan(b) || b == std::numeric_limits<double>::infinity()) {
                throw std::invalid_argument("logit_bias values must be finite or -inf");
            }
            p.logit_bias.push_back({tok, static_cast<float>(b)});
        }
    }
    return p;
}

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

void prime_window(llama_sampler * s, int32_t last_n, const std::vector<llama_token> & history, size_t n_history,
                  const std::vector<llama_token> & appended) {
    if (s == nullptr) {
        return;
    }
    const size_t total = n_history + appended.size();
    const size_t want = std::min<size_t>(total, static_cast<size_t>(last_n));
    for (size_t i = total - want; i < total; ++i) {
        llama_sampler_accept(s, i < n_history ? history[i] : appended[i - n_history]);
    }
}

sampler_chain::sampler_chain(const gen_params & p, const Model & model, uint32_t n_ctx) : n_vocab_(model.n_vocab()) {
    // The grammar first: it is the one part that can fail, and it must fail before anything else
    // is allocated or the KV cache touched.
    sampler_ptr grammar;
    if (!p.grammar.empty()) {
        grammar.reset(make_grammar_sampler(model, p.grammar));
        has_grammar_ = true;
    }
    chain_stages st = make_chain_stages(p, model, n_ctx);

    llama_sampler_chain_params cp = llama_sampler_chain_default_params();
    cp.no_perf = true;
    chain_ = llama_sampler_chain_init(cp);

    std::vector<llama_logit_bias> bias = p.logit_bias;
    if (p.ignore_eos) {
        for (llama_token t : model.eog_tokens()) {
            bias.push_back({t, -std::numeric_limits<float>::infinity()});
        }
    }
    if (!bias.empty()) {
        llama_sampler_chain_add(chain_, llama_sampler_init_logit_bias(n_vocab_, static_cast<int32_t>(bias.size()),
                                                                      bias.data()));
    }
    penalty_last_n_ = st.penalty_last_n;
    dry_last_n_ = st.dry_last_n;
    if (st.penalties) {
        penalties_ = st.penalties.release();
        llama_sampler_chain_add(chain_, penalties_);
    }
    if (st.dry) {
        dry_ = st.dry.release();
        llama_sampler_chain_add(chain_, dry_);
    }

    if (grammar) {
        if (p.greedy()) {
            grammar_ = grammar.release();  // checked after the argmax instead: see sample()
        } else {
            llama_sampler_chain_add(chain_, grammar.release());
        }
    }

    if (p.greedy()) {
        // Greedy: no truncation samplers, no RNG. With nothing else enabled the chain is [greedy],
        // exactly what llama.cpp's examples/simple runs.
        llama_sampler_chain_add(chain_, llama_sampler_init_greedy());
        if (penalties_ == nullptr && dry_ == nullptr) {
            // The chain is [logit_bias?, greedy]: stateless, so its choice can be computed directly.
            // Filling a 262k-entry candidate array per token costs ~0.5 ms, 4% of a Gemma 270M step.
            direct_argmax_ = true;
            bias_ = bias;
            if (!bias_.empty()) {
                biased_.assign(static_cast<size_t>(n_vocab_), 0);
                for (const auto & b : bias_) {
                    biased_[static_cast<size_t>(b.token)] = 1;
                }
            }
        }
        return;
    }
    for (auto & s : st.rest) {
        llama_sampler_chain_add(chain_, s.release());
    }
}

sampler_chain::~sampler_chain() {
    if (chain_ != nullptr) {
        llama_sampler_free(chain_);
    }
    if (grammar_ != nullptr) {
        llama_sampler_free(grammar_);
    }
}

void sampler_chain::prime_penalties(const std::vector<llama_token> & history, size_t n_history_used,
                                    const std::vector<llama_token> & appended) {
    prime_window(penalties_, penalty_last_n_, history, n_history_used, appended);
    prime_window(dry_, dry_last_n_, history, n_history_used, appended);
}

llama_token sampler_chain::argmax(const float * logits) const {
    // The same choice as llama.cpp's logit_bias + greedy samplers: biases add up per token (a token
    // may appear more than once), and the first maximum wins; -inf everywhere means nothing allowed.
    llama_token best = first_argmax(logits, n_vocab_);
    float best_v = best == LLAMA_TOKEN_NULL ? -std::numeric_limits<float>::infinity() : logits[best];
    if (best != LLAMA_TOKEN_NULL && !biased_.empty() && biased_[static_cast<size_t>(best)]) {
        // The raw winner carries a bias (typically a banned EOG): find the best unbiased token.
        best = LLAMA_TOKEN_NULL;
        best_v = -std::numeric_limits<float>::infinity();
        for (llama_token t = 0; t < n_vocab_; ++t) {
            if (!biased_[static_cast<size_t>(t)] && logits[t] > best_v) {
                best_v = logits[t];
                best = t;
            }
        }
    }
    for (size_t i = 0; i < bias_.size(); ++i) {
        const llama_token t = bias_[i].token;
        bool first = true;  // sum each token's biases once, at its first entry
        for (size_t j = 0; j < i; ++j) {
            first = first && bias_[j].token != t;
        }
        if (!first) {
            continue;
        }
        float v = logits[t];
        for (size_t j = i; j < bias_.size(); ++j) {
            if (bias_[j].token == t) {
                v += bias_[j].bias;
            }
        }
        if (v > best_v || (v == best_v && best != LLAMA_TOKEN_NULL && t < best)) {
            best_v = v;
            best = t;
        }
    }
    return best_v == -std::numeric_limits<float>::infinity() ? LLAMA_TOKEN_NULL : best;
}

llama_token sampler_chain::sample(llama_context * ctx) {
    // llama_sampler_sample() does this too, but GGML_ASSERTs (aborting the process) where we
    // would rather report, and it cannot tell "nothing allowed" from a real choice.
    const float * logits = llama_get_logits_ith(ctx, -1);
    if (logits == nullptr) {
        throw lloyal_error("no logits to sample from");
    }
    if (direct_argmax_ && grammar_ == nullptr) {
        return argmax(logits);  // stateless chain: nothing to accept
    }
    auto fill = [&] {
        cur_.resize(static_cast<size_t>(n_vocab_));
        for (llama_token t = 0; t < n_vocab_; ++t) {
            cur_[static_cast<size_t>(t)] = llama_token_data{t, logits[t], 0.0f};
        }
        return llama_token_data_array{cur_.data(), cur_.size(), -1, false};
    };
    auto is_banned = [](const llama_token_data & d) { return std::isinf(d.logit) && d.logit < 0.0f; };
    llama_token_data_array cur_p = fill();
    try {
        llama_sampler_apply(chain_, &cur_p);
        if (grammar_ != nullptr && cur_p.selected >= 0 && static_cast<size_t>(cur_p.selected) < cur_p.size) {
            // Greedy with a grammar: masking the whole vocabulary costs a grammar walk per token, tens
            // of ms for a 262k vocabulary, while the argmax is usually allowed. Checking that one token
            // first gives the same answer (the argmax of the allowed tokens is the overall argmax when
            // that one is allowed; bias, penalties and the mask commute), so only mask on a miss.
            llama_token_data one = cur_p.data[cur_p.selected];
            llama_token_data_array one_p = {&one, 1, -1, false};
            llama_sampler_apply(grammar_, &one_p);
            if (is_banned(one) && !is_banned(cur_p.data[cur_p.selected])) {
                cur_p = fill();
                llama_sampler_apply(grammar_, &cur_p);
                llama_sampler_apply(chain_, &cur_p);
            }
        }
    } catch (const std::exception & e) {
        throw lloyal_error(std::string("sampling failed: ") + e.what());
    }
    if (cur_p.selected < 0 || static_cast<size_t>(cur_p.selected) >= cur_p.size) {
        return LLAMA_TOKEN_NULL;
    }
    const llama_token_data & chosen = cur_p.data[cur_p.selected];
    if (is_banned(chosen)) {
        return LLAMA_TOKEN_NULL;
    }
    const llama_token id = chosen.id;
    try {
        llama_sampler_accept(chain_, id);
        if (grammar_ != nullptr) {
            llama_sampler_accept(grammar_, id);
        }
    } catch (const std::exception & e) {
        // The grammar refuses a token it did not mask out: a grammar llama.cpp cannot follow.
        throw grammar_error(std::string("grammar rejected the sampled token: ") + e.what());
    }
    return id;
}

}  // namespace lloyal
