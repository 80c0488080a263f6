#include "common.hpp"

#include "build-info.h"
#include "common.h"

#include <mutex>
#include <thread>

namespace lloyal {

int default_threads() {
    // What llama.cpp's own tools default to: the math cores, not the hyperthreads.
    const int n = common_cpu_get_num_math();
    if (n > 0) {
        return n;
    }
    const unsigned hc = std::thread::hardware_concurrency();
    return hc > 0 ? static_cast<int>(hc) : 4;
}

void register_backend(py::module_ & m) {
    static std::once_flag once;
    std::call_once(once, [] { llama_backend_init(); });

    m.attr("variant") = LLOYAL_VARIANT_NAME;

    m.def(
        "build_info",
        [] {
            py::dict d;
            d["variant"] = LLOYAL_VARIANT_NAME;
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
        "llama.cpp version/commit/compiler, ggml system info, default thread count, variant.");
}

}  // namespace lloyal
