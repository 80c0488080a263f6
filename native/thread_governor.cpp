#include "thread_governor.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>

namespace lloyal {

namespace {

// Below this share of their time running, a decode's threads did not have the cores: measured 0.99-1.0
// for 2 threads on a quiet 2-core machine, 0.9 with OpenMP's passive wait policy, 0.5 next to one busy
// process in another session.
constexpr double low_share = 0.75;
// Shorter decodes say little: a single preemption by a kernel thread is a large part of them.
constexpr int64_t min_wall_us = 1000;
// After lowering the cap, wait this long before raising it again: a neighbour that runs in bursts
// would otherwise cost a slow decode at every gap.
constexpr int64_t hold_us = 200000;

// What the governors have learnt about the machine, shared by every context of the process: a new
// context (a conversation, a batcher's, a fork's) starts from it instead of finding out again with a
// decode at full threads, which on a busy machine takes 65 times as long as one at the cap.
std::atomic<int32_t> machine_cap{0};  // 0: no cap
std::atomic<int64_t> machine_lowered_at_us{0};

}  // namespace

void thread_governor::set_wanted(int32_t n_threads, int32_t n_threads_batch) {
    n_threads_ = std::max(n_threads, 1);
    n_threads_batch_ = std::max(n_threads_batch, 1);
}

int32_t thread_governor::cap() const {
    const int32_t c = machine_cap.load(std::memory_order_relaxed);
    return !enabled_ || c == 0 ? wanted_max() : std::min(c, wanted_max());
}

thread_governor::threads thread_governor::before_decode(int64_t now_us) {
    if (!enabled_ || wanted_max() <= 1) {
        return last_ = {n_threads_, n_threads_batch_};
    }
    const int32_t c0 = machine_cap.load(std::memory_order_relaxed);
    if (c0 != 0 && c0 < wanted_max() && now_us - machine_lowered_at_us.load(std::memory_order_relaxed) >= hold_us) {
        // Our own threads are asleep under a lowered cap, except this one.
        const int32_t running = runnable_tasks();
        const int32_t cpus = usable_cpus();
        const int32_t free_cpus = running < 0 ? cpus : cpus - (running - 1);
        if (free_cpus > c0) {
            int32_t expected = c0;
            machine_cap.compare_exchange_strong(expected, free_cpus >= cpus ? 0 : free_cpus);
        }
    }
    const int32_t c = cap();
    return last_ = {std::min(n_threads_, c), std::min(n_threads_batch_, c)};
}

void thread_governor::after_decode(bool batched, int64_t wall_us, int64_t cpu_us, int64_t preempted,
                                   int64_t now_us) {
    const int32_t used = batched ? last_.n_batch : last_.n;
    if (!enabled_ || used <= 1 || wall_us < min_wall_us || preempted <= 0) {
        return;
    }
    const double share = static_cast<double>(cpu_us) / (static_cast<double>(used) * static_cast<double>(wall_us));
    if (share < low_share) {
        machine_cap.store(std::max(1, static_cast<int32_t>(std::lround(share * used))), std::memory_order_relaxed);
        machine_lowered_at_us.store(now_us, std::memory_order_relaxed);
    }
}

int32_t runnable_tasks() {
    // Opened per read: a descriptor kept open would be shared, offset and all, with a snapshot's forks.
    const int fd = ::open("/proc/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    // Its interrupt line alone runs to tens of KiB on a large machine: the buffer grows as needed and is kept.
    thread_local std::string text(4096, '\0');
    size_t got = 0;
    ssize_t n = 0;
    while ((n = ::read(fd, text.data() + got, text.size() - got)) > 0) {
        got += static_cast<size_t>(n);
        if (got == text.size()) {
            text.resize(text.size() * 2);
        }
    }
    ::close(fd);
    constexpr std::string_view key = "\nprocs_running ";
    const size_t at = n < 0 ? std::string_view::npos : std::string_view(text.data(), got).find(key);
    if (at == std::string_view::npos) {
        return -1;
    }
    return static_cast<int32_t>(std::strtol(text.data() + at + key.size(), nullptr, 10));
}

int32_t usable_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) {
        const long n = sysconf(_SC_NPROCESSORS_ONLN);
        return n > 0 ? static_cast<int32_t>(n) : 1;
    }
    return std::max(CPU_COUNT(&set), 1);
}

cpu_usage process_cpu_usage() {
    // The clock is exact (the scheduler's own accounting); rusage's times may be sampled at each tick.
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return {static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000, static_cast<int64_t>(ru.ru_nivcsw)};
}

}  // namespace lloyal
