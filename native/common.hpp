// Shared by every native/*.cpp: llama.h and the small helpers the concerns have in common. Plain C++:
// nothing here (or in any file but module.cpp, bind.hpp and bind_*.cpp) knows Python, so everything it
// declares runs without the GIL.
#pragma once

#include "llama.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lloyal {

// The llama.cpp log (logging.cpp). Warning and error lines are kept, whatever the level written to fd 2,
// so that a failure can say why: log_mark() before the call, log_errors_since(mark) after it.
void install_log_callback();
// Minimum level written to fd 2 (0 debug, 1 info, 2 warn, 3 error, 4 none); invalid_argument outside.
void set_log_level(int level);
uint64_t log_mark();
std::string log_errors_since(uint64_t mark, size_t max_lines = 3);
// log_errors_since as a suffix for a message: ": why", or "" when the log said nothing.
std::string log_reason_since(uint64_t mark, size_t max_lines = 3);
// Brackets a decode that our abort callback stopped, so its error lines are logged as debug.
void log_abort_begin();
void log_abort_end();
// Brackets a call whose failure the caller reports with the log's reason (a typed error): the warning
// and error lines are kept for log_errors_since but written to fd 2 as debug, so that they do not
// reach the user twice.
void log_reported_begin();
void log_reported_end();

// Threads a context uses unless told otherwise (backend.cpp).
int default_threads();
// llama_backend_init, once per process, and the CPU backend if none was loaded yet (backend.cpp).
void backend_init_once();

// A GGML abort prints its message on a line starting with this marker (twice: before and after a short
// native stack) and dies of SIGABRT without Python's faulthandler dump (abort_report.cpp); the parent
// names the last such line in WorkerCrashedError (lloyal_pool/_process.py, ABORT_MARKER).
#define LLOYAL_ABORT_MARKER "lloyal worker: GGML abort:"
void install_abort_report();
// Fails a real GGML_ASSERT when value is 0x6a6d: the test-only fault "ggml_abort" (worker/loop.py).
void test_ggml_assert(int value);

// Milliseconds between two steady_clock points.
double elapsed_ms(int64_t t0_us, int64_t t1_us);
int64_t now_us();

}  // namespace lloyal
