// llama.cpp/ggml log -> fd 2, one prefixed line at a time.
//
// fd 1 is never written: a worker's stdout may be its protocol channel. The callback runs on whatever
// thread llama.cpp logs from (the loader, ggml's compute threads) and never with any guarantee about
// the GIL, so it touches no Python object; it writes with write(2) directly.
#include "common.hpp"

#include <atomic>
#include <cerrno>
#include <deque>
#include <mutex>
#include <stdexcept>

#include <unistd.h>

namespace lloyal {

namespace {

// Our scale, as the stub documents it: 0 debug, 1 info, 2 warn, 3 error, 4 none.
constexpr int k_level_debug = 0;
constexpr int k_level_info = 1;
constexpr int k_level_warn = 2;
constexpr int k_level_error = 3;
constexpr int k_level_none = 4;

constexpr size_t k_kept_lines = 32;

struct kept_line {
    uint64_t seq;
    int level;
    std::string text;
};

struct log_state {
    std::mutex mu;
    std::string partial;  // text of the current line until its '\n' arrives
    int partial_level = k_level_info;
    std::deque<kept_line> kept;
    uint64_t seq = 0;
};

std::atomic<int> g_min_level{k_level_warn};
// > 0 while a decode we asked to abort is unwinding: llama.cpp logs that as three error lines
// ("failed to compute graph", ...) and a warning; for an interrupt those are expected, not errors.
std::atomic<int> g_aborting{0};
std::atomic<int> g_reported{0};

log_state & state() {
    // Leaked on purpose: ggml threads may still log while static destructors run at exit.
    static log_state * s = new log_state();
    return *s;
}

int to_our_level(ggml_log_level level) {
    switch (level) {
        case GGML_LOG_LEVEL_DEBUG: return k_level_debug;
        case GGML_LOG_LEVEL_INFO: return k_level_info;
        case GGML_LOG_LEVEL_WARN: return k_level_warn;
        case GGML_LOG_LEVEL_ERROR: return k_level_error;
        default: return k_level_info;  // NONE: unleveled output, treated as info
    }
}

void write_all(int fd, const char * data, size_t size) {
    while (size > 0) {
        const ssize_t n = ::write(fd, data, size);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return;  // nowhere left to report a failing stderr
        }
        data += n;
        size -= static_cast<size_t>(n);
    }
}

// Warnings that greet every normal use: a choice this module makes on purpose (swa_full defaults to
// true here), and a model-file quirk llama.cpp corrects itself (Gemma 3 marks '</s>' as text).
bool is_expected_warning(std::string_view line) {
    return line.find("using full-size SWA cache") != std::string_view::npos ||
           line.find("control-looking token") != std::string_view::npos;
}

// Called with state().mu held.
void emit_line(log_state & st, int level, std::string_view line) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) {
        line.remove_suffix(1);
    }
    if (line.empty()) {
        return;
    }
    if (level == k_level_warn && is_expected_warning(line)) {
        level = k_level_info;
    }
    if (level >= k_level_warn) {
        st.kept.push_back({++st.seq, level, std::string(line)});
        if (st.kept.size() > k_kept_lines) {
            st.kept.pop_front();
        }
    }
    if (g_reported.load(std::memory_order_relaxed) > 0) {
        level = k_level_debug;  // kept for the error message above; written only as debug
    }
    const int min_level = g_min_level.load(std::memory_order_relaxed);
    if (min_level >= k_level_none || level < min_level) {
        return;
    }
    static const char * const prefixes[] = {"[llama.cpp D] ", "[llama.cpp I] ", "[llama.cpp W] ", "[llama.cpp E] "};
    std::string out;
    out.reserve(line.size() + 16);
    out += prefixes[level];
    out += line;
    out += '\n';
    write_all(2, out.data(), out.size());
}

void log_callback(ggml_log_level level, const char * text, void *) {
    if (text == nullptr) {
        return;
    }
    log_state & st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    if ((level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) && g_aborting.load(std::memory_order_relaxed) > 0) {
        level = GGML_LOG_LEVEL_DEBUG;
    }
    if (level != GGML_LOG_LEVEL_CONT) {
        // A new message while the previous one has no newline yet: that one is complete.
        if (!st.partial.empty()) {
            emit_line(st, st.partial_level, st.partial);
            st.partial.clear();
        }
        st.partial_level = to_our_level(level);
    }
    st.partial += text;
    size_t start = 0;
    for (size_t nl = st.partial.find('\n'); nl != std::string::npos; nl = st.partial.find('\n', start)) {
        emit_line(st, st.partial_level, std::string_view(st.partial).substr(start, nl - start));
        start = nl + 1;
    }
    st.partial.erase(0, start);
}

}  // namespace

void log_abort_begin() { g_aborting.fetch_add(1, std::memory_order_relaxed); }
void log_reported_begin() { g_reported.fetch_add(1, std::memory_order_relaxed); }
void log_reported_end() { g_reported.fetch_sub(1, std::memory_order_relaxed); }
void log_abort_end() { g_aborting.fetch_sub(1, std::memory_order_relaxed); }

uint64_t log_mark() {
    log_state & st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    return st.seq;
}

std::string log_errors_since(uint64_t mark, size_t max_lines) {
    log_state & st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    // A message still waiting for its newline may be the very reason of a failure.
    if (!st.partial.empty() && st.partial_level >= k_level_warn) {
        emit_line(st, st.partial_level, st.partial);
        st.partial.clear();
    }
    // Errors say why; warnings only when there is no error line at all.
    for (int level : {k_level_error, k_level_warn}) {
        std::vector<const std::string *> lines;
        for (const auto & k : st.kept) {
            if (k.seq > mark && k.level >= level) {
                lines.push_back(&k.text);
            }
        }
        if (lines.empty()) {
            continue;
        }
        const size_t first = lines.size() > max_lines ? lines.size() - max_lines : 0;
        std::string out;
        for (size_t i = first; i < lines.size(); ++i) {
            if (!out.empty()) {
                out += '\n';
            }
            out += *lines[i];
        }
        return out;
    }
    return {};
}

void install_log_callback() { llama_log_set(log_callback, nullptr); }

void set_log_level(int level) {
    if (level < k_level_debug || level > k_level_none) {
        throw std::invalid_argument("log level must be in [0, 4] (0 debug, 1 info, 2 warn, 3 error, 4 none)");
    }
    g_min_level.store(level, std::memory_order_relaxed);
}

}  // namespace lloyal
