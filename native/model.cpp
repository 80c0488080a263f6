#include "common.hpp"
#include "errors.hpp"
#include "model.hpp"
#include "sampling.hpp"

#include <algorithm>
#include <cctype>
#include <string_view>

#include <climits>
#include <exception>

#include <memory>
#include <optional>

#include <gguf.h>
#include <sys/stat.h>

namespace lloyal {

namespace {

struct progress_state {
    Model::progress_fn fn;
    std::exception_ptr error;
    bool cancelled = false;
};

bool progress_trampoline(float fraction, void * user_data) {
    auto * st = static_cast<progress_state *>(user_data);
    if (st->error || st->cancelled) {
        return false;
    }
    try {
        st->cancelled = !st->fn(fraction);
    } catch (...) {
        st->error = std::current_exception();
    }
    return !(st->error || st->cancelled);
}

std::string meta_string(int32_t (*fn)(const llama_model *, int32_t, char *, size_t), const llama_model * model,
                        int32_t i) {
    std::vector<char> buf(256);
    int32_t n = fn(model, i, buf.data(), buf.size());
    if (n < 0) {
        return {};
    }
    if (static_cast<size_t>(n) >= buf.size()) {
        buf.resize(static_cast<size_t>(n) + 1);
        n = fn(model, i, buf.data(), buf.size());
        if (n < 0) {
            return {};
        }
    }
    return std::string(buf.data(), static_cast<size_t>(n));
}

// llama.cpp's limits on a model's layers and experts (LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS in
// src/llama-hparams.h; not in its API).
constexpr int64_t max_layers = 512;
constexpr int64_t max_experts = 1024;

// The value of an integer key (the largest element of an integer array: per-layer values); nothing when
// the key is absent or of another type.
std::optional<int64_t> int_value(const gguf_context * g, const std::string & key) {
    const int64_t k = gguf_find_key(g, key.c_str());
    if (k < 0) {
        return std::nullopt;
    }
    switch (gguf_get_kv_type(g, k)) {
        case GGUF_TYPE_UINT8: return gguf_get_val_u8(g, k);
        case GGUF_TYPE_INT8: return gguf_get_val_i8(g, k);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, k);
        case GGUF_TYPE_INT16: return gguf_get_val_i16(g, k);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, k);
        case GGUF_TYPE_INT32: return gguf_get_val_i32(g, k);
        case GGUF_TYPE_UINT64: return static_cast<int64_t>(std::min<uint64_t>(gguf_get_val_u64(g, k), INT64_MAX));
        case GGUF_TYPE_INT64: return gguf_get_val_i64(g, k);
        case GGUF_TYPE_ARRAY: {
            const gguf_type t = gguf_get_arr_type(g, k);
            const size_t n = gguf_get_arr_n(g, k);
            if (n == 0 || (t != GGUF_TYPE_UINT32 && t != GGUF_TYPE_INT32)) {
                return std::nullopt;
            }
            int64_t best = INT64_MIN;
            for (size_t i = 0; i < n; ++i) {
                const void * data = gguf_get_arr_data(g, k);
                best = std::max<int64_t>(best, t == GGUF_TYPE_UINT32 ? static_cast<const uint32_t *>(data)[i]
                                                                     : static_cast<const int32_t *>(data)[i]);
            }
            return best;
        }
        default: return std::nullopt;
    }
}

// Checks of the file's metadata for the values llama.cpp meets with an assertion, which aborts the
// worker, instead of an error (llama_model::load_hparams): the block count, the next-token-prediction
// layers and the expert counts. Only the metadata is read (no tensor data), which is cheap next to the
// load itself. The rarer expert-group rules are left to llama.cpp.
void check_metadata(const std::string & path, uint64_t mark) {
    gguf_init_params gp{};
    gp.no_alloc = true;
    gp.ctx = nullptr;
    std::unique_ptr<gguf_context, decltype(&gguf_free)> owner(gguf_init_from_file(path.c_str(), gp), &gguf_free);
    const gguf_context * g = owner.get();
    if (g == nullptr) {
        throw model_load_error("failed to load model '" + path + "': not a valid GGUF file" +
                               log_reason_since(mark));
    }
    const int64_t arch_key = gguf_find_key(g, "general.architecture");
    if (arch_key < 0 || gguf_get_kv_type(g, arch_key) != GGUF_TYPE_STRING) {
        return;  // llama.cpp says what is wrong with that
    }
    const std::string arch = gguf_get_val_str(g, arch_key);
    auto refuse = [&](const std::string & what) {
        throw model_load_error("failed to load model '" + path + "': " + what);
    };
    auto value = [&](const char * name) { return int_value(g, arch + "." + name); };
    const std::optional<int64_t> n_layer = value("block_count");
    if (!n_layer) {
        return;
    }
    if (*n_layer <= 0 || *n_layer > max_layers) {
        refuse(arch + ".block_count is " + std::to_string(*n_layer) + ", not in [1, " + std::to_string(max_layers) +
               "]");
    }
    const int64_t n_nextn = value("nextn_predict_layers").value_or(0);
    if (n_nextn < 0 || n_nextn > *n_layer) {
        refuse(arch + ".nextn_predict_layers is " + std::to_string(n_nextn) + ", not in [0, block_count " +
               std::to_string(*n_layer) + "]");
    }
    const int64_t n_expert = value("expert_count").value_or(0);
    if (n_expert < 0 || n_expert > max_experts) {
        refuse(arch + ".expert_count is " + std::to_string(n_expert) + ", not in [0, " +
               std::to_string(max_experts) + "]");
    }
    const int64_t n_used = value("expert_used_count").value_or(0);
    if (n_used < 0 || n_used > n_expert || (n_expert > 0 && n_used == 0)) {
        refuse(arch + ".expert_used_count is " + std::to_string(n_used) + " with an expert_count of " +
               std::to_string(n_expert));
    }
}

}  // namespace

namespace {

// A token that is markup for the model rather than text, beyond llama.cpp's CONTROL ones: GGUF files
// often mark special tokens USER_DEFINED (Gemma 3's <start_of_image>), and llama.cpp renders those as
// text. User-defined tokens are also ordinary text (HTML tags, runs of newlines), so only an
// angle-bracketed name with '_' or '|' in it counts, which no HTML tag has.
bool is_marker(const llama_vocab * vocab, llama_token t) {
    if ((llama_vocab_get_attr(vocab, t) & LLAMA_TOKEN_ATTR_USER_DEFINED) == 0) {
        return false;
    }
    const std::string_view text = llama_vocab_get_text(vocab, t);
    if (text.size() < 3 || text.front() != '<' || text.back() != '>') {
        return false;
    }
    const std::string_view name = text.substr(1, text.size() - 2);
    for (char ch : name) {
        if (std::isspace(static_cast<unsigned char>(ch)) != 0 || ch == '<' || ch == '>') {
            return false;
        }
    }
    return name.find_first_of("_|") != std::string_view::npos;
}

}  // namespace

Model::Model(const std::string & path, int n_gpu_layers, bool use_mmap, bool vocab_only, bool repack,
             progress_fn progress)
    : path_(path), vocab_only_(vocab_only), repack_(repack), n_gpu_layers_(n_gpu_layers) {
    // Say what is wrong with the path ourselves: llama.cpp's own message for it is generic.
    struct stat sb {};
    if (::stat(path.c_str(), &sb) != 0) {
        throw model_load_error("model file not found: '" + path + "'");
    }
    if (S_ISDIR(sb.st_mode)) {
        throw model_load_error("model path is a directory, not a GGUF file: '" + path + "'");
    }

    backend_init_once();  // ggml's backends are loaded at run time: the worker's choice, or "auto"
    llama_model_params params = llama_model_default_params();
    params.n_gpu_layers = n_gpu_layers;
    params.load_mode = use_mmap ? LLAMA_LOAD_MODE_MMAP : LLAMA_LOAD_MODE_NONE;
    params.vocab_only = vocab_only;
    params.use_extra_bufts = repack;

    progress_state pstate;
    if (progress) {
        pstate.fn = std::move(progress);
        params.progress_callback = progress_trampoline;
        params.progress_callback_user_data = &pstate;
    }

    const uint64_t mark = log_mark();
    if (!vocab_only) {
        check_metadata(path, mark);
    }
    model_ = llama_model_load_from_file(path.c_str(), params);
    if (pstate.error) {
        if (model_ != nullptr) {
            llama_model_free(model_);
            model_ = nullptr;
        }
        std::rethrow_exception(pstate.error);
    }
    if (model_ == nullptr) {
        if (pstate.cancelled) {
            throw model_load_error("model load cancelled by the progress callback: '" + path + "'");
        }
        throw model_load_error("failed to load model '" + path + "'" + log_reason_since(mark));
    }

    vocab_ = llama_model_get_vocab(model_);
    n_vocab_ = llama_vocab_n_tokens(vocab_);
    for (llama_token t = 0; t < n_vocab_; ++t) {
        if (llama_vocab_is_eog(vocab_, t)) {
            eog_tokens_.push_back(t);
        }
        if (is_marker(vocab_, t)) {
            markers_.push_back(t);
        }
    }
    for (llama_token t = 0; t < n_vocab_; ++t) {
        // Only a token with some attribute besides NORMAL can render differently (this keeps a large
        // vocabulary's load from rendering every piece twice).
        if (llama_vocab_get_attr(vocab_, t) != LLAMA_TOKEN_ATTR_NORMAL && text_piece(t, false) != token_to_piece(t, true)) {
            hidden_tokens_.push_back(t);
        }
    }
}

Model::~Model() {
    join_abandoned_grammar_parses();  // one of them may still read this model's vocabulary
    if (model_ != nullptr) {
        llama_model_free(model_);
    }
}

void Model::check_token(int64_t token) const {
    if (token < 0 || token >= n_vocab_) {
        throw invalid_token_error("token id " + std::to_string(token) + " is outside [0, " + std::to_string(n_vocab_) +
                                  ")");
    }
}

std::vector<llama_token> Model::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    if (text.size() > static_cast<size_t>(INT32_MAX)) {
        throw std::invalid_argument("text too long to tokenize (more than 2**31-1 bytes)");
    }
    const int32_t len = static_cast<int32_t>(text.size());
    std::vector<llama_token> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), len, out.data(), static_cast<int32_t>(out.size()), add_special,
                               parse_special);
    if (n == INT32_MIN) {
        throw std::invalid_argument("tokenization result does not fit in int32");
    }
    if (n < 0) {
        out.resize(static_cast<size_t>(-n));
        n = llama_tokenize(vocab_, text.data(), len, out.data(), static_cast<int32_t>(out.size()), add_special,
                           parse_special);
        if (n < 0) {
            throw lloyal_error("tokenization failed");
        }
    }
    out.resize(static_cast<size_t>(n));
    return out;
}

std::string Model::detokenize(const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) const {
    if (tokens.empty()) {
        return {};
    }
    if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
        throw std::invalid_argument("too many tokens to detokenize");
    }
    const int32_t n_tokens = static_cast<int32_t>(tokens.size());
    std::string out(std::min<size_t>(tokens.size() * 8 + 16, INT32_MAX), '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), n_tokens, out.data(), static_cast<int32_t>(out.size()),
                                 remove_special, unparse_special);
    if (n < 0) {
        if (n == INT32_MIN) {
            throw std::invalid_argument("detokenized text does not fit in int32");
        }
        out.resize(static_cast<size_t>(-n));
        n = llama_detokenize(vocab_, tokens.data(), n_tokens, out.data(), static_cast<int32_t>(out.size()),
                             remove_special, unparse_special);
        if (n < 0) {
            throw lloyal_error("detokenization failed");
        }
    }
    out.resize(static_cast<size_t>(n));
    return out;
}

std::string Model::text_piece(llama_token token, bool render_special) const {
    if (!render_special && std::binary_search(markers_.begin(), markers_.end(), token)) {
        return {};
    }
    return token_to_piece(token, render_special);
}

std::string Model::token_to_piece(llama_token token, bool special) const {
    char small[64];
    int32_t n = llama_token_to_piece(vocab_, token, small, sizeof(small), 0, special);
    if (n >= 0) {
        return std::string(small, static_cast<size_t>(n));
    }
    std::string out(static_cast<size_t>(-n), '\0');
    n = llama_token_to_piece(vocab_, token, out.data(), static_cast<int32_t>(out.size()), 0, special);
    if (n < 0) {
        throw lloyal_error("token_to_piece failed for token " + std::to_string(token));
    }
    out.resize(static_cast<size_t>(n));
    return out;
}

std::string Model::desc() const {
    char buf[256];
    const int32_t n = llama_model_desc(model_, buf, sizeof(buf));
    return std::string(buf, n > 0 ? std::min<size_t>(static_cast<size_t>(n), sizeof(buf) - 1) : 0);
}

std::vector<std::pair<std::string, std::string>> Model::meta() const {
    std::vector<std::pair<std::string, std::string>> out;
    const int32_t n_meta = llama_model_meta_count(model_);
    for (int32_t i = 0; i < n_meta; ++i) {
        out.emplace_back(meta_string(llama_model_meta_key_by_index, model_, i),
                         meta_string(llama_model_meta_val_str_by_index, model_, i));
    }
    return out;
}

}  // namespace lloyal
