// Grammars: GBNF (and JSON schemas converted to it) as llama.cpp grammar samplers, with the reason a
// grammar does not parse in the GrammarError.
#include "common.hpp"
#include "errors.hpp"
#include "sampling.hpp"

#include "common.h"
#include "json-schema-to-grammar.h"

#include <cstdio>
#include <functional>
#include <mutex>
#include <regex>
#include <set>

#include <sys/mman.h>
#include <unistd.h>

namespace lloyal {

namespace {

// llama.cpp's GBNF parser reports *why* a grammar does not parse with fprintf(stderr), not through
// the log callback, which only gets "failed to parse grammar". To put the reason into GrammarError,
// fd 2 is pointed at a temporary file for the duration of the (short, serialized) parse. What landed
// there goes into the error; after a parse that succeeded it is written on to the real fd 2.
std::string run_capturing_stderr(const std::function<void()> & fn) {
    // fd 2 is the process's: two parses at once (contexts on other threads, without the GIL) would
    // restore each other's redirections.
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    std::fflush(stderr);
    // A memfd, not tmpfile(): a sandboxed worker may not create files in /tmp.
    const int mfd = ::memfd_create("lloyal-grammar-stderr", MFD_CLOEXEC);
    FILE * tmp = mfd >= 0 ? ::fdopen(mfd, "w+") : nullptr;
    if (tmp == nullptr && mfd >= 0) {
        ::close(mfd);
    }
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
    return captured;
}

void write_all_stderr(const std::string & text) {
    size_t off = 0;
    while (off < text.size()) {
        const ssize_t w = ::write(2, text.data() + off, text.size() - off);
        if (w <= 0) {
            break;
        }
        off += static_cast<size_t>(w);
    }
}

std::string parse_error_reason(const std::string & captured) {
    static const std::string marker = "error parsing grammar: ";
    const size_t at = captured.find(marker);
    if (at == std::string::npos) {
        return {};
    }
    const size_t start = at + marker.size();
    const size_t end = captured.find('\n', start);
    std::string reason = captured.substr(start, end == std::string::npos ? std::string::npos : end - start);
    // llama.cpp quotes the rest of the grammar after "at ": nothing when the grammar ended early.
    if (reason.size() >= 3 && reason.compare(reason.size() - 3, 3, "at ") == 0) {
        reason += "the end of the grammar";
    }
    return reason;
}

}  // namespace

sampler_ptr make_grammar_sampler(const Model & model, const grammar_spec & g) {
    const uint64_t mark = log_mark();
    llama_sampler * smpl = nullptr;
    std::string captured;
    std::vector<const char *> patterns;
    for (const auto & p : g.trigger_patterns) {
        patterns.push_back(p.c_str());
    }
    const std::string & gbnf = g.gbnf;
    const std::string & root = g.root;
    const std::vector<llama_token> & trigger_tokens = g.trigger_tokens;
    struct reported {
        reported() { log_reported_begin(); }
        ~reported() { log_reported_end(); }
    };
    try {
        const reported quiet;  // a failed parse is a GrammarError carrying the reason: log it as debug
        captured = run_capturing_stderr([&] {
            if (g.lazy) {
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
    write_all_stderr(captured);
    sampler_ptr out(smpl);
    if (!g.prefill.empty()) {
        for (const llama_token tok : model.tokenize(g.prefill, false, true)) {
            // An end-of-generation token the grammar cannot end at would GGML_ABORT inside llama.cpp.
            if (llama_vocab_is_eog(model.vocab(), tok)) {
                throw grammar_error("a grammar prefill cannot hold an end-of-generation token (" +
                                    model.token_to_piece(tok, true) + ")");
            }
            try {
                llama_sampler_accept(out.get(), tok);
            } catch (const std::exception & e) {
                throw grammar_error("the grammar does not accept its prefill at " + model.token_to_piece(tok, true) +
                                    ": " + e.what());
            }
        }
    }
    return out;
}

std::string json_schema_to_gbnf(const std::string & schema_json) {
    // The converter reports bad schemas with several exception types (parse errors of the JSON itself,
    // invalid_argument for unsupported constructs); all of them mean the same here.
    try {
        return json_schema_to_grammar(common_json::parse(schema_json));
    } catch (const std::exception & e) {
        throw grammar_error(std::string("invalid JSON schema: ") + e.what());
    }
}

}  // namespace lloyal
