// Python dicts of lloyal_pool.params -> the typed structs of the C++ code: sampler and generate params
// (sampling.hpp, one rule per declared field), grammars, logit bias, context params. The C++ side owns
// validation: lloyal_pool.params only shapes types and keeps the checks that must fail before a request.
#include "bind.hpp"
#include "errors.hpp"

#include "common.h"

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
constexpr int64_t k_i32_max = std::numeric_limits<int32_t>::max();
// The n_seq_max of an embedding context unless it is given: how many texts one decode may take.
constexpr uint32_t k_embed_seq_max = 16;

const std::set<std::string> & sampler_keys() {
    static const std::set<std::string> keys(sampler_field_names().begin(), sampler_field_names().end());
    return keys;
}

const std::set<std::string> & generate_only_keys() {
    static const std::set<std::string> keys = {"n_predict", "ignore_eos", "logit_bias", "grammar", "stop",
                                               "cache_prompt", "cache_bit_exact",
                                               "render_special", "logprobs"};
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

// One reader per rule of LLOYAL_SAMPLER_FIELDS.
float read_any_float(const param_reader & r, const char * key) { return r.get_float(key); }
float read_non_negative(const param_reader & r, const char * key) { return r.get_non_negative(key); }
float read_unit(const param_reader & r, const char * key) { return r.get_float_in(key, 0.0f, 1.0f); }
int32_t read_count(const param_reader & r, const char * key) { return static_cast<int32_t>(r.get_int(key, 0, k_i32_max)); }
// -1: the whole context.
int32_t read_window(const param_reader & r, const char * key) {
    return static_cast<int32_t>(r.get_int(key, -1, k_i32_max));
}
int32_t read_mirostat(const param_reader & r, const char * key) { return static_cast<int32_t>(r.get_int(key, 0, 2)); }
uint32_t read_seed(const param_reader & r, const char * key) { return parse_seed(r.dict()[key], r.name(key)); }

float read_dry_base(const param_reader & r, const char * key) {
    const float x = r.get_float(key);
    // Below 1 the penalty would shrink as the repetition grows (llama.cpp silently turns DRY off).
    if (x != 0.0f && x < 1.0f) {
        throw std::invalid_argument("dry_base must be 0 (1.75) or >= 1");
    }
    return x;
}

std::vector<std::string> read_breakers(const param_reader & r, const char * key) {
    std::vector<std::string> out = r.get_strings(key);
    for (const auto & b : out) {
        if (b.empty() || b.size() > k_max_breaker_bytes) {
            throw std::invalid_argument("dry_sequence_breakers must be non-empty strings of at most " +
                                        std::to_string(k_max_breaker_bytes) + " bytes");
        }
    }
    return out;
}

void read_sampler_fields(const param_reader & r, sampler_params & p) {
#define LLOYAL_SAMPLER_READ(type, name, rule) \
    if (r.has(#name)) {                      \
        p.name = read_##rule(r, #name);      \
    }
    LLOYAL_SAMPLER_FIELDS(LLOYAL_SAMPLER_READ)
#undef LLOYAL_SAMPLER_READ
}

std::vector<std::string> spec_strings(const py::dict & d, const char * key) {
    std::vector<std::string> out;
    if (!d.contains(key) || d[key].is_none()) {
        return out;
    }
    py::object v = d[key];
    if (PyUnicode_Check(v.ptr()) || !py::isinstance<py::iterable>(v)) {
        throw py::type_error(std::string("grammar '") + key + "' must be a list of str");
    }
    for (auto it : py::iter(v)) {
        if (!PyUnicode_Check(it.ptr())) {
            throw py::type_error(std::string("grammar '") + key + "' must be a list of str");
        }
        std::string s = it.cast<std::string>();
        if (s.empty()) {
            throw std::invalid_argument(std::string("grammar '") + key + "' must not hold empty strings");
        }
        out.push_back(std::move(s));
    }
    return out;
}

const std::set<std::string> & known_context_keys() {
    static const std::set<std::string> keys = {
        "n_ctx",      "n_batch",         "n_ubatch", "n_threads", "n_threads_batch", "n_seq_max", "embeddings",
        "rope_freq_base", "rope_freq_scale", "type_k", "type_v",  "swa_full",        "flash_attn",
        "pooling",    "adapt_threads",   "batch_invariant",
    };
    return keys;
}

int64_t ctx_int(const py::dict & d, const char * key, int64_t lo, int64_t hi) {
    return dict_int<context_error, context_error>(d, key, lo, hi, key);
}

float ctx_float(const py::dict & d, const char * key) {
    py::object v = d[key];
    if (PyBool_Check(v.ptr()) || PyUnicode_Check(v.ptr())) {
        throw context_error(std::string(key) + " must be a number");
    }
    const double x = PyFloat_AsDouble(v.ptr());
    if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        throw context_error(std::string(key) + " must be a number");
    }
    if (!std::isfinite(x) || x < 0.0 || x > std::numeric_limits<float>::max()) {
        throw context_error(std::string(key) + " must be a finite number >= 0 (0: the model's value)");
    }
    return static_cast<float>(x);
}

bool ctx_bool(const py::dict & d, const char * key) {
    py::object v = d[key];
    if (!PyBool_Check(v.ptr())) {
        throw context_error(std::string(key) + " must be a bool");
    }
    return v.ptr() == Py_True;
}

enum llama_pooling_type ctx_pooling(const py::dict & d, const char * key) {
    py::object v = d[key];
    static const std::pair<const char *, enum llama_pooling_type> names[] = {
        {"none", LLAMA_POOLING_TYPE_NONE}, {"mean", LLAMA_POOLING_TYPE_MEAN}, {"cls", LLAMA_POOLING_TYPE_CLS},
        {"last", LLAMA_POOLING_TYPE_LAST}, {"rank", LLAMA_POOLING_TYPE_RANK}};
    if (PyUnicode_Check(v.ptr())) {
        const std::string name = v.cast<std::string>();
        for (const auto & [n, t] : names) {
            if (name == n) {
                return t;
            }
        }
        throw context_error(std::string(key) + " '" + name + "' is not a pooling type (none, mean, cls, last, rank)");
    }
    throw context_error(std::string(key) + " must be one of \"none\", \"mean\", \"cls\", \"last\", \"rank\"");
}

ggml_type ctx_cache_type(const py::dict & d, const char * key) {
    py::object v = d[key];
    if (!PyUnicode_Check(v.ptr())) {
        throw context_error(std::string(key) + " must be a ggml type name such as \"f16\" or \"q8_0\"");
    }
    const std::string name = v.cast<std::string>();
    // The cache types llama.cpp's own tools accept.
    static const ggml_type allowed[] = {GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                        GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1};
    std::string names;
    for (ggml_type t : allowed) {
        if (name == ggml_type_name(t)) {
            return t;
        }
        names += names.empty() ? "" : ", ";
        names += ggml_type_name(t);
    }
    throw context_error(std::string(key) + " '" + name + "' is not a KV cache type (one of: " + names + ")");
}

}  // namespace

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

// The most alternatives a token's logprobs carry (OpenAI's top_logprobs limit).
constexpr int64_t k_max_logprobs = 20;

gen_params parse_gen_params(const py::dict & d, const Model & model) {
    check_keys(d, "generate param", true);
    const param_reader r(d, "generate param");
    gen_params p;
    read_sampler_fields(r, p);
    if (r.has("n_predict")) {
        // Anything <= 0 means "until the context is full"; clamp the rest into int32.
        const int64_t n = r.get_int("n_predict", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
        p.n_predict = static_cast<int32_t>(std::clamp<int64_t>(n, -1, k_i32_max));
    }
    if (r.has("ignore_eos")) {
        p.ignore_eos = r.get_bool("ignore_eos");
    }
    if (r.has("cache_prompt")) {
        p.cache_prompt = r.get_bool("cache_prompt");
    }
    if (r.has("cache_bit_exact")) {
        p.cache_bit_exact = r.get_bool("cache_bit_exact");
    }
    if (r.has("render_special")) {
        p.render_special = r.get_bool("render_special");
    }
    if (r.has("grammar")) {
        // GBNF text ("" none), or a grammar dict as branches take it (lazy triggers included).
        py::object g = d["grammar"];
        if (PyUnicode_Check(g.ptr())) {
            std::string gbnf = g.cast<std::string>();
            if (!gbnf.empty()) {
                p.grammar = grammar_spec{};
                p.grammar->gbnf = std::move(gbnf);
            }
        } else if (PyDict_Check(g.ptr())) {
            p.grammar = parse_grammar(g, model);
        } else {
            throw py::type_error("generate param 'grammar' must be GBNF text or a grammar dict");
        }
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
        p.logit_bias = parse_logit_bias(d["logit_bias"], model);
    }
    if (r.has("logprobs")) {
        p.n_logprobs = static_cast<int32_t>(r.get_int("logprobs", 0, k_max_logprobs));
    }
    return p;
}

std::optional<grammar_spec> parse_grammar(py::handle spec, const Model & model) {
    if (spec.is_none()) {
        return std::nullopt;
    }
    if (!PyDict_Check(spec.ptr())) {
        throw py::type_error("a grammar must be a dict (or None)");
    }
    const py::dict d = py::reinterpret_borrow<py::dict>(spec);
    static const std::set<std::string> keys = {"gbnf", "root", "lazy", "trigger_words", "trigger_patterns",
                                               "trigger_tokens", "prefill"};
    for (auto item : d) {
        if (!PyUnicode_Check(item.first.ptr()) || keys.count(item.first.cast<std::string>()) == 0) {
            throw std::invalid_argument("unknown grammar key " + py::repr(item.first).cast<std::string>() +
                                        " (gbnf, root, lazy, trigger_words, trigger_patterns, trigger_tokens, "
                                        "prefill)");
        }
    }
    grammar_spec g;
    if (!d.contains("gbnf") || !PyUnicode_Check(d["gbnf"].ptr())) {
        throw py::type_error("grammar 'gbnf' must be a str");
    }
    g.gbnf = d["gbnf"].cast<std::string>();
    if (g.gbnf.empty()) {
        throw grammar_error("empty grammar (pass None to remove a branch's grammar)");
    }
    if (d.contains("root") && !d["root"].is_none()) {
        if (!PyUnicode_Check(d["root"].ptr())) {
            throw py::type_error("grammar 'root' must be a str");
        }
        g.root = d["root"].cast<std::string>();
    }
    if (d.contains("lazy") && !d["lazy"].is_none()) {
        if (!PyBool_Check(d["lazy"].ptr())) {
            throw py::type_error("grammar 'lazy' must be a bool");
        }
        g.lazy = d["lazy"].ptr() == Py_True;
    }
    for (const auto & w : spec_strings(d, "trigger_words")) {
        g.trigger_patterns.push_back(::regex_escape(w));  // llama.cpp common's, as its sampler does
    }
    for (auto & p : spec_strings(d, "trigger_patterns")) {
        g.trigger_patterns.push_back(std::move(p));
    }
    if (d.contains("trigger_tokens") && !d["trigger_tokens"].is_none()) {
        g.trigger_tokens = tokens_from_py(d["trigger_tokens"], model);
    }
    const bool has_triggers = !g.trigger_patterns.empty() || !g.trigger_tokens.empty();
    if (g.lazy && !has_triggers) {
        throw std::invalid_argument("a lazy grammar needs at least one trigger (word, pattern or token)");
    }
    if (!g.lazy && has_triggers) {
        throw std::invalid_argument("triggers only apply to a lazy grammar (lazy=True)");
    }
    if (d.contains("prefill") && !d["prefill"].is_none()) {
        if (!PyUnicode_Check(d["prefill"].ptr())) {
            throw py::type_error("grammar 'prefill' must be a str");
        }
        g.prefill = d["prefill"].cast<std::string>();
        if (g.lazy && !g.prefill.empty()) {
            throw std::invalid_argument("a prefill applies to a grammar that is not lazy");
        }
    }
    return g;
}

std::vector<std::pair<llama_token, float>> parse_logit_bias(py::handle bias, const Model & model) {
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
    return normalized_bias(std::move(out));
}

bool parse_batch_invariant(const py::dict & params) {
    return params.contains("batch_invariant") && ctx_bool(params, "batch_invariant");
}

bool parse_adapt_threads(const py::dict & params) {
    return !params.contains("adapt_threads") || ctx_bool(params, "adapt_threads");
}

llama_context_params parse_context_params(const py::dict & params) {
    for (auto item : params) {
        if (!PyUnicode_Check(item.first.ptr())) {
            throw context_error("context params keys must be str");
        }
        const std::string key = item.first.cast<std::string>();
        if (known_context_keys().count(key) == 0) {
            throw context_error("unknown context param '" + key + "'");
        }
    }
    auto has = [&](const char * key) { return params.contains(key) && !params[key].is_none(); };
    constexpr int64_t i32_max = std::numeric_limits<int32_t>::max();

    llama_context_params cp = llama_context_default_params();
    if (has("n_ctx")) {
        cp.n_ctx = static_cast<uint32_t>(ctx_int(params, "n_ctx", 0, i32_max));
    }
    if (has("n_batch")) {
        cp.n_batch = static_cast<uint32_t>(ctx_int(params, "n_batch", 1, i32_max));
    }
    if (has("n_ubatch")) {
        cp.n_ubatch = static_cast<uint32_t>(ctx_int(params, "n_ubatch", 1, i32_max));
    }
    // More threads than ggml can run would only fail deeper down.
    cp.n_threads = default_threads();
    if (has("n_threads")) {
        cp.n_threads = static_cast<int32_t>(ctx_int(params, "n_threads", 1, GGML_MAX_N_THREADS));
    }
    cp.n_threads_batch = cp.n_threads;
    if (has("n_threads_batch")) {
        cp.n_threads_batch = static_cast<int32_t>(ctx_int(params, "n_threads_batch", 1, GGML_MAX_N_THREADS));
    }
    if (has("n_seq_max")) {
        cp.n_seq_max = static_cast<uint32_t>(
            ctx_int(params, "n_seq_max", 1, static_cast<int64_t>(llama_max_parallel_sequences())));
    }
    if (has("embeddings")) {
        cp.embeddings = ctx_bool(params, "embeddings");
    }
    if (has("pooling")) {
        cp.pooling_type = ctx_pooling(params, "pooling");
    }
    if (cp.embeddings) {
        // llama.cpp pools per ubatch, so a text is pooled whole only when a decode is a single ubatch:
        // the two sizes go together here (512 unless one of them is given).
        if (!has("n_batch") && !has("n_ubatch")) {
            cp.n_batch = cp.n_ubatch = 512;
        } else if (!has("n_ubatch")) {
            cp.n_ubatch = cp.n_batch;
        } else if (!has("n_batch")) {
            cp.n_batch = cp.n_ubatch;
        }
        // Several texts per decode, one sequence each (the cache is unified: sequences cost nothing).
        if (!has("n_seq_max")) {
            cp.n_seq_max = std::min({k_embed_seq_max, cp.n_batch, static_cast<uint32_t>(llama_max_parallel_sequences())});
        }
    }
    if (has("rope_freq_base")) {
        cp.rope_freq_base = ctx_float(params, "rope_freq_base");
    }
    if (has("rope_freq_scale")) {
        cp.rope_freq_scale = ctx_float(params, "rope_freq_scale");
    }
    if (has("type_k")) {
        cp.type_k = ctx_cache_type(params, "type_k");
    }
    if (has("type_v")) {
        cp.type_v = ctx_cache_type(params, "type_v");
    }
    cp.swa_full = true;  // full-size sliding-window cache by default (branches need it)
    if (has("swa_full")) {
        cp.swa_full = ctx_bool(params, "swa_full");
    }

    if (has("flash_attn")) {
        py::object fa = params["flash_attn"];
        if (PyBool_Check(fa.ptr())) {
            cp.flash_attn_type = fa.ptr() == Py_True ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        } else if (PyUnicode_Check(fa.ptr())) {
            const std::string v = fa.cast<std::string>();
            if (v == "auto") {
                cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
            } else if (v == "on") {
                cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
            } else if (v == "off") {
                cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            } else {
                throw context_error("flash_attn must be \"auto\", \"on\" or \"off\", got '" + v + "'");
            }
        } else {
            throw context_error("flash_attn must be \"auto\", \"on\" or \"off\"");
        }
    }
    if (parse_batch_invariant(params)) {
        // Flash attention on the CPU visits a row's own cells only, in cache order; without it the attention
        // sums run over every sequence's cells, and where another sequence's cells lie changes the rounding.
        if (cp.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED) {
            throw context_error("batch_invariant needs flash attention: leave flash_attn unset or \"on\"");
        }
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    }
    return cp;
}

}  // namespace lloyal
