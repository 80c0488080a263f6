// The module only wires the concerns together; each lives in its own bind_*.cpp over plain C++ code.
#include "bind.hpp"

PYBIND11_MODULE(_native, m) {
    m.doc() = "lloyal_pool's native llama.cpp binding (worker processes only)";
    // Errors first: everything after may already need to raise them.
    lloyal::register_errors(m);
    lloyal::register_backend(m);
    lloyal::register_model(m);
    lloyal::register_context(m);
}
