// Dense projections for XLA:CPU, as an XLA FFI custom call: y[M, N] = x[M, K] @ W[K, N],
// float32, with W packed ahead of time into panels of 32 columns (jaxllm.models.linear
// packs it once at load: panels[N/32, K, 32], the last panel zero-padded).
//
// Why on CPU: a step multiplies a few dozen to a few hundred rows by every weight matrix
// of the model. XLA:CPU's dot reached ~100-160 GFLOP/s at 32-128 rows on SmolLM2's
// shapes (2-core Xeon, AVX-512), where this kernel reaches ~165-220; at 512 rows ~1.15x.
//
// The work: x is copied into tiles of 12 rows laid out [K][12] (so the inner loop reads
// one pointer), then every (block of rows, panel) item multiplies its rows by one panel
// with a 12 x 32 register tile: per k, two 16-wide loads of the panel and 12
// broadcasts of x into 24 FMAs. A panel (K x 32 floats: 72 KiB at K=576) stays in L2
// while the block's tiles pass over it; the first tile of an item prefetches the panel
// two ahead. Items run on XLA's intra-op pool; one pass packs x and multiplies (an item
// waits until its row block is packed; pack items come first in the order items are
// taken, so the wait always ends).
//
// Portable C++17 with GCC/Clang vector extensions (16 x float32 = one AVX-512 register,
// two AVX2 or four NEON registers); built by jaxllm/cpu_kernels/build.py.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxllm::f32xN;
using jaxllm::loadN;
using jaxllm::splatN;
using jaxllm::storeN;

namespace {

// A weight panel's vector of kLanes columns at p, as float32: float panels are loaded,
// int8 ones (jaxllm.models.quant) sign-extended and converted (their per-column scale is
// applied to the finished outputs, Dense below). The int8 conversion is written with
// intrinsics: GCC 12 scalarizes __builtin_convertvector from int8 lanes (16 scalar
// conversions per vector; it made int8 SmolLM2 slower than float32).
inline f32xN load_weights(const float* p) { return loadN(p); }
#if JAXLLM_LANES == 16
inline f32xN load_weights(const int8_t* p) {
  return (f32xN)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif JAXLLM_LANES == 8 && defined(__AVX2__)
inline f32xN load_weights(const int8_t* p) {
  return (f32xN)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else  // SSE2, AVX without AVX2, NEON: a lane at a time
inline f32xN load_weights(const int8_t* p) {
  f32xN v;
  for (int i = 0; i < jaxllm::kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
#endif

constexpr int kPanel = 32;
constexpr int kGroup = 32;          // inputs per scale of a Q8_0 panel (GGUF's block)          // columns per packed panel: two vectors
constexpr int kTileRows = 12;       // rows of a packed tile of x
constexpr int64_t kRowBlock = 96;   // rows per item at most (8 tiles): x's share stays in L2

// The register tile fits the register file of the ISA the library is built for: with
// AVX-512's 32 registers of 16 lanes, all 12 rows x 32 columns at once (24 accumulators);
// elsewhere (AVX2's 16 registers of 8 lanes, NEON's 32 of 4) that tile would spill, so
// 6 rows x 16 columns at a time (12 AVX2 or 24 NEON accumulators), four passes per tile.
// Each output is the same sum in the same order either way.
#ifdef __AVX512F__
constexpr bool kWideTile = true;
#else
constexpr bool kWideTile = false;
#endif
constexpr int kNarrowRows = 6;

// out[G][16] = rows g..g+G-1 of the packed tile times columns 16h..16h+15 of the panel,
// in vectors of the native width (f32xN: 2 per 16 columns with AVX2, 4 with NEON).
// `gscale` (Q8_0 panels; else null): the panel's scales [K / 32][32], each weight
// multiplied by its own before use, rounded once as gguf's dequantization rounds.
template <int G, typename W, bool kGroups>
void narrow_tile(const float* xt, int g, const W* panel, const float* gscale, int h, int64_t K, float* out,
                 const W* prefetch) {
  constexpr int V = 16 / jaxllm::kLanes;
  f32xN acc[G][V];
  for (int i = 0; i < G; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = f32xN{};
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    f32xN w[V];
    for (int v = 0; v < V; ++v) w[v] = load_weights(panel + k * kPanel + 16 * h + v * jaxllm::kLanes);
    if constexpr (kGroups)
      for (int v = 0; v < V; ++v) w[v] *= loadN(gscale + (k / kGroup) * kPanel + 16 * h + v * jaxllm::kLanes);
    if (prefetch) {
      __builtin_prefetch(prefetch + k * kPanel);
      __builtin_prefetch(prefetch + k * kPanel + 16);
    }
    for (int i = 0; i < G; ++i) {
      const f32xN xv = splatN(xt[k * kTileRows + g + i]);
      for (int v = 0; v < V; ++v) acc[i][v] += xv * w[v];
    }
  }
  for (int i = 0; i < G; ++i)
    for (int v = 0; v < V; ++v) storeN(out + (g + i) * kPanel + 16 * h + v * jaxllm::kLanes, acc[i][v]);
}

template <int R, typename W, bool kGroups>
void narrow_tile_times_panel(const float* xt, const W* panel, const float* gscale, int64_t K, float* y, int64_t ldy,
                             int cols, const W* prefetch) {
  constexpr int G1 = R < kNarrowRows ? R : kNarrowRows, G2 = R - G1;
  float out[kTileRows * kPanel];
  for (int h = 0; h < 2; ++h) {
    narrow_tile<G1, W, kGroups>(xt, 0, panel, gscale, h, K, out, h == 0 ? prefetch : nullptr);  // the next panel, once
    if constexpr (G2 > 0) narrow_tile<G2, W, kGroups>(xt, G1, panel, gscale, h, K, out, nullptr);
  }
  for (int i = 0; i < R; ++i) std::memcpy(y + i * ldy, out + i * kPanel, cols * sizeof(float));
}

template <int R, typename W, bool kGroups>
void wide_tile_times_panel(const float* xt, const W* panel, const float* gscale, int64_t K, float* y, int64_t ldy,
                           int cols, const W* prefetch) {
  static_assert(R > 0 && jaxllm::kLanes == 16, "the wide tile is two AVX-512 registers per row");
  f32xN acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = splatN(0.f);
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    f32xN w0 = load_weights(panel + k * kPanel), w1 = load_weights(panel + k * kPanel + 16);
    if constexpr (kGroups) {
      w0 *= loadN(gscale + (k / kGroup) * kPanel);
      w1 *= loadN(gscale + (k / kGroup) * kPanel + 16);
    }
    if (prefetch) {
      __builtin_prefetch(prefetch + k * kPanel);
      __builtin_prefetch(prefetch + k * kPanel + 16);
    }
    for (int i = 0; i < R; ++i) {
      const f32xN xv = splatN(xt[k * kTileRows + i]);
      acc0[i] += xv * w0;
      acc1[i] += xv * w1;
    }
  }
  if (cols == kPanel) {
    for (int i = 0; i < R; ++i) {
      storeN(y + i * ldy, acc0[i]);
      storeN(y + i * ldy + 16, acc1[i]);
    }
    return;
  }
  float row[kPanel];
  for (int i = 0; i < R; ++i) {
    storeN(row, acc0[i]);
    storeN(row + 16, acc1[i]);
    std::memcpy(y + i * ldy, row, cols * sizeof(float));
  }
}

// The tile this build runs (the other is never instantiated).
template <int R, typename W, bool kGroups>
void tile_times_panel(const float* xt, const W* panel, const float* gscale, int64_t K, float* y, int64_t ldy,
                      int cols, const W* prefetch) {
  if constexpr (kWideTile) {
    wide_tile_times_panel<R, W, kGroups>(xt, panel, gscale, K, y, ldy, cols, prefetch);
  } else {
    narrow_tile_times_panel<R, W, kGroups>(xt, panel, gscale, K, y, ldy, cols, prefetch);
  }
}

template <typename W, bool G>
using TileFn = void (*)(const float*, const W*, const float*, int64_t, float*, int64_t, int, const W*);
template <typename W, bool G>
constexpr TileFn<W, G> kTileFns[kTileRows + 1] = {
    nullptr,                     tile_times_panel<1, W, G>,  tile_times_panel<2, W, G>,  tile_times_panel<3, W, G>,
    tile_times_panel<4, W, G>,   tile_times_panel<5, W, G>,  tile_times_panel<6, W, G>,  tile_times_panel<7, W, G>,
    tile_times_panel<8, W, G>,   tile_times_panel<9, W, G>,  tile_times_panel<10, W, G>, tile_times_panel<11, W, G>,
    tile_times_panel<12, W, G>};

// Tile t of x (rows t*12 .. t*12+11, zeros past M) into xt[K][12].
void pack_tile(const float* x, int64_t M, int64_t K, int64_t t, float* xt) {
  const int64_t r0 = t * kTileRows, rows = std::min<int64_t>(kTileRows, M - r0);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < rows; ++i) xt[k * kTileRows + i] = x[(r0 + i) * K + k];
    for (int64_t i = rows; i < kTileRows; ++i) xt[k * kTileRows + i] = 0.f;
  }
}

// y = x @ panels (times `scales`, one per column of the padded panels, when given; with
// kGroups, `scales` are [num_panels][K / 32][32], applied to the weights as they load).
template <typename W, bool kGroups, typename PanelBuffer>
ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, PanelBuffer panels, const float* scales,
                 ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != kPanel)
    return ffi::Error::InvalidArgument("dense: x must be [M, K], panels [N/32, K, 32], y [M, N]");
  const int64_t M = xd[0], K = xd[1], num_panels = pd[0], N = yd[1];
  if (pd[1] != K || yd[0] != M || N > num_panels * kPanel || N <= (num_panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("dense: the shapes of x, panels and y do not agree");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* X = x.typed_data();
  const W* P = panels.typed_data();
  float* Y = y->typed_data();
  if (K == 0) {
    std::memset(Y, 0, M * N * sizeof(float));
    return ffi::Error::Success();
  }

  // Row blocks of equal size (whole tiles, at most kRowBlock rows).
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t tiles_per_block = (tiles + blocks - 1) / blocks;
  thread_local std::vector<float> packed;
  packed.resize(tiles * kTileRows * K);
  float* XT = packed.data();
  std::unique_ptr<std::atomic<int64_t>[]> tiles_packed(new std::atomic<int64_t>[blocks]);
  for (int64_t b = 0; b < blocks; ++b) tiles_packed[b].store(0, std::memory_order_relaxed);

  // Items: first one per tile (pack it), then one per (row block, panel), block-major.
  jaxllm::parallel_for(pool, tiles + blocks * num_panels, [&](int64_t item) {
    if (item < tiles) {
      pack_tile(X, M, K, item, XT + item * kTileRows * K);
      tiles_packed[item / tiles_per_block].fetch_add(1, std::memory_order_release);
      return;
    }
    item -= tiles;
    const int64_t b = item / num_panels, p = item % num_panels;
    const int64_t t0 = b * tiles_per_block, t1 = std::min(tiles, t0 + tiles_per_block);
    while (tiles_packed[b].load(std::memory_order_acquire) < t1 - t0) std::this_thread::yield();
    const W* panel = P + p * K * kPanel;
    const W* prefetch = p + 2 < num_panels ? P + (p + 2) * K * kPanel : nullptr;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    for (int64_t t = t0; t < t1; ++t) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - t * kTileRows));
      float* yt = Y + t * kTileRows * N + p * kPanel;
      const float* gscale = kGroups ? scales + p * (K / kGroup) * kPanel : nullptr;
      kTileFns<W, kGroups>[rows](XT + t * kTileRows * K, panel, gscale, K, yt, N, cols, t == t0 ? prefetch : nullptr);
      if (!kGroups && scales)
        for (int i = 0; i < rows; ++i)
          for (int c = 0; c < cols; ++c) yt[i * N + c] *= scales[p * kPanel + c];
    }
  });
  return ffi::Error::Success();
}

ffi::Error DenseF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                    ffi::ResultBuffer<ffi::F32> y) {
  return Dense<float, false>(pool, x, panels, nullptr, y);
}

ffi::Error DenseI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                   ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y) {
  const auto pd = panels.dimensions(), sd = scales.dimensions();
  if (pd.size() != 3 || sd.size() != 1 || sd[0] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("dense_i8: scales must be [N/32 * 32], one per column of the panels");
  return Dense<int8_t, false>(pool, x, panels, scales.typed_data(), y);
}

ffi::Error DenseQ8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                     ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y) {
  const auto pd = panels.dimensions(), sd = scales.dimensions();
  if (pd.size() != 3 || pd[1] % kGroup || sd.size() != 3 || sd[0] != pd[0] || sd[1] != pd[1] / kGroup ||
      sd[2] != kPanel)
    return ffi::Error::InvalidArgument("dense_q8_0: panels must be [P, K, 32] with K a multiple of 32, "
                                       "scales [P, K/32, 32]");
  return Dense<int8_t, true>(pool, x, panels, scales.typed_data(), y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseQ8_0, DenseQ8_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // panels [N/32 rounded up, K, 32], int8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N/32 rounded up, K/32, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseI8, DenseI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // panels [N/32 rounded up, K, 32], int8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N/32 rounded up * 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseF32, DenseF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [N/32 rounded up, K, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

// The vector width (float32 lanes) the library was built for: jaxllm.models.linear
// prefers this kernel to XLA's dot only where its wide tile runs (16 lanes).
extern "C" int JaxllmVectorLanes() { return jaxllm::kLanes; }
