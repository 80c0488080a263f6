// The worker's heartbeat: a u64 in the shared region (shm.py's header page) that the native loops advance
// at every interrupt check, so that the parent's hang watchdog sees a worker making progress without a
// round trip, and sees one that stopped (SIGSTOP, a deadlock, a loop with no check) by the word standing
// still. Only changes matter, never the count, so the increment need not be atomic as a whole.
#pragma once

#include <cstdint>

namespace lloyal {

// Set once at start-up, before anything decodes (set_heartbeat_word in bind_backend.cpp); null: none.
inline uint64_t * heartbeat_word = nullptr;

inline void heartbeat() {
    if (uint64_t * w = heartbeat_word) {
        __atomic_store_n(w, __atomic_load_n(w, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    }
}

}  // namespace lloyal
