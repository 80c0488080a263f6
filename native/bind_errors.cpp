// C++ exceptions (errors.hpp) -> the classes of lloyal_pool.errors, at the binding boundary.
#include "bind.hpp"
#include "errors.hpp"

#include <cstring>

namespace lloyal {

namespace {

// The classes of lloyal_pool.errors. Strong references that are never released on purpose: the
// module cannot be unloaded, and dropping them during interpreter teardown would race the
// destruction of lloyal_pool.errors itself.
struct error_classes {
    PyObject * base = nullptr;
    PyObject * model_load = nullptr;
    PyObject * context = nullptr;
    PyObject * invalid_token = nullptr;
    PyObject * context_overflow = nullptr;
    PyObject * grammar = nullptr;
    PyObject * decode = nullptr;
    PyObject * stale_handle = nullptr;
    PyObject * branch = nullptr;
    PyObject * interrupted = nullptr;
    PyObject * lora = nullptr;
    PyObject * result_too_large = nullptr;
    PyObject * state = nullptr;
    PyObject * chat_template = nullptr;
    PyObject * region_full = nullptr;  // the native module's own RegionFullError (a ContextError)
};

error_classes g_classes;

PyObject * load_class(const py::module_ & errors, const char * name) {
    py::object cls = errors.attr(name);
    if (!PyType_Check(cls.ptr()) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(cls.ptr()),
                                                       reinterpret_cast<PyTypeObject *>(PyExc_Exception))) {
        throw std::runtime_error(std::string("lloyal_pool.errors.") + name + " is not an exception class");
    }
    return cls.release().ptr();
}

// A message may quote bytes from a model file (an architecture name, a key) that are not UTF-8:
// PyErr_SetString would then raise UnicodeDecodeError in place of the typed error.
void set_error(PyObject * cls, const char * what) {
    PyObject * msg = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "replace");
    if (msg == nullptr) {
        return;  // MemoryError is set
    }
    PyErr_SetObject(cls, msg);
    Py_DECREF(msg);
}

}  // namespace

void register_errors(py::module_ & m) {
    py::module_ errors = py::module_::import("lloyal_pool.errors");
    g_classes.base = load_class(errors, "LloyalError");
    g_classes.model_load = load_class(errors, "ModelLoadError");
    g_classes.context = load_class(errors, "ContextError");
    g_classes.invalid_token = load_class(errors, "InvalidTokenError");
    g_classes.context_overflow = load_class(errors, "ContextOverflowError");
    g_classes.grammar = load_class(errors, "GrammarError");
    g_classes.decode = load_class(errors, "DecodeError");
    g_classes.stale_handle = load_class(errors, "StaleHandleError");
    g_classes.branch = load_class(errors, "BranchError");
    g_classes.interrupted = load_class(errors, "InterruptedByClient");
    g_classes.lora = load_class(errors, "LoraError");
    g_classes.result_too_large = load_class(errors, "ResultTooLargeError");
    g_classes.state = load_class(errors, "StateError");
    g_classes.chat_template = load_class(errors, "TemplateError");
    // Not a public error: the engine catches it when a context's logits row does not fit and raises a
    // ContextError that says which shm_bytes would (engine.py, Engine._region_full).
    const std::string qualified = m.attr("__name__").cast<std::string>() + ".RegionFullError";
    g_classes.region_full = PyErr_NewExceptionWithDoc(
        qualified.c_str(), "No room in the worker's shared-memory region for a context's logits row.",
        g_classes.context, nullptr);
    if (g_classes.region_full == nullptr) {
        throw py::error_already_set();
    }
    m.attr("RegionFullError") = py::handle(g_classes.region_full);

    // Most derived first: a catch clause for lloyal_error would also take every subclass.
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const model_load_error & e) {
            set_error(g_classes.model_load, e.what());
        } catch (const context_error & e) {
            set_error(g_classes.context, e.what());
        } catch (const invalid_token_error & e) {
            set_error(g_classes.invalid_token, e.what());
        } catch (const context_overflow_error & e) {
            set_error(g_classes.context_overflow, e.what());
        } catch (const grammar_error & e) {
            set_error(g_classes.grammar, e.what());
        } catch (const decode_error & e) {
            set_error(g_classes.decode, e.what());
        } catch (const stale_handle_error & e) {
            set_error(g_classes.stale_handle, e.what());
        } catch (const branch_error & e) {
            set_error(g_classes.branch, e.what());
        } catch (const interrupted_error & e) {
            set_error(g_classes.interrupted, e.what());
        } catch (const lora_error & e) {
            set_error(g_classes.lora, e.what());
        } catch (const result_too_large_error & e) {
            set_error(g_classes.result_too_large, e.what());
        } catch (const state_error & e) {
            set_error(g_classes.state, e.what());
        } catch (const template_error & e) {
            set_error(g_classes.chat_template, e.what());
        } catch (const region_full_error & e) {
            set_error(g_classes.region_full, e.what());
        } catch (const lloyal_error & e) {
            set_error(g_classes.base, e.what());
        } catch (const std::invalid_argument & e) {
            set_error(PyExc_ValueError, e.what());
        }
        // Anything else falls through to pybind11's own translators (error_already_set, bad_alloc, ...).
    });
}

}  // namespace lloyal
