// Grammars: GBNF (and JSON schemas converted to it) as llama.cpp grammar samplers, with the reason a
// grammar does not parse in the GrammarError.
#include "common.hpp"
#include "errors.hpp"
#include "sampling.hpp"

#include "common.h"
#include "json-schema-to-grammar.h"
#include "llama-grammar.h"
#include "llama-vocab.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <regex>
#include <set>
#include <thread>

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

// The grammar sampler is ours, over llama.cpp's grammar (llama-grammar.h), so that its two costly
// steps run in slices with an interrupt check between them. A grammar of many alternatives (a list of
// 20,000 names) has as many parse stacks: llama.cpp's apply costs stacks x candidates (seconds over a
// 262k vocabulary) and its accept stacks^2 (its duplicate check), both in one call. Sliced, each step
// gives the same result as llama.cpp's single call (tests/test_grammar_interrupt.py compares the masks):
// - apply: a candidate is allowed when some stack allows it, so the stacks are taken 128 at a time,
//   and the candidates no slice allowed yet in chunks sized to a few ms each; what no slice allowed
//   is masked at the end.
// - accept: each stack advances on its own; the slices' new stacks are concatenated in order, keeping
//   the first of any duplicates, which is llama.cpp's order.
namespace {

constexpr size_t k_stack_slice = 128;
constexpr int64_t k_slice_budget_us = 4000;

struct grammar_state {
    const llama_vocab * vocab = nullptr;
    llama_grammar * g = nullptr;  // null: an empty grammar, which allows everything
};

grammar_state * state_of(const llama_sampler * s);

const char * grammar_name(const llama_sampler *) { return "grammar"; }

void grammar_accept_iface(llama_sampler * s, llama_token token) { grammar_accept(s, token, nullptr); }

void grammar_apply_iface(llama_sampler * s, llama_token_data_array * cur) { grammar_apply(s, *cur, nullptr); }

llama_sampler * wrap(const llama_vocab * vocab, llama_grammar * g);

// llama_grammar_clone_impl points the copied stacks at the copied rules by comparing every stack
// element with every rule element: stacks x rule elements, 1.7 s for a grammar of 20,000 alternatives,
// and a branch clones its grammar at every produce, step and commit. The same copy, each element found
// by a binary search over where the rules start.
llama_grammar * clone_grammar(const llama_grammar & g) {
    auto * out = new llama_grammar{g.vocab,           g.rules,
                                   g.stacks,          g.partial_utf8,
                                   g.lazy,            g.awaiting_trigger,
                                   g.trigger_buffer,  g.trigger_buffer_positions,
                                   g.trigger_tokens,  g.trigger_patterns};
    std::vector<std::pair<const llama_grammar_element *, size_t>> starts;  // (first element, rule index)
    for (size_t r = 0; r < g.rules.size(); ++r) {
        if (!g.rules[r].empty()) {
            starts.emplace_back(g.rules[r].data(), r);
        }
    }
    const std::less<const llama_grammar_element *> before;
    std::sort(starts.begin(), starts.end(), [&](const auto & a, const auto & b) { return before(a.first, b.first); });
    for (auto & stack : out->stacks) {
        for (auto & el : stack) {
            auto it = std::upper_bound(starts.begin(), starts.end(), el,
                                       [&](const llama_grammar_element * p, const auto & st) { return before(p, st.first); });
            if (it == starts.begin()) {
                continue;  // not an element of a rule: left as it is, as llama.cpp leaves it
            }
            --it;
            const size_t r = it->second;
            const auto off = static_cast<size_t>(el - it->first);
            if (off < g.rules[r].size()) {
                el = &out->rules[r][off];
            }
        }
    }
    return out;
}

llama_sampler * grammar_clone(const llama_sampler * s) {
    const grammar_state * st = state_of(s);
    return wrap(st->vocab, st->g != nullptr ? clone_grammar(*st->g) : nullptr);
}

void grammar_free(llama_sampler * s) {
    grammar_state * st = state_of(s);
    if (st->g != nullptr) {
        llama_grammar_free_impl(st->g);
    }
    delete st;
}

llama_sampler_i & grammar_iface() {
    static llama_sampler_i iface = [] {
        llama_sampler_i i{};
        i.name = &grammar_name;
        i.accept = &grammar_accept_iface;
        i.apply = &grammar_apply_iface;
        i.clone = &grammar_clone;
        i.free = &grammar_free;
        return i;
    }();
    return iface;
}

grammar_state * state_of(const llama_sampler * s) {
    if (s == nullptr || s->iface != &grammar_iface()) {
        throw std::logic_error("not one of lloyal's grammar samplers");
    }
    return static_cast<grammar_state *>(s->ctx);
}

llama_sampler * wrap(const llama_vocab * vocab, llama_grammar * g) {
    auto * st = new grammar_state{vocab, g};
    return llama_sampler_init(&grammar_iface(), st);
}

// The grammar's stacks moved aside for the slices, and put back unless the step completed.
class stacks_aside {
  public:
    explicit stacks_aside(llama_grammar & g) : g_(g), all_(std::move(g.stacks)), partial_(g.partial_utf8) {}
    ~stacks_aside() {
        if (!done_) {
            g_.stacks = std::move(all_);
            g_.partial_utf8 = partial_;
        }
    }
    stacks_aside(const stacks_aside &) = delete;
    stacks_aside & operator=(const stacks_aside &) = delete;

    size_t size() const { return all_.size(); }
    // Slice [s0, s0 + k_stack_slice) becomes the grammar's stacks, from the partial UTF-8 state it had.
    void use_slice(size_t s0) {
        const size_t s1 = std::min(all_.size(), s0 + k_stack_slice);
        g_.stacks.assign(all_.begin() + static_cast<std::ptrdiff_t>(s0), all_.begin() + static_cast<std::ptrdiff_t>(s1));
        g_.partial_utf8 = partial_;
    }
    void finish(llama_grammar_stacks stacks, llama_partial_utf8 partial) {
        g_.stacks = std::move(stacks);
        g_.partial_utf8 = partial;
        done_ = true;
    }

  private:
    llama_grammar & g_;
    llama_grammar_stacks all_;
    llama_partial_utf8 partial_;
    bool done_ = false;
};

void check_stop(const stop_fn & stop) {
    if (stop && stop()) {
        throw interrupted_error("interrupted while the grammar was applied: nothing was changed");
    }
}

struct stack_less {
    bool operator()(const llama_grammar_stack & a, const llama_grammar_stack & b) const {
        return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(),
                                            std::less<const llama_grammar_element *>());
    }
};

}  // namespace

void grammar_apply(llama_sampler * s, llama_token_data_array & cur, const stop_fn & stop) {
    grammar_state * st = state_of(s);
    if (st->g == nullptr || st->g->awaiting_trigger || cur.size == 0) {
        return;  // a lazy grammar awaiting its trigger allows everything (as llama.cpp's does)
    }
    llama_grammar & g = *st->g;
    if (!stop && g.stacks.size() <= k_stack_slice) {
        llama_grammar_apply_impl(g, &cur);
        return;
    }
    std::vector<size_t> pending(cur.size);  // indices no slice has allowed yet
    for (size_t i = 0; i < cur.size; ++i) {
        pending[i] = i;
    }
    std::vector<size_t> still;
    std::vector<llama_token_data> part;
    size_t chunk = 4096;
    stacks_aside aside(g);
    for (size_t s0 = 0; s0 < aside.size() && !pending.empty(); s0 += k_stack_slice) {
        aside.use_slice(s0);
        still.clear();
        for (size_t i = 0; i < pending.size();) {
            const size_t m = std::min(chunk, pending.size() - i);
            part.resize(m);
            for (size_t k = 0; k < m; ++k) {
                part[k] = llama_token_data{cur.data[pending[i + k]].id, 0.0f, 0.0f};
            }
            llama_token_data_array a{part.data(), m, -1, false};
            const int64_t t0 = now_us();
            llama_grammar_apply_impl(g, &a);
            const int64_t dt = now_us() - t0;
            for (size_t k = 0; k < m; ++k) {
                if (std::isinf(part[k].logit)) {
                    still.push_back(pending[i + k]);
                }
            }
            i += m;
            check_stop(stop);
            if (dt > k_slice_budget_us && chunk > 16) {
                chunk /= 2;
            } else if (dt < k_slice_budget_us / 4 && chunk < (size_t{1} << 20)) {
                chunk *= 2;
            }
        }
        pending.swap(still);
    }
    for (size_t i : pending) {
        cur.data[i].logit = -INFINITY;
    }
    // The stacks go back as they were (the destructor): apply changes nothing of the grammar.
}

void grammar_accept(llama_sampler * s, llama_token token, const stop_fn & stop) {
    grammar_state * st = state_of(s);
    if (st->g == nullptr) {
        return;
    }
    llama_grammar & g = *st->g;
    if (g.awaiting_trigger || g.stacks.size() <= k_stack_slice || st->vocab->is_eog(token)) {
        llama_grammar_accept_impl(g, token);
        return;
    }
    const std::string & piece = st->vocab->token_to_piece(token);
    stacks_aside aside(g);
    llama_grammar_stacks merged;
    std::set<llama_grammar_stack, stack_less> seen;
    llama_partial_utf8 partial_after = g.partial_utf8;
    std::string refused;
    for (size_t s0 = 0; s0 < aside.size(); s0 += k_stack_slice) {
        aside.use_slice(s0);
        try {
            llama_grammar_accept_token(g, token, piece);
        } catch (const std::runtime_error & e) {
            refused = e.what();  // no stack of this slice goes on; another slice's may
            g.stacks.clear();
        }
        partial_after = g.partial_utf8;
        for (auto & stack : g.stacks) {
            if (seen.insert(stack).second) {
                merged.push_back(std::move(stack));
            }
        }
        check_stop(stop);
    }
    const bool none = merged.empty();
    aside.finish(std::move(merged), partial_after);
    if (none) {
        throw std::runtime_error(refused);  // llama.cpp's own error, its grammar left without stacks
    }
}

namespace {

// One parse of a grammar (llama_grammar_init_impl), with what llama.cpp wrote on stderr meanwhile. It
// owns copies of its inputs, so that a parse its caller stopped waiting for can run on to its end.
struct grammar_parse {
    const llama_vocab * vocab;
    grammar_spec spec;
    llama_grammar * parsed = nullptr;
    std::string captured;
    std::exception_ptr error;
    // For a parse aside (parse_aside): its end, and whether its caller stopped waiting for it.
    std::mutex mu;
    std::condition_variable ended;
    bool done = false;
    bool abandoned = false;

    // capture_stderr: false once the text is known to parse (parses_alone), since only llama.cpp's GBNF
    // parser writes to stderr.
    void run(bool capture_stderr) {
        std::vector<const char *> patterns;
        for (const auto & p : spec.trigger_patterns) {
            patterns.push_back(p.c_str());
        }
        const auto init = [&] {
            parsed = spec.lazy ? llama_grammar_init_impl(vocab, spec.gbnf.c_str(), spec.root.c_str(), true,
                                                         patterns.data(), patterns.size(),
                                                         spec.trigger_tokens.data(), spec.trigger_tokens.size())
                               : llama_grammar_init_impl(vocab, spec.gbnf.c_str(), spec.root.c_str(), false,
                                                         nullptr, 0, nullptr, 0);
        };
        try {
            const reported quiet;  // a failed parse is a GrammarError carrying the reason: log it as debug
            if (capture_stderr) {
                captured = run_capturing_stderr(init);
            } else {
                init();
            }
        } catch (...) {
            error = std::current_exception();
        }
    }

    // Whether the text parses (quick: no stacks are built), with llama.cpp's reason in `captured` if not.
    bool parses_alone() {
        bool ok = false;
        const reported quiet;
        captured = run_capturing_stderr([&] {
            llama_grammar_parser parser(vocab);
            ok = parser.parse(spec.gbnf.c_str()) && !parser.rules.empty();
        });
        return ok;
    }

  private:
    struct reported {
        reported() { log_reported_begin(); }
        ~reported() { log_reported_end(); }
    };
};

// A grammar this large may take llama.cpp long enough to parse (its stacks grow with the alternatives:
// 20,000 took 1.6 s) that an interrupt must not wait for it: it is parsed on a thread of its own.
constexpr size_t kParseAsideBytes = 4096;

// Parses the caller stopped waiting for, still running: joined before their vocabulary can go (a
// model's destructor) and before the process forks (a snapshot's zygote): a thread holding a lock (the
// allocator's, the log's) at the fork would leave it held for good in the child.
std::mutex g_aside_mu;
std::vector<std::thread> g_aside;

void join_aside_at_fork() { join_abandoned_grammar_parses(); }
const int g_atfork = ::pthread_atfork(join_aside_at_fork, nullptr, nullptr);

// The parse on a thread, asking `stop` every 2 ms meanwhile: true leaves the parse to end on its own
// (its result freed) and throws interrupted_error. The text is checked here first, so that the thread
// never holds fd 2 redirected: a parse left running must not swallow what others write there.
void parse_aside(const std::shared_ptr<grammar_parse> & job, const stop_fn & stop) {
    if (!job->parses_alone()) {
        return;  // no grammar: the caller reports the reason captured
    }
    std::thread worker([job] {
        job->run(false);
        std::lock_guard<std::mutex> lock(job->mu);
        job->done = true;
        if (job->abandoned && job->parsed != nullptr) {
            llama_grammar_free_impl(job->parsed);
            job->parsed = nullptr;
        }
        job->ended.notify_all();
    });
    std::unique_lock<std::mutex> lock(job->mu);
    while (!job->done) {
        if (stop()) {
            job->abandoned = true;
            lock.unlock();
            std::lock_guard<std::mutex> aside(g_aside_mu);
            g_aside.push_back(std::move(worker));
            throw interrupted_error("interrupted while the grammar was parsed: nothing was changed");
        }
        job->ended.wait_for(lock, std::chrono::milliseconds(2));
    }
    lock.unlock();
    worker.join();
}

}  // namespace

void join_abandoned_grammar_parses() {
    std::vector<std::thread> threads;
    {
        std::lock_guard<std::mutex> lock(g_aside_mu);
        threads.swap(g_aside);
    }
    for (auto & t : threads) {
        t.join();
    }
}

sampler_ptr make_grammar_sampler(const Model & model, const grammar_spec & g, const stop_fn & stop) {
    const uint64_t mark = log_mark();
    llama_sampler * smpl = nullptr;
    std::string captured;
    if (g.gbnf.empty()) {
        smpl = wrap(model.vocab(), nullptr);  // llama.cpp's grammar sampler: an empty one allows all
    } else {
        auto job = std::make_shared<grammar_parse>();
        job->vocab = model.vocab();
        job->spec = g;
        if (stop && g.gbnf.size() >= kParseAsideBytes) {
            parse_aside(job, stop);
        } else {
            job->run(true);
        }
        try {
            if (job->error) {
                std::rethrow_exception(job->error);
            }
        } catch (const std::regex_error & e) {
            throw grammar_error(std::string("invalid trigger pattern: ") + e.what());
        } catch (const std::exception & e) {
            throw grammar_error(std::string("invalid grammar: ") + e.what());
        }
        captured = std::move(job->captured);
        if (job->parsed != nullptr) {
            smpl = wrap(model.vocab(), job->parsed);
        }
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

std::vector<std::pair<std::vector<llama_token>, std::vector<llama_token>>>
grammar_slices_check(const Model & model, const std::string & gbnf, const std::vector<llama_token> & tokens) {
    sampler_ptr theirs(llama_sampler_init_grammar(model.vocab(), gbnf.c_str(), "root"));
    if (theirs == nullptr) {
        throw grammar_error("invalid grammar");
    }
    grammar_spec spec;
    spec.gbnf = gbnf;
    sampler_ptr ours = make_grammar_sampler(model, spec);
    const stop_fn never = [] { return false; };  // a stop check: the sliced path, whatever the size
    const int32_t n_vocab = model.n_vocab();
    std::vector<llama_token_data> a(static_cast<size_t>(n_vocab));
    std::vector<llama_token_data> b(static_cast<size_t>(n_vocab));
    std::vector<std::pair<std::vector<llama_token>, std::vector<llama_token>>> out;
    for (size_t step = 0; step <= tokens.size(); ++step) {
        for (int32_t t = 0; t < n_vocab; ++t) {
            a[static_cast<size_t>(t)] = b[static_cast<size_t>(t)] = llama_token_data{t, 0.0f, 0.0f};
        }
        llama_token_data_array pa{a.data(), a.size(), -1, false};
        llama_token_data_array pb{b.data(), b.size(), -1, false};
        llama_sampler_apply(theirs.get(), &pa);
        ours.reset(llama_sampler_clone(ours.get()));  // every step from a clone: our clone is checked too
        grammar_apply(ours.get(), pb, never);
        std::pair<std::vector<llama_token>, std::vector<llama_token>> allowed;
        for (int32_t t = 0; t < n_vocab; ++t) {
            if (!std::isinf(a[static_cast<size_t>(t)].logit)) {
                allowed.first.push_back(t);
            }
            if (!std::isinf(b[static_cast<size_t>(t)].logit)) {
                allowed.second.push_back(t);
            }
        }
        out.push_back(std::move(allowed));
        if (step < tokens.size()) {
            llama_sampler_accept(theirs.get(), tokens[step]);
            grammar_accept(ours.get(), tokens[step], never);
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
