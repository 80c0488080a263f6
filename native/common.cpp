#include "common.hpp"

#include <chrono>
#include <stdexcept>

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
    valid_ = true;
}

held_buffer::~held_buffer() {
    if (valid_) {
        PyBuffer_Release(&view_);
    }
}

std::string log_reason_since(uint64_t mark, size_t max_lines) {
    const std::string why = log_errors_since(mark, max_lines);
    return why.empty() ? why : ": " + why;
}

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

int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

double elapsed_ms(int64_t t0_us, int64_t t1_us) { return static_cast<double>(t1_us - t0_us) / 1000.0; }

}  // namespace lloyal
