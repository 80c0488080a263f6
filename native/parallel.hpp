// Work spread over the threads a context computes with, between its decodes: sampling many branches,
// and writing their logits snapshots (a copy, a max and a log-sum-exp over the whole vocabulary each).
// It runs on OpenMP, the runtime llama.cpp's CPU backend computes its graphs on: the calling thread's
// team is the one the last llama_decode used, still spinning, so the work starts on it at once instead
// of waking (or competing with) threads of our own.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

#include <omp.h>

namespace lloyal {

// fn(i, slot) for every i in [0, n), on up to `threads` threads; slot, in [0, threads), names the
// thread running it (for per-thread scratch). The first exception (by index) is rethrown after all
// have run. With one thread or one item it is a plain loop and no OpenMP team is opened: a
// snapshot's zygote must fork with none (worker/zygote.py), and it computes on one thread.
template <class F>
void parallel_for(size_t n, int32_t threads, F && fn) {
    const int32_t team = static_cast<int32_t>(std::min<size_t>(n, static_cast<size_t>(std::max(threads, 1))));
    if (team <= 1) {
        for (size_t i = 0; i < n; ++i) {
            fn(i, size_t{0});
        }
        return;
    }
    std::vector<std::exception_ptr> errors(n);
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
    for (size_t i = 0; i < n; ++i) {
        try {
            fn(i, static_cast<size_t>(omp_get_thread_num()));
        } catch (...) {
            errors[i] = std::current_exception();
        }
    }
    for (const std::exception_ptr & e : errors) {
        if (e) {
            std::rethrow_exception(e);
        }
    }
}

}  // namespace lloyal
