#include "common.hpp"
#include "errors.hpp"
#include "model.hpp"

#include <climits>
#include <exception>

#include <sys/stat.h>

namespace lloyal {

namespace {

struct progress_state {
    py::object fn;
    std::exception_ptr error;
    bool cancelled = false;
};

// Runs on the loading thread with the GIL released; takes it only for the Python call.
bool progress_trampoline(float fraction, void * user_data) {
    auto * st = static_cast<progress_state *>(user_data);
    if (st->error || st->cancelled) {
        return false;
    }
    gil_acquire gil;
    try {
        py::object r = st->fn(fraction);
        // Only an explicit falsy answer cancels: a callback that returns None is just observing.
        if (!r.is_none() && !PyObject_IsTrue(r.ptr())) {
            st->cancelled = true;
        }
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

}  // namespace

Model::Model(const std::string & path, int n_gpu_layers, bool use_mmap, bool vocab_only, const py::object & progress)
    : path_(path), vocab_only_(vocab_only) {
    // Say what is wrong with the path ourselves: llama.cpp's own message for it is generic.
    struct stat sb {};
    if (::stat(path.c_str(), &sb) != 0) {
        throw model_load_error("model file not found: '" + path + "'");
    }
    if (S_ISDIR(sb.st_mode)) {
        throw model_load_error("model path is a directory, not a GGUF file: '" + path + "'");
    }

    llama_model_params params = llama_model_default_params();
    params.n_gpu_layers = n_gpu_layers;
    params.load_mode = use_mmap ? LLAMA_LOAD_MODE_MMAP : LLAMA_LOAD_MODE_NONE;
    params.vocab_only = vocab_only;

    progress_state pstate;
    if (!progress.is_none()) {
        if (!PyCallable_Check(progress.ptr())) {
            throw py::type_error("progress must be callable or None");
        }
        pstate.fn = progress;
        params.progress_callback = progress_trampoline;
        params.progress_callback_user_data = &pstate;
    }

    const uint64_t mark = log_mark();
    {
        gil_release nogil;
        model_ = llama_model_load_from_file(path.c_str(), params);
    }
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
    }
}

Model::~Model() {
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

py::dict Model::info() const {
    py::dict d;
    char desc[256];
    const int32_t n_desc = llama_model_desc(model_, desc, sizeof(desc));
    d["desc"] = std::string(desc, n_desc > 0 ? std::min<size_t>(static_cast<size_t>(n_desc), sizeof(desc) - 1) : 0);
    d["path"] = path_;
    d["vocab_only"] = vocab_only_;
    d["n_params"] = llama_model_n_params(model_);
    d["size"] = llama_model_size(model_);
    d["ftype"] = llama_ftype_name(llama_model_ftype(model_));
    d["n_ctx_train"] = llama_model_n_ctx_train(model_);
    d["n_embd"] = llama_model_n_embd(model_);
    // Per-layer values GGML_ABORT for a layer that does not exist, and a vocab_only model has none.
    const int32_t n_layer = llama_model_n_layer(model_);
    d["n_layer"] = n_layer;
    d["n_head"] = n_layer > 0 ? llama_model_n_head(model_) : 0;
    d["n_head_kv"] = n_layer > 0 ? llama_model_n_head_kv(model_) : 0;
    d["n_swa"] = llama_model_n_swa(model_);
    d["n_vocab"] = n_vocab_;
    d["vocab_type"] = static_cast<int>(llama_vocab_type(vocab_));
    d["has_encoder"] = llama_model_has_encoder(model_);
    d["has_decoder"] = llama_model_has_decoder(model_);
    d["is_recurrent"] = llama_model_is_recurrent(model_);
    d["is_hybrid"] = llama_model_is_hybrid(model_);
    d["bos"] = llama_vocab_bos(vocab_);  // -1: none
    d["eos"] = llama_vocab_eos(vocab_);
    d["eot"] = llama_vocab_eot(vocab_);
    d["add_bos"] = llama_vocab_get_add_bos(vocab_);
    d["add_eos"] = llama_vocab_get_add_eos(vocab_);
    py::list eog;
    for (llama_token t : eog_tokens_) {
        eog.append(t);
    }
    d["eog_tokens"] = eog;
    const char * tmpl = llama_model_chat_template(model_, nullptr);
    d["chat_template"] = tmpl != nullptr ? py::object(py::str(tmpl)) : py::object(py::none());
    py::dict meta;
    const int32_t n_meta = llama_model_meta_count(model_);
    for (int32_t i = 0; i < n_meta; ++i) {
        const std::string key = meta_string(llama_model_meta_key_by_index, model_, i);
        const std::string val = meta_string(llama_model_meta_val_str_by_index, model_, i);
        meta[decode_utf8_replace(key)] = decode_utf8_replace(val);
    }
    d["meta"] = meta;
    return d;
}

std::string Model::apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                       const std::optional<std::string> & tmpl, bool add_assistant) const {
    const char * tmpl_c = nullptr;
    if (tmpl) {
        tmpl_c = tmpl->c_str();
    } else {
        tmpl_c = llama_model_chat_template(model_, nullptr);
        // llama.cpp would quietly fall back to chatml here; None means the model's own template.
        if (tmpl_c == nullptr) {
            throw std::invalid_argument("the model has no chat template; pass template explicitly (e.g. \"chatml\")");
        }
    }
    std::vector<llama_chat_message> chat;
    chat.reserve(messages.size());
    size_t total = 0;
    for (const auto & [role, content] : messages) {
        chat.push_back({role.c_str(), content.c_str()});
        total += role.size() + content.size();
    }
    std::vector<char> buf(2 * total + 256);
    int32_t n = llama_chat_apply_template(tmpl_c, chat.data(), chat.size(), add_assistant, buf.data(),
                                          static_cast<int32_t>(buf.size()));
    if (n < 0) {
        throw std::invalid_argument("unsupported chat template" +
                                    std::string(tmpl ? " '" + tmpl->substr(0, 80) + "'" : " (the model's own)") +
                                    ": llama_chat_apply_template only knows its built-in templates");
    }
    if (static_cast<size_t>(n) > buf.size()) {
        buf.resize(static_cast<size_t>(n));
        n = llama_chat_apply_template(tmpl_c, chat.data(), chat.size(), add_assistant, buf.data(),
                                      static_cast<int32_t>(buf.size()));
        if (n < 0) {
            throw lloyal_error("llama_chat_apply_template failed");
        }
    }
    return std::string(buf.data(), static_cast<size_t>(n));
}

llama_token token_from_py(py::handle obj, const Model & model) {
    // __index__ accepts numpy integers too, and refuses floats.
    long long v = 0;
    std::string text;
    if (!index_to_ll(obj, v, &text)) {
        throw invalid_token_error("token id " + text + " is outside [0, " + std::to_string(model.n_vocab()) + ")");
    }
    model.check_token(v);
    return static_cast<llama_token>(v);
}

std::vector<llama_token> tokens_from_py(py::handle seq, const Model & model) {
    if (PyUnicode_Check(seq.ptr()) || PyBytes_Check(seq.ptr())) {
        throw py::type_error("expected a sequence of token ids, not a string");
    }
    py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), "expected a sequence of token ids"));
    if (!fast) {
        throw py::error_already_set();
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    PyObject ** items = PySequence_Fast_ITEMS(fast.ptr());
    std::vector<llama_token> out;
    out.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        out.push_back(token_from_py(items[i], model));
    }
    return out;
}

void register_model(py::module_ & m) {
    py::class_<Model, std::shared_ptr<Model>>(m, "Model")
        .def(py::init<const std::string &, int, bool, bool, const py::object &>(), py::arg("path"), py::kw_only(),
             py::arg("n_gpu_layers") = 0, py::arg("use_mmap") = true, py::arg("vocab_only") = false,
             py::arg("progress") = py::none(),
             "Loads a GGUF (GIL released). progress(fraction) returning False cancels the load.\n"
             "Raises ModelLoadError (with llama.cpp's last error line) on failure.")
        .def_property_readonly("n_vocab", &Model::n_vocab)
        .def_property_readonly("path", &Model::path)
        .def("info", &Model::info)
        .def(
            "tokenize",
            [](const Model & self, const std::string & text, bool add_special, bool parse_special) {
                std::vector<llama_token> out;
                {
                    gil_release nogil;
                    out = self.tokenize(text, add_special, parse_special);
                }
                return out;
            },
            py::arg("text"), py::arg("add_special"), py::arg("parse_special"))
        .def(
            "detokenize",
            [](const Model & self, py::handle tokens, bool remove_special, bool unparse_special) {
                const std::vector<llama_token> toks = tokens_from_py(tokens, self);
                std::string text;
                {
                    gil_release nogil;
                    text = self.detokenize(toks, remove_special, unparse_special);
                }
                return decode_utf8_replace(text);
            },
            py::arg("tokens"), py::arg("remove_special"), py::arg("unparse_special"),
            "Invalid UTF-8 becomes U+FFFD. Raises InvalidTokenError for ids outside [0, n_vocab).")
        .def(
            "token_to_piece",
            [](const Model & self, py::handle token, bool special) {
                return py::bytes(self.token_to_piece(token_from_py(token, self), special));
            },
            py::arg("token"), py::arg("special"))
        .def(
            "is_eog",
            [](const Model & self, py::handle token) {
                return llama_vocab_is_eog(self.vocab(), token_from_py(token, self));
            },
            py::arg("token"))
        .def("apply_chat_template", &Model::apply_chat_template, py::arg("messages"), py::arg("template"),
             py::arg("add_assistant"),
             "(role, content) pairs through llama_chat_apply_template; template None = the model's own.");
}

}  // namespace lloyal
