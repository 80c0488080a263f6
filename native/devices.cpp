#include "devices.hpp"

#include "backends.hpp"

#include "ggml-backend.h"
// llama.cpp's staging API: the only place it reports where a context's memory went (pinned tree).
#include "../vendor/llama.cpp/src/llama-ext.h"

namespace lloyal {

namespace {

const char * type_name(enum ggml_backend_dev_type type) {
    switch (type) {
        case GGML_BACKEND_DEVICE_TYPE_CPU: return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU: return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU: return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "accel";
        default: return "unknown";
    }
}

std::string safe(const char * s) {
    return s != nullptr ? std::string(s) : std::string();
}

}  // namespace

std::vector<device_info> list_devices() {
    backend_init_once();
    std::vector<device_info> out;
    const size_t n = ggml_backend_dev_count();
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        device_info d;
        d.name = safe(ggml_backend_dev_name(dev));
        d.description = safe(ggml_backend_dev_description(dev));
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        d.backend = reg != nullptr ? safe(ggml_backend_reg_name(reg)) : std::string();
        d.type = type_name(ggml_backend_dev_type(dev));
        ggml_backend_dev_memory(dev, &d.memory_free, &d.memory_total);
        d.kernels = d.type == "cpu" ? cpu_backend().name : d.backend;
        out.push_back(std::move(d));
    }
    return out;
}

size_t gpu_device_count() {
    backend_init_once();
    size_t n = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(ggml_backend_dev_get(i));
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            ++n;
        }
    }
    return n;
}

std::vector<buffer_memory> memory_breakdown(const llama_context * ctx) {
    std::vector<buffer_memory> out;
    for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
        buffer_memory m;
        m.buffer = safe(ggml_backend_buft_name(buft));
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        m.device = dev != nullptr ? safe(ggml_backend_dev_name(dev)) : std::string();
        m.host = ggml_backend_buft_is_host(buft);
        m.model = mb.model;
        m.context = mb.context;
        m.compute = mb.compute;
        out.push_back(std::move(m));
    }
    return out;
}

}  // namespace lloyal
