// The branch and raw KV methods of native.Context (the branch driver, branch.hpp). Each turns its
// Python arguments into typed ones (handles, token ids, params, grammars), calls the driver without the
// GIL, and turns the result back. The contract is the stub, lloyal_pool/worker/_native.pyi.
#include "bind_context.hpp"
#include "errors.hpp"

#include <cstring>
#include <limits>

namespace lloyal {

namespace {

using created_tuple = std::pair<uint32_t, size_t>;

created_tuple created(const branch_created & c) { return {c.handle, c.logits_offset}; }

std::vector<uint32_t> handles_arg(py::handle seq, const char * what) {
    std::vector<uint32_t> out;
    for (const py::object & h : sequence_items(seq, what)) {
        out.push_back(handle_arg(h));
    }
    return out;
}

py::list produced_list(const std::vector<produced_token> & out, const Model & model) {
    py::list result;
    for (const produced_token & p : out) {
        py::object lp = py::none();
        if (p.logprobs) {
            lp = logprobs_list({*p.logprobs}, model)[0];
        }
        result.append(py::make_tuple(p.token == LLAMA_TOKEN_NULL ? -1 : p.token, py::bytes(p.piece), p.is_stop, lp));
    }
    return result;
}

llama_pos pos_arg(py::handle v, const char * what) {
    const int64_t x = int_arg(v, what);
    if (x < std::numeric_limits<llama_pos>::min() || x > std::numeric_limits<llama_pos>::max()) {
        throw std::invalid_argument(std::string(what) + " does not fit an int32 position");
    }
    return static_cast<llama_pos>(x);
}

// (branch, token) pairs: commit's, and the commits that ride in a prefill.
std::vector<std::pair<uint32_t, llama_token>> commit_pairs(py::handle pairs, const Model & model) {
    std::vector<std::pair<uint32_t, llama_token>> out;
    for (const py::object & item : sequence_items(pairs, "commit pairs")) {
        auto [h, t] = pair_items(item, "commit pairs");
        out.emplace_back(handle_arg(h), token_from_py(t, model));
    }
    return out;
}

uint32_t grammar_handle_arg(py::handle h) {
    const int64_t v = int_arg(h, "a grammar handle");
    if (v <= 0 || v > 0xFFFFFFFFll) {
        throw stale_handle_error("grammar handle " + std::to_string(v) + " is not live (handles are positive u32)");
    }
    return static_cast<uint32_t>(v);
}

// Runs fn on the driver without the GIL.
template <class F> auto nogil(F && fn) {
    gil_release release;
    return fn();
}

}  // namespace

void register_branch_methods(context_class & cls) {
    cls.def(
           "branch_create",
           [](py_context & c, const py::dict & params, py::handle grammar, uint64_t request_id) {
               const sampler_params p = parse_sampler_params(params);
               const auto g = parse_grammar(grammar, c.core->model());
               return created(nogil([&] { return c.branches->create(p, g, request_id); }));
           },
           py::arg("params"), py::arg("grammar") = py::none(), py::arg("request_id") = 0)
        .def(
            "branch_adopt",
            [](py_context & c, py::handle seq, const py::dict & params, py::handle grammar, uint64_t request_id) {
                const int64_t s = int_arg(seq, "a sequence id");
                const sampler_params p = parse_sampler_params(params);
                const auto g = parse_grammar(grammar, c.core->model());
                return created(nogil([&] { return c.branches->adopt(s, p, g, request_id); }));
            },
            py::arg("seq"), py::arg("params"), py::arg("grammar") = py::none(), py::arg("request_id") = 0)
        .def(
            "branch_fork",
            [](py_context & c, py::handle src) {
                const uint32_t h = handle_arg(src);
                return created(nogil([&] { return c.branches->fork(h); }));
            },
            py::arg("src"))
        .def(
            "branch_prune",
            [](py_context & c, py::handle h, bool subtree) {
                const uint32_t b = handle_arg(h);
                return nogil([&] { return c.branches->prune(b, subtree); });
            },
            py::arg("branch"), py::arg("subtree") = false)
        .def(
            "branch_retain_only",
            [](py_context & c, py::handle h) {
                const uint32_t b = handle_arg(h);
                return nogil([&] { return c.branches->retain_only(b); });
            },
            py::arg("branch"))
        .def(
            "branch_detach",
            [](py_context & c, py::handle h) {
                const uint32_t b = handle_arg(h);
                return nogil([&] { return c.branches->detach(b); });
            },
            py::arg("branch"))
        .def(
            "branch_info",
            [](py_context & c, py::handle h) {
                const uint32_t b = handle_arg(h);
                const branch_info i = nogil([&] { return c.branches->info(b); });
                py::dict d;
                d["handle"] = i.handle;
                d["seq"] = i.seq;
                d["position"] = i.position;
                d["fork_head"] = i.fork_head;
                d["parent"] = i.parent;
                d["children"] = i.children;
                d["has_logits"] = i.has_logits;
                d["n_accepted"] = i.n_accepted;
                d["perplexity"] = i.perplexity;
                d["sampling_perplexity"] = i.sampling_perplexity;
                d["last_token"] = i.last_token;
                return d;
            },
            py::arg("branch"))
        .def("branches", [](py_context & c) { return nogil([&] { return c.branches->handles(); }); })
        .def(
            "branch_set_params",
            [](py_context & c, py::handle h, const py::dict & params) {
                const uint32_t b = handle_arg(h);
                const sampler_params p = parse_sampler_params(params);
                nogil([&] { c.branches->set_params(b, p); });
            },
            py::arg("branch"), py::arg("params"))
        .def(
            "branch_set_grammar",
            [](py_context & c, py::handle h, py::handle grammar, uint64_t request_id) {
                const uint32_t b = handle_arg(h);
                const auto g = parse_grammar(grammar, c.core->model());
                nogil([&] { c.branches->set_grammar(b, g, request_id); });
            },
            py::arg("branch"), py::arg("grammar"), py::arg("request_id") = 0)
        .def(
            "branch_set_logit_bias",
            [](py_context & c, py::handle h, py::handle bias) {
                const uint32_t b = handle_arg(h);
                auto parsed = parse_logit_bias(bias, c.core->model());
                nogil([&] { c.branches->set_logit_bias(b, std::move(parsed)); });
            },
            py::arg("branch"), py::arg("bias"))
        .def(
            "branch_reseed",
            [](py_context & c, py::handle h, py::handle seed) {
                const uint32_t b = handle_arg(h);
                const uint32_t s = parse_seed(seed, "seed");
                nogil([&] { c.branches->reseed(b, s); });
            },
            py::arg("branch"), py::arg("seed"))
        .def(
            "branch_set_logits",
            [](py_context & c, py::handle h, py::handle src) {
                const uint32_t b = handle_arg(h);
                held_buffer buf(src, false);
                const size_t n = static_cast<size_t>(c.core->model().n_vocab());
                if (buf.size() != n * sizeof(float)) {
                    throw std::invalid_argument("logits have " + std::to_string(buf.size()) + " bytes, need exactly " +
                                                std::to_string(n * sizeof(float)) + " (n_vocab float32)");
                }
                // Copied out: the buffer may be unaligned, and the snapshot may be what it points into.
                std::vector<float> z(n);
                std::memcpy(z.data(), buf.data(), n * sizeof(float));
                nogil([&] { c.branches->set_logits(b, z.data()); });
            },
            py::arg("branch"), py::arg("logits"))
        .def(
            "branch_merge_logits",
            [](py_context & c, py::handle dst, py::handle experts, double alpha) {
                const uint32_t d = handle_arg(dst);
                const std::vector<uint32_t> es = handles_arg(experts, "experts");
                nogil([&] { c.branches->merge_logits(d, es, alpha); });
            },
            py::arg("dst"), py::arg("experts"), py::arg("alpha"))
        .def(
            "produce",
            [](py_context & c, py::handle handles, uint64_t request_id) {
                const std::vector<uint32_t> hs = handles_arg(handles, "branch handles");
                return produced_list(nogil([&] { return c.branches->produce(hs, request_id); }), c.core->model());
            },
            py::arg("branches"), py::arg("request_id") = 0)
        .def(
            "branch_set_logprobs",
            [](py_context & c, py::handle branch, int64_t logprobs) {
                const uint32_t b = handle_arg(branch);
                if (logprobs < -1 || logprobs > 20) {
                    throw std::invalid_argument("logprobs must be in [0, 20] (-1: none), got " + std::to_string(logprobs));
                }
                nogil([&] { c.branches->set_logprobs(b, static_cast<int32_t>(logprobs)); });
            },
            py::arg("branch"), py::arg("logprobs"))
        .def(
            "branch_set_text",
            [](py_context & c, py::handle branch, py::handle stops, bool render_special, int64_t logprobs) {
                const uint32_t b = handle_arg(branch);
                if (logprobs < -1 || logprobs > 20) {
                    throw std::invalid_argument("logprobs must be in [0, 20] (-1: none), got " + std::to_string(logprobs));
                }
                std::vector<std::string> ss;
                for (const py::object & s : sequence_items(stops, "stop strings")) {
                    if (!py::isinstance<py::str>(s)) {
                        throw std::invalid_argument("a stop string is a str");
                    }
                    ss.push_back(s.cast<std::string>());
                }
                nogil([&] { c.branches->set_text(b, std::move(ss), render_special, static_cast<int32_t>(logprobs)); });
            },
            py::arg("branch"), py::arg("stop"), py::arg("render_special") = false, py::arg("logprobs") = -1)
        .def(
            "produce_text",
            [](py_context & c, py::handle handles, uint64_t request_id) {
                const std::vector<uint32_t> hs = handles_arg(handles, "branch handles");
                const std::vector<produced_text> out = nogil([&] { return c.branches->produce_text(hs, request_id); });
                py::list result;
                const Model & model = c.core->model();
                for (const produced_text & p : out) {
                    py::object lp = py::none();
                    if (p.logprobs) {
                        lp = logprobs_list({*p.logprobs}, model)[0];
                    }
                    result.append(py::make_tuple(p.token == LLAMA_TOKEN_NULL ? -1 : p.token, p.is_stop,
                                                 py::bytes(p.text), py::bytes(p.held), p.stop_string, lp));
                }
                return result;
            },
            py::arg("branches"), py::arg("request_id") = 0)
        .def(
            "commit",
            [](py_context & c, py::handle pairs, uint64_t request_id) {
                const std::vector<std::pair<uint32_t, llama_token>> ps = commit_pairs(pairs, c.core->model());
                nogil([&] { c.branches->commit(ps, request_id); });
            },
            py::arg("pairs"), py::arg("request_id") = 0)
        .def(
            "prefill",
            [](py_context & c, py::handle items, uint64_t request_id, const py::object & on_progress,
               py::handle commits, py::handle loras) {
                std::vector<std::pair<uint32_t, std::vector<llama_token>>> its;
                for (const py::object & item : sequence_items(items, "prefill items")) {
                    auto [h, t] = pair_items(item, "prefill items");
                    its.emplace_back(handle_arg(h), tokens_from_py(t, c.core->model()));
                }
                const std::vector<std::pair<uint32_t, llama_token>> cs = commit_pairs(commits, c.core->model());
                const context_core::progress_fn progress = progress_arg(on_progress);
                std::optional<std::vector<lora_weight>> config;
                if (!loras.is_none()) {
                    config = lora_weights(loras);
                }
                nogil([&] { c.branches->prefill(its, cs, request_id, progress, config); });
            },
            py::arg("items"), py::arg("request_id") = 0, py::arg("on_progress") = py::none(),
            py::arg("commits") = py::tuple(), py::arg("loras") = py::none())
        .def(
            "step",
            [](py_context & c, py::handle handles, uint64_t request_id) {
                const std::vector<uint32_t> hs = handles_arg(handles, "branch handles");
                return produced_list(nogil([&] { return c.branches->step(hs, request_id); }), c.core->model());
            },
            py::arg("branches"), py::arg("request_id") = 0)
        .def(
            "clear_and_reseed",
            [](py_context & c, py::handle sinks, py::handle tail, uint64_t request_id) {
                std::vector<llama_token> s = tokens_from_py(sinks, c.core->model());
                const std::vector<llama_token> t = tokens_from_py(tail, c.core->model());
                nogil([&] { c.branches->clear_and_reseed(std::move(s), t, request_id); });
            },
            py::arg("sinks"), py::arg("tail"), py::arg("request_id") = 0)
        // -- raw KV sequences ---------------------------------------------------------------------------
        .def(
            "free_seq",
            [](py_context & c, py::handle seq) {
                const int64_t s = int_arg(seq, "a sequence id");
                nogil([&] { c.branches->free_seq(s); });
            },
            py::arg("seq"))
        .def(
            "decode",
            [](py_context & c, const py::object & toks, py::handle pos, py::handle seq, uint64_t request_id) {
                const std::vector<llama_token> tokens = tokens_from_py(toks, c.core->model());
                const llama_pos at = pos_arg(pos, "pos");
                const int64_t s = int_arg(seq, "a sequence id");
                return nogil([&] { return c.branches->raw_decode(tokens, at, s, request_id); });
            },
            py::arg("tokens"), py::arg("pos"), py::arg("seq"), py::arg("request_id") = 0)
        .def(
            "sample",
            [](py_context & c, const py::dict & params, py::handle grammar, uint64_t request_id) {
                const sampler_params p = parse_sampler_params(params);
                const std::optional<uint32_t> g =
                    grammar.is_none() ? std::nullopt : std::optional<uint32_t>(grammar_handle_arg(grammar));
                return nogil([&] {
                    if (!c.branches->raw_logits_current()) {
                        try {
                            c.sequence->write_logits();  // eval's or generate's last logits, into the row
                        } catch (const lloyal_error &) {
                            throw lloyal_error("no logits to sample from: sample() draws from the last decode(), "
                                               "eval() or generate() of this context, and none has left any "
                                               "since (a branch keeps its own: Branch.sample())");
                        }
                    }
                    return c.branches->raw_sample(p, g ? &c.grammars->sampler(*g) : nullptr, request_id);
                });
            },
            py::arg("params"), py::arg("grammar") = py::none(), py::arg("request_id") = 0)
        .def(
            "grammar_new",
            [](py_context & c, py::handle grammar, uint64_t request_id) {
                const auto g = parse_grammar(grammar, c.core->model());
                if (!g) {
                    throw std::invalid_argument("grammar_new needs a grammar, not None");
                }
                return nogil([&] { return c.grammars->create(*g, request_id); });
            },
            py::arg("grammar"), py::arg("request_id") = 0)
        .def(
            "grammar_clone",
            [](py_context & c, py::handle h) {
                const uint32_t g = grammar_handle_arg(h);
                return nogil([&] { return c.grammars->clone(g); });
            },
            py::arg("handle"))
        .def(
            "grammar_mask",
            [](py_context & c, py::handle h, uint64_t request_id) {
                const uint32_t g = grammar_handle_arg(h);
                return nogil([&] { return c.grammars->mask(g, request_id); });
            },
            py::arg("handle"), py::arg("request_id") = 0)
        .def(
            "grammar_accept",
            [](py_context & c, py::handle h, py::handle token, uint64_t request_id) {
                const uint32_t g = grammar_handle_arg(h);
                const llama_token t = token_from_py(token, c.core->model());
                nogil([&] { c.grammars->accept(g, t, request_id); });
            },
            py::arg("handle"), py::arg("token"), py::arg("request_id") = 0)
        .def(
            "grammar_free",
            [](py_context & c, py::handle h) {
                const uint32_t g = grammar_handle_arg(h);
                nogil([&] { c.grammars->free(g); });
            },
            py::arg("handle"))
        .def(
            "kv_seq_cp",
            [](py_context & c, py::handle src, py::handle dst, py::handle p0, py::handle p1) {
                const int64_t s = int_arg(src, "a sequence id");
                const int64_t d = int_arg(dst, "a sequence id");
                const llama_pos a = pos_arg(p0, "p0");
                const llama_pos b = pos_arg(p1, "p1");
                nogil([&] { c.branches->seq_cp(s, d, a, b); });
            },
            py::arg("src"), py::arg("dst"), py::arg("p0"), py::arg("p1"))
        .def(
            "kv_seq_keep",
            [](py_context & c, py::handle seq) {
                const int64_t s = int_arg(seq, "a sequence id");
                nogil([&] { c.branches->seq_keep(s); });
            },
            py::arg("seq"))
        .def(
            "kv_seq_rm",
            [](py_context & c, py::handle seq, py::handle p0, py::handle p1) {
                const int64_t s = int_arg(seq, "a sequence id");
                const llama_pos a = pos_arg(p0, "p0");
                const llama_pos b = pos_arg(p1, "p1");
                return nogil([&] { return c.branches->seq_rm(s, a, b); });
            },
            py::arg("seq"), py::arg("p0"), py::arg("p1"))
        .def(
            "kv_seq_pos_min",
            [](py_context & c, py::handle seq) {
                const int64_t s = int_arg(seq, "a sequence id");
                return nogil([&] { return c.branches->seq_pos_min(s); });
            },
            py::arg("seq"))
        .def(
            "kv_seq_pos_max",
            [](py_context & c, py::handle seq) {
                const int64_t s = int_arg(seq, "a sequence id");
                return nogil([&] { return c.branches->seq_pos_max(s); });
            },
            py::arg("seq"))
        .def("kv_pressure",
             [](py_context & c) {
                 const kv_pressure k = nogil([&] { return c.branches->pressure(); });
                 py::dict d;
                 d["n_ctx"] = k.n_ctx;
                 d["cells_used"] = k.cells_used;
                 d["remaining"] = k.remaining;
                 d["n_seq_max"] = k.n_seq_max;
                 d["seqs_leased"] = k.seqs_leased;
                 d["seqs_free"] = k.seqs_free;
                 return d;
             })
        .def(
            "state_seq_size",
            [](py_context & c, py::handle seq) {
                const int64_t s = int_arg(seq, "a sequence id");
                return nogil([&] { return c.branches->state_size(s); });
            },
            py::arg("seq"))
        .def(
            "state_seq_get",
            [](py_context & c, py::handle seq) {
                const int64_t s = int_arg(seq, "a sequence id");
                const std::vector<uint8_t> data = nogil([&] { return c.branches->state_get(s); });
                return py::bytes(reinterpret_cast<const char *>(data.data()), data.size());
            },
            py::arg("seq"))
        .def(
            "state_seq_set",
            [](py_context & c, py::handle seq, py::handle data) {
                const int64_t s = int_arg(seq, "a sequence id");
                held_buffer buf(data, false);
                return nogil([&] {
                    return c.branches->state_set(s, static_cast<const uint8_t *>(buf.data()), buf.size());
                });
            },
            py::arg("seq"), py::arg("data"))
        .def(
            "state_seq_save_file",
            [](py_context & c, py::handle seq, const std::string & path, py::handle tokens) {
                const int64_t s = int_arg(seq, "a sequence id");
                const std::vector<llama_token> toks = tokens_from_py(tokens, c.core->model());
                return nogil([&] { return c.branches->state_save_file(s, path, toks); });
            },
            py::arg("seq"), py::arg("path"), py::arg("tokens") = py::list())
        .def(
            "state_seq_load_file",
            [](py_context & c, py::handle seq, const std::string & path) {
                const int64_t s = int_arg(seq, "a sequence id");
                return nogil([&] { return c.branches->state_load_file(s, path); });
            },
            py::arg("seq"), py::arg("path"));
}

}  // namespace lloyal
