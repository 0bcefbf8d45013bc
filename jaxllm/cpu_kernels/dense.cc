// Dense projections for XLA:CPU, as XLA FFI custom calls: y[M, N] = x[M, K] @ W[K, N],
// float32, with W packed ahead of time into panels of 32 columns (jaxllm.models.linear
// packs it once at load: panels[N/32, K, 32], the last panel zero-padded). Quantized
// panels (int8 values with a scale per column; blocks with a scale (and min) per G
// inputs: GGUF's Q8_0, Q4_0, Q4_1 (G = 32), int4 (128), a mixed GGUF's int8 container
// (16); 4-bit values two to a byte) are converted to float32 weights in registers when
// one tile of rows passes over a panel, or once into a float panel when several do; each
// weight is the float gguf dequantizes it to. bfloat16 panels hold inputs in pairs for
// vdpbf16ps (AVX512_BF16), which the float tiles read as float32 lanes too: the same
// sums, the call's `bf16_tiles` picks (BF16Pairs; or AMX's tiles, below). A mixture of experts' projection
// runs the same pass once per expert over its rows (GroupedDense). Blocks of 32 inputs
// also multiply x quantized per 32 to int8 or int16, in integers (the *_x8 / *_x16
// handlers, below: EngineConfig.activation_quantization).
//
// Why on CPU: a step multiplies a few dozen to a few hundred rows by every weight matrix
// of the model. XLA:CPU's dot reached ~100-160 GFLOP/s at 32-128 rows on SmolLM2's
// shapes (2-core Xeon, AVX-512), where this kernel reaches ~165-220; at 512 rows ~1.15x.
//
// The work: x is copied into tiles of 12 rows laid out [K][12] (so the inner loop reads
// one pointer), then every (block of rows, panel) item multiplies its rows by one panel
// with a 12 x 32 register tile: per k, two 16-wide loads of the panel and 12
// broadcasts of x into 24 FMAs. A panel (K x 32 floats: 72 KiB at K=576) stays in L2
// while the block's tiles pass over it; each tile of an item prefetches its share of the
// panel two ahead (PrefetchShare), so those reads spread over the whole item. Items run
// on XLA's intra-op pool; one pass packs x and multiplies (an item waits until its row
// block is packed; pack items come first in the order items are taken, so the wait
// always ends).
//
// Portable C++17 with GCC/Clang vector extensions (16 x float32 = one AVX-512 register,
// two AVX2 or four NEON registers); built by jaxllm/cpu_kernels/build.py.

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "activation.h"
#include "amx.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxllm::f32xN;
using jaxllm::loadN;
using jaxllm::splatN;
using jaxllm::storeN;

namespace {

constexpr int kPanel = 32;          // columns per packed panel: two vectors
constexpr int kMinGroup = 16;       // inputs per scale of a grouped panel: a power of two, 16 (Q6_K) or more
constexpr int kTileRows = 12;       // rows of a packed tile of x
constexpr int64_t kRowBlock = 96;   // rows per item at most (8 tiles): x's share stays in L2

// How a panel stores its weights, and how kLanes of its columns at one input k become
// float32 lanes. Float panels are loaded; int8 ones (jaxllm.models.quant: per-column
// int8, GGUF's Q8_0) sign-extended and converted; 4-bit ones (GGUF's Q4_0 / Q4_1) hold
// 16 bytes per input, byte j holding column j in its low nibble and column j + 16 in
// its high one. The conversions are written with intrinsics: GCC 12 scalarizes
// __builtin_convertvector from int8 lanes (16 scalar conversions per vector; it made
// int8 SmolLM2 slower than float32).
#if JAXLLM_LANES == 16
inline f32xN int8_lanes(const int8_t* p) {
  return (f32xN)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// Zero-extended first, then one op picks the nibble (the two halves of a 16-byte load
// share the extension): 3 integer ops per 32 weights, against 5 splitting the bytes.
inline f32xN nibble_lanes(const uint8_t* p, int high) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (f32xN)_mm512_cvtepi32_ps(high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
}
#elif JAXLLM_LANES == 8 && defined(__AVX2__)
inline f32xN int8_lanes(const int8_t* p) {
  return (f32xN)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline f32xN nibble_lanes(const uint8_t* p, int high) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (f32xN)_mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
}
#else  // SSE2, AVX without AVX2, NEON: a lane at a time
inline f32xN int8_lanes(const int8_t* p) {
  f32xN v;
  for (int i = 0; i < jaxllm::kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline f32xN nibble_lanes(const uint8_t* p, int high) {
  f32xN v;
  for (int i = 0; i < jaxllm::kLanes; ++i) v[i] = static_cast<float>((p[i] >> (4 * high)) & 0x0F);
  return v;
}
#endif

// x as the tiles read it (`pack`: tile t of x into xt, `depth(K)` entries of 12 per
// tile): float32 rows [K][12] for every panel format but bfloat16 multiplied by
// vdpbf16ps (BF16Pairs below).
struct FloatX {
  using X = float;
  static constexpr bool kConvertPanel = true;  // several tiles: the panel converted to float32 once
  static int64_t depth(int64_t K) { return K; }
  static void pack(const float* x, int64_t M, int64_t K, int64_t t, float* xt);
};

struct F32Weights : FloatX {
  using T = float;
  static constexpr bool kConvertPanel = false;
  static constexpr int kRow = kPanel;  // elements of T per input
  static int64_t panel_size(int64_t K) { return K * kRow; }
  static f32xN load(const T* panel, int64_t k, int c) { return loadN(panel + k * kRow + c); }
};
struct I8Weights : FloatX {
  using T = int8_t;
  static constexpr int kRow = kPanel;
  static int64_t panel_size(int64_t K) { return K * kRow; }
  static f32xN load(const T* panel, int64_t k, int c) { return int8_lanes(panel + k * kRow + c); }
};
template <int kZero>  // Q4_0: nibble - 8 (exact in float32); Q4_1: the nibble
struct Q4Weights : FloatX {
  using T = uint8_t;
  static constexpr int kRow = kPanel / 2;
  static int64_t panel_size(int64_t K) { return K * kRow; }
  static f32xN load(const T* panel, int64_t k, int c) {
    const f32xN q = nibble_lanes(panel + k * kRow + c % kRow, c / kRow);
    return kZero ? q - splatN(static_cast<float>(kZero)) : q;
  }
};

using jaxllm::bf16_bits;  // x rounded to bfloat16 (simd.h), and back
using jaxllm::bf16_value;
// kLanes float32 lanes rounded so, in the high half of each 32-bit lane (finite values:
// the weights of a panel, so no NaN case).
typedef uint32_t u32xN __attribute__((vector_size(jaxllm::kLanes * sizeof(uint32_t))));
inline u32xN bf16_rounded(f32xN v) {
  u32xN u;
  std::memcpy(&u, &v, sizeof u);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

// bfloat16 panels: [K/2 rounded up][32][2], the two inputs of a pair side by side for
// each column (what vdpbf16ps multiplies; an odd K's last pair padded with a zero), so
// kLanes columns at input k are the low (k even) or high halves of kLanes 32-bit lanes,
// made float32 by a shift or a mask. x is rounded to bfloat16 as it is packed: the
// products are exact in float32 and summed there, as XLA's dot of bfloat16 inputs with
// float32 results. Two ways to multiply them: with AVX512_BF16, vdpbf16ps (two
// multiply-adds per lane), reading x as pairs of bfloat16 [K/2][12] (BF16Pairs<true>);
// or the float tiles, the weights made float32 lanes (BF16Pairs<false>), which take a
// pair's odd input first: the order vdpbf16ps sums a pair in (its two products added one
// after the other, each rounded to nearest even; a product of two bfloat16 values is
// exact in float32), so both give the same sums bit for bit (but for subnormal inputs,
// which vdpbf16ps reads as zero). Built with AVX512_BF16 both are compiled and the call's
// `bf16_tiles` attribute picks one, per step shape by a measurement at start-up (on the
// Intel Xeon measured, Emerald Rapids, vdpbf16ps issues on one port where float32 FMAs
// issue on two and lost from 4 rows; on Zen 4 it ran 1.6-1.8x the float32 kernel).
#if defined(__AVX512BF16__)
constexpr bool kDotBF16 = true;
#else
constexpr bool kDotBF16 = false;
#endif
// The tiles a call's `bf16_tiles` attribute asks for: the float tiles, vdpbf16ps, or AMX
// (below: vdpbf16ps where the build or the OS has no AMX); without AVX512_BF16 always
// the float tiles.
enum BF16Tiles : int32_t { kFloatTiles = 0, kDotTiles = 1, kAmxTiles = 2 };

#if JAXLLM_LANES == 16
inline f32xN bf16_lanes(const uint16_t* p, int high) {
  const __m512i v = _mm512_loadu_si512(p);
  return (f32xN)_mm512_castsi512_ps(high ? _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                         : _mm512_slli_epi32(v, 16));
}
#elif JAXLLM_LANES == 8 && defined(__AVX2__)
inline f32xN bf16_lanes(const uint16_t* p, int high) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (f32xN)_mm256_castsi256_ps(high ? _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                         : _mm256_slli_epi32(v, 16));
}
#else
inline f32xN bf16_lanes(const uint16_t* p, int high) {
  f32xN v;
  for (int i = 0; i < jaxllm::kLanes; ++i) v[i] = bf16_value(p[2 * i + high]);
  return v;
}
#endif

template <bool kDot>
struct BF16Pairs {
  static_assert(kDotBF16 || !kDot, "vdpbf16ps needs a build with AVX512_BF16");
  using T = uint16_t;
  using X = std::conditional_t<kDot, uint32_t, float>;  // a pair of bfloat16, or one rounded float
  static constexpr bool kConvertPanel = !kDot;
  static constexpr int kRow = kPanel;  // elements of T per input (a pair: 2 x 32)
  // the steps a tile takes: pairs, or inputs (K rounded up to even: an odd K's padding
  // zero comes first in its pair)
  static int64_t depth(int64_t K) { return kDot ? (K + 1) / 2 : (K + 1) / 2 * 2; }
  static int64_t panel_size(int64_t K) { return (K + 1) / 2 * 2 * kPanel; }
  // the float tiles' step k: input k ^ 1 (the pair's odd input first)
  static f32xN load(const T* panel, int64_t k, int c) {
    return bf16_lanes(panel + (k >> 1) * 2 * kPanel + 2 * c, static_cast<int>(~k & 1));
  }
  static void pack(const float* x, int64_t M, int64_t K, int64_t t, X* xt);
};
template <class Wt>
constexpr bool kIsPairs = std::is_same_v<Wt, BF16Pairs<false>> || std::is_same_v<Wt, BF16Pairs<true>>;

// What scales a panel carries. kColumnScales: one per column, applied to the finished
// outputs (Dense below). kGroupScales: [K / G][32] per panel (G inputs per scale: 32 for
// GGUF's blocks, 16 for the container a GGUF of mixed types is kept in), each weight
// multiplied by its own before use (GGUF's d * q). kGroupScalesMins: also mins, d * q + m, with the
// product rounded before the sum as gguf's dequantization does (no fused multiply-add:
// the empty asm hides the product from contraction). Either way each weight is the
// float32 gguf dequantizes it to, so the sums are those of the dequantized matrix.
enum Scaling { kNoScales, kColumnScales, kGroupScales, kGroupScalesMins };
// Or-ed into a grouped scaling: each weight then rounded to bfloat16 (a bfloat16 model's
// weights kept quantized: the values that model would hold dequantized), x as BF16Pairs
// packs it: the float tiles then take each pair's odd input first (input_at), or with
// kBF16Dot too, vdpbf16ps multiplies pairs.
constexpr int kRoundBF16 = 8;
constexpr int kBF16Dot = 16;
constexpr int kBF16Flags = kRoundBF16 | kBF16Dot;

// The input a float tile multiplies at its step k under S: k, or k ^ 1 for a bfloat16
// model's quantized weights (BF16Pairs' order; groups hold whole pairs).
template <int S>
constexpr int64_t input_at(int64_t k) {
  return (S & kRoundBF16) != 0 ? k ^ 1 : k;
}

using jaxllm::rounded;  // a product kept from contraction (simd.h)

template <int S>
constexpr bool kGroupScaled = (S & ~kBF16Flags) == kGroupScales || (S & ~kBF16Flags) == kGroupScalesMins;

// Weights w (kLanes of them, as loaded) times their group's scales s, plus its mins m,
// as S says.
template <int S>
inline f32xN scaled(f32xN w, f32xN s, f32xN m) {
  if constexpr (kGroupScaled<S>) w *= s;
  if constexpr ((S & ~kBF16Flags) == kGroupScalesMins) {
    rounded(w);
    w += m;
  }
  if constexpr ((S & kRoundBF16) != 0) {
    const u32xN r = bf16_rounded(w);
    std::memcpy(&w, &r, sizeof w);
  }
  return w;
}

// The kLanes weights of columns c.. at input k, as float32.
template <class Wt, int S>
inline f32xN weights_at(const typename Wt::T* panel, const float* gscale, const float* gmin, int shift, int64_t k,
                        int c) {
  f32xN s{}, m{};
  if constexpr (kGroupScaled<S>) s = loadN(gscale + (k >> shift) * kPanel + c);
  if constexpr ((S & ~kBF16Flags) == kGroupScalesMins) m = loadN(gmin + (k >> shift) * kPanel + c);
  return scaled<S>(Wt::load(panel, input_at<S>(k), c), s, m);
}

template <class Wt>
inline void prefetch_row(const typename Wt::T* prefetch, int64_t k) {
  __builtin_prefetch(prefetch + k * Wt::kRow);
  if constexpr (Wt::kRow * sizeof(typename Wt::T) > 64) __builtin_prefetch(prefetch + k * Wt::kRow + 16);
}

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
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif
// A pass over half the panel keeps 2 G accumulators busy: at G <= 2 fewer than the 8
// products two FMA units of latency 4 need in flight (the 2 rows left of a 32-row step's
// last tile; one-row decodes), so such rows take the whole panel in one pass (4 G
// accumulators with AVX2) where its accumulators, vectors and a broadcast fit the
// register file.
constexpr bool whole_panel(int g) { return (g + 1) * (kPanel / jaxllm::kLanes) + 1 <= kVectorRegisters; }
template <int G>
constexpr bool kWholePanel = whole_panel(G);

// Whether a narrow pass of g rows keeps a group's scales (and mins: 2 vectors per weight
// vector) in registers beside its accumulators, weights and broadcast (one spill
// allowed: one row of Q4_1 under AVX2 ran 4-10% faster so), reading them once per
// group; else it reads them from memory at every input as the weights' operands (a
// 12-row Q4_1 tile, two 6-row passes, ran ~4% slower with them in registers).
constexpr bool narrow_scales_in_registers(int g, int scale_vectors) {
  const int v = (whole_panel(g) ? kPanel : 16) / jaxllm::kLanes;
  return g * v + (1 + scale_vectors) * v + 1 <= kVectorRegisters + 1;
}
template <int S>
constexpr int kScaleVectors = (S & ~kBF16Flags) == kGroupScalesMins ? 2 : kGroupScaled<S> ? 1 : 0;

// Whether a tile of `rows` rows reads a grouped panel's scales in registers (so float16
// ones need no widening first): always on the wide tile.
template <int S>
bool scales_in_registers(int rows) {
  if (kWideTile) return true;
  const int g1 = std::min(rows, kNarrowRows), g2 = rows - g1;
  return narrow_scales_in_registers(g1, kScaleVectors<S>) &&
         (g2 == 0 || narrow_scales_in_registers(g2, kScaleVectors<S>));
}

// Which rows of the panel two ahead a pass over a panel prefetches at its step k: every
// row, one a step, where one pass reads the panel; where an item makes n passes (its row
// block's tiles, the narrow tiles' row groups and halves), spread(i, n, steps) gives pass i
// of n its 1/n of them, one every n steps, so the next panels' reads overlap all of the
// item's arithmetic rather than its first pass, which left the memory idle for the rest.
// The wide float tiles ask for their row at every step, so each row n times (measured
// faster than once); the narrow ones (AVX2, NEON) at every fourth step where that still
// asks for every row (`step_mask`: their 12 FMAs a step left the request's address
// arithmetic ~5% of a prefill projection on the Zen 3); the integer tiles, bound by their
// arithmetic, once (`starts`), as many prefetches as before. Measurements:
// docs/bench-log/2026-12-03-xeon-amx.md, docs/bench-log/2026-12-07-zen3-avx2.md.
struct PrefetchShare {
  int64_t first = 0;       // 16.16 fixed point, as `rate`
  int64_t rate = 1 << 16;  // rows a step
  int64_t at(int64_t k) const { return (first + k * rate) >> 16; }
  bool starts(int64_t k) const { return k == 0 || at(k) != at(k - 1); }  // a row not asked for yet
  // Asking at the steps k with (k & step_mask()) == 0 asks for every row: every fourth
  // step where a row lasts four steps or more, else every step.
  int64_t step_mask() const { return rate <= (1 << 14) ? 3 : 0; }
  PrefetchShare spread(int64_t i, int64_t n, int64_t steps) const { return {first + i * steps * rate / n, rate / n}; }
};

// A panel (Panel, X8Panel) for pass i of n over `steps` steps: its share of the prefetches.
template <class P>
P spread(P p, int64_t i, int64_t n, int64_t steps) {
  p.share = p.share.spread(i, n, steps);
  return p;
}

// A panel's weights and scales, as a tile function reads them.
template <class Wt>
struct Panel {
  const typename Wt::T* w;
  const float* scale;      // [K / G][32] (grouped scales), else null
  const float* min;        // [K / G][32] (Q4_1, the mixed-GGUF container), else null
  const typename Wt::T* prefetch;  // the panel two ahead, or null
  int group_shift = 0;     // log2(G)
  // float16 scales (and mins) [K / G][32] in place of `scale` and `min`: read a group
  // at a time (group_scales), widened in registers
  const uint16_t* half_scale = nullptr;
  const uint16_t* half_min = nullptr;
  PrefetchShare share = {};  // a tile's or a pass's rows of `prefetch` (spread)
};

// n float16 values as float32 (exact), 16 or 8 at a time where the CPU converts vectors
// (F16C, AVX-512, NEON; a plain loop of _Float16 was left scalar by GCC 12).
inline void widen_halves(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#elif defined(__aarch64__)
  for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
#endif
  for (; i < n; ++i) {
    _Float16 v;
    std::memcpy(&v, h + i, sizeof v);
    out[i] = static_cast<float>(v);
  }
}

// kLanes scales (or mins) at `at`: float32 ones, or float16 ones widened (exact).
inline f32xN group_lanes(const float* f, const uint16_t* h, int64_t at) {
  if (h == nullptr) return loadN(f + at);
#if JAXLLM_LANES == 16
  return (f32xN)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + at)));
#elif JAXLLM_LANES == 8 && defined(__F16C__)
  return (f32xN)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + at)));
#elif JAXLLM_LANES == 4 && defined(__aarch64__)
  return (f32xN)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + at)));
#else
  f32xN v;
  widen_halves(h + at, jaxllm::kLanes, reinterpret_cast<float*>(&v));
  return v;
#endif
}

// Inputs per scale of a panel under S: its group, or all K (one pass) where there are
// no grouped scales. The tiles run group by group, the group's scales (and mins) read
// once, float16 ones widened then.
template <class Wt, int S>
inline int64_t scale_step(const Panel<Wt>& p, int64_t K) {
  return kGroupScaled<S> ? int64_t{1} << p.group_shift : K;
}

// The scales (and mins) of the group of input k0, V vectors of them from column c, into
// sc (and mn) as S has them (nothing without grouped scales).
template <int S, int V, class Wt>
inline void group_scales(const Panel<Wt>& p, int64_t k0, int c, f32xN* sc, f32xN* mn) {
  if constexpr (kGroupScaled<S>) {
    const int64_t at = (k0 >> p.group_shift) * kPanel + c;
    for (int v = 0; v < V; ++v) sc[v] = group_lanes(p.scale, p.half_scale, at + v * jaxllm::kLanes);
    if constexpr (kScaleVectors<S> == 2)
      for (int v = 0; v < V; ++v) mn[v] = group_lanes(p.min, p.half_min, at + v * jaxllm::kLanes);
  }
}

// out[G][C] = rows g..g+G-1 of the packed tile times columns Ch..Ch+C-1 of the panel (C:
// 16, or the whole panel's 32), in vectors of the native width (f32xN: 2 per 16 columns
// with AVX2, 4 with NEON).
template <int G, int C, class Wt, int S>
void narrow_tile(const float* xt, int g, const Panel<Wt>& p, int h, int64_t K, float* out) {
  constexpr int V = C / jaxllm::kLanes;
  f32xN acc[G][V];
  for (int i = 0; i < G; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = f32xN{};
  const auto steps = [&](int64_t k0, int64_t k1, auto weights) {  // inputs k0..k1-1, weights(k, v)
    const int64_t mask = p.share.step_mask();
#pragma GCC unroll 4
    for (int64_t k = k0; k < k1; ++k) {
      f32xN w[V];
      for (int v = 0; v < V; ++v) w[v] = weights(k, C * h + v * jaxllm::kLanes);
      if (p.prefetch && (k & mask) == 0) prefetch_row<Wt>(p.prefetch, p.share.at(k));
      for (int i = 0; i < G; ++i) {
        const f32xN xv = splatN(xt[k * kTileRows + g + i]);
        for (int v = 0; v < V; ++v) acc[i][v] += xv * w[v];
      }
    }
  };
  if constexpr (kGroupScaled<S> && !narrow_scales_in_registers(G, kScaleVectors<S>)) {  // scales from memory
    steps(0, K, [&](int64_t k, int c) { return weights_at<Wt, S>(p.w, p.scale, p.min, p.group_shift, k, c); });
  } else {  // a group at a time, its scales (and mins) in registers
    const int64_t step = scale_step<Wt, S>(p, K);
    for (int64_t k0 = 0; k0 < K; k0 += step) {
      f32xN sc[V] = {}, mn[V] = {};
      group_scales<S, V>(p, k0, C * h, sc, mn);
      steps(k0, k0 + step, [&](int64_t k, int c) {
        const int v = (c - C * h) / jaxllm::kLanes;
        return scaled<S>(Wt::load(p.w, input_at<S>(k), c), sc[v], mn[v]);
      });
    }
  }
  for (int i = 0; i < G; ++i)
    for (int v = 0; v < V; ++v) storeN(out + (g + i) * kPanel + C * h + v * jaxllm::kLanes, acc[i][v]);
}

// Rows g..g+G-1 of the tile times the panel: in one pass, or one per half (each with its
// share of the prefetches).
template <int G, class Wt, int S>
void narrow_rows(const float* xt, int g, const Panel<Wt>& p, int64_t K, float* out) {
  if constexpr (kWholePanel<G>) {
    narrow_tile<G, kPanel, Wt, S>(xt, g, p, 0, K, out);
  } else {
    for (int h = 0; h < 2; ++h) narrow_tile<G, 16, Wt, S>(xt, g, spread(p, h, 2, K), h, K, out);
  }
}

template <int R, class Wt, int S>
void narrow_tile_times_panel(const float* xt, const Panel<Wt>& p, int64_t K, float* y, int64_t ldy, int cols) {
  constexpr int G1 = R < kNarrowRows ? R : kNarrowRows, G2 = R - G1, kGroups = G2 > 0 ? 2 : 1;
  float out[kTileRows * kPanel];
  narrow_rows<G1, Wt, S>(xt, 0, spread(p, 0, kGroups, K), K, out);
  if constexpr (G2 > 0) narrow_rows<G2, Wt, S>(xt, G1, spread(p, 1, kGroups, K), K, out);
  for (int i = 0; i < R; ++i) std::memcpy(y + i * ldy, out + i * kPanel, cols * sizeof(float));
}

// acc += rows 0..R-1 of the tile times inputs k0..k1-1 of the panel, weights scaled by
// s0/s1 (columns 0-15 / 16-31) and shifted by m0/m1 as S says.
template <int R, class Wt, int S>
inline void wide_steps(const float* xt, const Panel<Wt>& p, int64_t k0, int64_t k1, f32xN s0, f32xN s1, f32xN m0,
                       f32xN m1, f32xN* acc0, f32xN* acc1) {
#pragma GCC unroll 4
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t in = input_at<S>(k);
    const f32xN w0 = scaled<S>(Wt::load(p.w, in, 0), s0, m0), w1 = scaled<S>(Wt::load(p.w, in, 16), s1, m1);
    if (p.prefetch) prefetch_row<Wt>(p.prefetch, p.share.at(k));
    for (int i = 0; i < R; ++i) {
      const f32xN xv = splatN(xt[k * kTileRows + i]);
      acc0[i] += xv * w0;
      acc1[i] += xv * w1;
    }
  }
}

// The AVX-512 tile: rows 0..R-1 times all 32 columns in registers, a group of inputs at a
// time with its scales (and mins) in registers too.
template <int R, class Wt, int S>
void wide_tile_times_panel(const float* xt, const Panel<Wt>& p, int64_t K, float* y, int64_t ldy, int cols) {
  static_assert(R > 0 && jaxllm::kLanes == 16, "the wide tile is two AVX-512 registers per row");
  f32xN acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = splatN(0.f);
  const int64_t step = scale_step<Wt, S>(p, K);
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    f32xN sc[2] = {}, mn[2] = {};
    group_scales<S, 2>(p, k0, 0, sc, mn);
    wide_steps<R, Wt, S>(xt, p, k0, k0 + step, sc[0], sc[1], mn[0], mn[1], acc0, acc1);
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

// Columns c.. of a grouped panel at inputs 2 k2 and 2 k2 + 1 (K is even: whole groups),
// as BF16Pairs holds a pair: each weight rounded to bfloat16, the even input low.
// With AVX512_BF16: vcvtne2ps2bf16 rounds both inputs' lanes at once (to nearest even, as
// bf16_rounded; a subnormal weight would become 0, as in XLA's own bfloat16 ops), a
// vpermw puts each column's two side by side.
template <class Wt, int S>
inline u32xN bf16_pair_lanes(const Panel<Wt>& p, int64_t k2, int c) {
  static_assert(S == kGroupScales || S == kGroupScalesMins, "each weight dequantized before the dot");
  const f32xN lo = weights_at<Wt, S>(p.w, p.scale, p.min, p.group_shift, 2 * k2, c);
  const f32xN hi = weights_at<Wt, S>(p.w, p.scale, p.min, p.group_shift, 2 * k2 + 1, c);
#if defined(__AVX512BF16__) && JAXLLM_LANES == 16
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (u32xN)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
#else
  return bf16_rounded(lo) >> 16 | bf16_rounded(hi);
#endif
}

// Pair k2 of a grouped panel, all 32 columns, as bfloat16 pairs into `row` [32][2] (the
// same inputs of the panel two ahead prefetched).
template <class Wt, int S>
inline void bf16_pair_row(const Panel<Wt>& p, int64_t k2, uint16_t* row) {
  if (p.prefetch) {
    prefetch_row<Wt>(p.prefetch, 2 * k2);
    prefetch_row<Wt>(p.prefetch, 2 * k2 + 1);
  }
  for (int c = 0; c < kPanel; c += jaxllm::kLanes) {
    const u32xN pair = bf16_pair_lanes<Wt, S>(p, k2, c);
    std::memcpy(row + 2 * c, &pair, sizeof pair);
  }
}

template <class Wt>
constexpr bool kIsQ4 = false;
template <int kZero>
constexpr bool kIsQ4<Q4Weights<kZero>> = true;
template <class Wt>
constexpr bool kStepConverts = kIsQ4<Wt> || std::is_same_v<Wt, I8Weights>;  // pairs_step_of's formats
constexpr int kStepPairs = 16;  // pairs of a converted step: 32 inputs (AMX's step, one Q4 group)

// Whether pairs_step_of converts pairs j.. of a panel: 4-bit or int8 blocks of 32 inputs or more
// (a step then lies in one group), a whole step, and vcvtne2ps2bf16.
template <class Wt, int S>
inline bool fast_step_ready(const Panel<Wt>& p, int64_t j, int64_t pairs) {
#if defined(__AVX512BF16__) && JAXLLM_LANES == 16
  return kStepConverts<Wt> && kGroupScaled<S> && (S & kBF16Flags) == 0 &&
         (p.scale != nullptr || p.half_scale != nullptr) && p.group_shift >= 5 && j + kStepPairs <= pairs;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && JAXLLM_LANES == 16
template <class Wt>
constexpr int kQ4Zero = 0;
template <int kZero>
constexpr int kQ4Zero<Q4Weights<kZero>> = kZero;

// Columns 0-7, 8-15, 16-23 and 24-31 of rows a and b (two inputs) as int32 lanes, a's and b's
// value of each column side by side: the two rows' bytes interleaved, then widened.
template <class Wt>
inline std::array<__m512i, 4> pair_values(const typename Wt::T* a, const typename Wt::T* b) {
  const auto bytes = [](const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); };
  if constexpr (kIsQ4<Wt>) {  // 16 bytes a row: column c's nibble in byte c % 16, low for c < 16
    const __m128i ra = bytes(a), rb = bytes(b);
    const __m512i first8 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(ra, rb));  // bytes 0-7 of both rows
    const __m512i last8 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(ra, rb));
    const __m512i nibble = _mm512_set1_epi32(0x0F);
    return {_mm512_and_si512(first8, nibble), _mm512_and_si512(last8, nibble), _mm512_srli_epi32(first8, 4),
            _mm512_srli_epi32(last8, 4)};
  } else {  // int8: 32 bytes a row, column c in byte c
    const __m128i a0 = bytes(a), a1 = bytes(a + 16), b0 = bytes(b), b1 = bytes(b + 16);
    return {_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a0, b0)), _mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a0, b0)),
            _mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a1, b1)), _mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a1, b1))};
  }
}

// Pairs j..j+15 of a Q4_0 / Q4_1 / Q8_0 panel as bfloat16 pairs [16][32][2]: bf16_pair_row's
// values (the same products, sums and rounding), converted otherwise. bf16_pair_row widens 16
// columns of one input, then vpermw interleaves two inputs' words per row (port 5 bound, with
// the widening: docs/cpu_kernels.md); here the two rows' bytes are interleaved before widening
// (pair_values), so vcvtne2ps2bf16 writes pairs as they lie, and the group's scales (and
// mins), read once a step, are duplicated into those lanes.
template <class Wt, int S>
inline void pairs_step_of(const Panel<Wt>& p, int64_t j, uint16_t* out) {
  const int64_t g = (2 * j) >> p.group_shift;
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const auto lanes = [&](const float* f, const uint16_t* h) {  // columns 0-7, 8-15, 16-23, 24-31, each twice
    const __m512 lo = (__m512)group_lanes(f, h, g * kPanel), hi = (__m512)group_lanes(f, h, g * kPanel + 16);
    return std::array<f32xN, 4>{(f32xN)_mm512_permutexvar_ps(first, lo), (f32xN)_mm512_permutexvar_ps(second, lo),
                                (f32xN)_mm512_permutexvar_ps(first, hi), (f32xN)_mm512_permutexvar_ps(second, hi)};
  };
  const std::array<f32xN, 4> sc = lanes(p.scale, p.half_scale);
  std::array<f32xN, 4> mn = {};
  if constexpr ((S & ~kBF16Flags) == kGroupScalesMins) mn = lanes(p.min, p.half_min);
  // the bytes 4 steps on, into L1 (past the panel's end, the next panel's: where the panel has
  // a panel two ahead to prefetch, the memory past it is the call's); the panel two ahead
  // itself, spread over the steps, measured 1.8% slower in the defaults' workload on the AMX
  // Xeon (docs/bench-log/2026-12-05-xeon-amx.md)
  if (p.prefetch)
    for (int l = 0; l < 2 * kStepPairs * Wt::kRow / 64; ++l)
      __builtin_prefetch(p.w + 2 * (j + 4 * kStepPairs) * Wt::kRow + 64 * l);
  for (int i = 0; i < kStepPairs; ++i) {
    const auto* row = p.w + 2 * (j + i) * Wt::kRow;
    const std::array<__m512i, 4> q = pair_values<Wt>(row, row + Wt::kRow);
    f32xN w[4];
    for (int v = 0; v < 4; ++v) {
      w[v] = (f32xN)_mm512_cvtepi32_ps(q[v]);
      if constexpr (kQ4Zero<Wt> != 0) w[v] -= splatN(static_cast<float>(kQ4Zero<Wt>));
      w[v] = scaled<S>(w[v], sc[v], mn[v]);
    }
    _mm512_storeu_si512(out + i * 2 * kPanel, (__m512i)_mm512_cvtne2ps_pbh((__m512)w[1], (__m512)w[0]));
    _mm512_storeu_si512(out + i * 2 * kPanel + kPanel, (__m512i)_mm512_cvtne2ps_pbh((__m512)w[3], (__m512)w[2]));
  }
}
template <class Wt, int S>
inline void pairs_step_fast(const Panel<Wt>& p, int64_t j, uint16_t* out) {
  if constexpr (kStepConverts<Wt>) pairs_step_of<Wt, S>(p, j, out);
}
#else
template <class Wt, int S>
inline void pairs_step_fast(const Panel<Wt>&, int64_t, uint16_t*) {}
#endif

// Pairs j..j+15 of a grouped panel as bfloat16 pairs (zeros past `pairs`).
template <class Wt, int S>
inline void bf16_pairs_step(const Panel<Wt>& p, int64_t j, int64_t pairs, uint16_t* out) {
  if (fast_step_ready<Wt, S>(p, j, pairs)) return pairs_step_fast<Wt, S>(p, j, out);
  for (int64_t i = 0; i < kStepPairs; ++i) {
    if (j + i < pairs) {
      bf16_pair_row<Wt, S>(p, j + i, out + i * 2 * kPanel);
    } else {
      std::memset(out + i * 2 * kPanel, 0, 2 * kPanel * sizeof(uint16_t));
    }
  }
}

// A grouped panel as bfloat16 pairs [K/2][32][2] (BF16Pairs' panel): what a bfloat16
// model's dot multiplies when its weights are kept quantized (the `bf16` attribute).
template <class Wt, int S>
void bf16_pairs_panel(const Panel<Wt>& p, int64_t K, uint16_t* out) {
  const int64_t pairs = (K + 1) / 2;
  int64_t j = 0;
  for (; fast_step_ready<Wt, S>(p, j, pairs); j += kStepPairs) pairs_step_fast<Wt, S>(p, j, out + j * 2 * kPanel);
  for (; 2 * j < K; ++j) bf16_pair_row<Wt, S>(p, j, out + j * 2 * kPanel);
}

#if defined(__AVX512BF16__)
// The wide tile over pairs of inputs: per pair, two loads of the panel (16 columns x 2
// inputs each; a grouped panel's converted in registers), 12 broadcasts of x's pairs,
// 24 vdpbf16ps. K2: the pairs.
template <int R, class Wt, int S>
void bf16_pairs_tile_times_panel(const uint32_t* xt, const Panel<Wt>& p, int64_t K2, float* y, int64_t ldy,
                                 int cols) {
  __m512 acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh w0, w1;
    if constexpr (kIsPairs<Wt>) {
      w0 = (__m512bh)_mm512_loadu_si512(p.w + k * 2 * kPanel);
      w1 = (__m512bh)_mm512_loadu_si512(p.w + k * 2 * kPanel + kPanel);
      if (p.prefetch) {
        __builtin_prefetch(p.prefetch + p.share.at(k) * 2 * kPanel);
        __builtin_prefetch(p.prefetch + p.share.at(k) * 2 * kPanel + kPanel);
      }
    } else {
      w0 = (__m512bh)bf16_pair_lanes<Wt, S>(p, k, 0);
      w1 = (__m512bh)bf16_pair_lanes<Wt, S>(p, k, 16);
      if (p.prefetch) {
        prefetch_row<Wt>(p.prefetch, 2 * p.share.at(k));
        prefetch_row<Wt>(p.prefetch, 2 * p.share.at(k) + 1);
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[k * kTileRows + i]));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], w0, xv);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], w1, xv);
    }
  }
  float row[kPanel];
  for (int i = 0; i < R; ++i) {
    float* out = cols == kPanel ? y + i * ldy : row;
    _mm512_storeu_ps(out, acc0[i]);
    _mm512_storeu_ps(out + 16, acc1[i]);
    if (cols != kPanel) std::memcpy(y + i * ldy, row, cols * sizeof(float));
  }
}
#endif

// x as a tile of Wt's panels under scaling S reads it.
template <class Wt, int S>
using TileX = std::conditional_t<(S & kRoundBF16) != 0, typename BF16Pairs<(S & kBF16Dot) != 0>::X, typename Wt::X>;

// The tile this build runs (the others are never instantiated).
template <int R, class Wt, int S>
void tile_times_panel(const TileX<Wt, S>* xt, const Panel<Wt>& p, int64_t K, float* y, int64_t ldy, int cols) {
  if constexpr (std::is_same_v<Wt, BF16Pairs<true>> || (S & kBF16Dot) != 0) {
#if defined(__AVX512BF16__)
    bf16_pairs_tile_times_panel<R, Wt, (S & ~kBF16Flags)>(xt, p, K, y, ldy, cols);
#endif
  } else if constexpr (kWideTile) {
    wide_tile_times_panel<R, Wt, S>(xt, p, K, y, ldy, cols);
  } else {
    narrow_tile_times_panel<R, Wt, S>(xt, p, K, y, ldy, cols);
  }
}

template <class Wt, int S>
using TileFn = void (*)(const TileX<Wt, S>*, const Panel<Wt>&, int64_t, float*, int64_t, int);
template <class Wt, int S>
constexpr TileFn<Wt, S> kTileFns[kTileRows + 1] = {
    nullptr,                       tile_times_panel<1, Wt, S>,  tile_times_panel<2, Wt, S>,  tile_times_panel<3, Wt, S>,
    tile_times_panel<4, Wt, S>,    tile_times_panel<5, Wt, S>,  tile_times_panel<6, Wt, S>,  tile_times_panel<7, Wt, S>,
    tile_times_panel<8, Wt, S>,    tile_times_panel<9, Wt, S>,  tile_times_panel<10, Wt, S>, tile_times_panel<11, Wt, S>,
    tile_times_panel<12, Wt, S>};

// Tile t of x (rows t*12 .. t*12+11, zeros past M) into xt[K][12].
void FloatX::pack(const float* x, int64_t M, int64_t K, int64_t t, float* xt) {
  const int64_t r0 = t * kTileRows, rows = std::min<int64_t>(kTileRows, M - r0);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < rows; ++i) xt[k * kTileRows + i] = x[(r0 + i) * K + k];
    for (int64_t i = rows; i < kTileRows; ++i) xt[k * kTileRows + i] = 0.f;
  }
}

// Tile t of x rounded to bfloat16: as pairs [K/2 rounded up][12] (input 2j in the low
// half, 2j + 1, or a zero past K, in the high one), or as floats [K rounded up to
// even][12] in the float tiles' order (step k: input k ^ 1, or a zero past K).
template <bool kDot>
void BF16Pairs<kDot>::pack(const float* x, int64_t M, int64_t K, int64_t t, X* xt) {
  const int64_t r0 = t * kTileRows, rows = std::min<int64_t>(kTileRows, M - r0);
  for (int64_t k = 0; k < depth(K); ++k) {
    for (int64_t i = 0; i < kTileRows; ++i) {
      const float* row = x + (r0 + i) * K;
      if constexpr (kDot) {
        const uint32_t lo = i < rows ? bf16_bits(row[2 * k]) : 0;
        const uint32_t hi = i < rows && 2 * k + 1 < K ? bf16_bits(row[2 * k + 1]) : 0;
        xt[k * kTileRows + i] = lo | hi << 16;
      } else {
        xt[k * kTileRows + i] = i < rows && (k ^ 1) < K ? bf16_value(bf16_bits(row[k ^ 1])) : 0.f;
      }
    }
  }
}

// A quantized panel's weights as float32 [K][32], each the value weights_at gives (the
// per-column scales of int8 panels are left to the outputs), for the tiles of a row
// block to share: converting a panel costs about as much as a 12-row tile's FMAs.
template <class Wt, int S>
void dequantize_panel(const Panel<Wt>& p, int64_t K, float* out) {
  constexpr int kS = S == kColumnScales ? kNoScales : S, V = kPanel / jaxllm::kLanes;
  const int64_t step = scale_step<Wt, kS>(p, K);
  for (int64_t k0 = 0; k0 < K; k0 += step) {  // a group at a time, its scales (and mins) in registers
    f32xN sc[V] = {}, mn[V] = {};
    group_scales<kS, V>(p, k0, 0, sc, mn);
    for (int64_t k = k0; k < k0 + step; ++k) {
      if (p.prefetch) prefetch_row<Wt>(p.prefetch, k);
      for (int v = 0; v < V; ++v)
        storeN(out + k * kPanel + v * jaxllm::kLanes,
               scaled<kS>(Wt::load(p.w, input_at<kS>(k), v * jaxllm::kLanes), sc[v], mn[v]));
    }
  }
}

void scale_columns(float* y, int64_t ldy, int rows, int cols, const float* scales) {
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < cols; ++c) y[i * ldy + c] *= scales[c];
}

// A call's scales (or mins) as it passes them: float32, or float16 as GGUF's Q8_0, Q4_0
// and Q4_1 blocks store theirs (held so, they take half the bytes). The tiles and a
// panel's conversion read float16 ones as they are, a group at a time (Panel's
// half_scale); other paths get a panel's widened first (`floats`; exact: every float16
// is a float32).
struct Scales {
  const void* data = nullptr;
  bool half = false;
  Scales at(int64_t offset) const {  // from element `offset` on
    return data ? Scales{static_cast<const char*>(data) + offset * (half ? 2 : 4), half} : *this;
  }
  // n values from element `offset` as float32: the data itself, or widened into `wide`.
  const float* floats(int64_t offset, int64_t n, jaxllm::LineVector<float>& wide) const {
    if (data == nullptr) return nullptr;
    if (!half) return static_cast<const float*>(data) + offset;
    wide.resize(n);
    widen_halves(static_cast<const uint16_t*>(data) + offset, n, wide.data());
    return wide.data();
  }
};
inline Scales scales_of(const ffi::AnyBuffer* b) {
  return b ? Scales{b->untyped_data(), b->element_type() == ffi::DataType::F16} : Scales{};
}
inline Scales scales_of(const ffi::Buffer<ffi::F32>* b) { return b ? Scales{b->untyped_data(), false} : Scales{}; }
// Grouped scales are float32 or float16, mins of the scales' type.
inline bool scale_types_ok(const ffi::AnyBuffer& scales, const ffi::AnyBuffer* mins = nullptr) {
  const auto t = scales.element_type();
  return (t == ffi::DataType::F32 || t == ffi::DataType::F16) && (mins == nullptr || mins->element_type() == t);
}
constexpr const char* kScaleTypes = ": scales (and mins) must be float32 or float16, mins of the scales' type";

// The parallel pass every dense call makes over x's M rows: one item per tile of 12 rows
// (kRows: 16 for AMX; pack(t): the tile as the multiply reads it), then one per (row
// block, panel), block-major: multiply(p, t0, t1), tiles t0..t1-1 times panel p, once the
// block's tiles are packed (pack items are taken first, so the wait always ends). Row
// blocks are of equal size: whole tiles, at most kBlock rows.
template <int kRows = kTileRows, int64_t kBlock = kRowBlock, class Pack, class Multiply>
void pack_then_multiply(ffi::ThreadPool& pool, int64_t M, int64_t num_panels, Pack&& pack, Multiply&& multiply,
                        jaxllm::ThreadHooks hooks = {}) {
  const int64_t tiles = (M + kRows - 1) / kRows;
  const int64_t blocks = (M + kBlock - 1) / kBlock;
  const int64_t tiles_per_block = (tiles + blocks - 1) / blocks;
  std::unique_ptr<std::atomic<int64_t>[]> tiles_packed(new std::atomic<int64_t>[blocks]);
  for (int64_t b = 0; b < blocks; ++b) tiles_packed[b].store(0, std::memory_order_relaxed);
  jaxllm::parallel_for(pool, tiles + blocks * num_panels, [&](int64_t item) {
    if (item < tiles) {
      pack(item);
      tiles_packed[item / tiles_per_block].fetch_add(1, std::memory_order_release);
      return;
    }
    item -= tiles;
    const int64_t b = item / num_panels, p = item % num_panels;
    const int64_t t0 = b * tiles_per_block, t1 = std::min(tiles, t0 + tiles_per_block);
    while (tiles_packed[b].load(std::memory_order_acquire) < t1 - t0) std::this_thread::yield();
    multiply(p, t0, t1);
  }, hooks, /*guided=*/true);
}

// AMX (Intel Sapphire Rapids and later): bfloat16 pairs multiplied by tdpbf16ps, 16 rows
// x 16 columns x 32 inputs per instruction (docs/cpu_kernels.md: its rate). x is
// packed per 16 rows as bfloat16 rows [16][2 depth] (depth: the pairs, rounded up to 16;
// zeros past K and past M): a tile of x is then 16 of those rows, 32 inputs each. A
// panel of pairs [K/2][32][2] is two tiles per 16 pairs as it lies (16 columns each,
// rows 128 bytes apart); a quantized panel is converted to pairs once per item
// (bf16_pairs_panel), as the vdpbf16ps tiles do for several tiles. Per item, two tiles of
// x at a time times both halves of the panel: four tiles of sums. The products are those
// of vdpbf16ps (exact in float32); the sums are float32 but in the tile unit's order,
// not bit for bit those of the other tiles (EngineConfig's backend measurement picks
// `amx` per step shape like any other: PackedWeight.bf16_tiles). Where the OS refuses the
// tile state (amx.h) the call runs vdpbf16ps instead.
#ifdef JAXLLM_AMX
constexpr int kAmxRows = 16;   // rows of a tile of x, and of sums
constexpr int kAmxPairs = 16;  // input pairs per step (a tile row: 64 bytes)
// From three tiles of x on (amx_rows_grouped), rows per item at most: a step's rows (up to
// 512), so a group of panels is read once per step (30 layers of SmolLM2's bfloat16
// projections at 512 rows: 1-2% faster than 256-row items on the 2-vCPU AMX Xeon,
// docs/bench-log/2026-12-04-xeon-amx.md); x's tiles, bfloat16, stay in L2
// (docs/bench-log/2026-11-30-amx.md); and at most kAmxGroup of y's panels per item.
constexpr int64_t kAmxRowBlock = 512, kAmxConvertedRowBlock = 512, kAmxGroup = 8;

using jaxllm::amx_ready;
using jaxllm::kAmxHooks;
// Tiles 0-3 hold sums (two tiles of rows x two halves of the panel), 4-5 x, 6-7 the
// panel's halves.

inline int64_t amx_depth(int64_t K) { return ((K + 1) / 2 + kAmxPairs - 1) / kAmxPairs * kAmxPairs; }

inline __mmask16 first_lanes(int64_t n) {
  return n <= 0 ? 0 : n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// Tile t of x (rows 16 t.., zeros past M) rounded to bfloat16 (to nearest even, as
// bf16_bits), [16][2 amx_depth(K)] (zeros past K): 32 inputs per vcvtne2ps2bf16.
void amx_pack(const float* x, int64_t M, int64_t K, int64_t t, uint16_t* xt) {
  const int64_t width = 2 * amx_depth(K);
  for (int64_t i = 0; i < kAmxRows; ++i) {
    uint16_t* out = xt + i * width;
    const int64_t r = t * kAmxRows + i;
    if (r >= M) {
      std::memset(out, 0, width * sizeof(uint16_t));
      continue;
    }
    const float* row = x + r * K;
    for (int64_t k = 0; k < width; k += 32) {
      const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(K - k), row + k);
      const __m512 hi = _mm512_maskz_loadu_ps(first_lanes(K - k - 16), row + k + 16);
      _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// Sums of one or two tiles of x (x0, x1: their first row at the first step; `stride`
// bytes per row) times `pairs` pairs of a panel of pairs `w` ([pairs][32][2], from the
// same step), into tiles 0-3. With `ahead`, each step also prefetches into L2 the 2 KB that
// lie kAmxAhead past it in memory (past the panel's end, the next panel's, which a thread's
// next item usually is; into L1 measured slower: docs/bench-log/2026-12-03-xeon-amx.md;
// where it had prefetched the panel two ahead, spread over the pass, the weights' reads
// waited at the start of each call and of each thread's run of items:
// docs/bench-log/2026-12-05-xeon-amx.md). kStreamW: the panel's tiles loaded with the
// streaming hint (tileloaddt1), so that a panel streaming past x's tiles evicts less of
// them from L1 (docs/bench-log/2026-12-05-xeon-amx.md).
constexpr int64_t kAmxAhead = 4 * kAmxPairs * 2 * kPanel;  // 4 steps (8 KB), in bfloat16 elements
template <bool kTwo, bool kStreamW = false>
inline void amx_steps(const uint16_t* x0, const uint16_t* x1, int64_t stride, const uint16_t* w, int64_t pairs,
                      bool ahead = false) {
  for (int64_t j = 0; j < pairs; j += kAmxPairs) {
    if (ahead)
      for (int l = 0; l < kAmxPairs * 2 * kPanel * 2 / 64; ++l)
        __builtin_prefetch(w + j * 2 * kPanel + kAmxAhead + 32 * l, 0, 2);
    if constexpr (kStreamW) {
      _tile_stream_loadd(6, w + j * 2 * kPanel, 4 * kPanel);
      _tile_stream_loadd(7, w + j * 2 * kPanel + kPanel, 4 * kPanel);
    } else {
      _tile_loadd(6, w + j * 2 * kPanel, 4 * kPanel);
      _tile_loadd(7, w + j * 2 * kPanel + kPanel, 4 * kPanel);
    }
    _tile_loadd(4, x0 + 2 * j, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwo) {
      _tile_loadd(5, x1 + 2 * j, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Rows 16 t.. of y, columns p 32..: the sums in tiles 0-1 (the first of two tiles of x)
// or 2-3 (kSecond), stored in place where whole, else through `out`. (The tile numbers
// must be literals.)
template <bool kSecond>
inline void amx_store(float* Y, int64_t M, int64_t N, int64_t t, int64_t p, int cols, float* out) {
  float* y = Y + t * kAmxRows * N + p * kPanel;
  const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, M - t * kAmxRows));
  const bool whole = rows == kAmxRows && cols == kPanel;
  float* to = whole ? y : out;
  const int64_t stride = (whole ? N : kPanel) * sizeof(float);
  if constexpr (kSecond) {
    _tile_stored(2, to, stride);
    _tile_stored(3, to + 16, stride);
  } else {
    _tile_stored(0, to, stride);
    _tile_stored(1, to + 16, stride);
  }
  if (!whole)
    for (int i = 0; i < rows; ++i) std::memcpy(y + i * N, out + i * kPanel, cols * sizeof(float));
}

// Tiles t0..t1-1 of x (XT, packed by amx_pack) times a panel of pairs `w` with `pairs`
// pairs in memory (the steps past them read zeros), into y; with `ahead` (the memory after
// the panel holds the call's next panel) each pass over the panel (two tiles of x)
// prefetches ahead of its reads, and with `stream` it loads the panel with the streaming
// hint (amx_steps).
void amx_tiles_times_panel(const uint16_t* XT, int64_t M, int64_t K, int64_t t0, int64_t t1, const uint16_t* w,
                           int64_t pairs, float* Y, int64_t N, int64_t p, int cols, bool ahead = false,
                           bool stream = false) {
  const int64_t depth = amx_depth(K), whole = pairs / kAmxPairs * kAmxPairs;
  const int64_t tile_size = kAmxRows * 2 * depth, stride = 2 * depth * sizeof(uint16_t);
  alignas(64) uint16_t tail[kAmxPairs * 2 * kPanel];  // the last step's pairs, zeros past `pairs`
  if (whole < depth) {
    std::memset(tail, 0, sizeof tail);
    std::memcpy(tail, w + whole * 2 * kPanel, (pairs - whole) * 2 * kPanel * sizeof(uint16_t));
  }
  alignas(64) float out[kAmxRows * kPanel];
  for (int64_t t = t0; t < t1; t += 2) {
    const uint16_t* x0 = XT + t * tile_size;
    _tile_zero(0);
    _tile_zero(1);
    if (t + 1 < t1) {
      _tile_zero(2);
      _tile_zero(3);
      if (stream)
        amx_steps<true, true>(x0, x0 + tile_size, stride, w, whole, ahead);
      else
        amx_steps<true>(x0, x0 + tile_size, stride, w, whole, ahead);
      if (whole < depth) amx_steps<true>(x0 + 2 * whole, x0 + tile_size + 2 * whole, stride, tail, kAmxPairs);
      amx_store<false>(Y, M, N, t, p, cols, out);
      amx_store<true>(Y, M, N, t + 1, p, cols, out);
    } else {
      amx_steps<false>(x0, nullptr, stride, w, whole, ahead);
      if (whole < depth) amx_steps<false>(x0 + 2 * whole, nullptr, stride, tail, kAmxPairs);
      amx_store<false>(Y, M, N, t, p, cols, out);
    }
  }
}

// One or two tiles of x (t0, and t0 + 1 where t1 - t0 is 2) times a kept panel converted to
// pairs a step (16 pairs, 2 KB) at a time into one of two buffers, each multiplied while it
// is in L1, where the whole panel converted first (bf16_pairs_panel: 36 KB at K = 576) is
// read back from further out (measured faster at decode sizes; converting the next step
// between the tile products, software-pipelined, measured no faster than this:
// docs/bench-log/2026-11-30-amx.md). The same pairs, so the same sums. Pairs past K (a
// group of 16 inputs can end K mid-step) are zeros.
template <class Wt, int S>
void amx_tiles_times_kept_panel(const uint16_t* XT, int64_t M, int64_t K, int64_t t0, int64_t t1,
                                const Panel<Wt>& panel, float* Y, int64_t N, int64_t p, int cols) {
  const int64_t depth = amx_depth(K), pairs = K / 2;  // K: whole groups, so even
  const int64_t tile_size = kAmxRows * 2 * depth, stride = 2 * depth * sizeof(uint16_t);
  const uint16_t* x0 = XT + t0 * tile_size;
  const bool two = t1 - t0 > 1;
  alignas(64) uint16_t buffers[2][kAmxPairs * 2 * kPanel];
  alignas(64) float out[kAmxRows * kPanel];
  jaxllm::zero_four_tiles();
  static_assert(kAmxPairs == kStepPairs, "a converted step is AMX's");
  for (int64_t j = 0; j < depth; j += kAmxPairs) {
    uint16_t* w = buffers[(j / kAmxPairs) & 1];
    bf16_pairs_step<Wt, S>(panel, j, pairs, w);
    if (two) {
      amx_steps<true>(x0 + 2 * j, x0 + tile_size + 2 * j, stride, w, kAmxPairs);
    } else {
      amx_steps<false>(x0 + 2 * j, nullptr, stride, w, kAmxPairs);
    }
  }
  amx_store<false>(Y, M, N, t0, p, cols, out);
  if (two) amx_store<true>(Y, M, N, t0 + 1, p, cols, out);
}

// Kept panel p (grouped scales S) as the conversion to pairs reads it: float16 scales read
// as they are where pairs_step_of converts every step (whole steps, K a multiple of 32),
// else widened into thread-local buffers (valid until the next call on this thread).
template <class Wt, int S>
Panel<Wt> amx_kept_panel(const typename Wt::T* P, int64_t p, int64_t num_panels, int64_t K, Scales scales,
                         Scales mins, int group_shift, bool prefetch) {
  const int64_t panel_size = Wt::panel_size(K), groups = (K >> group_shift) * kPanel;
  Panel<Wt> panel{P + p * panel_size, nullptr, nullptr,
                  prefetch && p + 2 < num_panels ? P + (p + 2) * panel_size : nullptr, group_shift};
  if (scales.half) {
    panel.half_scale = static_cast<const uint16_t*>(scales.data) + p * groups;
    if constexpr (S == kGroupScalesMins) panel.half_min = static_cast<const uint16_t*>(mins.data) + p * groups;
  }
  if (!scales.half || K % (2 * kStepPairs) != 0 || !fast_step_ready<Wt, S>(panel, 0, K / 2)) {
    panel.half_scale = panel.half_min = nullptr;
    thread_local jaxllm::LineVector<float> wide_scales, wide_mins;
    panel.scale = scales.floats(p * groups, groups, wide_scales);
    if constexpr (S == kGroupScalesMins) panel.min = mins.floats(p * groups, groups, wide_mins);
  }
  return panel;
}

// dense_rows' bfloat16 pairs by AMX, at decode sizes (one or two tiles of x): an item is
// a panel times the rows, a kept panel converted a step at a time
// (amx_tiles_times_kept_panel); both prefetch a few steps ahead of their reads (amx_steps,
// pairs_step_of). With an activation `act`
// (a gated MLP's fused [gate | up] projection, N/2 columns each, a whole number of
// panels): y is [M, N/2], act(gate) * up, each item a gate panel and its up panel: their
// sums into two buffers, then the activation into y, so the float32 sums of the 2 N
// columns never cross memory (docs/cpu_kernels.md).
template <class Wt, int S>
void amx_rows_by_panel(ffi::ThreadPool& pool, const uint16_t* XT, int64_t M, int64_t K, const typename Wt::T* P,
                       int64_t num_panels, int64_t N, float* Y, Scales scales, Scales mins, int group_shift,
                       int32_t act, const std::function<void(int64_t)>& pack) {
  const int64_t depth = amx_depth(K), panel_size = Wt::panel_size(K);
  // panel p times tiles t0..t1-1 into y's columns p' 32.. (y of `ldy` columns)
  const auto panel_into = [&](int64_t p, int64_t t0, int64_t t1, float* y, int64_t ldy, int64_t p_out) {
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    if constexpr (kIsPairs<Wt>) {
      amx_tiles_times_panel(XT, M, K, t0, t1, P + p * panel_size, (K + 1) / 2, y, ldy, p_out, cols,
                            p + 1 < num_panels);
    } else {
      const Panel<Wt> panel = amx_kept_panel<Wt, S>(P, p, num_panels, K, scales, mins, group_shift, true);
      amx_tiles_times_kept_panel<Wt, S>(XT, M, K, t0, t1, panel, y, ldy, p_out, cols);
    }
  };
  if (act == jaxllm::kNoActivation) {
    pack_then_multiply<kAmxRows, 2 * kAmxRows>(pool, M, num_panels, pack, [&](int64_t p, int64_t t0, int64_t t1) {
      panel_into(p, t0, t1, Y, N, p);
    }, kAmxHooks);
    return;
  }
  const int64_t half = num_panels / 2, F = N / 2;
  pack_then_multiply<kAmxRows, 2 * kAmxRows>(pool, M, half, pack, [&](int64_t p, int64_t t0, int64_t t1) {
    thread_local jaxllm::LineVector<float> gate, up;  // [M][32] each; the item's rows written and read
    gate.resize(M * kPanel);
    up.resize(M * kPanel);
    panel_into(p, t0, t1, gate.data(), kPanel, 0);
    panel_into(p + half, t0, t1, up.data(), kPanel, 0);
    for (int64_t r = t0 * kAmxRows; r < std::min(M, t1 * kAmxRows); ++r)
      jaxllm::glu_row(gate.data() + r * kPanel, up.data() + r * kPanel, kPanel, Y + r * F + p * kPanel, act);
  }, kAmxHooks);
}

// The same from three tiles of x on (prefill chunks): an item is a row block times a group
// of up to kAmxGroup panels (of y's; a gated projection's gate panels, each with its up
// panel), a pair of x's tiles at a time times each panel of the group: the pair (36 KB at
// K = 576) stays in L1 while the panels stream past it in order, where a panel per item
// (its 36 KB in L1 and each pair of tiles streaming past it, 16 rows 1152 bytes apart)
// ran the tile unit at about two thirds of this rate (docs/cpu_kernels.md). Kept panels
// are converted to pairs once per item. Groups are sized for about three items a thread.
template <class Wt, int S>
void amx_rows_grouped(ffi::ThreadPool& pool, const uint16_t* XT, int64_t M, int64_t K, const typename Wt::T* P,
                      int64_t num_panels, int64_t N, float* Y, Scales scales, Scales mins, int group_shift,
                      int32_t act, const std::function<void(int64_t)>& pack) {
  constexpr int64_t kBlock = kIsPairs<Wt> ? kAmxRowBlock : kAmxConvertedRowBlock;
  const bool gated = act != jaxllm::kNoActivation;
  const int64_t depth = amx_depth(K), panel_size = Wt::panel_size(K), pair_size = depth * 2 * kPanel;
  const int64_t out_panels = gated ? num_panels / 2 : num_panels, ldy = gated ? N / 2 : N;
  const int64_t blocks = (M + kBlock - 1) / kBlock;
  const int64_t group = std::clamp<int64_t>(out_panels * blocks / (3 * pool.num_threads()), 1, kAmxGroup);
  const int64_t groups = (out_panels + group - 1) / group;
  // plain panels stream past the pair of x's tiles (kept ones, converted at the item's
  // start, measured mixed with the streaming hint: docs/bench-log/2026-12-05-xeon-amx.md)
  constexpr bool stream = kIsPairs<Wt>;
  pack_then_multiply<kAmxRows, kBlock>(pool, M, groups, pack, [&](int64_t g, int64_t t0, int64_t t1) {
    const int64_t p0 = g * group, n = std::min(out_panels, p0 + group) - p0;
    const uint16_t* w[2][kAmxGroup];  // the item's panels as pairs: [y's panel (gate)], [up]
    thread_local jaxllm::LineVector<uint16_t> converted;
    if constexpr (!kIsPairs<Wt>) converted.resize((gated ? 2 : 1) * n * pair_size);
    for (int set = 0; set < (gated ? 2 : 1); ++set)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = p0 + i + set * out_panels;
        if constexpr (kIsPairs<Wt>) {
          w[set][i] = P + p * panel_size;
        } else {
          uint16_t* to = converted.data() + (set * n + i) * pair_size;
          bf16_pairs_panel<Wt, S>(amx_kept_panel<Wt, S>(P, p, num_panels, K, scales, mins, group_shift, true), K, to);
          w[set][i] = to;
        }
      }
    alignas(64) float gate[2 * kAmxRows * kPanel], up[2 * kAmxRows * kPanel];  // a pair of tiles' sums
    for (int64_t t = t0; t < t1; t += 2) {
      const int64_t te = std::min(t1, t + 2), r0 = t * kAmxRows, rows = std::min(M, te * kAmxRows) - r0;
      const uint16_t* xt = XT + t * kAmxRows * 2 * depth;  // the pair's tiles, as tiles 0 and 1 of `rows` rows
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = p0 + i;
        // plain panels: the first pair's pass over a panel prefetches ahead of its reads into
        // L2; kept ones were converted at the item's start
        const auto ahead = [&](int set) { return kIsPairs<Wt> && t == t0 && p + set * out_panels + 1 < num_panels; };
        if (!gated) {
          const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
          amx_tiles_times_panel(xt, rows, K, 0, te - t, w[0][i], (K + 1) / 2, Y + r0 * N, N, p, cols, ahead(0), stream);
          continue;
        }
        amx_tiles_times_panel(xt, rows, K, 0, te - t, w[0][i], (K + 1) / 2, gate, kPanel, 0, kPanel, ahead(0), stream);
        amx_tiles_times_panel(xt, rows, K, 0, te - t, w[1][i], (K + 1) / 2, up, kPanel, 0, kPanel, ahead(1), stream);
        for (int64_t r = 0; r < rows; ++r)
          jaxllm::glu_row(gate + r * kPanel, up + r * kPanel, kPanel, Y + (r0 + r) * ldy + p * kPanel, act);
      }
    }
  }, kAmxHooks);
}

// dense_rows' bfloat16 pairs by AMX: plain bfloat16 panels, or grouped ones (S) each
// weight dequantized and rounded to bfloat16; x packed per tile (amx_pack) by the same
// parallel pass, then by panel (decode sizes) or by groups of panels (from three tiles).
template <class Wt, int S>
void amx_rows(ffi::ThreadPool& pool, const float* X, int64_t M, int64_t K, const typename Wt::T* P,
              int64_t num_panels, int64_t N, float* Y, Scales scales, Scales mins, int group_shift,
              int32_t act = jaxllm::kNoActivation) {
  const int64_t tiles = (M + kAmxRows - 1) / kAmxRows, depth = amx_depth(K);
  thread_local jaxllm::LineVector<uint16_t> packed;
  packed.resize(tiles * kAmxRows * 2 * depth);
  uint16_t* XT = packed.data();
  const std::function<void(int64_t)> pack = [&](int64_t t) { amx_pack(X, M, K, t, XT + t * kAmxRows * 2 * depth); };
  if (tiles <= 2)
    return amx_rows_by_panel<Wt, S>(pool, XT, M, K, P, num_panels, N, Y, scales, mins, group_shift, act, pack);
  amx_rows_grouped<Wt, S>(pool, XT, M, K, P, num_panels, N, Y, scales, mins, group_shift, act, pack);
}
#else
constexpr bool amx_ready() { return false; }
#endif

// One dense_rows call as its items read it: x packed for the tiles (XT, `depth` steps a
// row), the panels (P) and their scales.
template <class Wt, class Tiles>
struct DenseCall {
  const typename Tiles::X* XT;
  int64_t M, K, depth, num_panels, N;
  const typename Wt::T* P;
  Scales scales, mins;
  int group_shift;
};

// Panel p as an item of tiles t0..t1-1 reads it: the panel two ahead to prefetch, and
// its scales: float16 ones read as they are, a group's at a time, by a one-tile item's
// tile or a panel's conversion for several; else widened for the item (bfloat16 pairs,
// narrow passes that read scales from memory).
template <class Wt, int S, int B, class Tiles>
Panel<Wt> item_panel(const DenseCall<Wt, Tiles>& c, int64_t p, int64_t t0, int64_t t1) {
  constexpr bool kGrouped = S == kGroupScales || S == kGroupScalesMins, kDot = (B & kBF16Dot) != 0;
  const int64_t groups = (c.K >> c.group_shift) * kPanel, panel_size = Wt::panel_size(c.K);
  Panel<Wt> panel{c.P + p * panel_size, nullptr, nullptr, p + 2 < c.num_panels ? c.P + (p + 2) * panel_size : nullptr,
                  c.group_shift};
  const int rows0 = static_cast<int>(std::min<int64_t>(kTileRows, c.M - t0 * kTileRows));  // the first tile's
  const bool halves = t1 - t0 > 1 ? Wt::kConvertPanel  // converted once, a group at a time
                                  : scales_in_registers<S>(rows0);
  if (kGrouped && c.scales.half && halves && !kDot) {
    panel.half_scale = static_cast<const uint16_t*>(c.scales.data) + p * groups;
    if (S == kGroupScalesMins) panel.half_min = static_cast<const uint16_t*>(c.mins.data) + p * groups;
  } else if (kGrouped) {
    thread_local jaxllm::LineVector<float> wide_scales, wide_mins;
    panel.scale = c.scales.floats(p * groups, groups, wide_scales);
    if (S == kGroupScalesMins) panel.min = c.mins.floats(p * groups, groups, wide_mins);
  }
  return panel;
}

// Tiles t0..t1-1 of a call times panel p into y's rows (`ldy` apart) from column `col`:
// one tile converts the panel in registers, several have it converted once (to bfloat16
// pairs for vdpbf16ps, else to float32 weights, rounded to bfloat16 for a bfloat16 B).
template <class Wt, int S, int B, class Tiles>
void panel_times_tiles(const DenseCall<Wt, Tiles>& c, int64_t p, int64_t t0, int64_t t1, float* y, int64_t ldy,
                       int64_t col) {
  constexpr bool kBF16 = B != 0, kDot = (B & kBF16Dot) != 0;
  const Panel<Wt> panel = item_panel<Wt, S, B>(c, p, t0, t1);
  const int cols = static_cast<int>(std::min<int64_t>(kPanel, c.N - p * kPanel));
  auto tiles_times = [&](const auto* tile_fns, auto pan) {  // the block's tiles times `pan`
    for (int64_t t = t0; t < t1; ++t) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, c.M - t * kTileRows));
      float* yt = y + t * kTileRows * ldy + col;
      tile_fns[rows](c.XT + t * kTileRows * c.depth, spread(pan, t - t0, t1 - t0, c.depth), c.depth, yt, ldy, cols);
      if constexpr (S == kColumnScales)
        scale_columns(yt, ldy, rows, cols, static_cast<const float*>(c.scales.data) + p * kPanel);
    }
  };
  if constexpr (kBF16) {
    if (t1 - t0 == 1) {  // one tile: converted in registers
      tiles_times(kTileFns<Wt, S | B>, panel);
    } else if constexpr (kDot) {  // several: the panel converted to bfloat16 pairs once
      thread_local jaxllm::LineVector<uint16_t> pairs;
      pairs.resize(Tiles::panel_size(c.K));  // Tiles: BF16Pairs<true>
      bf16_pairs_panel<Wt, S>(panel, c.K, pairs.data());
      tiles_times(kTileFns<Tiles, kNoScales>, Panel<Tiles>{pairs.data(), nullptr, nullptr, nullptr});
    } else {  // or to float32 weights rounded to bfloat16 (in the float tiles' order), for float tiles
      thread_local jaxllm::LineVector<float> converted;
      converted.resize(c.K * kPanel);
      dequantize_panel<Wt, S | kRoundBF16>(panel, c.K, converted.data());
      tiles_times(kTileFns<F32Weights, kNoScales>, Panel<F32Weights>{converted.data(), nullptr, nullptr, nullptr});
    }
  } else {
    if constexpr (Wt::kConvertPanel) {
      if (t1 - t0 > 1) {  // several tiles: the panel converted once (all `depth` steps), then float tiles
        thread_local jaxllm::LineVector<float> converted;
        converted.resize(c.depth * kPanel);
        dequantize_panel<Wt, S>(panel, c.depth, converted.data());
        tiles_times(kTileFns<F32Weights, kNoScales>, Panel<F32Weights>{converted.data(), nullptr, nullptr, nullptr});
        return;
      }
    }
    tiles_times(kTileFns<Wt, S>, panel);
  }
}

// y[M, N] = x[M, K] @ the panels (num_panels of them, N columns), shapes checked by the
// caller; one parallel pass over the pack and multiply items. B (grouped panels): 0, or
// kRoundBF16 (x and the dequantized weights rounded to bfloat16, float32 sums, as a
// bfloat16 model's plain weights multiply: BF16Pairs' float tiles) with kBF16Dot
// (vdpbf16ps; the same sums in the same order either way, however a panel is converted).
// With an activation `act` (a gated MLP's [gate | up], F = N/2 columns each, whole panels):
// y [M, F] = act(gate) * up, each item a gate panel and its up panel (amx_rows alike).
template <class Wt, int S, int B = 0>
void dense_rows(ffi::ThreadPool& pool, const float* X, int64_t M, int64_t K, const typename Wt::T* P,
                int64_t num_panels, int64_t N, float* Y, Scales scales, Scales mins, int group_shift,
                bool amx = false, int32_t act = jaxllm::kNoActivation) {
  if (K == 0) {
    std::memset(Y, 0, M * (act == jaxllm::kNoActivation ? N : N / 2) * sizeof(float));
    return;
  }
  constexpr bool kBF16 = B != 0, kDot = (B & kBF16Dot) != 0;
#ifdef JAXLLM_AMX
  if constexpr (kDot || std::is_same_v<Wt, BF16Pairs<true>>) {
    if (amx && amx_ready())
      return amx_rows<Wt, S>(pool, X, M, K, P, num_panels, N, Y, scales, mins, group_shift, act);
  }
#endif
  using Tiles = std::conditional_t<kBF16, BF16Pairs<kDot>, Wt>;  // how x is packed, which tiles multiply
  const int64_t tiles = (M + kTileRows - 1) / kTileRows, depth = Tiles::depth(K);
  thread_local jaxllm::LineVector<typename Tiles::X> packed;
  packed.resize(tiles * kTileRows * depth);
  typename Tiles::X* XT = packed.data();
  const auto pack = [&](int64_t t) { Tiles::pack(X, M, K, t, XT + t * kTileRows * depth); };
  const DenseCall<Wt, Tiles> call{XT, M, K, depth, num_panels, N, P, scales, mins, group_shift};
  if (act == jaxllm::kNoActivation) {
    pack_then_multiply(pool, M, num_panels, pack, [&](int64_t p, int64_t t0, int64_t t1) {
      panel_times_tiles<Wt, S, B>(call, p, t0, t1, Y, N, p * kPanel);
    });
    return;
  }
  // a gated MLP's [gate | up]: each item a gate panel and its up panel, their sums into two
  // buffers of the block's rows (in L2), then act(gate) * up into y [M, N/2]
  const int64_t half = num_panels / 2, F = N / 2;
  pack_then_multiply(pool, M, half, pack, [&](int64_t p, int64_t t0, int64_t t1) {
    thread_local jaxllm::LineVector<float> gate, up;  // [M][32] each; the block's rows written and read
    gate.resize(M * kPanel);
    up.resize(M * kPanel);
    panel_times_tiles<Wt, S, B>(call, p, t0, t1, gate.data(), kPanel, 0);
    panel_times_tiles<Wt, S, B>(call, p + half, t0, t1, up.data(), kPanel, 0);
    for (int64_t r = t0 * kTileRows; r < std::min(M, t1 * kTileRows); ++r)
      jaxllm::glu_row(gate.data() + r * kPanel, up.data() + r * kPanel, kPanel, Y + r * F + p * kPanel, act);
  });
}

// Calls f(std::true_type) where `tiles` asks for vdpbf16ps or AMX and the build has
// AVX512_BF16, else f(std::false_type): the bfloat16 tiles a call's `bf16_tiles` picks
// (AMX: dense_rows' `amx`).
template <class F>
decltype(auto) with_bf16_tiles(int32_t tiles, F&& f) {
  if constexpr (kDotBF16) {
    if (tiles != kFloatTiles) return f(std::true_type{});
  }
  return f(std::false_type{});
}

// dense_rows with `bf16` (grouped scalings only: each weight dequantized before the dot)
// and its tiles (`tiles`: BF16Tiles) chosen at run time.
template <class Wt, int S>
void dense_rows_as(bool bf16, int32_t tiles, ffi::ThreadPool& pool, const float* X, int64_t M, int64_t K,
                   const typename Wt::T* P, int64_t num_panels, int64_t N, float* Y, Scales scales, Scales mins,
                   int group_shift, int32_t act = jaxllm::kNoActivation) {
  if constexpr (S == kGroupScales || S == kGroupScalesMins) {
    if (bf16) {
      return with_bf16_tiles(tiles, [&](auto use_dot) {
        constexpr int B = kRoundBF16 | (decltype(use_dot)::value ? kBF16Dot : 0);
        dense_rows<Wt, S, B>(pool, X, M, K, P, num_panels, N, Y, scales, mins, group_shift, tiles == kAmxTiles,
                             act);
      });
    }
  }
  dense_rows<Wt, S>(pool, X, M, K, P, num_panels, N, Y, scales, mins, group_shift, tiles == kAmxTiles, act);
}

// y = x @ panels, the panels' scales applied as S says: `scales` per column of the padded
// panels (kColumnScales), or [num_panels][K / G][32] with `mins` alike (grouped, G =
// 2^group_shift inputs per scale); `bf16`: quantized panels multiplied in bfloat16, by
// the tiles `tiles` names where the build (and the OS, for AMX) has them.
template <class Wt, int S, typename PanelBuffer>
ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, PanelBuffer panels, Scales scales, Scales mins,
                 ffi::ResultBuffer<ffi::F32> y, int group_shift = 0, bool bf16 = false, int32_t tiles = kDotTiles) {
  const auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  constexpr bool kPairs = kIsPairs<Wt>;
  if (xd.size() != 2 || pd.size() != (kPairs ? 4 : 3) || yd.size() != 2 || pd[2] != (kPairs ? kPanel : Wt::kRow) ||
      (kPairs && pd[3] != 2))
    return ffi::Error::InvalidArgument("dense: x must be [M, K], panels [N/32, K, 32 (16 bytes if 4-bit)] "
                                       "(bfloat16: [N/32, K/2 rounded up, 32, 2]), y [M, N]");
  const int64_t M = xd[0], K = xd[1], num_panels = pd[0], N = yd[1];
  if (pd[1] != (kPairs ? (K + 1) / 2 : K) || yd[0] != M || N > num_panels * kPanel ||
      N <= (num_panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("dense: the shapes of x, panels and y do not agree");
  if (M == 0 || N == 0) return ffi::Error::Success();
  dense_rows_as<Wt, S>(bf16, tiles, pool, x.typed_data(), M, K,
                       reinterpret_cast<const typename Wt::T*>(panels.untyped_data()), num_panels, N, y->typed_data(),
                       scales, mins, group_shift);
  return ffi::Error::Success();
}

// Grouped scales (and mins) are [panels, K / G, 32] for G a power of two, at least 16,
// dividing K; log2(G), or -1 where the shapes say otherwise.
// `lead` leading axes (a mixture's experts: 1) come before both and must agree.
template <typename PanelBuffer, typename ScaleBuffer>
int group_shift_of(const PanelBuffer& panels, const ScaleBuffer& scales, size_t lead = 0) {
  const auto pd = panels.dimensions(), sd = scales.dimensions();
  if (pd.size() != 3 + lead || sd.size() != 3 + lead) return -1;
  for (size_t i = 0; i <= lead; ++i)  // the leading axes and the panels
    if (sd[i] != pd[i]) return -1;
  const int64_t k = pd[lead + 1], groups = sd[lead + 1];
  if (sd[lead + 2] != kPanel || groups <= 0 || k % groups) return -1;
  const int64_t group = k / groups;
  if (group < kMinGroup || (group & (group - 1))) return -1;
  return __builtin_ctzll(static_cast<unsigned long long>(group));
}

ffi::Error DenseF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                    ffi::ResultBuffer<ffi::F32> y) {
  return Dense<F32Weights, kNoScales>(pool, x, panels, {}, {}, y);
}

ffi::Error DenseBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> panels,
                     ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return with_bf16_tiles(tiles, [&](auto use_dot) {
    return Dense<BF16Pairs<decltype(use_dot)::value>, kNoScales>(pool, x, panels, {}, {}, y, 0, false, tiles);
  });
}

ffi::Error DenseI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                   ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y) {
  const auto pd = panels.dimensions(), sd = scales.dimensions();
  if (pd.size() != 3 || sd.size() != 1 || sd[0] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("dense_i8: scales must be [N/32 * 32], one per column of the panels");
  return Dense<I8Weights, kColumnScales>(pool, x, panels, scales_of(&scales), {}, y);
}

constexpr const char* kGroupedShapes =
    ": panels must be [P, K, 32] int8 or [P, K, 16] 4-bit, scales (and mins) [P, K/G, 32] with G a power of "
    "two >= 16 dividing K";

// Blocks with a scale per G inputs: Q8_0 (int8 panels [P, K, 32]), Q4_0 (4-bit panels
// [P, K, 16]).
template <class Wt, ffi::DataType kPanelType>
ffi::Error DenseBlocks(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kPanelType> panels,
                       ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> y, bool bf16, int32_t bf16_tiles) {
  const int shift = group_shift_of(panels, scales);
  if (shift < 0) return ffi::Error::InvalidArgument(std::string("dense_q8_0 / dense_q4_0") + kGroupedShapes);
  if (!scale_types_ok(scales)) return ffi::Error::InvalidArgument(std::string("dense_q8_0 / dense_q4_0") + kScaleTypes);
  return Dense<Wt, kGroupScales>(pool, x, panels, scales_of(&scales), {}, y, shift, bf16, bf16_tiles);
}
constexpr auto DenseQ8_0 = DenseBlocks<I8Weights, ffi::S8>;
constexpr auto DenseQ4_0 = DenseBlocks<Q4Weights<8>, ffi::U8>;

// Blocks with a scale and a min per G inputs: Q4_1 (4-bit panels), and int8 ones (the
// container a GGUF of mixed block types is kept in: Q5_0, Q4_K, Q6_K... as int8 values
// with a scale and min per 16 inputs).
template <class Wt, ffi::DataType kPanelType>
ffi::Error DenseBlocksMins(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kPanelType> panels,
                           ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::ResultBuffer<ffi::F32> y, bool bf16,
                           int32_t bf16_tiles) {
  const int shift = group_shift_of(panels, scales);
  if (shift < 0 || group_shift_of(panels, mins) != shift || mins.dimensions()[1] != scales.dimensions()[1])
    return ffi::Error::InvalidArgument(std::string("dense_q4_1 / dense_q8_mins") + kGroupedShapes);
  if (!scale_types_ok(scales, &mins))
    return ffi::Error::InvalidArgument(std::string("dense_q4_1 / dense_q8_mins") + kScaleTypes);
  return Dense<Wt, kGroupScalesMins>(pool, x, panels, scales_of(&scales), scales_of(&mins), y, shift, bf16,
                                     bf16_tiles);
}
constexpr auto DenseQ4_1 = DenseBlocksMins<Q4Weights<0>, ffi::U8>;
constexpr auto DenseQ8Mins = DenseBlocksMins<I8Weights, ffi::S8>;

// A mixture of experts' projection: x's rows sorted by expert, group_sizes[e] of them
// for expert e (in order; rows past their sum get zeros, as jax.lax.ragged_dot), each
// group times its own expert's panels ([E, N/32, K, 32]; bfloat16 [E, N/32, K/2, 32,
// 2]; quantized ones as a dense call's, stacked, with their scales (and mins) [E, ...]
// likewise). The work follows the rows routed: one dense pass per expert over its rows.
template <class Wt, int S, typename PanelBuffer, typename ScaleBuffer = ffi::AnyBuffer>
ffi::Error GroupedDenseScaled(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, PanelBuffer panels,
                              const ScaleBuffer* scales, const ScaleBuffer* mins,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y, bool bf16 = false,
                              int32_t tiles = kDotTiles, int32_t act = jaxllm::kNoActivation) {
  constexpr bool kPairs = kIsPairs<Wt>;
  constexpr bool kGrouped = S == kGroupScales || S == kGroupScalesMins;
  const auto xd = x.dimensions(), pd = panels.dimensions(), gd = group_sizes.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || gd.size() != 1 || pd.size() != (kPairs ? 5u : 4u) || pd[0] != gd[0] ||
      pd[3] != Wt::kRow || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("grouped dense: x must be [M, K], panels [E, N/32, K, 32] (bfloat16: "
                                       "[E, N/32, K/2, 32, 2]; 4-bit: [E, N/32, K, 16]), group_sizes [E], y [M, N]");
  const bool gated = act != jaxllm::kNoActivation;
  const int64_t M = xd[0], K = xd[1], experts = pd[0], num_panels = pd[1], ldy = yd[1], N = gated ? 2 * ldy : ldy;
  if (pd[2] != (kPairs ? (K + 1) / 2 : K) || N > num_panels * kPanel || N <= (num_panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("grouped dense: the shapes of x, panels and y do not agree");
  if (gated && (N != num_panels * kPanel || num_panels % 2 || (act != jaxllm::kSilu && act != jaxllm::kGeluTanh)))
    return ffi::Error::InvalidArgument("grouped dense with an activation: panels of [gate | up] (2F columns, F a "
                                       "multiple of 32), y [M, F], act 0 (silu) or 1 (gelu, tanh form)");
  int shift = 0;
  int64_t scale_size = 0;  // per expert
  if constexpr (S != kNoScales) {
    const auto sd = scales->dimensions();
    if constexpr (kGrouped) shift = group_shift_of(panels, *scales, 1);
    if (kGrouped ? shift < 0 : (sd.size() != 2 || sd[0] != experts || sd[1] != num_panels * kPanel))
      return ffi::Error::InvalidArgument("grouped dense: scales must be [E, N/32, K/G, 32] (G a power of two >= 16) "
                                         "or [E, N/32 * 32] per column");
    if (mins != nullptr && group_shift_of(panels, *mins, 1) != shift)
      return ffi::Error::InvalidArgument("grouped dense: mins must be shaped as the scales");
    if constexpr (std::is_same_v<ScaleBuffer, ffi::AnyBuffer>) {
      if (!scale_types_ok(*scales, mins))
        return ffi::Error::InvalidArgument(std::string("grouped dense") + kScaleTypes);
    }
    scale_size = scales->element_count() / experts;
  }
  const int32_t* sizes = group_sizes.typed_data();
  const auto* P = reinterpret_cast<const typename Wt::T*>(panels.untyped_data());
  const int64_t expert_size = num_panels * Wt::panel_size(K);
  float* Y = y->typed_data();
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] < 0 || row + sizes[e] > M)
      return ffi::Error::InvalidArgument("grouped dense: group_sizes must be >= 0 and sum to at most M");
    if (sizes[e] > 0 && N > 0) {
      dense_rows_as<Wt, S>(bf16, tiles, pool, x.typed_data() + row * K, sizes[e], K, P + e * expert_size, num_panels, N,
                           Y + row * ldy, scales_of(scales).at(e * scale_size), scales_of(mins).at(e * scale_size),
                           shift, act);
    }
    row += sizes[e];
  }
  std::memset(Y + row * ldy, 0, (M - row) * ldy * sizeof(float));
  return ffi::Error::Success();
}
template <class Wt, typename PanelBuffer>
ffi::Error GroupedDense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, PanelBuffer panels,
                        ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y) {
  return GroupedDenseScaled<Wt, kNoScales, PanelBuffer, ffi::Buffer<ffi::F32>>(pool, x, panels, nullptr, nullptr,
                                                                               group_sizes, y);
}
constexpr auto GroupedDenseF32 = GroupedDense<F32Weights, ffi::Buffer<ffi::F32>>;
ffi::Error GroupedDenseBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> panels,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return with_bf16_tiles(tiles, [&](auto use_dot) {
    return GroupedDenseScaled<BF16Pairs<decltype(use_dot)::value>, kNoScales, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::F32>>(
        pool, x, panels, nullptr, nullptr, group_sizes, y, false, tiles);
  });
}

// Quantized experts: int8 with scales per column, Q8_0 / Q4_0 blocks (int4 of a float
// checkpoint is Q4_1's layout: a scale and min per group).
ffi::Error GroupedDenseI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                          ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> group_sizes,
                          ffi::ResultBuffer<ffi::F32> y) {
  return GroupedDenseScaled<I8Weights, kColumnScales, ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>>(
      pool, x, panels, &scales, nullptr, group_sizes, y);
}
template <class Wt, ffi::DataType kPanelType>
ffi::Error GroupedDenseBlocks(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kPanelType> panels,
                              ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> group_sizes,
                              ffi::ResultBuffer<ffi::F32> y, bool bf16, int32_t bf16_tiles) {
  return GroupedDenseScaled<Wt, kGroupScales, ffi::Buffer<kPanelType>, ffi::AnyBuffer>(
      pool, x, panels, &scales, nullptr, group_sizes, y, bf16, bf16_tiles);
}
template <class Wt, ffi::DataType kPanelType>
ffi::Error GroupedDenseBlocksMins(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kPanelType> panels,
                                  ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                                  ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y, bool bf16,
                                  int32_t bf16_tiles) {
  return GroupedDenseScaled<Wt, kGroupScalesMins>(pool, x, panels, &scales, &mins, group_sizes, y, bf16, bf16_tiles);
}
// A gated MLP's fused [gate | up] projection, act(gate) * up by its tiles (amx_rows, or
// dense_rows' items of a gate and an up panel; y [M, F]): Q4_1 blocks and bfloat16
// panels, as their plain handlers.
ffi::Error GroupedDenseQ4_1Gated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                                 ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::ResultBuffer<ffi::F32> y, bool bf16, int32_t bf16_tiles, int32_t act) {
  return GroupedDenseScaled<Q4Weights<0>, kGroupScalesMins>(pool, x, panels, &scales, &mins, group_sizes, y, bf16,
                                                            bf16_tiles, act);
}
ffi::Error GroupedDenseBF16Gated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> panels,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y, int32_t tiles,
                                 int32_t act) {
  return with_bf16_tiles(tiles, [&](auto use_dot) {
    using Pairs = BF16Pairs<decltype(use_dot)::value>;
    return GroupedDenseScaled<Pairs, kNoScales, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::F32>>(
        pool, x, panels, nullptr, nullptr, group_sizes, y, false, tiles, act);
  });
}
constexpr auto GroupedDenseQ8_0 = GroupedDenseBlocks<I8Weights, ffi::S8>;
constexpr auto GroupedDenseQ4_0 = GroupedDenseBlocks<Q4Weights<8>, ffi::U8>;
constexpr auto GroupedDenseQ4_1 = GroupedDenseBlocksMins<Q4Weights<0>, ffi::U8>;
constexpr auto GroupedDenseQ8Mins = GroupedDenseBlocksMins<I8Weights, ffi::S8>;  // a mixed GGUF's experts


// ---------------------------------------------------------------------------------------
// int8 activations (the *_x8 handlers, EngineConfig.activation_quantization="int8"): x
// quantized per row and 32 inputs to int8 with a float32 scale (d = max|x| * (1/127), q = x / d
// rounded to nearest even; llama.cpp's Q8_0 / Q8_1 activations, those of vLLM's GGUF
// kernels too), times 4-bit blocks with integer dot products: vpdpbusd (AVX512_VNNI),
// vpmaddubsw + vpmaddwd (AVX2: a block's 32 products per column summed in 16 bits, at
// most 16 x 15 x 127 in a lane, then widened once), plain C++ elsewhere. Each block's
// exact integer sum is then scaled: y = sum over blocks of (d_w d_x) isum (+ m_w s_x for
// Q4_1, s_x = d_x sum(q_x)); Q4_0's stored nibble is q + 8, taken off exactly as 8 sum(q_x).
// jaxllm.models.quant.quantized_activation_matmul is the same arithmetic in jnp.
//
// The panels ("dot layout"), 128 bytes (32 columns x 4) per row: 4-bit values as [K/8][32][4]
// bytes, byte j of column c at inputs 8i..8i+7 holding input 8i + j in its low nibble and
// 8i + 4 + j in its high one; int8 values (Q8_0) as [K/4][32][4], byte j of column c at
// inputs 4i.. being input 4i + j: the 4 inputs a 32-bit lane sums. An int8 value w is
// read as the unsigned w + 128 (a flipped sign bit; the unsigned operand of vpdpbusd /
// vpmaddubsw), with AVX2 as two nibbles (16 hi + lo: each product then fits the 16-bit
// sums), and 128 sum(q_x) taken off, as Q4_0's 8. Scales (and mins) [K/G][32] per panel
// as the grouped panels', G a power of two >= 32.
constexpr int kXBlock = 32;          // inputs per activation scale
constexpr int kDotRow = kPanel * 4;  // bytes of a dot-layout panel row

template <int kBits>
constexpr int kDotSteps = kBits == 4 ? 4 : 8;  // dot-layout rows per block of 32 inputs

// Tile t of x quantized: q [12][K] int8 (or int16: Q), d [K/32][12] float32, sum(q)
// [K/32][12] int32 (rows past M zero).
template <bool kConst, class Q>
struct XTileOf {
  template <class T>
  using P = std::conditional_t<kConst, const T*, T*>;
  using Byte = std::conditional_t<kConst, const uint8_t, uint8_t>;
  static constexpr int64_t values(int64_t K) { return kTileRows * K * static_cast<int64_t>(sizeof(Q)); }
  static int64_t bytes(int64_t K) { return values(K) + (K / kXBlock) * kTileRows * 8; }
  P<Q> q;
  P<float> d;
  P<int32_t> sum;
  XTileOf(Byte* base, int64_t K)
      : q(reinterpret_cast<P<Q>>(base)),
        d(reinterpret_cast<P<float>>(base + values(K))),
        sum(reinterpret_cast<P<int32_t>>(base + values(K) + (K / kXBlock) * kTileRows * 4)) {}
};
template <class Q>
using XTile = XTileOf<true, Q>;
using X8Tile = XTile<int8_t>;
using X16Tile = XTile<int16_t>;

// Where input k of a row sits in its tile: in order for int8; for int16, inputs 1 and 2
// of each 4 swapped ([x0, x2, x1, x3]: the pairs a 32-bit lane of the int16 weights
// holds, x16_rows below).
template <class Q>
constexpr int64_t slot(int64_t k) {
  return sizeof(Q) == 1 ? k : (k & ~int64_t{3}) | ((k & 1) << 1) | ((k >> 1) & 1);
}

// One block of 32 inputs xb quantized into qb (in slot order): its scale d = max|x| *
// (1/127) (int8) or (1/32767) (int16), as XLA computes amax / 127 (times the
// reciprocal), q = x / d to nearest even (the vector conversions round so, as nearbyint
// does, in the default rounding mode); returns the sum of the values, sets *scale.
// Vectorized where the ISA converts and narrows vectors (a scalar loop cost int16
// activations a third of a 32-row call at K = 1536); the same values either way.
#if defined(__AVX512BW__) && JAXLLM_LANES == 16
template <class Q>
inline int32_t quantize_block(const float* xb, Q* qb, float* scale) {
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  *scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) *
           (1.f / static_cast<float>(std::numeric_limits<Q>::max()));
  const __m512 inv = _mm512_set1_ps(*scale > 0.f ? 1.f / *scale : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb2 = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  if constexpr (sizeof(Q) == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(qb2));
  } else {  // inputs 1 and 2 of each 4 swapped (slot)
    const __m256i swap = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                          0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_shuffle_epi8(_mm512_cvtsepi32_epi16(qa), swap));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), _mm256_shuffle_epi8(_mm512_cvtsepi32_epi16(qb2), swap));
  }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb2));
}
#elif defined(__AVX2__)
template <class Q>
inline int32_t quantize_block(const float* xb, Q* qb, float* scale) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(xb + 8 * j);
    m = _mm256_max_ps(m, _mm256_and_ps(v[j], abs_mask));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  *scale = _mm_cvtss_f32(h) * (1.f / static_cast<float>(std::numeric_limits<Q>::max()));
  const __m256 inv = _mm256_set1_ps(*scale > 0.f ? 1.f / *scale : 0.f);
  __m256i q[4], total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    total = _mm256_add_epi32(total, q[j]);
  }
  // int32 to int16 in order (packs interleaves the 128-bit halves; the permute undoes it)
  const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
  const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
  if constexpr (sizeof(Q) == 1) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                        _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xD8));
  } else {  // inputs 1 and 2 of each 4 swapped (slot)
    const __m256i swap = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                          0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_shuffle_epi8(w01, swap));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), _mm256_shuffle_epi8(w23, swap));
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}
#else
template <class Q>
inline int32_t quantize_block(const float* xb, Q* qb, float* scale) {
  float amax = 0.f;
  for (int k = 0; k < kXBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
  *scale = amax * (1.f / static_cast<float>(std::numeric_limits<Q>::max()));
  const float inv = *scale > 0.f ? 1.f / *scale : 0.f;
  int32_t s = 0;
  for (int k = 0; k < kXBlock; ++k) {
    const int v = static_cast<int>(std::nearbyint(xb[k] * inv));
    qb[slot<Q>(k)] = static_cast<Q>(v);
    s += v;
  }
  return s;
}
#endif

// Tile t's rows, block by block (rows past M: zeros, scale 0).
template <class Q>
void quantize_tile(const float* x, int64_t M, int64_t K, int64_t t, uint8_t* out) {
  const XTileOf<false, Q> tile(out, K);
  const int64_t r0 = t * kTileRows, rows = std::min<int64_t>(kTileRows, M - r0);
  for (int64_t i = 0; i < kTileRows; ++i) {
    for (int64_t b = 0; b < K / kXBlock; ++b) {
      Q* qb = tile.q + i * K + b * kXBlock;
      float scale = 0.f;
      int32_t s = 0;
      if (i < rows)
        s = quantize_block(x + (r0 + i) * K + b * kXBlock, qb, &scale);
      else
        std::memset(qb, 0, kXBlock * sizeof(Q));
      tile.d[b * kTileRows + i] = scale;
      tile.sum[b * kTileRows + i] = s;
    }
  }
}

struct X8Panel {
  const uint8_t* w;        // the dot layout
  const float* scale;      // [K/G][32]
  const float* min;        // [K/G][32] (Q4_1, int4), else null
  const uint8_t* prefetch; // the panel two ahead, or null
  int group_shift;         // log2(G)
  const uint16_t* half_scale = nullptr;  // float16 ones in place of scale and min (kX8HalfScales)
  const uint16_t* half_min = nullptr;
  PrefetchShare share = {};  // a pass's blocks of `prefetch` (spread)
};

inline int32_t x8_quad(const int8_t* p) {  // 4 inputs' int8 values, as a 32-bit lane holds them
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int kBits>
inline void prefetch_dot_rows(const X8Panel& p, int64_t step) {  // the block of 32 inputs p.share gives
  const int64_t b = p.share.at(step);
  for (int j = 0; j < kDotSteps<kBits>; ++j) {
    __builtin_prefetch(p.prefetch + (b * kDotSteps<kBits> + j) * kDotRow);
    __builtin_prefetch(p.prefetch + (b * kDotSteps<kBits> + j) * kDotRow + 64);
  }
}

// out[g..g+R-1][32] = rows g.. of the quantized tile times the panel. kOffset: the value
// each stored weight carries above its own (Q4_0: 8; int8 read unsigned: 128), taken off
// the integer sums as kOffset sum(q_x).
#if defined(__AVX512VNNI__) && JAXLLM_LANES == 16
constexpr int kX8Rows = 6;  // 12 int32 and 12 float32 accumulators, 4 weight registers

// A block's exact sums s of rows g.. (either activation width) offset, scaled by the
// panel's scales times x's, and added to the rows' float accumulators (Q4_1's mins
// times x's block sums too).
template <int R, bool kMins, int kOffset, class Q>
inline void x_block_out(__m512i (&s)[R][2], __m512 (&acc)[R][2], const XTile<Q>& xt, int g, const X8Panel& p,
                        int64_t b) {
  const int64_t grp = (b * kXBlock) >> p.group_shift;
  const __m512 d0 = (__m512)group_lanes(p.scale, p.half_scale, grp * kPanel);
  const __m512 d1 = (__m512)group_lanes(p.scale, p.half_scale, grp * kPanel + 16);
  __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
  if constexpr (kMins) {
    m0 = (__m512)group_lanes(p.min, p.half_min, grp * kPanel);
    m1 = (__m512)group_lanes(p.min, p.half_min, grp * kPanel + 16);
  }
  for (int i = 0; i < R; ++i) {
    const int64_t at = b * kTileRows + g + i;
    if constexpr (kOffset != 0) {
      const __m512i off = _mm512_set1_epi32(kOffset * xt.sum[at]);
      s[i][0] = _mm512_sub_epi32(s[i][0], off);
      s[i][1] = _mm512_sub_epi32(s[i][1], off);
    }
    const __m512 dx = _mm512_set1_ps(xt.d[at]);
    acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][0]), _mm512_mul_ps(d0, dx), acc[i][0]);
    acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][1]), _mm512_mul_ps(d1, dx), acc[i][1]);
    if constexpr (kMins) {
      const __m512 sx = _mm512_set1_ps(xt.d[at] * static_cast<float>(xt.sum[at]));
      acc[i][0] = _mm512_fmadd_ps(m0, sx, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(m1, sx, acc[i][1]);
    }
  }
}

template <int R>
inline void x_rows_out(const __m512 (&acc)[R][2], int g, float* out) {
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(out + (g + i) * kPanel, acc[i][0]);
    _mm512_storeu_ps(out + (g + i) * kPanel + 16, acc[i][1]);
  }
}

// The pass both activation widths make over a panel with R rows: per block of 32 inputs
// its dot-layout rows loaded (v0: columns 0-15, v1: 16-31) and handed to `step` with the
// block's int32 sums s, then the block's epilogue (x_block_out); the rows stored.
template <int R, int kBits, bool kMins, int kOffset, class Q, class Step>
inline void x_rows(const XTile<Q>& xt, int g, const X8Panel& p, int64_t K, float* out, Step step) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / kXBlock; ++b) {
    if (p.prefetch && p.share.starts(b)) prefetch_dot_rows<kBits>(p, b);
    __m512i s[R][2];
    for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = _mm512_setzero_si512();
    for (int j = 0; j < kDotSteps<kBits>; ++j) {
      const uint8_t* w = p.w + (b * kDotSteps<kBits> + j) * kDotRow;
      step(s, _mm512_loadu_si512(w), _mm512_loadu_si512(w + 64), b, j);
    }
    x_block_out<R, kMins, kOffset>(s, acc, xt, g, p, b);
  }
  x_rows_out<R>(acc, g, out);
}

template <int R, int kBits, bool kMins, int kOffset>
void x8_rows(const X8Tile& xt, int g, const X8Panel& p, int64_t K, float* out) {
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(-128);
  const auto step = [&](__m512i (&s)[R][2], __m512i v0, __m512i v1, int64_t b, int j) {
    if constexpr (kBits == 4) {
      const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
      const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
      for (int i = 0; i < R; ++i) {
        const int8_t* xr = xt.q + (g + i) * K + b * kXBlock + j * 8;
        const __m512i xa = _mm512_set1_epi32(x8_quad(xr)), xb = _mm512_set1_epi32(x8_quad(xr + 4));
        s[i][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i][0], lo0, xa), hi0, xb);
        s[i][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i][1], lo1, xa), hi1, xb);
      }
    } else {
      const __m512i u0 = _mm512_xor_si512(v0, flip), u1 = _mm512_xor_si512(v1, flip);
      for (int i = 0; i < R; ++i) {
        const __m512i xa = _mm512_set1_epi32(x8_quad(xt.q + (g + i) * K + b * kXBlock + j * 4));
        s[i][0] = _mm512_dpbusd_epi32(s[i][0], u0, xa);
        s[i][1] = _mm512_dpbusd_epi32(s[i][1], u1, xa);
      }
    }
  };
  x_rows<R, kBits, kMins, kOffset>(xt, g, p, K, out, step);
}

// int16 activations (the *_x16 handlers) times the same panels: each 32-bit lane of a
// dot-layout row made two int16 weights, one by sign- (int8) or zero-extension (4-bit:
// 0..15) of its bytes 0 and 2, one of bytes 1 and 3 (4-bit: a nibble of each), times
// x's pairs [x0, x2] and [x1, x3] (slot) by vpdpwssd: a block's sums exact in int32 (32
// products of at most 127 x 32767). int8 weights read as they are: no offset.
template <int R>
inline void x16_pairs(__m512i (&s)[R][2], __m512i a0, __m512i b0, __m512i a1, __m512i b1, const X16Tile& xt, int g,
                      int64_t K, int64_t k) {
  for (int i = 0; i < R; ++i) {
    const int16_t* xr = xt.q + (g + i) * K + k;
    const __m512i xa = _mm512_set1_epi32(x8_quad(reinterpret_cast<const int8_t*>(xr)));
    const __m512i xb = _mm512_set1_epi32(x8_quad(reinterpret_cast<const int8_t*>(xr + 2)));
    s[i][0] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s[i][0], a0, xa), b0, xb);
    s[i][1] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s[i][1], a1, xa), b1, xb);
  }
}

template <int R, int kBits, bool kMins, int kOffset>
void x16_rows(const X16Tile& xt, int g, const X8Panel& p, int64_t K, float* out) {
  const __m512i nib = _mm512_set1_epi16(0x000F);
  const auto step = [&](__m512i (&s)[R][2], __m512i v0, __m512i v1, int64_t b, int j) {
    if constexpr (kBits == 4) {  // inputs 8j.. in the low nibbles, 8j + 4.. in the high ones
      const int64_t k = b * kXBlock + j * 8;
      x16_pairs<R>(s, _mm512_and_si512(v0, nib), _mm512_and_si512(_mm512_srli_epi16(v0, 8), nib),
                   _mm512_and_si512(v1, nib), _mm512_and_si512(_mm512_srli_epi16(v1, 8), nib), xt, g, K, k);
      x16_pairs<R>(s, _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib), _mm512_srli_epi16(v0, 12),
                   _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib), _mm512_srli_epi16(v1, 12), xt, g, K, k + 4);
    } else {
      x16_pairs<R>(s, _mm512_srai_epi16(_mm512_slli_epi16(v0, 8), 8), _mm512_srai_epi16(v0, 8),
                   _mm512_srai_epi16(_mm512_slli_epi16(v1, 8), 8), _mm512_srai_epi16(v1, 8), xt, g, K,
                   b * kXBlock + j * 4);
    }
  };
  x_rows<R, kBits, kMins, kOffset>(xt, g, p, K, out, step);
}
constexpr int kX16Rows = 6;  // 12 int32 and 12 float32 accumulators, 4 weight registers, 2 of x
constexpr bool kX8HalfScales = true;  // x8_rows and x16_rows read float16 scales (and mins) as they are
#elif defined(__AVX2__)
constexpr int kX8Rows = 4;  // 8 16-bit accumulators, 4 weight registers

// 8 scales (or mins) at `at`: float32, or float16 widened (exact).
inline __m256 x8_lanes(const float* f, const uint16_t* h, int64_t at) {
  if (h == nullptr) return _mm256_loadu_ps(f + at);
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + at)));
#else
  alignas(32) float v[8];
  widen_halves(h + at, 8, v);
  return _mm256_load_ps(v);
#endif
}

// A block's 16-bit sums (each of a column's lanes: 16 products of at most 15 x 127)
// widened, offset, scaled and added to 8 outputs o[0..7] of one row.
template <bool kMins, int kOffset, class Q>
inline void x8_block_out(__m256i si, const XTile<Q>& xt, int64_t at, __m256 scale, __m256 min, float* o) {
  if constexpr (kOffset != 0) si = _mm256_sub_epi32(si, _mm256_set1_epi32(kOffset * xt.sum[at]));
  __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(scale, _mm256_set1_ps(xt.d[at])),
                             _mm256_loadu_ps(o));
  if constexpr (kMins) a = _mm256_fmadd_ps(min, _mm256_set1_ps(xt.d[at] * static_cast<float>(xt.sum[at])), a);
  _mm256_storeu_ps(o, a);
}

template <int R, int kBits, bool kMins, int kOffset>
void x8_rows(const X8Tile& xt, int g, const X8Panel& p, int64_t K, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(-128);
  const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  for (int i = 0; i < R; ++i) std::memset(out + (g + i) * kPanel, 0, kPanel * sizeof(float));
  for (int64_t b = 0; b < K / kXBlock; ++b) {
    if (p.prefetch && p.share.starts(b)) prefetch_dot_rows<kBits>(p, b);
    const int64_t grp = (b * kXBlock) >> p.group_shift;
    // 4-bit: columns 16h..16h+15, two vectors of 8; int8: columns 8h..8h+7, low and high nibbles
    for (int h = 0; h < (kBits == 4 ? 2 : 4); ++h) {
      __m256i s[R][2];
      for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = _mm256_setzero_si256();
      for (int j = 0; j < kDotSteps<kBits>; ++j) {
        const uint8_t* w = p.w + (b * kDotSteps<kBits> + j) * kDotRow + h * (kBits == 4 ? 64 : 32);
        if constexpr (kBits == 4) {
          const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
          const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
          const __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
          const __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
          for (int i = 0; i < R; ++i) {
            const int8_t* xr = xt.q + (g + i) * K + b * kXBlock + j * 8;
            const __m256i xa = _mm256_set1_epi32(x8_quad(xr)), xb = _mm256_set1_epi32(x8_quad(xr + 4));
            s[i][0] = _mm256_add_epi16(s[i][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa),
                                                                  _mm256_maddubs_epi16(hi0, xb)));
            s[i][1] = _mm256_add_epi16(s[i][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa),
                                                                  _mm256_maddubs_epi16(hi1, xb)));
          }
        } else {
          const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), flip);
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int i = 0; i < R; ++i) {
            const __m256i xa = _mm256_set1_epi32(x8_quad(xt.q + (g + i) * K + b * kXBlock + j * 4));
            s[i][0] = _mm256_add_epi16(s[i][0], _mm256_maddubs_epi16(lo, xa));
            s[i][1] = _mm256_add_epi16(s[i][1], _mm256_maddubs_epi16(hi, xa));
          }
        }
      }
      // the block's scales (and mins) of these columns: 16 (two vectors) or 8
      const int64_t c0 = grp * kPanel + (kBits == 4 ? 16 : 8) * h;
      __m256 sc[2], mn[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int v = 0; v < (kBits == 4 ? 2 : 1); ++v) {
        sc[v] = x8_lanes(p.scale, p.half_scale, c0 + 8 * v);
        if constexpr (kMins) mn[v] = x8_lanes(p.min, p.half_min, c0 + 8 * v);
      }
      for (int i = 0; i < R; ++i) {
        const int64_t at = b * kTileRows + g + i;
        float* o = out + (g + i) * kPanel;
        if constexpr (kBits == 4) {
          for (int v = 0; v < 2; ++v)
            x8_block_out<kMins, kOffset>(_mm256_madd_epi16(s[i][v], ones), xt, at, sc[v], mn[v], o + 16 * h + 8 * v);
        } else {
          const __m256i si = _mm256_add_epi32(_mm256_madd_epi16(s[i][0], ones), _mm256_madd_epi16(s[i][1], sixteens));
          x8_block_out<kMins, kOffset>(si, xt, at, sc[0], mn[0], o + 8 * h);
        }
      }
    }
  }
}

// int16 activations as the AVX-512 x16_rows takes them, by vpmaddwd (two products a
// 32-bit lane, summed) and a 32-bit add: 8 columns at a time, R rows of x.
template <int R>
inline void x16_pairs(__m256i (&s)[R], __m256i a, __m256i b, const X16Tile& xt, int g, int64_t K, int64_t k) {
  for (int i = 0; i < R; ++i) {
    const int16_t* xr = xt.q + (g + i) * K + k;
    const __m256i xa = _mm256_set1_epi32(x8_quad(reinterpret_cast<const int8_t*>(xr)));
    const __m256i xb = _mm256_set1_epi32(x8_quad(reinterpret_cast<const int8_t*>(xr + 2)));
    s[i] = _mm256_add_epi32(s[i], _mm256_add_epi32(_mm256_madd_epi16(a, xa), _mm256_madd_epi16(b, xb)));
  }
}

template <int R, int kBits, bool kMins, int kOffset>
void x16_rows(const X16Tile& xt, int g, const X8Panel& p, int64_t K, float* out) {
  const __m256i nib = _mm256_set1_epi16(0x000F);
  for (int i = 0; i < R; ++i) std::memset(out + (g + i) * kPanel, 0, kPanel * sizeof(float));
  for (int64_t b = 0; b < K / kXBlock; ++b) {
    if (p.prefetch && p.share.starts(b)) prefetch_dot_rows<kBits>(p, b);
    const int64_t grp = (b * kXBlock) >> p.group_shift;
    for (int h = 0; h < 4; ++h) {  // columns 8h..8h+7
      __m256i s[R];
      for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
      for (int j = 0; j < kDotSteps<kBits>; ++j) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.w + (b * kDotSteps<kBits> + j) * kDotRow + 32 * h));
        if constexpr (kBits == 4) {
          const int64_t k = b * kXBlock + j * 8;
          x16_pairs<R>(s, _mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srli_epi16(v, 8), nib), xt, g, K, k);
          x16_pairs<R>(s, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), _mm256_srli_epi16(v, 12), xt, g, K, k + 4);
        } else {
          x16_pairs<R>(s, _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), _mm256_srai_epi16(v, 8), xt, g, K,
                       b * kXBlock + j * 4);
        }
      }
      const __m256 sc = x8_lanes(p.scale, p.half_scale, grp * kPanel + 8 * h);
      const __m256 mn = kMins ? x8_lanes(p.min, p.half_min, grp * kPanel + 8 * h) : _mm256_setzero_ps();
      for (int i = 0; i < R; ++i)
        x8_block_out<kMins, kOffset>(s[i], xt, b * kTileRows + g + i, sc, mn, out + (g + i) * kPanel + 8 * h);
    }
  }
}
constexpr int kX16Rows = 6;  // 6 accumulators, 2 weight registers (4-bit: 2 at a time), 2 of x
constexpr bool kX8HalfScales = true;
#else  // a lane at a time (SSE2, NEON): the same sums in the same order
constexpr int kX8Rows = kTileRows;
constexpr bool kX8HalfScales = false;  // float16 scales widened for it per item
template <int R, int kBits, bool kMins, int kOffset>
void x8_rows(const X8Tile& xt, int g, const X8Panel& p, int64_t K, float* out) {
  for (int i = 0; i < R; ++i) {
    float* o = out + (g + i) * kPanel;
    for (int c = 0; c < kPanel; ++c) o[c] = 0.f;
    for (int64_t b = 0; b < K / kXBlock; ++b) {
      const int64_t at = b * kTileRows + g + i, grp = (b * kXBlock) >> p.group_shift;
      const int8_t* xr = xt.q + (g + i) * K + b * kXBlock;
      for (int c = 0; c < kPanel; ++c) {
        int32_t s = 0;
        for (int j = 0; j < kDotSteps<kBits>; ++j)
          for (int l = 0; l < 4; ++l) {
            const uint8_t byte = p.w[(b * kDotSteps<kBits> + j) * kDotRow + c * 4 + l];
            if constexpr (kBits == 4)
              s += (byte & 0x0F) * xr[j * 8 + l] + (byte >> 4) * xr[j * 8 + 4 + l];
            else
              s += (byte ^ 0x80) * xr[j * 4 + l];
          }
        s -= kOffset * xt.sum[at];
        o[c] = std::fma(static_cast<float>(s), p.scale[grp * kPanel + c] * xt.d[at], o[c]);
        if constexpr (kMins)
          o[c] = std::fma(p.min[grp * kPanel + c], xt.d[at] * static_cast<float>(xt.sum[at]), o[c]);
      }
    }
  }
}
constexpr int kX16Rows = kTileRows;
template <int R, int kBits, bool kMins, int kOffset>
void x16_rows(const X16Tile& xt, int g, const X8Panel& p, int64_t K, float* out) {
  for (int i = 0; i < R; ++i) {
    float* o = out + (g + i) * kPanel;
    for (int c = 0; c < kPanel; ++c) o[c] = 0.f;
    for (int64_t b = 0; b < K / kXBlock; ++b) {
      const int64_t at = b * kTileRows + g + i, grp = (b * kXBlock) >> p.group_shift, k0 = b * kXBlock;
      const int16_t* xr = xt.q + (g + i) * K;
      for (int c = 0; c < kPanel; ++c) {
        int32_t s = 0;
        for (int j = 0; j < kDotSteps<kBits>; ++j)
          for (int l = 0; l < 4; ++l) {
            const uint8_t byte = p.w[(b * kDotSteps<kBits> + j) * kDotRow + c * 4 + l];
            if constexpr (kBits == 4) {
              const int64_t k = k0 + j * 8 + l;
              s += (byte & 0x0F) * xr[slot<int16_t>(k)] + (byte >> 4) * xr[slot<int16_t>(k + 4)];
            } else {
              s += static_cast<int8_t>(byte) * xr[slot<int16_t>(k0 + j * 4 + l)];
            }
          }
        s -= kOffset * xt.sum[at];
        o[c] = std::fma(static_cast<float>(s), p.scale[grp * kPanel + c] * xt.d[at], o[c]);
        if constexpr (kMins)
          o[c] = std::fma(p.min[grp * kPanel + c], xt.d[at] * static_cast<float>(xt.sum[at]), o[c]);
      }
    }
  }
}
#endif

// Rows g.. of a quantized tile (int8 or int16 values: Q) times a panel, by the ISA's
// x8_rows or x16_rows.
template <class Q, int R, int kBits, bool kMins, int kOffset>
inline void xq_rows(const XTile<Q>& xt, int g, const X8Panel& p, int64_t K, float* out) {
  if constexpr (sizeof(Q) == 1)
    x8_rows<R, kBits, kMins, kOffset>(xt, g, p, K, out);
  else
    x16_rows<R, kBits, kMins, kOffset>(xt, g, p, K, out);
}

template <class Q, int R, int kBits, bool kMins, int kOffset>
void x8_chunks(const XTile<Q>& xt, int g, const X8Panel& p, int64_t K, float* out) {
  constexpr int kRows = sizeof(Q) == 1 ? kX8Rows : kX16Rows;
  constexpr int C = R < kRows ? R : kRows;
  const int passes = (g + R + kRows - 1) / kRows;  // the tile's (g + R rows), each its share of the prefetches
  xq_rows<Q, C, kBits, kMins, kOffset>(xt, g, spread(p, g / kRows, passes, K / kXBlock), K, out);
  if constexpr (R > C) x8_chunks<Q, R - C, kBits, kMins, kOffset>(xt, g + C, p, K, out);
}

template <class Q, int R, int kBits, bool kMins, int kOffset>
void x8_tile_times_panel(const XTile<Q>& xt, const X8Panel& p, int64_t K, float* y, int64_t ldy, int cols) {
  float out[kTileRows * kPanel];
  x8_chunks<Q, R, kBits, kMins, kOffset>(xt, 0, p, K, out);
  for (int i = 0; i < R; ++i) std::memcpy(y + i * ldy, out + i * kPanel, cols * sizeof(float));
}

template <class Q>
using X8TileFn = void (*)(const XTile<Q>&, const X8Panel&, int64_t, float*, int64_t, int);
template <class Q, int kBits, bool kMins, int kOffset>
constexpr X8TileFn<Q> kX8TileFns[kTileRows + 1] = {
    nullptr,
    x8_tile_times_panel<Q, 1, kBits, kMins, kOffset>,  x8_tile_times_panel<Q, 2, kBits, kMins, kOffset>,
    x8_tile_times_panel<Q, 3, kBits, kMins, kOffset>,  x8_tile_times_panel<Q, 4, kBits, kMins, kOffset>,
    x8_tile_times_panel<Q, 5, kBits, kMins, kOffset>,  x8_tile_times_panel<Q, 6, kBits, kMins, kOffset>,
    x8_tile_times_panel<Q, 7, kBits, kMins, kOffset>,  x8_tile_times_panel<Q, 8, kBits, kMins, kOffset>,
    x8_tile_times_panel<Q, 9, kBits, kMins, kOffset>,  x8_tile_times_panel<Q, 10, kBits, kMins, kOffset>,
    x8_tile_times_panel<Q, 11, kBits, kMins, kOffset>, x8_tile_times_panel<Q, 12, kBits, kMins, kOffset>};

// y[M, N] = x[M, K] (quantized to Q as it is packed) @ the dot-layout panels; shapes
// checked by the caller (K a positive multiple of 32).
template <class Q, int kBits, bool kMins, int kOffset>
void dense_rows_x8(ffi::ThreadPool& pool, const float* X, int64_t M, int64_t K, const uint8_t* P,
                   int64_t num_panels, int64_t N, float* Y, Scales scales, Scales mins, int group_shift) {
  const int64_t tiles = (M + kTileRows - 1) / kTileRows, tile_bytes = XTile<Q>::bytes(K);
  const int64_t panel_bytes = K / kXBlock * kDotSteps<kBits> * kDotRow, panel_groups = (K >> group_shift) * kPanel;
  thread_local jaxllm::LineVector<uint8_t> packed;
  packed.resize(tiles * tile_bytes);
  uint8_t* XT = packed.data();
  const auto pack = [&](int64_t t) { quantize_tile<Q>(X, M, K, t, XT + t * tile_bytes); };
  pack_then_multiply(pool, M, num_panels, pack, [&](int64_t p, int64_t t0, int64_t t1) {
    thread_local jaxllm::LineVector<float> wide_scales, wide_mins;  // a panel's float16 ones, widened
    X8Panel panel{P + p * panel_bytes, nullptr, nullptr, p + 2 < num_panels ? P + (p + 2) * panel_bytes : nullptr,
                  group_shift};
    // float16 scales: read as they are, a block's at a time, by one tile; widened once
    // for several (each tile would convert them again)
    if (kX8HalfScales && scales.half && t1 - t0 == 1) {
      panel.half_scale = static_cast<const uint16_t*>(scales.data) + p * panel_groups;
      if (kMins) panel.half_min = static_cast<const uint16_t*>(mins.data) + p * panel_groups;
    } else {
      panel.scale = scales.floats(p * panel_groups, panel_groups, wide_scales);
      if (kMins) panel.min = mins.floats(p * panel_groups, panel_groups, wide_mins);
    }
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    for (int64_t t = t0; t < t1; ++t) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - t * kTileRows));
      kX8TileFns<Q, kBits, kMins, kOffset>[rows](XTile<Q>(XT + t * tile_bytes, K),
                                                 spread(panel, t - t0, t1 - t0, K / kXBlock), K,
                                                 Y + t * kTileRows * N + p * kPanel, N, cols);
    }
  });
}

// bfloat16 activations over the dot layout's blocks (the *_xbf16 handlers): what the float
// layout's blocks multiply with `bf16` (x and each dequantized weight rounded to bfloat16,
// float32 sums: `activation_quantization` bfloat16), from the arrays the int16 handlers
// read, so one copy of the blocks serves both, the start-up measurement picking per step
// shape (int16 won up to ~32 rows on a Zen 4, bfloat16 from ~128:
// docs/bench-log/2026-12-04-zen4.md). Each panel is converted to bfloat16 pairs once per
// item, then multiplied by the BF16Pairs tiles: the same weights, pairs and order as
// bf16_pairs_panel's from the float layout, so the same sums bit for bit.
struct BF16Acts {};  // DenseX8's Q for these handlers
// Rows per item at most: each item converts its panel, so twice the float tiles' kRowBlock
// (x's share, 16 tiles of bfloat16 pairs, still fits a 1 MiB L2 at K = 1536): 4% faster
// summed over SmolLM2's projections at 128-512 rows than 96 on a Zen 4
// (docs/bench-log/2026-12-04-zen4.md).
constexpr int64_t kDotBF16RowBlock = 2 * kRowBlock;

// Input k of column c of a dot-layout panel: the nibble (Q4_0's still + 8) or the int8 value.
template <int kBits>
inline int dot_value(const uint8_t* w, int64_t k, int c) {
  if constexpr (kBits == 8) return static_cast<int8_t>(w[(k / 4) * kDotRow + c * 4 + (k % 4)]);
  const uint8_t byte = w[(k / 8) * kDotRow + c * 4 + (k % 4)];
  return (k % 8) < 4 ? byte & 0x0F : byte >> 4;
}

// Inputs k0..k0+31 (one block) of a dot-layout panel as bfloat16 pairs [16][32][2], each
// weight as scaled<S | kRoundBF16> makes it (kLanes columns a vector): any build.
template <int kBits, int kZero, int S>
inline void dot_pairs_block_any(const uint8_t* w, const float* sc, const float* mn, int group_shift, int64_t k0,
                                uint16_t* out) {
  const int64_t g = (k0 >> group_shift) * kPanel;
  for (int64_t k = k0; k < k0 + kXBlock; ++k) {
    for (int c = 0; c < kPanel; c += jaxllm::kLanes) {
      f32xN q, s = loadN(sc + g + c), m{};
      if constexpr (S == kGroupScalesMins) m = loadN(mn + g + c);
      for (int l = 0; l < jaxllm::kLanes; ++l) q[l] = static_cast<float>(dot_value<kBits>(w, k, c + l) - kZero);
      const f32xN v = scaled<S | kRoundBF16>(q, s, m);
      for (int l = 0; l < jaxllm::kLanes; ++l) out[(k - k0) / 2 * 2 * kPanel + 2 * (c + l) + (k & 1)] = bf16_bits(v[l]);
    }
  }
}

#if defined(__AVX512BF16__) && JAXLLM_LANES == 16
// The same with AVX512_BF16: 16 columns of a dot row (64 bytes: 4 inputs a column, as
// bytes, or as the low and the high nibbles of 4-bit ones) widened 4 columns at a time,
// so each column's 4 inputs lie side by side, scaled (each column's scale repeated 4
// times), rounded by vcvtne2ps2bf16 into pairs of 8 columns, and each column's two pairs
// split into their rows by vpermt2d.
template <int kBits, int kZero, int S>
inline void dot_pairs_block(const uint8_t* w, const float* sc, const float* mn, int group_shift, int64_t k0,
                            uint16_t* out) {
  const int64_t g = (k0 >> group_shift) * kPanel;
  f32xN s[2][4], m[2][4] = {};
  const __m512i quad = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
  for (int h = 0; h < 2; ++h) {
    const __m512 sv = _mm512_loadu_ps(sc + g + 16 * h);
    const __m512 mv = S == kGroupScalesMins ? _mm512_loadu_ps(mn + g + 16 * h) : _mm512_setzero_ps();
    for (int q = 0; q < 4; ++q) {
      const __m512i four = _mm512_add_epi32(quad, _mm512_set1_epi32(4 * q));  // columns 4q.. each 4 times
      s[h][q] = (f32xN)_mm512_permutexvar_ps(four, sv);
      if constexpr (S == kGroupScalesMins) m[h][q] = (f32xN)_mm512_permutexvar_ps(four, mv);
    }
  }
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  constexpr int kHalves = kBits == 4 ? 2 : 1, kInputs = 4 * kHalves;  // inputs a dot row holds
  for (int i = 0; i < kDotSteps<kBits>; ++i) {  // dot row i: inputs k0 + kInputs i ..
    for (int h = 0; h < 2; ++h) {  // columns 16h ..
      const __m512i bytes = _mm512_loadu_si512(w + (k0 / kInputs + i) * kDotRow + 64 * h);
      for (int half = 0; half < kHalves; ++half) {  // inputs kInputs i + 4 half .. + 3
        const __m512i v = kBits == 8 ? bytes
                          : half   ? _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble)
                                   : _mm512_and_si512(bytes, nibble);
        const __m128i chunk[4] = {_mm512_castsi512_si128(v), _mm512_extracti32x4_epi32(v, 1),
                                  _mm512_extracti32x4_epi32(v, 2), _mm512_extracti32x4_epi32(v, 3)};
        f32xN f[4];
        for (int q = 0; q < 4; ++q) {  // columns 16h + 4q .. + 3, their 4 inputs each
          const __m512i ints = kBits == 8 ? _mm512_cvtepi8_epi32(chunk[q]) : _mm512_cvtepu8_epi32(chunk[q]);
          f[q] = (f32xN)_mm512_cvtepi32_ps(ints);
          if constexpr (kZero != 0) f[q] -= splatN(static_cast<float>(kZero));
          f[q] = scaled<S>(f[q], s[h][q], m[h][q]);
        }
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh((__m512)f[1], (__m512)f[0]);  // columns 16h .. + 7
        const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh((__m512)f[3], (__m512)f[2]);  // 16h + 8 .. + 15
        uint16_t* row = out + (kInputs * i + 4 * half) / 2 * 2 * kPanel + 2 * 16 * h;
        _mm512_storeu_si512(row, _mm512_permutex2var_epi32(lo, even, hi));
        _mm512_storeu_si512(row + 2 * kPanel, _mm512_permutex2var_epi32(lo, odd, hi));
      }
    }
  }
}
#endif

// A dot-layout panel (K a multiple of 32, groups of 32 inputs or more) as bfloat16 pairs
// [K/2][32][2], float32 scales (and mins: kMins) [K/G][32]; the panel two ahead prefetched
// block by block.
template <int kBits, int kZero, bool kMins>
void dot_pairs_panel(const uint8_t* w, const float* sc, const float* mn, int group_shift, int64_t K,
                     const uint8_t* prefetch, uint16_t* out) {
  constexpr int S = kMins ? kGroupScalesMins : kGroupScales;
  constexpr int64_t kBlockBytes = kDotSteps<kBits> * kDotRow;
  for (int64_t k0 = 0; k0 < K; k0 += kXBlock) {
    if (prefetch)
      for (int l = 0; l < kBlockBytes / 64; ++l) __builtin_prefetch(prefetch + k0 / kXBlock * kBlockBytes + 64 * l);
#if defined(__AVX512BF16__) && JAXLLM_LANES == 16
    dot_pairs_block<kBits, kZero, S>(w, sc, mn, group_shift, k0, out + k0 / 2 * 2 * kPanel);
#else
    dot_pairs_block_any<kBits, kZero, S>(w, sc, mn, group_shift, k0, out + k0 / 2 * 2 * kPanel);
#endif
  }
}

// y[M, N] = x[M, K] rounded to bfloat16 @ the dot-layout panels, each weight dequantized
// and rounded to bfloat16, by the tiles `tiles` names (BF16Tiles: vdpbf16ps where the
// build has it, else the float tiles; the same sums); shapes checked by the caller.
template <int kBits, int kZero, bool kMins>
void dense_rows_dot_bf16(ffi::ThreadPool& pool, const float* X, int64_t M, int64_t K, const uint8_t* P,
                         int64_t num_panels, int64_t N, float* Y, Scales scales, Scales mins, int group_shift,
                         int32_t tiles) {
  with_bf16_tiles(tiles, [&](auto use_dot) {
    using Tiles = BF16Pairs<decltype(use_dot)::value>;
    const int64_t depth = Tiles::depth(K), panel_bytes = K / kXBlock * kDotSteps<kBits> * kDotRow;
    const int64_t groups = (K >> group_shift) * kPanel;
    thread_local jaxllm::LineVector<typename Tiles::X> packed;
    packed.resize((M + kTileRows - 1) / kTileRows * kTileRows * depth);
    typename Tiles::X* XT = packed.data();
    const auto pack = [&](int64_t t) { Tiles::pack(X, M, K, t, XT + t * kTileRows * depth); };
    pack_then_multiply<kTileRows, kDotBF16RowBlock>(pool, M, num_panels, pack, [&](int64_t p, int64_t t0, int64_t t1) {
      thread_local jaxllm::LineVector<float> wide_scales, wide_mins;
      thread_local jaxllm::LineVector<uint16_t> pairs;
      pairs.resize(Tiles::panel_size(K));
      const float* sc = scales.floats(p * groups, groups, wide_scales);
      const float* mn = kMins ? mins.floats(p * groups, groups, wide_mins) : nullptr;
      dot_pairs_panel<kBits, kZero, kMins>(P + p * panel_bytes, sc, mn, group_shift, K,
                                           p + 2 < num_panels ? P + (p + 2) * panel_bytes : nullptr, pairs.data());
      const Panel<Tiles> panel{pairs.data(), nullptr, nullptr, nullptr};
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
      for (int64_t t = t0; t < t1; ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - t * kTileRows));
        kTileFns<Tiles, kNoScales>[rows](XT + t * kTileRows * depth, panel, depth, Y + t * kTileRows * N + p * kPanel,
                                         N, cols);
      }
    });
  });
}

// DenseX8's rows: x quantized to Q, or rounded to bfloat16 (BF16Acts).
template <class Q, int kBits, bool kMins, int kOffset>
void rows_x(ffi::ThreadPool& pool, const float* X, int64_t M, int64_t K, const uint8_t* P, int64_t num_panels,
            int64_t N, float* Y, Scales scales, Scales mins, int group_shift, int32_t tiles) {
  if constexpr (std::is_same_v<Q, BF16Acts>) {  // Q4_0's nibble + 8 taken off; int8 values signed as stored
    dense_rows_dot_bf16<kBits, kBits == 4 ? kOffset : 0, kMins>(pool, X, M, K, P, num_panels, N, Y, scales, mins,
                                                              group_shift, tiles);
  } else {
    dense_rows_x8<Q, kBits, kMins, kOffset>(pool, X, M, K, P, num_panels, N, Y, scales, mins, group_shift);
  }
}

// Blocks in the dot layout times int8 (Q) or int16 activations: panels [P, K/8, 32, 4] uint8 (4-bit)
// or [P, K/4, 32, 4] int8, scales (and mins) [P, K/G, 32], G a power of two >= 32
// dividing K. With `group_sizes` (a mixture of experts, as GroupedDenseScaled): each
// expert's [E, ...] panels and scales times its rows, x's rows sorted by expert.
template <class Q, int kBits, bool kMins, int kOffset, ffi::DataType kPanelType>
ffi::Error DenseX8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kPanelType> panels,
                   ffi::AnyBuffer scales, const ffi::AnyBuffer* mins, const ffi::Buffer<ffi::S32>* group_sizes,
                   ffi::ResultBuffer<ffi::F32> y, int32_t tiles = kDotTiles) {
  const size_t lead = group_sizes ? 1 : 0;  // the experts axis
  const auto xd = x.dimensions(), pd = panels.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 4 + lead || sd.size() != 3 + lead || yd.size() != 2 || pd[lead + 2] != kPanel ||
      pd[lead + 3] != 4 || (lead && (group_sizes->dimensions().size() != 1 || group_sizes->dimensions()[0] != pd[0])))
    return ffi::Error::InvalidArgument("dense x8: x must be [M, K], panels [(E,) N/32, K/8 (4-bit) or K/4 (int8), 32, "
                                       "4], scales (and mins) [(E,) N/32, K/G, 32], (group_sizes [E],) y [M, N]");
  const int64_t M = xd[0], K = xd[1], num_panels = pd[lead], N = yd[1], groups = sd[lead + 1];
  if (K % kXBlock || pd[lead + 1] * (kBits == 4 ? 8 : 4) != K || yd[0] != M || N > num_panels * kPanel ||
      N <= (num_panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("dense x8: the shapes of x, panels and y do not agree (K a multiple of 32)");
  const int64_t group = groups > 0 && K % groups == 0 ? K / groups : 0;
  if ((lead && sd[0] != pd[0]) || sd[lead] != num_panels || sd[lead + 2] != kPanel || group < kXBlock ||
      (group & (group - 1)))
    return ffi::Error::InvalidArgument("dense x8: scales must be [(E,) N/32, K/G, 32], G a power of two >= 32");
  if (mins != nullptr && !std::equal(sd.begin(), sd.end(), mins->dimensions().begin(), mins->dimensions().end()))
    return ffi::Error::InvalidArgument("dense x8: mins must be shaped as the scales");
  if (!scale_types_ok(scales, mins)) return ffi::Error::InvalidArgument(std::string("dense x8") + kScaleTypes);
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(group));
  const auto* P = reinterpret_cast<const uint8_t*>(panels.untyped_data());
  const Scales sc = scales_of(&scales), mn = scales_of(mins);
  if (!lead) {
    if (M > 0 && N > 0)
      rows_x<Q, kBits, kMins, kOffset>(pool, x.typed_data(), M, K, P, num_panels, N, y->typed_data(), sc, mn, shift,
                                       tiles);
    return ffi::Error::Success();
  }
  const int64_t experts = pd[0], expert_bytes = num_panels * (K / kXBlock) * kDotSteps<kBits> * kDotRow;
  const int64_t scale_size = scales.element_count() / std::max<int64_t>(experts, 1);
  const int32_t* sizes = group_sizes->typed_data();
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] < 0 || row + sizes[e] > M)
      return ffi::Error::InvalidArgument("dense x8: group_sizes must be >= 0 and sum to at most M");
    if (sizes[e] > 0 && N > 0)
      rows_x<Q, kBits, kMins, kOffset>(pool, x.typed_data() + row * K, sizes[e], K, P + e * expert_bytes,
                                       num_panels, N, y->typed_data() + row * N, sc.at(e * scale_size),
                                       mn.at(e * scale_size), shift, tiles);
    row += sizes[e];
  }
  std::memset(y->typed_data() + row * N, 0, (M - row) * N * sizeof(float));
  return ffi::Error::Success();
}
// int8 activations (X8: Q8_0's values read unsigned, 128 taken off) and int16 (X16:
// signed as stored); Q4_0's nibble + 8 either way.
template <class Q>
constexpr int kQ8Offset = sizeof(Q) == 1 ? 128 : 0;
template <class Q>
ffi::Error DenseQ4_0Xq(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                       ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> y) {
  return DenseX8<Q, 4, false, 8>(pool, x, panels, scales, nullptr, nullptr, y);
}
template <class Q>
ffi::Error DenseQ4_1Xq(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                       ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::ResultBuffer<ffi::F32> y) {
  return DenseX8<Q, 4, true, 0>(pool, x, panels, scales, &mins, nullptr, y);
}
template <class Q>
ffi::Error DenseQ8_0Xq(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                       ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> y) {
  return DenseX8<Q, 8, false, kQ8Offset<Q>>(pool, x, panels, scales, nullptr, nullptr, y);
}
template <class Q>
ffi::Error GroupedDenseQ4_0Xq(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                              ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> group_sizes,
                              ffi::ResultBuffer<ffi::F32> y) {
  return DenseX8<Q, 4, false, 8>(pool, x, panels, scales, nullptr, &group_sizes, y);
}
template <class Q>
ffi::Error GroupedDenseQ4_1Xq(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                              ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y) {
  return DenseX8<Q, 4, true, 0>(pool, x, panels, scales, &mins, &group_sizes, y);
}
template <class Q>
ffi::Error GroupedDenseQ8_0Xq(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                              ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> group_sizes,
                              ffi::ResultBuffer<ffi::F32> y) {
  return DenseX8<Q, 8, false, kQ8Offset<Q>>(pool, x, panels, scales, nullptr, &group_sizes, y);
}
constexpr auto DenseQ4_0X8 = DenseQ4_0Xq<int8_t>, DenseQ4_0X16 = DenseQ4_0Xq<int16_t>;
constexpr auto DenseQ4_1X8 = DenseQ4_1Xq<int8_t>, DenseQ4_1X16 = DenseQ4_1Xq<int16_t>;
constexpr auto DenseQ8_0X8 = DenseQ8_0Xq<int8_t>, DenseQ8_0X16 = DenseQ8_0Xq<int16_t>;
constexpr auto GroupedDenseQ4_0X8 = GroupedDenseQ4_0Xq<int8_t>, GroupedDenseQ4_0X16 = GroupedDenseQ4_0Xq<int16_t>;
constexpr auto GroupedDenseQ4_1X8 = GroupedDenseQ4_1Xq<int8_t>, GroupedDenseQ4_1X16 = GroupedDenseQ4_1Xq<int16_t>;
constexpr auto GroupedDenseQ8_0X8 = GroupedDenseQ8_0Xq<int8_t>, GroupedDenseQ8_0X16 = GroupedDenseQ8_0Xq<int16_t>;
// bfloat16 activations over the dot layout (BF16Acts), summed by the tiles `tiles` names
ffi::Error DenseQ4_0XBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                          ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return DenseX8<BF16Acts, 4, false, 8>(pool, x, panels, scales, nullptr, nullptr, y, tiles);
}
ffi::Error DenseQ4_1XBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                          ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return DenseX8<BF16Acts, 4, true, 0>(pool, x, panels, scales, &mins, nullptr, y, tiles);
}
ffi::Error DenseQ8_0XBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                          ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return DenseX8<BF16Acts, 8, false, 0>(pool, x, panels, scales, nullptr, nullptr, y, tiles);
}
ffi::Error GroupedDenseQ8_0XBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                                 ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return DenseX8<BF16Acts, 8, false, 0>(pool, x, panels, scales, nullptr, &group_sizes, y, tiles);
}
ffi::Error GroupedDenseQ4_0XBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                                 ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return DenseX8<BF16Acts, 4, false, 8>(pool, x, panels, scales, nullptr, &group_sizes, y, tiles);
}
ffi::Error GroupedDenseQ4_1XBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                                 ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  return DenseX8<BF16Acts, 4, true, 0>(pool, x, panels, scales, &mins, &group_sizes, y, tiles);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedDenseF32, GroupedDenseF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], rows sorted by expert
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [E, N/32 rounded up, K, 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedDenseBF16, GroupedDenseBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K], rows sorted by expert
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // panels [E, N/32 rounded up, K/2 rounded up, 32, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<int32_t>("bf16_tiles"));  // 0 float tiles, 1 vdpbf16ps, 2 AMX (where built)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedDenseBF16Gated, GroupedDenseBF16Gated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // panels [E, 2F/32, K/2 rounded up, 32, 2]: gate | up
                                  .Arg<ffi::Buffer<ffi::S32>>()   // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, F] = act(gate) * up
                                  .Attr<int32_t>("bf16_tiles")
                                  .Attr<int32_t>("act"));         // 0 silu, 1 gelu (tanh form)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedDenseQ4_1Gated, GroupedDenseQ4_1Gated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // panels [E, 2F/32, K, 16]: gate | up
                                  .Arg<ffi::AnyBuffer>()         // scales [E, 2F/32, K/G, 32]
                                  .Arg<ffi::AnyBuffer>()         // mins, as the scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, F] = act(gate) * up
                                  .Attr<bool>("bf16")
                                  .Attr<int32_t>("bf16_tiles")
                                  .Attr<int32_t>("act"));        // 0 silu, 1 gelu (tanh form)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedDenseI8, GroupedDenseI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], rows sorted by expert
                                  .Arg<ffi::Buffer<ffi::S8>>()   // panels [E, N/32 rounded up, K, 32]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [E, N/32 rounded up * 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

#define JAXLLM_GROUPED_BLOCKS(NAME, FN, PANELS)                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, FN,                                                        \
                                ffi::Ffi::Bind()                                                 \
                                    .Ctx<ffi::ThreadPool>()                                      \
                                    .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K] */                \
                                    .Arg<ffi::Buffer<PANELS>>()    /* panels [E, N/32, K, .] */  \
                                    .Arg<ffi::AnyBuffer>()         /* scales [E, N/32, K/G, 32] */ \
                                    .Arg<ffi::Buffer<ffi::S32>>()  /* group_sizes [E] */         \
                                    .Ret<ffi::Buffer<ffi::F32>>()  /* y [M, N] */                \
                                    .Attr<bool>("bf16")                                          \
                                    .Attr<int32_t>("bf16_tiles"));
JAXLLM_GROUPED_BLOCKS(JaxllmGroupedDenseQ8_0, GroupedDenseQ8_0, ffi::S8)
JAXLLM_GROUPED_BLOCKS(JaxllmGroupedDenseQ4_0, GroupedDenseQ4_0, ffi::U8)
#undef JAXLLM_GROUPED_BLOCKS

#define JAXLLM_GROUPED_BLOCKS_MINS(NAME, FN, PANELS)                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, FN,                                                             \
                                ffi::Ffi::Bind()                                                      \
                                    .Ctx<ffi::ThreadPool>()                                           \
                                    .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K] */                     \
                                    .Arg<ffi::Buffer<PANELS>>()    /* panels [E, N/32, K, 16 or 32] */ \
                                    .Arg<ffi::AnyBuffer>()         /* scales [E, N/32, K/G, 32] */    \
                                    .Arg<ffi::AnyBuffer>()         /* mins, as the scales */          \
                                    .Arg<ffi::Buffer<ffi::S32>>()  /* group_sizes [E] */              \
                                    .Ret<ffi::Buffer<ffi::F32>>()  /* y [M, N] */                     \
                                    .Attr<bool>("bf16")                                          \
                                    .Attr<int32_t>("bf16_tiles"));
JAXLLM_GROUPED_BLOCKS_MINS(JaxllmGroupedDenseQ4_1, GroupedDenseQ4_1, ffi::U8)
JAXLLM_GROUPED_BLOCKS_MINS(JaxllmGroupedDenseQ8Mins, GroupedDenseQ8Mins, ffi::S8)
#undef JAXLLM_GROUPED_BLOCKS_MINS

#define JAXLLM_DENSE_Q4_1_X(NAME, FN)                                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, FN,                                                                \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K], int8/16 per 32 inputs */ \
                                    .Arg<ffi::Buffer<ffi::U8>>()   /* panels [N/32, K/8, 32, 4] */       \
                                    .Arg<ffi::AnyBuffer>()         /* scales [N/32, K/G, 32] */          \
                                    .Arg<ffi::AnyBuffer>()         /* mins, as the scales */             \
                                    .Ret<ffi::Buffer<ffi::F32>>()); /* y [M, N] */
JAXLLM_DENSE_Q4_1_X(JaxllmDenseQ4_1X8, DenseQ4_1X8)
JAXLLM_DENSE_Q4_1_X(JaxllmDenseQ4_1X16, DenseQ4_1X16)
#undef JAXLLM_DENSE_Q4_1_X

#define JAXLLM_GROUPED_X8(NAME, FN, PANELS)                                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, FN,                                                                \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K], rows sorted by expert */ \
                                    .Arg<ffi::Buffer<PANELS>>()    /* panels [E, N/32, K/8|K/4, 32, 4] */ \
                                    .Arg<ffi::AnyBuffer>()         /* scales [E, N/32, K/G, 32] */       \
                                    .Arg<ffi::Buffer<ffi::S32>>()  /* group_sizes [E] */                 \
                                    .Ret<ffi::Buffer<ffi::F32>>()); /* y [M, N] */
JAXLLM_GROUPED_X8(JaxllmGroupedDenseQ4_0X8, GroupedDenseQ4_0X8, ffi::U8)
JAXLLM_GROUPED_X8(JaxllmGroupedDenseQ8_0X8, GroupedDenseQ8_0X8, ffi::S8)
JAXLLM_GROUPED_X8(JaxllmGroupedDenseQ4_0X16, GroupedDenseQ4_0X16, ffi::U8)
JAXLLM_GROUPED_X8(JaxllmGroupedDenseQ8_0X16, GroupedDenseQ8_0X16, ffi::S8)
#undef JAXLLM_GROUPED_X8

#define JAXLLM_GROUPED_Q4_1_X(NAME, FN)                                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, FN,                                                                \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K], rows sorted by expert */ \
                                    .Arg<ffi::Buffer<ffi::U8>>()   /* panels [E, N/32, K/8, 32, 4] */    \
                                    .Arg<ffi::AnyBuffer>()         /* scales [E, N/32, K/G, 32] */       \
                                    .Arg<ffi::AnyBuffer>()         /* mins, as the scales */             \
                                    .Arg<ffi::Buffer<ffi::S32>>()  /* group_sizes [E] */                 \
                                    .Ret<ffi::Buffer<ffi::F32>>()); /* y [M, N] */
JAXLLM_GROUPED_Q4_1_X(JaxllmGroupedDenseQ4_1X8, GroupedDenseQ4_1X8)
JAXLLM_GROUPED_Q4_1_X(JaxllmGroupedDenseQ4_1X16, GroupedDenseQ4_1X16)
#undef JAXLLM_GROUPED_Q4_1_X

// Q8_0 (int8 panels [N/32, K/4, 32, 4]) and Q4_0 (nibble + 8, [N/32, K/8, 32, 4]) in the dot layout
#define JAXLLM_DENSE_X8(NAME, FN, PANELS)                                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, FN,                                                                \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K], int8 per 32 inputs */    \
                                    .Arg<ffi::Buffer<PANELS>>()    /* panels [N/32, K/4|K/8, 32, 4] */   \
                                    .Arg<ffi::AnyBuffer>()         /* scales [N/32, K/G, 32] */          \
                                    .Ret<ffi::Buffer<ffi::F32>>()); /* y [M, N] */
JAXLLM_DENSE_X8(JaxllmDenseQ8_0X8, DenseQ8_0X8, ffi::S8)
JAXLLM_DENSE_X8(JaxllmDenseQ4_0X8, DenseQ4_0X8, ffi::U8)
JAXLLM_DENSE_X8(JaxllmDenseQ8_0X16, DenseQ8_0X16, ffi::S8)
JAXLLM_DENSE_X8(JaxllmDenseQ4_0X16, DenseQ4_0X16, ffi::U8)
#undef JAXLLM_DENSE_X8

// bfloat16 activations over the dot layout: Q4_0, Q4_1 (int4) and Q8_0, dense and grouped
#define JAXLLM_DENSE_XBF16(NAME, FN, PANELS)                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, FN,                                                                \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K], rounded to bfloat16 */   \
                                    .Arg<ffi::Buffer<PANELS>>()    /* panels [N/32, K/4|K/8, 32, 4] */   \
                                    .Arg<ffi::AnyBuffer>()         /* scales [N/32, K/G, 32] */          \
                                    .Ret<ffi::Buffer<ffi::F32>>()  /* y [M, N] */                        \
                                    .Attr<int32_t>("bf16_tiles"));
JAXLLM_DENSE_XBF16(JaxllmDenseQ8_0XBF16, DenseQ8_0XBF16, ffi::S8)
JAXLLM_DENSE_XBF16(JaxllmDenseQ4_0XBF16, DenseQ4_0XBF16, ffi::U8)
#undef JAXLLM_DENSE_XBF16

#define JAXLLM_GROUPED_XBF16(NAME, FN, PANELS)                                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, FN,                                                                \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K], rows sorted by expert */ \
                                    .Arg<ffi::Buffer<PANELS>>()    /* panels [E, N/32, K/4|K/8, 32, 4] */ \
                                    .Arg<ffi::AnyBuffer>()         /* scales [E, N/32, K/G, 32] */       \
                                    .Arg<ffi::Buffer<ffi::S32>>()  /* group_sizes [E] */                 \
                                    .Ret<ffi::Buffer<ffi::F32>>()  /* y [M, N] */                        \
                                    .Attr<int32_t>("bf16_tiles"));
JAXLLM_GROUPED_XBF16(JaxllmGroupedDenseQ8_0XBF16, GroupedDenseQ8_0XBF16, ffi::S8)
JAXLLM_GROUPED_XBF16(JaxllmGroupedDenseQ4_0XBF16, GroupedDenseQ4_0XBF16, ffi::U8)
#undef JAXLLM_GROUPED_XBF16

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseQ4_1XBF16, DenseQ4_1XBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], rounded to bfloat16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // panels [N/32, K/8, 32, 4]
                                  .Arg<ffi::AnyBuffer>()         // scales [N/32, K/G, 32]
                                  .Arg<ffi::AnyBuffer>()         // mins, as the scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int32_t>("bf16_tiles"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedDenseQ4_1XBF16, GroupedDenseQ4_1XBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], rows sorted by expert
                                  .Arg<ffi::Buffer<ffi::U8>>()   // panels [E, N/32, K/8, 32, 4]
                                  .Arg<ffi::AnyBuffer>()         // scales [E, N/32, K/G, 32]
                                  .Arg<ffi::AnyBuffer>()         // mins, as the scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int32_t>("bf16_tiles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseQ4_1, DenseQ4_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // panels [N/32 rounded up, K, 16], two nibbles a byte
                                  .Arg<ffi::AnyBuffer>()         // scales [N/32 rounded up, K/G, 32]
                                  .Arg<ffi::AnyBuffer>()         // mins, as the scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("bf16")  // x and weights rounded to bfloat16
                                  .Attr<int32_t>("bf16_tiles"));  // 0 float tiles, 1 vdpbf16ps, 2 AMX (where built)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseQ8Mins, DenseQ8Mins,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // panels [N/32 rounded up, K, 32], int8
                                  .Arg<ffi::AnyBuffer>()         // scales [N/32 rounded up, K/G, 32]
                                  .Arg<ffi::AnyBuffer>()         // mins, as the scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("bf16")  // x and weights rounded to bfloat16
                                  .Attr<int32_t>("bf16_tiles"));  // 0 float tiles, 1 vdpbf16ps, 2 AMX (where built)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseQ4_0, DenseQ4_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // panels [N/32 rounded up, K, 16], two nibbles a byte
                                  .Arg<ffi::AnyBuffer>()         // scales [N/32 rounded up, K/G, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("bf16")  // x and weights rounded to bfloat16
                                  .Attr<int32_t>("bf16_tiles"));  // 0 float tiles, 1 vdpbf16ps, 2 AMX (where built)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseQ8_0, DenseQ8_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // panels [N/32 rounded up, K, 32], int8
                                  .Arg<ffi::AnyBuffer>()         // scales [N/32 rounded up, K/G, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("bf16")  // x and weights rounded to bfloat16
                                  .Attr<int32_t>("bf16_tiles"));  // 0 float tiles, 1 vdpbf16ps, 2 AMX (where built)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseI8, DenseI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // panels [N/32 rounded up, K, 32], int8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N/32 rounded up * 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseBF16, DenseBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // panels [N/32 rounded up, K/2 rounded up, 32, 2]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<int32_t>("bf16_tiles"));  // 0 float tiles, 1 vdpbf16ps, 2 AMX (where built)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDenseF32, DenseF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [N/32 rounded up, K, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

// The vector width (float32 lanes) the library was built for: jaxllm.models.linear
// prefers this kernel to XLA's dot only where its wide tile runs (16 lanes).
extern "C" int JaxllmVectorLanes() { return jaxllm::kLanes; }

// Whether the library multiplies bfloat16 by vdpbf16ps where a call's `bf16_tiles` asks
// (built with AVX512_BF16); else every bfloat16 call runs the float tiles.
extern "C" int JaxllmBF16Dot() { return kDotBF16 ? 1 : 0; }

// Whether a call's `bf16_tiles` AMX runs on AMX's tiles: built with AMX_BF16 and the OS
// hands this process the tile state (asked here, once).
extern "C" int JaxllmAmx() { return amx_ready() ? 1 : 0; }

// The integer dot products the *_x8 / *_x16 handlers are built with: 2 AVX512_VNNI, 1
// AVX2 (vpmaddubsw, vpmaddwd), 0 none (SSE2, NEON: a lane at a time, slower than the
// float tiles; EngineConfig.activation_quantization "auto" then multiplies in float).
extern "C" int JaxllmIntegerDot() {
#if defined(__AVX512VNNI__) && JAXLLM_LANES == 16
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}
