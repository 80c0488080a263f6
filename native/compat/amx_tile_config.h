// Forced into the CPU backends built with AMX (CMakeLists.txt), before ggml's own code.
//
// GCC's _tile_loadconfig (amxtileintrin.h, GCC 12 at least) tells the compiler that ldtilecfg reads 8
// bytes of the config, not 64, so the stores that fill in each tile's rows and columns are dropped as
// dead: ggml's AMX matmul then loads a config with no tile in it, and its first tilezero dies with
// SIGILL. This spelling reads all 64 bytes.
#pragma once

#include <immintrin.h>

#if defined(__AMX_TILE__) && defined(__GNUC__) && !defined(__clang__)
typedef struct {
    unsigned char bytes[64];
} lloyal_tile_config_bytes;

static inline void lloyal_tile_loadconfig(const void * config) {
    __asm__ volatile("ldtilecfg %0" : : "m"(*(const lloyal_tile_config_bytes *) config));
}

#define _tile_loadconfig(config) lloyal_tile_loadconfig(config)
#endif
