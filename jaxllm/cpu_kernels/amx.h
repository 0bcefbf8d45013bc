// AMX's tiles (Intel Sapphire Rapids and later), shared by the kernels of this directory:
// whether the build and the process may use them, and the one tile configuration they
// load (eight tiles of 16 rows x 64 bytes).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define JAXLLM_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "parallel.h"

namespace jaxllm {

// Linux hands a process the tile state only when asked (else the first tile instruction
// faults): asked once; where it refuses, the callers take their other paths.
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
inline constexpr AmxConfig kAmxConfig{};
// Tiles 0-3 zeroed: the sums of both kernels' four-tile products. (Tile numbers must be
// literals, so this is not a loop.)
inline void zero_four_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
// A thread's tiles for one parallel_for: configured before its first task (the thread
// may have run other tile code since: XLA's oneDNN dots) and released after its last.
inline constexpr ThreadHooks kAmxHooks{[] { _tile_loadconfig(&kAmxConfig); }, [] { _tile_release(); }};

}  // namespace jaxllm

#endif
