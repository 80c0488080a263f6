// The Python side of the native module: included by module.cpp and the bind_*.cpp files only. They turn
// Python objects into the typed arguments of the C++ code (model, context_core, the drivers), call it
// without the GIL, and turn its results back into Python objects. Include this first, so that pybind11
// sees Python.h before any system header.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.hpp"
#include "model.hpp"
#include "sampling.hpp"

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace lloyal {

using gil_release = py::gil_scoped_release;
using gil_acquire = py::gil_scoped_acquire;

// Registration hooks, one per concern; module.cpp calls them in this order.
void register_errors(py::module_ & m);
void register_backend(py::module_ & m);
void register_model(py::module_ & m);
void register_context(py::module_ & m);

// Bytes to str the way Python's bytes.decode("utf-8", "replace") does it. Every string that reaches
// Python from generated text goes through this one decoder, so streamed pieces and the final text
// replace invalid sequences identically.
py::str decode_utf8_replace(const char * data, size_t size);
inline py::str decode_utf8_replace(std::string_view s) { return decode_utf8_replace(s.data(), s.size()); }

// A Py_buffer held for as long as this object lives. Holding the export pins the memory: a bytearray
// cannot be resized and shared memory cannot be unmapped (mmap refuses to close) while we point into it.
class held_buffer {
  public:
    held_buffer(py::handle obj, bool writable);
    ~held_buffer();
    held_buffer(const held_buffer &) = delete;
    held_buffer & operator=(const held_buffer &) = delete;

    void * data() const { return view_.buf; }
    size_t size() const { return static_cast<size_t>(view_.len); }

  private:
    Py_buffer view_{};
};

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

// The items of a list-like argument (not str/bytes), TypeError("<what> must be a list") otherwise.
std::vector<py::object> sequence_items(py::handle seq, const char * what);
// (a, b) of a two-item sequence, TypeError("<what> must be (branch, ...) pairs") otherwise.
std::pair<py::object, py::object> pair_items(const py::object & item, const char * what);

// Token ids from any Python sequence of ints, each checked against [0, n_vocab).
// Raises TypeError for a non-integer item and InvalidTokenError for an id out of range.
std::vector<llama_token> tokens_from_py(py::handle seq, const Model & model);
llama_token token_from_py(py::handle obj, const Model & model);

// bind_params.cpp: the wire dicts of lloyal_pool.params as the structs of sampling.hpp and
// context_core.hpp. ValueError/TypeError for bad values and unknown keys, InvalidTokenError for token
// ids, ContextError for context params.
gen_params parse_gen_params(const py::dict & params, const Model & model);
// A branch's params: exactly the sampler keys (a generate-only key such as n_predict is a ValueError).
sampler_params parse_sampler_params(const py::dict & params);
// A seed in [0, 2**32-2] (llama.cpp reads 0xFFFFFFFF as "random"; here every seed is a seed).
uint32_t parse_seed(py::handle v, const std::string & what);
// A grammar dict (see the stub) or None.
std::optional<grammar_spec> parse_grammar(py::handle spec, const Model & model);
// The sum of each token's biases, sorted by token: what chain_sampler::set_logit_bias takes.
// InvalidTokenError for a bad id, ValueError for +inf or NaN.
std::vector<std::pair<llama_token, float>> parse_logit_bias(py::handle bias, const Model & model);
// The context params dict (see the stub's Context); ContextError for unknown keys and bad values.
llama_context_params parse_context_params(const py::dict & params);
// The context param adapt_threads (default true): whether the thread governor may lower the threads.
bool parse_adapt_threads(const py::dict & params);
// The context param batch_invariant (default false): context_core's batch_invariant.
bool parse_batch_invariant(const py::dict & params);

}  // namespace lloyal
