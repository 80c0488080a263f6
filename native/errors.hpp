// C++ exceptions that reach Python as the classes of lloyal_pool.errors (translator in errors.cpp).
// They can be thrown with the GIL released: translation happens at the binding boundary, after the
// gil_scoped_release guards have re-acquired it.
#pragma once

#include <stdexcept>
#include <string>

namespace lloyal {

struct lloyal_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct model_load_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

struct context_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

struct invalid_token_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

struct context_overflow_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

struct grammar_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

struct decode_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

// A branch handle that is not live (pruned, never issued, or of another generation of its slot).
struct stale_handle_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

// A branch operation that cannot be done as asked (children in the way, a duplicate in a batch, a
// write to a sequence a branch owns, ...).
struct branch_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

// A LoRA adapter that cannot be loaded or applied as asked (see lora.hpp).
struct lora_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

// A result that does not fit the worker's shared-memory region (nothing was computed).
struct result_too_large_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

// A chat template that cannot be used: none in the model and none given, or one that fails to parse or render.
struct template_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

// A saved context state that cannot be used: not one (garbage, truncated, corrupted), of another model
// or format version, or a file that cannot be read or written.
struct state_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

// No free block of the size asked for in the worker's shared-memory region (arena.cpp). A caller that
// knows what the block was for says so in its own type (a branch's snapshot: branch_error; embedding
// rows: result_too_large_error); a context's logits row reaches Python as the native module's
// RegionFullError, a ContextError that the engine turns into advice on shm_bytes.
struct region_full_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

// An all-or-nothing operation stopped by the interrupt word; nothing was changed.
struct interrupted_error : lloyal_error {
    using lloyal_error::lloyal_error;
};

}  // namespace lloyal
