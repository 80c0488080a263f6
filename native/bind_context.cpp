// native.Arena and native.Context: construction, the interrupt word, and the sequence driver's methods
// (eval, generate, logits, history). Each method turns its Python arguments into typed ones, calls the
// driver without the GIL, and turns the result back.
#include "bind_context.hpp"
#include "devices.hpp"
#include "errors.hpp"

#include <cmath>
#include <limits>

namespace lloyal {

py_context::py_context(std::shared_ptr<Model> model, const py::dict & params, std::shared_ptr<py_arena> arena_)
    : arena(std::move(arena_)) {
    if (!model) {
        throw context_error("model is None");
    }
    if (!arena) {
        throw context_error("arena is None");
    }
    const llama_context_params cp = parse_context_params(params);
    const bool adapt_threads = parse_adapt_threads(params);
    {
        gil_release nogil;
        core = std::make_unique<context_core>(std::move(model), cp, arena->arena, parse_batch_invariant(params));
    }
    if (!adapt_threads) {
        core->set_adapt_threads(false);
    }
    sequence = std::make_unique<sequence_driver>(*core);
    branches = std::make_unique<branch_driver>(*core);
    embedder = std::make_unique<embed_driver>(*core, *sequence);
    grammars = std::make_unique<grammar_handles>(*core);
}

py_context::~py_context() = default;

uint32_t handle_arg(py::handle h) {
    long long v = 0;
    std::string text;
    if (!strict_int(h, "a branch handle", v, &text) || v <= 0 || v > 0xFFFFFFFFll) {
        throw stale_handle_error("branch handle " + text + " is not live (handles are positive u32)");
    }
    return static_cast<uint32_t>(v);
}

int64_t int_arg(py::handle v, const char * what) {
    long long x = 0;
    std::string text;
    if (!strict_int(v, what, x, &text)) {
        throw std::invalid_argument(std::string(what) + " " + text + " is out of range");
    }
    return x;
}

context_core::progress_fn progress_arg(const py::object & on_progress) {
    if (on_progress.is_none()) {
        return nullptr;
    }
    if (!PyCallable_Check(on_progress.ptr())) {
        throw py::type_error("on_progress must be callable or None");
    }
    // A borrowed handle, as for on_piece: the caller's reference outlives the call.
    return [cb = py::handle(on_progress)](size_t done, size_t total) {
        gil_acquire gil;
        cb(done, total);
    };
}

// (token, logprob, piece, [(token, logprob, piece), ...]) per token: pieces with control tokens shown.
py::list logprobs_list(const std::vector<token_logprobs> & entries, const Model & model) {
    py::list out;
    for (const token_logprobs & e : entries) {
        py::list top;
        for (const auto & [t, lp] : e.top) {
            top.append(py::make_tuple(t, lp, py::bytes(model.token_to_piece(t, true))));
        }
        out.append(py::make_tuple(e.token, e.logprob, py::bytes(model.token_to_piece(e.token, true)), top));
    }
    return out;
}

std::vector<lora_weight> lora_weights(py::handle adapters) {
    std::vector<lora_weight> weights;
    for (const py::object & item : sequence_items(adapters, "adapters")) {
        const std::vector<py::object> pair = sequence_items(item, "a (Lora, scale) entry");
        if (pair.size() != 2 || !py::isinstance<lora_adapter>(pair[0])) {
            throw py::type_error("adapters must be (Lora, scale) pairs");
        }
        const py::object & adapter = pair[0];
        const py::object & scale = pair[1];
        if (!PyFloat_Check(scale.ptr()) && (PyBool_Check(scale.ptr()) || !PyLong_Check(scale.ptr()))) {
            throw py::type_error("a LoRA scale must be a float");
        }
        weights.push_back({adapter.cast<std::shared_ptr<lora_adapter>>(), scale.cast<float>()});
    }
    return weights;
}

namespace {

std::shared_ptr<py_arena> make_arena(const py::object & region, int64_t bulk_offset, int64_t page) {
    auto a = std::make_shared<py_arena>();
    a->region = std::make_unique<held_buffer>(region, true);
    if (reinterpret_cast<uintptr_t>(a->region->data()) % alignof(uint64_t) != 0) {
        throw std::invalid_argument("the region must be 8-byte aligned");
    }
    if (bulk_offset < 0 || page <= 0) {
        throw std::invalid_argument("bulk_offset must be >= 0 and page > 0");
    }
    a->arena = std::make_shared<region_arena>(static_cast<char *>(a->region->data()), a->region->size(),
                                              static_cast<size_t>(bulk_offset), static_cast<size_t>(page));
    return a;
}

void set_interrupt_word(py_context & c, const py::object & control, int64_t index) {
    context_core::busy_guard busy(*c.core);
    if (control.is_none()) {
        // Detach: releases the buffer export (a SharedMemory cannot close while one is held).
        c.core->set_interrupt_word(nullptr);
        c.control.reset();
        return;
    }
    if (index < 0) {
        throw std::invalid_argument("index must be >= 0");
    }
    auto buf = std::make_unique<held_buffer>(control, false);
    if (static_cast<uint64_t>(index) >= buf->size() / 8) {
        throw std::invalid_argument("index " + std::to_string(index) + " is past the end of a " +
                                    std::to_string(buf->size()) + "-byte buffer");
    }
    auto * word = reinterpret_cast<const uint64_t *>(static_cast<const char *>(buf->data()) + static_cast<size_t>(index) * 8);
    if (reinterpret_cast<uintptr_t>(word) % alignof(uint64_t) != 0) {
        throw std::invalid_argument("the interrupt word is not 8-byte aligned");
    }
    c.core->set_interrupt_word(word);
    c.control = std::move(buf);
}

void reset(py_context & c) {
    gil_release nogil;
    context_core::busy_guard busy(*c.core);
    c.branches->clear();
    llama_memory_clear(c.core->memory(), true);
    c.sequence->clear();
}

bool set_lora(py_context & c, py::handle adapters) {
    std::vector<lora_weight> weights = lora_weights(adapters);
    gil_release nogil;
    return set_loras(*c.core, *c.sequence, *c.branches, std::move(weights));
}

py::dict eval(py_context & c, py::handle tokens, uint64_t request_id, const py::object & on_progress) {
    const std::vector<llama_token> toks = tokens_from_py(tokens, c.core->model());
    const context_core::progress_fn progress = progress_arg(on_progress);
    eval_result r;
    {
        gil_release nogil;
        r = c.sequence->eval(toks, request_id, progress);
    }
    py::dict d;
    d["n_tokens"] = r.n_tokens;
    d["n_past"] = r.n_past;
    d["interrupted"] = r.interrupted;
    d["prompt_ms"] = r.prompt_ms;
    d["n_threads"] = c.core->last_decode_threads();
    return d;
}

// generate()'s and generate_with_draft()'s arguments, typed.
struct generate_args {
    gen_params params;
    prompt_input prompt;
    piece_fn on_piece;
    context_core::progress_fn on_progress;
};

// on_piece as the driver calls it: without the GIL, taking it for the Python call only. A borrowed
// handle: the caller's reference outlives the call, and the std::function is destroyed without the GIL.
piece_fn piece_arg(const py::object & on_piece) {
    if (on_piece.is_none()) {
        return nullptr;
    }
    if (!PyCallable_Check(on_piece.ptr())) {
        throw py::type_error("on_piece must be callable or None");
    }
    return [cb = py::handle(on_piece)](std::string_view piece) {
        gil_acquire gil;
        cb(decode_utf8_replace(piece));
    };
}

generate_args parse_generate_args(py_context & c, py::handle prompt, const py::dict & params, const py::object & on_piece,
                                  bool append, const py::object & on_progress) {
    const Model & model = c.core->model();
    generate_args a;
    a.on_piece = piece_arg(on_piece);
    a.params = parse_gen_params(params, model);
    a.prompt.append = append;
    if (PyUnicode_Check(prompt.ptr())) {
        a.prompt.is_text = true;
        a.prompt.text = prompt.cast<std::string>();
    } else {
        a.prompt.tokens = tokens_from_py(prompt, model);
    }
    a.on_progress = progress_arg(on_progress);
    return a;
}

py::dict result_dict(const generate_result & r, const gen_params & p, const Model & model) {
    py::dict d;
    if (p.n_logprobs >= 0) {
        d["logprobs"] = logprobs_list(r.logprobs, model);
    }
    d["text"] = decode_utf8_replace(r.text);
    d["tokens"] = r.tokens;
    d["n_prompt"] = r.n_prompt;
    d["n_decoded"] = r.n_decoded;
    d["n_cached"] = r.n_cached;
    d["n_past"] = r.n_past;
    d["stop_reason"] = r.stop_reason;
    d["prompt_ms"] = r.prompt_ms;
    d["decode_ms"] = r.decode_ms;
    d["n_drafted"] = r.n_drafted;
    d["n_accepted"] = r.n_accepted;
    d["n_threads"] = r.n_threads;
    return d;
}

py::dict generate(py_context & c, py::handle prompt, const py::dict & params, uint64_t request_id,
                  const py::object & on_piece, bool append, const py::object & on_progress) {
    const generate_args a = parse_generate_args(c, prompt, params, on_piece, append, on_progress);
    generate_result r;
    {
        gil_release nogil;
        r = c.sequence->generate(a.prompt, a.params, request_id, a.on_piece, a.on_progress);
    }
    return result_dict(r, a.params, c.core->model());
}

py::dict generate_with_draft(py_context & c, py::handle prompt, const py::dict & params, const py::object & draft,
                             int64_t n_draft, int64_t ngram_min, int64_t ngram_max, uint64_t request_id,
                             const py::object & on_piece, bool append, const py::object & on_progress) {
    const generate_args a = parse_generate_args(c, prompt, params, on_piece, append, on_progress);
    if (n_draft < 1 || n_draft > 1024) {
        throw std::invalid_argument("n_draft must be in [1, 1024], got " + std::to_string(n_draft));
    }
    if (ngram_min < 1 || ngram_max < ngram_min || ngram_max > 64) {
        throw std::invalid_argument("ngram sizes must satisfy 1 <= ngram_min <= ngram_max <= 64");
    }
    if (a.params.n_logprobs >= 0) {
        throw std::invalid_argument("logprobs are not reported by speculative decoding (generate_with_draft)");
    }
    std::unique_ptr<drafter> d;
    if (PyUnicode_Check(draft.ptr())) {
        if (draft.cast<std::string>() != "ngram") {
            throw std::invalid_argument("draft must be \"ngram\" or a Context, got '" + draft.cast<std::string>() + "'");
        }
        d = make_ngram_drafter(static_cast<size_t>(ngram_min), static_cast<size_t>(ngram_max));
    } else if (py::isinstance<py_context>(draft)) {
        py_context & dc = draft.cast<py_context &>();
        d = make_model_drafter(*c.sequence, *dc.sequence);
    } else {
        throw py::type_error("draft must be \"ngram\" or a Context");
    }
    generate_result r;
    {
        gil_release nogil;
        r = c.sequence->generate_with_draft(a.prompt, a.params, *d, static_cast<size_t>(n_draft), request_id, a.on_piece,
                                            a.on_progress);
        d.reset();  // releases the draft context
    }
    return result_dict(r, a.params, c.core->model());
}

py::dict resume(py_context & c, uint64_t request_id, const py::object & on_piece, uint64_t origin) {
    const piece_fn piece = piece_arg(on_piece);
    gen_params shown;
    shown.n_logprobs = c.sequence->paused_logprobs();
    generate_result r;
    {
        gil_release nogil;
        r = c.sequence->resume(request_id, origin, piece);
    }
    return result_dict(r, shown, c.core->model());
}

py::dict suspension(const py_context & c) {
    const suspended_generation s = c.sequence->suspension();
    py::list draws;
    for (const auto & d : s.draws) {
        draws.append(py::make_tuple(d.narrow, d.wide));
    }
    py::dict d;
    d["tokens"] = s.tokens;
    d["n_sampled"] = s.n_sampled;
    d["emitted"] = s.emitted;
    d["draws"] = draws;
    d["n_prompt"] = s.n_prompt;
    d["n_cached"] = s.n_cached;
    d["prompt_ms"] = s.prompt_ms;
    return d;
}

void adopt(py_context & c, const py::dict & params, const py::dict & d, uint64_t origin) {
    const Model & model = c.core->model();
    const gen_params p = parse_gen_params(params, model);
    suspended_generation s;
    try {
        s.tokens = tokens_from_py(d["tokens"], model);
        s.n_sampled = d["n_sampled"].cast<int32_t>();
        s.emitted = d["emitted"].cast<size_t>();
        for (auto item : py::iter(d["draws"])) {
            auto pair = item.cast<std::pair<uint64_t, uint64_t>>();
            s.draws.push_back(chain_sampler::draw_count{pair.first, pair.second});
        }
        s.n_prompt = d["n_prompt"].cast<size_t>();
        s.n_cached = d["n_cached"].cast<size_t>();
        s.prompt_ms = d["prompt_ms"].cast<double>();
    } catch (const py::error_already_set & e) {
        throw std::invalid_argument(std::string("not a paused generation: ") + e.what());
    } catch (const py::cast_error & e) {
        throw std::invalid_argument(std::string("not a paused generation: ") + e.what());
    }
    gil_release nogil;
    c.sequence->adopt(p, s, origin);
}

std::vector<std::vector<llama_token>> token_lists(py::handle inputs, const Model & model, const char * what) {
    if (PyUnicode_Check(inputs.ptr()) || !py::isinstance<py::iterable>(inputs)) {
        throw py::type_error(std::string(what) + " must be a list of token lists");
    }
    std::vector<std::vector<llama_token>> out;
    for (auto item : py::iter(inputs)) {
        out.push_back(tokens_from_py(item, model));
    }
    return out;
}

py::dict score_dict(const score_result & r) {
    py::dict d;
    d["n_tokens"] = r.n_tokens;
    d["n_scored"] = r.n_scored;
    d["nll"] = r.nll;
    d["perplexity"] = r.n_scored > 0 ? std::exp(r.nll / static_cast<double>(r.n_scored))
                                     : std::numeric_limits<double>::quiet_NaN();
    return d;
}

py::dict score(py_context & c, py::handle tokens, uint64_t request_id, int32_t n_logprobs) {
    const std::vector<llama_token> toks = tokens_from_py(tokens, c.core->model());
    score_result r;
    {
        gil_release nogil;
        r = c.sequence->score(toks, request_id, n_logprobs);
    }
    py::dict d = score_dict(r);
    if (n_logprobs >= 0) {
        d["logprobs"] = logprobs_list(r.logprobs, c.core->model());
    }
    return d;
}

py::list score_choices(py_context & c, py::handle choices, uint64_t request_id) {
    std::vector<std::vector<llama_token>> items;
    for (const py::object & item : sequence_items(choices, "choices")) {
        items.push_back(tokens_from_py(item, c.core->model()));
    }
    std::vector<score_result> rs;
    {
        gil_release nogil;
        rs = c.sequence->score_choices(items, request_id);
    }
    py::list out;
    for (const score_result & r : rs) {
        out.append(score_dict(r));
    }
    return out;
}

py::dict embed(py_context & c, py::handle inputs, bool normalize, uint64_t request_id) {
    const auto lists = token_lists(inputs, c.core->model(), "inputs");
    embed_result r;
    {
        gil_release nogil;
        r = c.embedder->embed(lists, normalize, request_id);
    }
    py::dict d;
    d["offset"] = r.offset;
    d["rows"] = r.rows;
    d["width"] = r.width;
    return d;
}

std::vector<double> score_tails(py_context & c, py::handle prompts, const std::vector<size_t> & n_tail,
                                uint64_t request_id) {
    const auto lists = token_lists(prompts, c.core->model(), "prompts");
    gil_release nogil;
    return c.embedder->score_tails(lists, n_tail, request_id);
}

const char * pooling_name(enum llama_pooling_type t) {
    switch (t) {
        case LLAMA_POOLING_TYPE_MEAN:
            return "mean";
        case LLAMA_POOLING_TYPE_CLS:
            return "cls";
        case LLAMA_POOLING_TYPE_LAST:
            return "last";
        case LLAMA_POOLING_TYPE_RANK:
            return "rank";
        default:
            return "none";
    }
}

}  // namespace

void register_context(py::module_ & m) {
    py::class_<py_arena, std::shared_ptr<py_arena>>(m, "Arena")
        .def(py::init(&make_arena), py::arg("region"), py::arg("bulk_offset"), py::arg("page"))
        .def_property_readonly("free_bytes", [](const py_arena & a) { return a.arena->free_bytes(); })
        .def_property_readonly("used_end", [](const py_arena & a) { return a.arena->used_end(); });

    context_class cls(m, "Context");
    cls.def(py::init<std::shared_ptr<Model>, const py::dict &, std::shared_ptr<py_arena>>(), py::arg("model"),
            py::arg("params"), py::arg("arena"))
        .def_property_readonly("n_ctx", [](const py_context & c) { return c.core->n_ctx; })
        .def_property_readonly("n_batch", [](const py_context & c) { return c.core->n_batch; })
        .def_property_readonly("n_ubatch", [](const py_context & c) { return c.core->n_ubatch; })
        .def_property_readonly("n_seq_max", [](const py_context & c) { return c.core->n_seq_max; })
        .def_property_readonly("n_threads", [](const py_context & c) { return c.core->n_threads; })
        .def_property_readonly("n_threads_batch", [](const py_context & c) { return c.core->n_threads_batch; })
        // The threads llama.cpp computes with from now on; n_threads/n_threads_batch keep the values the
        // context was created with. A snapshot's zygote computes on one thread (no OpenMP team exists
        // when it forks) and its forks go back to those values.
        .def("set_threads", [](py_context & c, int32_t n_threads, int32_t n_threads_batch) {
            if (n_threads < 1 || n_threads_batch < 1) {
                throw py::value_error("thread counts must be at least 1");
            }
            c.core->set_threads(n_threads, n_threads_batch);
        }, py::arg("n_threads"), py::arg("n_threads_batch"))
        .def_property_readonly("last_decode_ms", [](const py_context & c) { return c.core->decode_ms(); })
        .def_property_readonly("logits_offset", [](const py_context & c) { return c.core->logits_block().offset(); })
        .def_property_readonly("model", [](const py_context & c) { return c.core->model_ptr(); })
        .def_property_readonly("embeddings", [](const py_context & c) { return c.core->embeddings; })
        .def_property_readonly("pooling",
                               [](const py_context & c) -> py::object {
                                   if (!c.core->embeddings) {
                                       return py::none();
                                   }
                                   return py::str(pooling_name(c.core->pooling));
                               })
        .def("set_interrupt_word", &set_interrupt_word, py::arg("control"), py::arg("index") = 0)
        .def("n_past", [](const py_context & c) { return c.sequence->n_past(); })
        .def("tokens", [](const py_context & c) { return c.sequence->tokens(); })
        .def("memory_breakdown",
             [](const py_context & c) {
                 std::vector<buffer_memory> rows;
                 {
                     gil_release nogil;
                     rows = memory_breakdown(c.core->get());
                 }
                 py::list out;
                 for (const auto & r : rows) {
                     py::dict e;
                     e["buffer"] = r.buffer;
                     e["device"] = r.device;
                     e["host"] = r.host;
                     e["model"] = r.model;
                     e["context"] = r.context;
                     e["compute"] = r.compute;
                     out.append(e);
                 }
                 return out;
             })
        .def("reset", &reset)
        .def("set_lora", &set_lora, py::arg("adapters"),
             "Replaces the whole LoRA configuration with (Lora, scale) pairs ([] clears it). Returns True\n"
             "when it changed, which empties the history and the KV cache; LoraError (nothing changed) for\n"
             "an adapter of another model, a non-finite scale, an adapter twice, or a change while the\n"
             "context holds branches or detached sequences.")
        .def("eval", &eval, py::arg("tokens"), py::arg("request_id") = 0, py::arg("on_progress") = py::none())
        .def(
            "write_logits",
            [](py_context & c) {
                gil_release nogil;
                if (!c.branches->raw_logits_current()) {  // else a raw decode's logits are there already
                    c.sequence->write_logits();
                }
            })
        .def(
            "save_state",
            [](py_context & c, const std::string & path) {
                gil_release nogil;
                return c.sequence->save_state(path);
            },
            py::arg("path"))
        .def(
            "load_state",
            [](py_context & c, const std::string & path) {
                gil_release nogil;
                return c.sequence->load_state(path);
            },
            py::arg("path"))
        .def("score", &score, py::arg("tokens"), py::arg("request_id") = 0, py::arg("n_logprobs") = -1)
        .def("score_choices", &score_choices, py::arg("choices"), py::arg("request_id") = 0)
        .def("generate", &generate, py::arg("prompt"), py::arg("params"), py::arg("request_id") = 0,
             py::arg("on_piece") = py::none(), py::arg("append") = false, py::arg("on_progress") = py::none())
        .def("generate_with_draft", &generate_with_draft, py::arg("prompt"), py::arg("params"), py::arg("draft"),
             py::arg("n_draft") = 8, py::arg("ngram_min") = 2, py::arg("ngram_max") = 4, py::arg("request_id") = 0,
             py::arg("on_piece") = py::none(), py::arg("append") = false, py::arg("on_progress") = py::none())
        .def("resume", &resume, py::arg("request_id") = 0, py::arg("on_piece") = py::none(), py::arg("origin") = 0)
        .def("paused", [](const py_context & c) { return c.sequence->paused(); })
        .def("suspension", &suspension)
        .def("adopt", &adopt, py::arg("params"), py::arg("suspension"), py::arg("origin") = 0)
        .def("embed", &embed, py::arg("inputs"), py::arg("normalize"), py::arg("request_id") = 0)
        .def("score_tails", &score_tails, py::arg("prompts"), py::arg("n_tail"), py::arg("request_id") = 0);
    register_branch_methods(cls);
}

}  // namespace lloyal
