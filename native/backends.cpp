#include "backends.hpp"

#include "common.hpp"

#include "ggml-backend.h"

#include <dirent.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#endif

namespace lloyal {

namespace {

constexpr const char * CPU_PREFIX = "libggml-cpu";
constexpr const char * SUFFIX = ".so";

bool ends_with(const std::string & s, const std::string & tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// ggml's own test of a backend file against this CPU, without registering it.
int score_of(const std::string & path) {
    void * handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        return 0;
    }
    int score = 0;
    if (auto fn = reinterpret_cast<int (*)()>(dlsym(handle, "ggml_backend_score"))) {
        score = fn();
    }
    dlclose(handle);
    return score;
}

std::string names_of(const std::vector<cpu_level> & levels, bool runnable_only) {
    std::string out;
    for (const auto & l : levels) {
        if (!runnable_only || l.score > 0) {
            out += (out.empty() ? "" : ", ") + l.name;
        }
    }
    return out.empty() ? "none" : out;
}

std::vector<std::pair<std::string, std::string>> features_of(ggml_backend_reg_t reg) {
    std::vector<std::pair<std::string, std::string>> out;
    auto get = reinterpret_cast<ggml_backend_get_features_t>(
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features"));
    if (get != nullptr) {
        for (const ggml_backend_feature * f = get(reg); f != nullptr && f->name != nullptr; ++f) {
            out.emplace_back(f->name, f->value != nullptr ? f->value : "");
        }
    }
    return out;
}

bool uses_amx(const std::vector<std::pair<std::string, std::string>> & features) {
    return std::any_of(features.begin(), features.end(),
                       [](const auto & f) { return f.first.rfind("AMX", 0) == 0 && f.second == "1"; });
}

#if defined(__x86_64__) && defined(__linux__)
constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;

struct alignas(64) tile_config {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// One tile configured (ldtilecfg), zeroed (tilezero: the first use of the tile data, which the kernel
// traps when it did not grant it) and released (tilerelease). Spelled as bytes, so that neither the
// compiler's flags nor the assembler's age matter; the memory clobber keeps the whole config stored.
void touch_tiles() {
    tile_config cfg{};
    cfg.palette_id = 1;
    cfg.colsb[0] = 64;
    cfg.rows[0] = 1;
    __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0x07" : : "D"(&cfg) : "memory");  // ldtilecfg (%rdi)
    __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, 0xc0" : : : "memory");            // tilezero %tmm0
    __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0xc0" : : : "memory");            // tilerelease
}
#endif

std::mutex choice_mutex;
std::optional<cpu_choice> chosen;

}  // namespace

std::string backend_dir() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void *>(&backend_dir), &info) == 0 || info.dli_fname == nullptr) {
        throw std::runtime_error("cannot tell where the native module was loaded from (dladdr failed)");
    }
    std::string path = info.dli_fname;
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

std::vector<cpu_level> cpu_levels() {
    const std::string dir = backend_dir();
    std::vector<cpu_level> out;
    if (DIR * d = opendir(dir.c_str())) {
        while (const dirent * e = readdir(d)) {
            const std::string file = e->d_name;
            if (file.rfind(CPU_PREFIX, 0) != 0 || !ends_with(file, SUFFIX)) {
                continue;
            }
            std::string name = file.substr(std::strlen(CPU_PREFIX), file.size() - std::strlen(CPU_PREFIX) -
                                                                        std::strlen(SUFFIX));
            name = name.empty() ? "default" : (name[0] == '-' ? name.substr(1) : name);
            cpu_level l;
            l.name = name;
            l.path = dir + "/" + file;
            l.score = score_of(l.path);
            out.push_back(std::move(l));
        }
        closedir(d);
    }
    std::sort(out.begin(), out.end(), [](const cpu_level & a, const cpu_level & b) {
        return a.score != b.score ? a.score > b.score : a.name < b.name;
    });
    return out;
}

bool amx_usable(std::string & why) {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || (d & (1u << 24)) == 0) {
        why = "this CPU has no AMX";
        return false;
    }
    // In a child: a process the trap kills is not this one.
    const pid_t pid = fork();
    if (pid < 0) {
        why = std::string("could not fork to try AMX: ") + std::strerror(errno);
        return false;
    }
    if (pid == 0) {
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
            _exit(3);
        }
        touch_tiles();
        _exit(0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        return true;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 3) {
        why = "the kernel does not grant AMX tile data to this process (arch_prctl ARCH_REQ_XCOMP_PERM failed)";
    } else if (WIFSIGNALED(status)) {
        why = std::string("the CPU reports AMX but a tile instruction was killed by signal ") +
              std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
    } else {
        why = "trying a tile instruction failed (status " + std::to_string(status) + ")";
    }
    return false;
#else
    why = "AMX is an x86-64 instruction set";
    return false;
#endif
}

const cpu_choice & load_cpu_backend(const std::string & requested) {
    std::lock_guard<std::mutex> lock(choice_mutex);
    if (chosen) {
        if (requested == "auto" || requested == chosen->requested || requested == chosen->name) {
            return *chosen;
        }
        throw std::runtime_error("this process already runs the '" + chosen->name + "' CPU kernels; a process "
                                 "loads one level (asked for '" + requested + "')");
    }
    const std::vector<cpu_level> levels = cpu_levels();
    if (levels.empty()) {
        throw std::runtime_error("no CPU backend (libggml-cpu*.so) beside the native module in " + backend_dir());
    }
    std::vector<const cpu_level *> candidates;
    if (requested == "auto") {
        for (const auto & l : levels) {
            if (l.score > 0) {
                candidates.push_back(&l);
            }
        }
        if (candidates.empty()) {
            throw std::runtime_error("this CPU runs none of the CPU levels built (" + names_of(levels, false) + ")");
        }
    } else {
        auto it = std::find_if(levels.begin(), levels.end(), [&](const cpu_level & l) { return l.name == requested; });
        if (it == levels.end()) {
            throw std::invalid_argument("no CPU level '" + requested + "' in this build; it has: " +
                                        names_of(levels, false));
        }
        if (it->score == 0) {
            throw std::runtime_error("this CPU cannot run the '" + requested + "' kernels (it lacks an instruction "
                                     "set they need); it runs: " + names_of(levels, true));
        }
        candidates.push_back(&*it);
    }
    std::string skipped;
    for (const cpu_level * l : candidates) {
        const uint64_t mark = log_mark();
        ggml_backend_reg_t reg = ggml_backend_load(l->path.c_str());
        if (reg == nullptr) {
            skipped += "; " + l->name + " did not load" + log_reason_since(mark);
            continue;
        }
        auto features = features_of(reg);
        std::string why;
        if (uses_amx(features) && requested == "auto") {
            // Not chosen unasked: llama.cpp's AMX kernels copy every weight into a buffer of their own, so
            // a worker holds a private copy of the model instead of sharing the file's pages with the other
            // workers, and the copy starts an OpenMP team that a snapshot's fork cannot survive.
            ggml_backend_unload(reg);
            skipped += "; " + l->name + " passed over: its AMX kernels copy every weight into the worker's own "
                       "memory (name it to use them)";
            continue;
        }
        if (uses_amx(features) && !amx_usable(why)) {
            ggml_backend_unload(reg);
            skipped += "; " + l->name + " skipped: its kernels use AMX and " + why;
            continue;
        }
        cpu_choice c;
        c.name = l->name;
        c.path = l->path;
        c.requested = requested;
        c.features = std::move(features);
        c.reason = requested == "auto" ? "the best of the levels this CPU runs (" + names_of(levels, true) + ")"
                                       : "asked for (the best this CPU runs: " + levels.front().name + ")";
        c.reason += skipped;
        chosen = std::move(c);
        return *chosen;
    }
    throw std::runtime_error("no CPU level could be loaded (asked for '" + requested + "')" + skipped);
}

const cpu_choice & cpu_backend() {
    {
        std::lock_guard<std::mutex> lock(choice_mutex);
        if (chosen) {
            return *chosen;
        }
    }
    const char * env = std::getenv("LLOYAL_POOL_CPU");
    return load_cpu_backend(env != nullptr && *env != '\0' ? env : "auto");
}

size_t load_gpu_backend(const std::string & name, std::string & why) {
    const std::string path = backend_dir() + "/libggml-" + name + SUFFIX;
    if (access(path.c_str(), R_OK) != 0) {
        why = "the " + name + " backend is not built here (no " + path + ")";
        return 0;
    }
    const uint64_t mark = log_mark();
    ggml_backend_reg_t reg = ggml_backend_load(path.c_str());
    if (reg == nullptr) {
        why = "the " + name + " backend did not load" + log_reason_since(mark);
        return 0;
    }
    size_t n = 0;
    for (size_t i = 0; i < ggml_backend_reg_dev_count(reg); ++i) {
        const auto type = ggml_backend_dev_type(ggml_backend_reg_dev_get(reg, i));
        n += type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU ? 1 : 0;
    }
    if (n == 0) {
        why = "the " + name + " backend sees no GPU device (no driver, or no device visible)" + log_reason_since(mark);
        ggml_backend_unload(reg);
    }
    return n;
}

}  // namespace lloyal
