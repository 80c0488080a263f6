#include "common.hpp"
#include "errors.hpp"
#include "branch.hpp"
#include "sampling.hpp"

#include "common.h"
#include "json-schema-to-grammar.h"

#include <cstdio>
#include <functional>
#include <regex>
#include <set>

#include <unistd.h>

namespace lloyal {

namespace {

// llama.cpp's GBNF parser reports *why* a grammar does not parse with fprintf(stderr), not through
// the log callback, which only gets "failed to parse grammar". To put the reason into GrammarError,
// fd 2 is pointed at a temporary file for the duration of the (short, GIL-holding) parse; whatever
// landed there is then written on to the real fd 2, so nothing is lost, at worst reordered.
std::string run_capturing_stderr(const std::function<void()> & fn) {
    std::fflush(stderr);
    FILE * tmp = std::tmpfile();
    const int saved = tmp != nullptr ? ::dup(2) : -1;
    if (tmp == nullptr || saved < 0 || ::dup2(fileno(tmp), 2) < 0) {
        if (saved >= 0) {
            ::close(saved);
        }
        if (tmp != nullptr) {
            std::fclose(tmp);
        }
        fn();  // no capture possible: still run, just without the detailed reason
        return {};
    }
    struct restore {
        int saved;
        FILE * tmp;
        ~restore() {
            std::fflush(stderr);
            ::dup2(saved, 2);
            ::close(saved);
        }
    };
    std::string captured;
    {
        restore r{saved, tmp};
        fn();
    }
    std::rewind(tmp);
    char buf[4096];
    size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof(buf), tmp)) > 0) {
        captured.append(buf, n);
    }
    std::fclose(tmp);
    size_t off = 0;
    while (off < captured.size()) {
        const ssize_t w = ::write(2, captured.data() + off, captured.size() - off);
        if (w <= 0) {
            break;
        }
        off += static_cast<size_t>(w);
    }
    return captured;
}

std::string parse_error_reason(const std::string & captured) {
    static const std::string marker = "error parsing grammar: ";
    const size_t at = captured.find(marker);
    if (at == std::string::npos) {
        return {};
    }
    const size_t start = at + marker.size();
    const size_t end = captured.find('\n', start);
    return captured.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

}  // namespace

llama_sampler * make_grammar_sampler(const Model & model, const std::string & gbnf, const std::string & root, bool lazy,
                                     const std::vector<std::string> & trigger_patterns,
                                     const std::vector<llama_token> & trigger_tokens) {
    const uint64_t mark = log_mark();
    llama_sampler * smpl = nullptr;
    std::string captured;
    std::vector<const char *> patterns;
    for (const auto & p : trigger_patterns) {
        patterns.push_back(p.c_str());
    }
    try {
        captured = run_capturing_stderr([&] {
            if (lazy) {
                smpl = llama_sampler_init_grammar_lazy_patterns(model.vocab(), gbnf.c_str(), root.c_str(), patterns.data(),
                                                                patterns.size(), trigger_tokens.data(),
                                                                trigger_tokens.size());
            } else {
                smpl = llama_sampler_init_grammar(model.vocab(), gbnf.c_str(), root.c_str());
            }
        });
    } catch (const std::regex_error & e) {
        throw grammar_error(std::string("invalid trigger pattern: ") + e.what());
    } catch (const std::exception & e) {
        throw grammar_error(std::string("invalid grammar: ") + e.what());
    }
    if (smpl == nullptr) {
        const std::string parsed = parse_error_reason(captured);
        throw grammar_error("invalid grammar" + (parsed.empty() ? log_reason_since(mark, 1) : ": " + parsed));
    }
    return smpl;
}

namespace {

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

}  // namespace

grammar_spec parse_grammar_spec(const py::handle & spec, const Model & model) {
    if (!PyDict_Check(spec.ptr())) {
        throw py::type_error("a grammar must be a dict (or None)");
    }
    const py::dict d = py::reinterpret_borrow<py::dict>(spec);
    static const std::set<std::string> keys = {"gbnf", "root", "lazy", "trigger_words", "trigger_patterns",
                                               "trigger_tokens"};
    for (auto item : d) {
        if (!PyUnicode_Check(item.first.ptr()) || keys.count(item.first.cast<std::string>()) == 0) {
            throw std::invalid_argument("unknown grammar key " + py::repr(item.first).cast<std::string>() +
                                        " (gbnf, root, lazy, trigger_words, trigger_patterns, trigger_tokens)");
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
    return g;
}

llama_sampler * make_grammar_sampler(const Model & model, const grammar_spec & g) {
    return make_grammar_sampler(model, g.gbnf, g.root, g.lazy, g.trigger_patterns, g.trigger_tokens);
}

void register_grammar(py::module_ & m) {
    m.def(
        "json_schema_to_grammar",
        [](const std::string & schema_json) {
            // The converter reports bad schemas with several exception types (parse errors of the
            // JSON itself, invalid_argument for unsupported constructs); all of them mean the same here.
            try {
                return json_schema_to_grammar(common_json::parse(schema_json));
            } catch (const std::exception & e) {
                throw grammar_error(std::string("invalid JSON schema: ") + e.what());
            }
        },
        py::arg("schema_json"),
        "llama.cpp's own JSON-schema -> GBNF converter. Raises GrammarError on an invalid schema.");
}

}  // namespace lloyal
