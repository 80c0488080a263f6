// Shared by every native/*.cpp: pybind11, llama.h and the small helpers the concerns have in common.
// Include this first, so that pybind11 sees Python.h before any system header.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "llama.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace py = pybind11;

namespace lloyal {

using gil_release = py::gil_scoped_release;
using gil_acquire = py::gil_scoped_acquire;

// Registration hooks, one per concern; module.cpp calls them in this order.
void register_errors(py::module_ & m);
void register_logging(py::module_ & m);
void register_backend(py::module_ & m);
void register_model(py::module_ & m);
void register_context(py::module_ & m);
void register_grammar(py::module_ & m);

// Bytes to str the way Python's bytes.decode("utf-8", "replace") does it. Every string that reaches
// Python from generated text goes through this one decoder, so streamed pieces and the final text
// replace invalid sequences identically.
py::str decode_utf8_replace(const char * data, size_t size);
inline py::str decode_utf8_replace(std::string_view s) { return decode_utf8_replace(s.data(), s.size()); }

// A Py_buffer held for as long as this object lives. Holding the export pins the memory: a bytearray
// cannot be resized and shared memory cannot be unmapped (mmap refuses to close) while we point into it.
class held_buffer {
  public:
    held_buffer() = default;
    held_buffer(py::handle obj, bool writable);
    ~held_buffer();
    held_buffer(const held_buffer &) = delete;
    held_buffer & operator=(const held_buffer &) = delete;

    void * data() const { return view_.buf; }
    size_t size() const { return static_cast<size_t>(view_.len); }
    bool valid() const { return valid_; }

  private:
    Py_buffer view_{};
    bool valid_ = false;
};

// The llama.cpp log (logging.cpp). Warning and error lines are kept, whatever the level written to fd 2,
// so that a failure can say why: log_mark() before the call, log_errors_since(mark) after it.
uint64_t log_mark();
std::string log_errors_since(uint64_t mark, size_t max_lines = 3);
// log_errors_since as a suffix for a message: ": why", or "" when the log said nothing.
std::string log_reason_since(uint64_t mark, size_t max_lines = 3);
// Brackets a decode that our abort callback stopped, so its error lines are logged as debug.
void log_abort_begin();
void log_abort_end();

// An int-like Python object (anything with __index__, numpy integers included; floats refused with
// TypeError) as a long long. Returns false when it does not fit one; `text` gets its repr for messages.
bool index_to_ll(py::handle obj, long long & out, std::string * text = nullptr);

// index_to_ll for an argument that must be an int: a bool, a float or anything else without __index__
// raises NotInt("<what> must be an int").
template <class NotInt = py::type_error>
bool strict_int(py::handle v, std::string_view what, long long & out, std::string * text = nullptr) {
    if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr())) {
        throw NotInt(std::string(what) + " must be an int");
    }
    return index_to_ll(v, out, text);
}

// A dict value that must be an int (bools refused, NotInt raised) in [lo, hi] (else OutOfRange).
template <class NotInt, class OutOfRange>
int64_t dict_int(const py::dict & d, const char * key, int64_t lo, int64_t hi, const std::string & what) {
    long long x = 0;
    std::string text;
    if (!strict_int<NotInt>(d[key], what, x, &text) || x < lo || x > hi) {
        throw OutOfRange(std::string(key) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                         "], got " + text);
    }
    return x;
}

// Threads a context uses unless told otherwise (backend.cpp).
int default_threads();

// Milliseconds between two steady_clock points.
double elapsed_ms(int64_t t0_us, int64_t t1_us);
int64_t now_us();

}  // namespace lloyal
