// native.Context as the bindings see it: a context_core and its two drivers, plus the Python buffers
// they point into (the region the arena hands out, the interrupt word), pinned for as long as it lives.
#pragma once

#include "bind.hpp"
#include "branch.hpp"
#include "context_core.hpp"
#include "embed.hpp"
#include "grammar_handles.hpp"
#include "sequence.hpp"

#include <memory>

namespace lloyal {

// native.Arena: the worker's shared region (its bulk area) as blocks the native side hands out.
struct py_arena {
    std::unique_ptr<held_buffer> region;
    std::shared_ptr<region_arena> arena;
};

struct py_context {
    py_context(std::shared_ptr<Model> model, const py::dict & params, std::shared_ptr<py_arena> arena);
    ~py_context();

    std::shared_ptr<py_arena> arena;  // declared first: destroyed last, after every block went back
    std::unique_ptr<context_core> core;
    std::unique_ptr<sequence_driver> sequence;
    std::unique_ptr<branch_driver> branches;
    std::unique_ptr<embed_driver> embedder;
    std::unique_ptr<grammar_handles> grammars;
    std::unique_ptr<held_buffer> control;  // the interrupt word's buffer
};

using context_class = py::class_<py_context, std::shared_ptr<py_context>>;

// bind_branch.cpp: the branch and raw KV methods of native.Context.
void register_branch_methods(context_class & cls);

// Logprobs as Python tuples: (token, logprob, piece, [(token, logprob, piece), ...]) per entry.
py::list logprobs_list(const std::vector<token_logprobs> & entries, const Model & model);

// A branch handle argument: StaleHandleError for anything that is not a live-looking u32, TypeError for
// a non-int.
uint32_t handle_arg(py::handle h);
// A sequence id or position argument as int64 (the driver checks the range).
int64_t int_arg(py::handle v, const char * what);
// (Lora, scale) pairs as lora weights; TypeError for anything else. The checks that need the context are
// lora_config's.
std::vector<lora_weight> lora_weights(py::handle adapters);
// An on_progress(done, total) argument (None: no reports) as a progress_fn that takes the GIL to call it.
context_core::progress_fn progress_arg(const py::object & on_progress);

}  // namespace lloyal
