#include "common.hpp"

#include "backends.hpp"

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

void backend_init_once() {
    static std::once_flag once;
    std::call_once(once, [] { llama_backend_init(); });
    // ggml's backends are libraries loaded at run time: llama.cpp finds no device until one is.
    cpu_backend();
}

}  // namespace lloyal
