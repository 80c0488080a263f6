#include "common.hpp"

#include <chrono>

namespace lloyal {

std::string log_reason_since(uint64_t mark, size_t max_lines) {
    const std::string why = log_errors_since(mark, max_lines);
    return why.empty() ? why : ": " + why;
}

int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

double elapsed_ms(int64_t t0_us, int64_t t1_us) { return static_cast<double>(t1_us - t0_us) / 1000.0; }

}  // namespace lloyal
