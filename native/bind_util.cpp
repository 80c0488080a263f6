// Conversions every binding file shares (bind.hpp).
#include "bind.hpp"
#include "errors.hpp"

namespace lloyal {

py::str decode_utf8_replace(const char * data, size_t size) {
    PyObject * s = PyUnicode_DecodeUTF8(data, static_cast<Py_ssize_t>(size), "replace");
    if (s == nullptr) {
        throw py::error_already_set();
    }
    return py::reinterpret_steal<py::str>(s);
}

held_buffer::held_buffer(py::handle obj, bool writable) {
    // PyBUF_SIMPLE: one contiguous run of bytes whatever the exporter's item format is
    // (a memoryview of a float32 or uint64 numpy array qualifies as long as it is C-contiguous).
    const int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
        throw py::error_already_set();
    }
}

held_buffer::~held_buffer() { PyBuffer_Release(&view_); }

bool index_to_ll(py::handle obj, long long & out, std::string * text) {
    py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
    if (!idx) {
        throw py::error_already_set();
    }
    if (text != nullptr) {
        *text = py::str(idx).cast<std::string>();
    }
    int overflow = 0;
    out = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
    if (out == -1 && PyErr_Occurred()) {
        throw py::error_already_set();
    }
    return overflow == 0;
}

std::vector<py::object> sequence_items(py::handle seq, const char * what) {
    const std::string must = std::string(what) + " must be a list";
    if (PyUnicode_Check(seq.ptr()) || PyBytes_Check(seq.ptr())) {
        throw py::type_error(must);
    }
    py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), must.c_str()));
    if (!fast) {
        throw py::error_already_set();
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    PyObject ** items = PySequence_Fast_ITEMS(fast.ptr());
    std::vector<py::object> out;
    out.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        out.push_back(py::reinterpret_borrow<py::object>(items[i]));
    }
    return out;
}

std::pair<py::object, py::object> pair_items(const py::object & item, const char * what) {
    if (!PySequence_Check(item.ptr()) || PyUnicode_Check(item.ptr())) {
        throw py::type_error(std::string(what) + " must be (branch, ...) pairs");
    }
    std::vector<py::object> two = sequence_items(item, what);
    if (two.size() != 2) {
        throw py::type_error(std::string(what) + " must be (branch, ...) pairs");
    }
    return {two[0], two[1]};
}

llama_token token_from_py(py::handle obj, const Model & model) {
    // __index__ accepts numpy integers too, and refuses floats.
    long long v = 0;
    std::string text;
    if (!index_to_ll(obj, v, &text)) {
        throw invalid_token_error("token id " + text + " is outside [0, " + std::to_string(model.n_vocab()) + ")");
    }
    model.check_token(v);
    return static_cast<llama_token>(v);
}

std::vector<llama_token> tokens_from_py(py::handle seq, const Model & model) {
    if (PyUnicode_Check(seq.ptr()) || PyBytes_Check(seq.ptr())) {
        throw py::type_error("expected a sequence of token ids, not a string");
    }
    py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), "expected a sequence of token ids"));
    if (!fast) {
        throw py::error_already_set();
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    PyObject ** items = PySequence_Fast_ITEMS(fast.ptr());
    std::vector<llama_token> out;
    out.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        out.push_back(token_from_py(items[i], model));
    }
    return out;
}

}  // namespace lloyal
