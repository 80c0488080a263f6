// Module-level functions: the backends a worker loads (backends.hpp), llama.cpp's build info, the devices
// ggml sees, the log level, the JSON-schema converter, and the sampler fields the C++ side declares
// (sampling.hpp).
#include "backends.hpp"
#include "bind.hpp"
#include "devices.hpp"
#include "heartbeat.hpp"

#include "build-info.h"
#include "common.h"

#include <memory>
#include <thread>

namespace lloyal {

namespace {

// The buffer the heartbeat word lives in, pinned until detached. A plain pointer, never a static object:
// a static destructor would release the Python buffer after the interpreter has finalized.
held_buffer * heartbeat_buffer = nullptr;

void set_heartbeat_word(const py::object & buffer, int64_t index) {
    if (buffer.is_none()) {
        heartbeat_word = nullptr;
        delete heartbeat_buffer;
        heartbeat_buffer = nullptr;
        return;
    }
    auto buf = std::make_unique<held_buffer>(buffer, true);
    if (index < 0 || static_cast<uint64_t>(index) >= buf->size() / 8) {
        throw std::invalid_argument("heartbeat index " + std::to_string(index) + " is outside a " +
                                    std::to_string(buf->size()) + "-byte buffer");
    }
    auto * word = reinterpret_cast<uint64_t *>(static_cast<char *>(buf->data()) + static_cast<size_t>(index) * 8);
    if (reinterpret_cast<uintptr_t>(word) % alignof(uint64_t) != 0) {
        throw std::invalid_argument("the heartbeat word is not 8-byte aligned");
    }
    heartbeat_word = word;
    delete heartbeat_buffer;
    heartbeat_buffer = buf.release();
}

py::dict cpu_choice_dict(const cpu_choice & c) {
    py::dict d;
    d["kernels"] = c.name;
    d["requested"] = c.requested;
    d["reason"] = c.reason;
    d["path"] = c.path;
    py::dict features;
    for (const auto & [name, value] : c.features) {
        features[py::str(name)] = value;
    }
    d["features"] = features;
    return d;
}

}  // namespace

void register_backend(py::module_ & m) {
    install_log_callback();
    install_abort_report();

    m.def("backend_dir", &backend_dir, "The folder the module was loaded from, where ggml's backends lie.");
    m.def(
        "cpu_levels",
        [] {
            py::list out;
            for (const auto & l : cpu_levels()) {
                py::dict d;
                d["name"] = l.name;
                d["path"] = l.path;
                d["score"] = l.score;
                out.append(d);
            }
            return out;
        },
        "Every CPU backend of the build, best first for this CPU: name, path, score (0: this CPU cannot run it).");
    m.def(
        "load_cpu_backend",
        [](const std::string & level) {
            const cpu_choice * c = nullptr;
            {
                gil_release nogil;
                c = &load_cpu_backend(level);
            }
            return cpu_choice_dict(*c);
        },
        py::arg("level") = "auto",
        "Loads the CPU kernels: 'auto' (the best level this CPU runs) or a level's name. Once per process.");
    m.def(
        "load_gpu_backend",
        [](const std::string & name) {
            std::string why;
            size_t n = 0;
            {
                gil_release nogil;
                n = load_gpu_backend(name, why);
            }
            return py::make_tuple(n, why);
        },
        py::arg("name"), "Loads GPU backend name ('cuda', 'vulkan'): (its GPU devices, why 0).");
    m.def(
        "amx_usable",
        [] {
            std::string why;
            bool ok = false;
            {
                gil_release nogil;
                ok = amx_usable(why);
            }
            return py::make_tuple(ok, why);
        },
        "(whether AMX tile instructions run in this process, why not).");
    m.def("gpu_device_count", [] { return gpu_device_count(); }, "GPU devices of the loaded backends.");

    m.def(
        "build_info",
        [] {
            py::dict d;
            d["cpu"] = cpu_choice_dict(cpu_backend());
            // One line for humans: version, then build number and commit (b0-unknown when the vendored
            // tree carried no git metadata).
            d["llama_cpp"] = std::string(llama_version()) + " (" + llama_build_info() + ")";
            d["llama_version"] = llama_version();
            d["build_number"] = llama_build_number();
            d["commit"] = llama_commit();
            d["build_info"] = llama_build_info();
            d["compiler"] = llama_compiler();
            d["build_target"] = llama_build_target();
            d["ggml_version"] = ggml_version();
            d["ggml_commit"] = ggml_commit();
            d["system_info"] = llama_print_system_info();
            d["default_threads"] = default_threads();
            d["hardware_concurrency"] = std::thread::hardware_concurrency();
            d["supports_mmap"] = llama_supports_mmap();
            d["supports_mlock"] = llama_supports_mlock();
            d["supports_gpu_offload"] = llama_supports_gpu_offload();
            d["max_devices"] = llama_max_devices();
            d["max_parallel_sequences"] = llama_max_parallel_sequences();
            return d;
        },
        "llama.cpp version/commit/compiler, ggml system info, default thread count, the CPU kernels.");
    m.def(
        "devices",
        [] {
            std::vector<device_info> devs;
            {
                gil_release nogil;
                devs = list_devices();
            }
            py::list out;
            for (const auto & d : devs) {
                py::dict e;
                e["name"] = d.name;
                e["description"] = d.description;
                e["backend"] = d.backend;
                e["type"] = d.type;
                e["memory_free"] = d.memory_free;
                e["memory_total"] = d.memory_total;
                e["kernels"] = d.kernels;
                out.append(e);
            }
            return out;
        },
        "The devices ggml's backend registry holds, in its order.");
    m.def("set_log_level", &set_log_level, py::arg("level"),
          "Minimum llama.cpp log level written to fd 2 (0 debug, 1 info, 2 warn, 3 error, 4 none).");
    m.def(
        "json_schema_to_grammar",
        [](const std::string & schema_json) {
            gil_release nogil;
            return json_schema_to_gbnf(schema_json);
        },
        py::arg("schema_json"), "llama.cpp's own JSON-schema -> GBNF converter. Raises GrammarError on an invalid schema.");
    m.def("set_heartbeat_word", &set_heartbeat_word, py::arg("buffer"), py::arg("index") = 0,
          "Points the heartbeat (advanced at every interrupt check) at u64 word `index` of a writable "
          "buffer; None detaches it.");
    m.def(
        "_test_ggml_assert",
        [](int value) {
            gil_release nogil;
            test_ggml_assert(value);
        },
        py::arg("value"), "Test only: a real GGML_ASSERT that fails (and aborts the process) for 0x6a6d.");
    m.def("sampler_fields", &sampler_field_names, "The sampler params' names, in the order they are declared.");
}

}  // namespace lloyal
