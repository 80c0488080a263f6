// Which of ggml's backends a worker runs on, chosen at run time. The build ships one CPU backend per
// instruction-set level (libggml-cpu-<level>.so: x64, sse42, haswell, skylakex, sapphirerapids, ...) beside
// the native module, and a GPU backend (libggml-cuda.so) where one was built. The worker loads the best CPU
// level this machine runs, or the one it is told to, then a GPU backend if asked. Plain C++ (backends.cpp).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace lloyal {

// A CPU backend the build holds, as this machine sees it.
struct cpu_level {
    std::string name;   // "haswell"; "default" for a build with one CPU backend (libggml-cpu.so)
    std::string path;
    int score = 0;      // ggml's: 0 when the CPU lacks an instruction set the level needs, more is better
};

// What load_cpu_backend chose, and why.
struct cpu_choice {
    std::string name;
    std::string path;
    std::string requested;  // "auto" or a level's name
    std::string reason;     // one line for humans: why this level
    std::vector<std::pair<std::string, std::string>> features;  // the backend's own list (ggml_backend_get_features)
};

// The folder the module was loaded from, where the backends lie.
std::string backend_dir();
// Every CPU backend in backend_dir(), best score first.
std::vector<cpu_level> cpu_levels();
// Loads the CPU backend: "auto" is the best level this CPU runs whose kernels do not use AMX (those copy the
// model into the worker's own memory), a name is that level (AMX only where amx_usable()). Once per process: a second call returns the first choice if it
// asked for the same (or "auto"), else throws. std::invalid_argument for a level the build does not hold,
// std::runtime_error for one this CPU cannot run.
const cpu_choice & load_cpu_backend(const std::string & requested);
// The choice made, loading "auto" (or LLOYAL_POOL_CPU) first if nothing was loaded yet.
const cpu_choice & cpu_backend();
// Whether AMX tile instructions run in this process: the CPU has them, the kernel grants the tile state,
// and a tile instruction does not kill a child process that tries one (a sandbox may report AMX and still
// trap it). why says what failed.
bool amx_usable(std::string & why);
// Loads GPU backend `name` ("cuda", "vulkan") from backend_dir(). Returns its number of GPU devices; on 0
// the backend is unloaded again and why says what was missing (the file, the driver, a device).
size_t load_gpu_backend(const std::string & name, std::string & why);

}  // namespace lloyal
