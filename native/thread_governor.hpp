// How many threads the next llama_decode of a context computes with, when the machine is shared.
//
// ggml's threads meet at a barrier after every op of a decode. When another busy process holds a core
// (on a desktop: any other app, which the kernel's autogroup scheduling gives an equal share of the CPU),
// one of a context's threads waits at each barrier for a peer that is not running: measured on 2 cores,
// generation fell from 46 to 0.5-22 tok/s with 2 threads, while 1 thread kept 20-28. The governor keeps
// the threads a context was asked for while the decodes get the CPU they ask for, and computes with
// fewer while they do not:
//   - after a decode, the share of its threads' time that ran (process CPU time over threads x wall
//     time) says whether the cores were there; a share below a threshold lowers the cap to the cores
//     that were, if the kernel also took the CPU from the process during it (involuntary context
//     switches: a thread that waited for the disk, as the first decodes of a freshly mapped model do,
//     gave it up of its own accord);
//   - before a decode under a lowered cap, the runnable tasks the kernel counts (/proc/stat
//     procs_running) say whether cores have come free; if they have, the cap goes back up, and the next
//     decode's share confirms it.
// A quiet machine never lowers the cap (its share is about 1), so its speed is unchanged. The cap is the
// process's (what the machine gives it), shared by the governors of all its contexts; the thread counts
// asked for are each context's.
#pragma once

#include <cstdint>

namespace lloyal {

class thread_governor {
  public:
    // The thread counts the context was asked for (and set_threads sets later).
    void set_wanted(int32_t n_threads, int32_t n_threads_batch);
    void set_enabled(bool on) { enabled_ = on; }
    bool enabled() const { return enabled_; }

    struct threads {
        int32_t n;
        int32_t n_batch;
    };
    // The thread counts for the next decode.
    threads before_decode(int64_t now_us);
    // What the decode just made of its threads: batched (more than one token: n_batch threads ran),
    // wall time, and the process's CPU time and involuntary context switches over it.
    void after_decode(bool batched, int64_t wall_us, int64_t cpu_us, int64_t preempted, int64_t now_us);
    // The cap (threads at most) in force for this context: the wanted count when nothing lowered it.
    int32_t cap() const;

  private:
    int32_t wanted_max() const { return n_threads_ > n_threads_batch_ ? n_threads_ : n_threads_batch_; }

    bool enabled_ = true;
    int32_t n_threads_ = 1;
    int32_t n_threads_batch_ = 1;
    threads last_{0, 0};
};

// Runnable tasks on the whole machine now (procs_running of /proc/stat), or -1 where it cannot be read.
int32_t runnable_tasks();
// The CPUs this process may run on (its affinity mask).
int32_t usable_cpus();
// The whole process's CPU time in microseconds, and how often the kernel took a CPU from one of its
// threads (involuntary context switches).
struct cpu_usage {
    int64_t cpu_us;
    int64_t preempted;
};
cpu_usage process_cpu_usage();

}  // namespace lloyal
