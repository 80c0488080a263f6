// native.Model: a loaded GGUF (model.hpp), its info as a dict, its tokenizer; native.Lora: a LoRA adapter
// loaded for one model (lora.hpp).
#include "bind.hpp"
#include "chat.hpp"
#include "errors.hpp"
#include "lora.hpp"

#include <exception>

namespace lloyal {

namespace {

std::shared_ptr<Model> load(const std::string & path, int n_gpu_layers, bool use_mmap, bool vocab_only, bool repack,
                            const py::object & progress) {
    Model::progress_fn fn;
    if (!progress.is_none()) {
        if (!PyCallable_Check(progress.ptr())) {
            throw py::type_error("progress must be callable or None");
        }
        // Runs on the loading thread with the GIL released; takes it only for the Python call. Only an
        // explicit falsy answer cancels: a callback that returns None is just observing.
        // A borrowed handle: the std::function is copied and destroyed without the GIL, and the caller's
        // reference keeps the callable alive for the whole load.
        fn = [callback = py::handle(progress)](float fraction) {
            gil_acquire gil;
            py::object r = callback(fraction);
            if (r.is_none()) {
                return true;
            }
            const int truth = PyObject_IsTrue(r.ptr());
            if (truth < 0) {
                throw py::error_already_set();
            }
            return truth != 0;
        };
    }
    gil_release nogil;
    return std::make_shared<Model>(path, n_gpu_layers, use_mmap, vocab_only, repack, std::move(fn));
}

py::dict info(const Model & m) {
    const llama_model * model = m.get();
    const llama_vocab * vocab = m.vocab();
    py::dict d;
    d["desc"] = m.desc();
    d["path"] = m.path();
    d["vocab_only"] = m.vocab_only();
    d["n_params"] = llama_model_n_params(model);
    d["size"] = llama_model_size(model);
    d["ftype"] = llama_ftype_name(llama_model_ftype(model));
    d["n_ctx_train"] = llama_model_n_ctx_train(model);
    d["n_embd"] = llama_model_n_embd(model);
    // Per-layer values GGML_ABORT for a layer that does not exist, and a vocab_only model has none.
    const int32_t n_layer = llama_model_n_layer(model);
    d["n_layer"] = n_layer;
    d["n_head"] = n_layer > 0 ? llama_model_n_head(model) : 0;
    d["n_head_kv"] = n_layer > 0 ? llama_model_n_head_kv(model) : 0;
    d["n_swa"] = llama_model_n_swa(model);
    d["n_vocab"] = m.n_vocab();
    d["vocab_type"] = static_cast<int>(llama_vocab_type(vocab));
    d["has_encoder"] = llama_model_has_encoder(model);
    d["has_decoder"] = llama_model_has_decoder(model);
    d["is_recurrent"] = llama_model_is_recurrent(model);
    d["is_hybrid"] = llama_model_is_hybrid(model);
    d["bos"] = llama_vocab_bos(vocab);  // -1: none
    d["eos"] = llama_vocab_eos(vocab);
    d["eot"] = llama_vocab_eot(vocab);
    d["add_bos"] = llama_vocab_get_add_bos(vocab);
    d["add_eos"] = llama_vocab_get_add_eos(vocab);
    d["sep"] = llama_vocab_sep(vocab);
    d["add_sep"] = llama_vocab_get_add_sep(vocab);
    d["n_embd_out"] = llama_model_n_embd_out(model);
    const char * rerank = llama_model_chat_template(model, "rerank");
    d["rerank_template"] = rerank != nullptr ? py::object(py::str(rerank)) : py::object(py::none());
    d["eog_tokens"] = m.eog_tokens();
    d["hidden_tokens"] = m.hidden_tokens();
    const char * tmpl = llama_model_chat_template(model, nullptr);
    d["chat_template"] = tmpl != nullptr ? py::object(py::str(tmpl)) : py::object(py::none());
    py::dict meta;
    for (const auto & [key, val] : m.meta()) {
        meta[decode_utf8_replace(key)] = decode_utf8_replace(val);
    }
    d["meta"] = meta;
    return d;
}

}  // namespace

void register_model(py::module_ & m) {
    m.def(
        "_grammar_slices_check",
        [](const Model & model, const std::string & gbnf, const std::vector<llama_token> & tokens) {
            gil_release nogil;
            return grammar_slices_check(model, gbnf, tokens);
        },
        py::arg("model"), py::arg("gbnf"), py::arg("tokens"),
        "Test only: per step, the tokens llama.cpp's grammar sampler allows and those ours (sliced) allows.");
    py::class_<Model, std::shared_ptr<Model>>(m, "Model")
        .def(py::init(&load), py::arg("path"), py::kw_only(), py::arg("n_gpu_layers") = 0, py::arg("use_mmap") = true,
             py::arg("vocab_only") = false, py::arg("repack") = true, py::arg("progress") = py::none(),
             "Loads a GGUF (GIL released). progress(fraction) returning False cancels the load.\n"
             "Raises ModelLoadError (with llama.cpp's last error line) on failure.")
        .def_property_readonly("n_vocab", &Model::n_vocab)
        .def_property_readonly("path", &Model::path)
        .def("info", &info)
        .def(
            "tokenize",
            [](const Model & self, const std::string & text, bool add_special, bool parse_special) {
                gil_release nogil;
                return self.tokenize(text, add_special, parse_special);
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
        .def(
            "apply_chat_template",
            [](const Model & self, const std::vector<std::pair<std::string, std::string>> & messages,
               const std::string & template_source, bool add_generation_prompt, const std::string & tools_json) {
                chat_request req{messages, template_source, add_generation_prompt, tools_json};
                gil_release nogil;
                return apply_chat(self, req);
            },
            py::arg("messages"), py::arg("template_source"), py::arg("add_generation_prompt"),
            py::arg("tools_json"),
            "(role, content) pairs through llama.cpp's Jinja chat engine (common/chat); template_source \"\" =\n"
            "the model's own. TemplateError when there is none, or the template does not parse or render.")
        .def(
            "format_chat",
            [](const Model & self, const std::string & messages_json, const std::string & template_source,
               bool add_generation_prompt, const std::string & tools_json, const std::string & tool_choice) {
                const chat_conversation conv{messages_json, template_source, add_generation_prompt, tools_json,
                                             tool_choice};
                chat_prompt p;
                {
                    gil_release nogil;
                    p = format_chat(self, conv);
                }
                py::dict d;
                d["prompt"] = decode_utf8_replace(p.prompt);
                d["format"] = p.format;
                d["grammar"] = p.grammar;
                d["grammar_lazy"] = p.grammar_lazy;
                d["trigger_words"] = p.trigger_words;
                d["trigger_patterns"] = p.trigger_patterns;
                d["trigger_tokens"] = p.trigger_tokens;
                d["preserved_tokens"] = p.preserved_tokens;
                d["additional_stops"] = p.additional_stops;
                d["generation_prompt"] = decode_utf8_replace(p.generation_prompt);
                return d;
            },
            py::arg("messages_json"), py::arg("template_source"), py::arg("add_generation_prompt"),
            py::arg("tools_json"), py::arg("tool_choice"),
            "OpenAI-style messages (JSON) through common/chat: the prompt, and the format's tool-call grammar\n"
            "(lazy or not) with its triggers, preserved tokens and extra stop strings, as a dict.")
        .def(
            "parse_chat",
            [](const Model & self, const std::string & messages_json, const std::string & template_source,
               const std::string & tools_json, const std::string & tool_choice, const std::string & text,
               bool partial) {
                const chat_conversation conv{messages_json, template_source, true, tools_json, tool_choice};
                chat_message msg;
                {
                    gil_release nogil;
                    msg = parse_chat(self, conv, text, partial);
                }
                py::list calls;
                for (const auto & tc : msg.tool_calls) {
                    calls.append(py::make_tuple(decode_utf8_replace(tc.name), decode_utf8_replace(tc.arguments),
                                                decode_utf8_replace(tc.id)));
                }
                return py::make_tuple(decode_utf8_replace(msg.content), decode_utf8_replace(msg.reasoning), calls);
            },
            py::arg("messages_json"), py::arg("template_source"), py::arg("tools_json"), py::arg("tool_choice"),
            py::arg("text"), py::arg("partial"),
            "An assistant turn generated after the messages, through the parser of the template's format:\n"
            "(content, reasoning, [(name, arguments JSON, id)]). TemplateError for text it cannot parse.");

    py::class_<lora_adapter, std::shared_ptr<lora_adapter>>(m, "Lora")
        .def(py::init([](std::shared_ptr<Model> model, const std::string & path) {
                 gil_release nogil;
                 return std::make_shared<lora_adapter>(std::move(model), path);
             }),
             py::arg("model"), py::arg("path"),
             "Loads a LoRA adapter GGUF for model (GIL released). Raises LoraError (with llama.cpp's reason)\n"
             "for a missing file, a file that is not a LoRA adapter GGUF, or one for another architecture\n"
             "or other tensor shapes.")
        .def_property_readonly("path", &lora_adapter::path)
        .def_property_readonly("alpha", &lora_adapter::alpha)
        .def("meta", [](const lora_adapter & a) {
            py::dict d;
            for (const auto & [key, val] : a.meta()) {
                d[decode_utf8_replace(key)] = decode_utf8_replace(val);
            }
            return d;
        });
}

}  // namespace lloyal
