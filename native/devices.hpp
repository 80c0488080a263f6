// What ggml's backend registry sees (devices()), what a context's memory sits on (memory_breakdown()),
// and whether a GPU backend has a device to run on. Plain C++ (devices.cpp).
#pragma once

#include "common.hpp"

#include <cstddef>
#include <string>
#include <vector>

namespace lloyal {

struct device_info {
    std::string name;         // ggml's device name: "CPU", "CUDA0", ...
    std::string description;  // the hardware: the CPU model, the GPU's name
    std::string backend;      // the backend that registered it: "CPU", "CUDA", ...
    std::string type;         // "cpu", "gpu", "igpu" or "accel"
    size_t memory_free = 0;   // bytes, as the backend reports them
    size_t memory_total = 0;
    std::string kernels;      // the CPU's: the level of kernels chosen ("haswell"); a GPU's: its backend
};

// Every device registered with ggml, in registry order.
std::vector<device_info> list_devices();

// How many devices of type gpu or igpu are registered.
size_t gpu_device_count();

struct buffer_memory {
    std::string buffer;  // the buffer type: "CPU", "CPU_Mapped", "CUDA0", "CUDA_Host", ...
    std::string device;  // the device the buffer type belongs to ("" when ggml names none)
    bool host = false;   // the buffer lives in host memory
    size_t model = 0;    // bytes of weights
    size_t context = 0;  // bytes of KV cache / recurrent state
    size_t compute = 0;  // bytes of compute buffers
};

// Per buffer type: the memory a context and its model hold (llama.cpp's memory breakdown).
std::vector<buffer_memory> memory_breakdown(const llama_context * ctx);

}  // namespace lloyal
