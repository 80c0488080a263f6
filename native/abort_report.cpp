// What a GGML abort (GGML_ASSERT, GGML_ABORT, a grammar accepting what it cannot) leaves behind. ggml's
// default prints its message, then a backtrace from an attached gdb, and then Python's faulthandler
// dumps every thread's stack: the one line that says what failed scrolled out of the parent's stderr
// tail (WorkerCrashedError.stderr_tail, its last 40 lines) behind 50 and more lines of stacks. Ours
// prints that line marked (ABORT_MARKER, which the parent looks for), a short native backtrace, and
// then dies of SIGABRT without faulthandler's dump, so that the line stays in the tail.
#include "common.hpp"

#include <csignal>
#include <cstdlib>
#include <cstring>

#include <execinfo.h>
#include <unistd.h>

namespace lloyal {

namespace {

void write_fd2(const char * s) {
    size_t n = std::strlen(s);
    while (n > 0) {
        const ssize_t w = ::write(2, s, n);
        if (w <= 0) {
            return;
        }
        s += w;
        n -= static_cast<size_t>(w);
    }
}

void on_ggml_abort(const char * message) {
    // Only async-signal-safe calls from here on: the process may be in any state.
    write_fd2("\n" LLOYAL_ABORT_MARKER " ");
    write_fd2(message != nullptr ? message : "(no message)");
    write_fd2("\n");
    void * frames[24];
    const int n = ::backtrace(frames, 24);
    ::backtrace_symbols_fd(frames, n, 2);
    write_fd2(LLOYAL_ABORT_MARKER " ");
    write_fd2(message != nullptr ? message : "(no message)");
    write_fd2(" (see above for the native stack)\n");
    std::signal(SIGABRT, SIG_DFL);  // faulthandler's dump of every thread would push the line out
}

}  // namespace

void install_abort_report() { ggml_set_abort_callback(&on_ggml_abort); }

void test_ggml_assert(int value) {
    // A real GGML_ASSERT, failing on demand (the test-only fault "ggml_abort" of the worker loop).
    GGML_ASSERT(value != 0x6a6d && "the test hook asked for a GGML abort");
}

}  // namespace lloyal
