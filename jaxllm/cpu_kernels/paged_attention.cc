// Ragged paged attention for XLA:CPU, as an XLA FFI custom call.
//
// Same semantics as pallas_kernels.ragged_paged_attention (see docs/kernels.md): a flat
// ragged batch of query rows (prefill chunks and decodes mixed), each sequence reading
// its K/V through its block table, causal, optional sliding window and logit soft cap; or
// bidirectional (`causal` 0: every row sees its whole sequence, as an encoder's do).
//
// Why a custom call on CPU: XLA:CPU cannot fuse a gather into a dot, so the jnp path
// copies every K/V block it reads into a buffer before its dots and reads the cache
// about three times per step; decode attention is bound by memory traffic, and this
// reads each K/V row once, from where it lies in the cache.
//
// The work: one item per (sequence, tile of up to kRowTile query rows), all heads.
// Items run on XLA's intra-op thread pool (the caller takes items too), longest first.
// An item walks its keys in chunks of 64 tokens (any block size: each token's row is
// found through the block table), one online-softmax step per chunk and query (running
// max and sum, float32), per KV head. A chunk is kTiles tiles of kLanes keys, kLanes
// being the float32 lanes of one register of the ISA the library is built for (16 with
// AVX-512, 8 with AVX2, 4 with SSE or NEON: simd.h), so every loop below keeps its
// accumulators in registers on each:
// - decode path (fewer than kManyQueries queries per KV head): the scores of the head's
//   query group (up to 4 heads a pass) as dot products along head_dim (a bfloat16 row's
//   even and odd elements apart: load_even_odd), a tile's kLanes
//   partial-sum vectors folded into one vector; the same loop prefetches into L2 the rows
//   it will read one chunk later; the values accumulated for the group's queries together, in
//   slices of head_dim where a row's accumulators for all of them would not fit;
// - prefill path: K of the chunk transposed once (kLanes x kLanes in-register
//   transposes), then two small matrix products in register blocks sized by the
//   register file: scores for 6 queries x 2 key tiles (AVX2; x 4 with AVX-512) per
//   head_dim step, values for 6 queries x a slice of head_dim (2 vectors; 4) per key.
//   A block of queries skips the key tiles past its last row (the causal diagonal),
//   and the softmax's exp is vexp's polynomial without the clamps (exp_scores).
// - the prefill path on AMX (a bfloat16 cache, head_dim a multiple of 64, where the CPU
//   and OS give the tiles): scores (keys x queries) and values as tile products, the
//   queries and the probabilities multiplied as three bfloat16 parts each (one, rounded,
//   for a bfloat16 model's: `bf16_products`), the softmax across 16 queries a vector
//   (attend_chunk_amx).
// - the prefill path of a bfloat16 model (`bf16_products`; a bfloat16 cache, AVX512_BF16,
//   not on AMX's path): the queries and the probabilities rounded to bfloat16 and multiplied by
//   vdpbf16ps, two elements a lane, float32 sums (score_tiles_paired, value_slice_paired);
//   its decode path likewise where the AMX path does not run (attend_chunk_paired).
// What each path runs at, per machine (scripts/bench_attention.py against the XLA
// backend): docs/cpu_kernels.md and the lab log it points to.
//
// Portable C++17 with GCC/Clang vector extensions; built by jaxllm/cpu_kernels/build.py
// with -O3 -march=native (or $JAXLLM_CPU_MARCH) against the installed jaxlib's FFI headers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxllm::hmax;
using jaxllm::hsum;
using jaxllm::kLanes;
using jaxllm::parallel_for;
using jaxllm::vmax;
using V = jaxllm::f32xN;  // one register of float32
using M = jaxllm::i32xN;  // its lane mask

namespace jaxllm_attention {

inline V load(const float* p) { return jaxllm::loadN(p); }
inline void store(float* p, V v) { jaxllm::storeN(p, v); }
inline V splat(float x) { return jaxllm::splatN(x); }
inline V select(M mask, V a, V b) { return mask ? a : b; }

// The cache's element types (the kv_cache_dtype option): float32; bfloat16, float16 and
// float8 e4m3fn as their bits; int8 with a float32 scale per token and KV head, which the
// kernel applies to a key's scores and a value's probabilities rather than to each
// element. load_row widens kLanes elements to float32 exactly (integer ops only: XLA's
// threads flush denormal floats, so float16's and e4m3's subnormals are built as m * 2^-k).
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
struct F8E4M3 {
  uint8_t bits;
};
template <class R>
constexpr bool kScaled = std::is_same_v<R, int8_t>;
typedef uint32_t u32xN __attribute__((vector_size(kLanes * 4)));
typedef uint16_t u16xN __attribute__((vector_size(kLanes * 2)));
typedef uint8_t u8xN __attribute__((vector_size(kLanes)));
typedef int8_t i8xN __attribute__((vector_size(kLanes)));

template <class T, class F>
inline T bit_cast_vec(F x) {
  static_assert(sizeof(T) == sizeof(F));
  T t;
  std::memcpy(&t, &x, sizeof t);
  return t;
}
template <class E>
inline E load_elems(const void* p) {
  E e;
  std::memcpy(&e, p, sizeof e);
  return e;
}

// kLanes 8- or 16-bit integers widened to 32 bits (as `Out`). The x86 intrinsics (an
// AVX-512 and an AVX2 conversion, each with the load of its kLanes source bytes): GCC
// lowers a memcpy into a 16-byte int8 vector and its __builtin_convertvector through
// general registers, lane by lane (an int8 cache read slower than float32's four times
// the bytes). Elsewhere (SSE, NEON) the vector extension's conversion.
#if JAXLLM_LANES == 16
inline __m256i load_256(const __m128i* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#define JAXLLM_WIDEN(name, Out, Elems, cvt512, load512, cvt256, load256) \
  inline Out name(const void* p) { return reinterpret_cast<Out>(cvt512(load512(static_cast<const __m128i*>(p)))); }
#elif JAXLLM_LANES == 8 && defined(__AVX2__)
#define JAXLLM_WIDEN(name, Out, Elems, cvt512, load512, cvt256, load256) \
  inline Out name(const void* p) { return reinterpret_cast<Out>(cvt256(load256(static_cast<const __m128i*>(p)))); }
#else
#define JAXLLM_WIDEN(name, Out, Elems, cvt512, load512, cvt256, load256) \
  inline Out name(const void* p) { return __builtin_convertvector(load_elems<Elems>(p), Out); }
#endif
JAXLLM_WIDEN(widen_u16, u32xN, u16xN, _mm512_cvtepu16_epi32, load_256, _mm256_cvtepu16_epi32, _mm_loadu_si128)
JAXLLM_WIDEN(widen_u8, u32xN, u8xN, _mm512_cvtepu8_epi32, _mm_loadu_si128, _mm256_cvtepu8_epi32, _mm_loadl_epi64)
JAXLLM_WIDEN(widen_i8, M, i8xN, _mm512_cvtepi8_epi32, _mm_loadu_si128, _mm256_cvtepi8_epi32, _mm_loadl_epi64)
#undef JAXLLM_WIDEN

template <class R>
inline V load_row(const R* p);
template <>
inline V load_row<float>(const float* p) {
  return load(p);
}
template <>
inline V load_row<BF16>(const BF16* p) {
  return bit_cast_vec<V>(widen_u16(p) << 16);
}

// A bfloat16 cache's decode path reads 2 kLanes elements of a row at once as its even and
// its odd elements (a shift and a mask of one load: no widening shuffle), the queries and
// the outputs' accumulators taken in that order (even_odd_blocks; interleaved back after).
template <int D, class R>
constexpr bool kEvenOdd = std::is_same_v<R, BF16> && (D / kLanes) % 2 == 0;
inline void load_even_odd(const BF16* p, V& even, V& odd) {
  const u32xN x = load_elems<u32xN>(p);
  even = bit_cast_vec<V>(x << 16);
  odd = bit_cast_vec<V>(x & 0xFFFF0000u);
}
template <size_t... I>
inline void deinterleave(V a, V b, V& even, V& odd, std::index_sequence<I...>) {
  even = __builtin_shufflevector(a, b, (2 * I)...);
  odd = __builtin_shufflevector(a, b, (2 * I + 1)...);
}
template <size_t... I>
inline void interleave_pairs(V even, V odd, V& a, V& b, std::index_sequence<I...>) {
  a = __builtin_shufflevector(even, odd, ((I % 2) ? kLanes + I / 2 : I / 2)...);
  b = __builtin_shufflevector(even, odd, ((I % 2) ? kLanes + kLanes / 2 + I / 2 : kLanes / 2 + I / 2)...);
}
// x's blocks of 2 kLanes floats (n of them) as their even elements, then their odd ones.
inline void even_odd_blocks(float* x, int64_t n) {
  for (int64_t b = 0; b < n; ++b, x += 2 * kLanes) {
    V e, o;
    deinterleave(load(x), load(x + kLanes), e, o, std::make_index_sequence<kLanes>{});
    store(x, e);
    store(x + kLanes, o);
  }
}
template <>
inline V load_row<F16>(const F16* p) {
#if JAXLLM_LANES == 16
  return reinterpret_cast<V>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));  // F16C
#elif JAXLLM_LANES == 8 && defined(__F16C__)
  return reinterpret_cast<V>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const u32xN x = widen_u16(p);
  const u32xN em = x & 0x7fffu, e = em >> 10, sign = (x & 0x8000u) << 16;
  const u32xN normal = (em << 13) + (112u << 23), special = (em << 13) | 0x7f800000u;  // e == 31: inf, nan
  const u32xN sub = bit_cast_vec<u32xN>(__builtin_convertvector(x & 0x3ffu, V) * (1.f / 16777216.f));  // m * 2^-24
  return bit_cast_vec<V>((e == 0 ? sub : e == 31 ? special : normal) | sign);
#endif
}
template <>
inline V load_row<F8E4M3>(const F8E4M3* p) {
  const u32xN x = widen_u8(p);
  const u32xN em = x & 0x7fu, sign = (x & 0x80u) << 24;
  const u32xN normal = (em << 20) + (120u << 23);  // no inf; 0x7f (nan) is never written: saturated
  const u32xN sub = bit_cast_vec<u32xN>(__builtin_convertvector(x & 7u, V) * (1.f / 512.f));  // m * 2^-9
  return bit_cast_vec<V>(((em >> 3) == 0 ? sub : normal) | sign);
}
template <>
inline V load_row<int8_t>(const int8_t* p) {
  return __builtin_convertvector(widen_i8(p), V);
}

constexpr int kTile = kLanes;  // key tokens per tile: the lanes of one vector
constexpr int kChunk = 64;     // keys of one online-softmax step
constexpr int kTiles = kChunk / kTile;
constexpr int kRowTile = 32;   // query rows of one prefill item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Vector registers the ISA has (AVX2 and SSE 16, AVX-512 and NEON 32); loops keep at
// most about 3/4 of them as accumulators.
#if JAXLLM_LANES == 16 || defined(__aarch64__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif
constexpr int kAccumulators = kRegisters * 3 / 4;

// Two vectors' lanes interleaved in blocks of B: lo takes the even blocks of a and b,
// hi the odd ones (a's block, then b's, in turn). They are the stages of the tile
// reduction and of the in-register transpose.
#if JAXLLM_LANES == 16
#define JAXLLM_LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define JAXLLM_HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define JAXLLM_LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define JAXLLM_HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define JAXLLM_LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define JAXLLM_HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define JAXLLM_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define JAXLLM_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#elif JAXLLM_LANES == 8
#define JAXLLM_LO1 0, 8, 2, 10, 4, 12, 6, 14
#define JAXLLM_HI1 1, 9, 3, 11, 5, 13, 7, 15
#define JAXLLM_LO2 0, 1, 8, 9, 4, 5, 12, 13
#define JAXLLM_HI2 2, 3, 10, 11, 6, 7, 14, 15
#define JAXLLM_LO4 0, 1, 2, 3, 8, 9, 10, 11
#define JAXLLM_HI4 4, 5, 6, 7, 12, 13, 14, 15
#else
#define JAXLLM_LO1 0, 4, 2, 6
#define JAXLLM_HI1 1, 5, 3, 7
#define JAXLLM_LO2 0, 1, 4, 5
#define JAXLLM_HI2 2, 3, 6, 7
#endif
template <int B>
inline void interleave(V a, V b, V& lo, V& hi) {
  if constexpr (B == 1) {
    lo = __builtin_shufflevector(a, b, JAXLLM_LO1);
    hi = __builtin_shufflevector(a, b, JAXLLM_HI1);
  } else if constexpr (B == 2) {
    lo = __builtin_shufflevector(a, b, JAXLLM_LO2);
    hi = __builtin_shufflevector(a, b, JAXLLM_HI2);
#if JAXLLM_LANES >= 8
  } else if constexpr (B == 4) {
    lo = __builtin_shufflevector(a, b, JAXLLM_LO4);
    hi = __builtin_shufflevector(a, b, JAXLLM_HI4);
#endif
#if JAXLLM_LANES >= 16
  } else if constexpr (B == 8) {
    lo = __builtin_shufflevector(a, b, JAXLLM_LO8);
    hi = __builtin_shufflevector(a, b, JAXLLM_HI8);
#endif
  }
}

// kLanes vectors of partial dot products -> one vector of their sums: a tree of
// log2(kLanes) levels, each pairing vectors (an even slot's a with the odd slot's b:
// interleaved in blocks of kLanes / 2 at level 0, ..., 1 at the last, the halves
// added), halving the vectors and the lanes. Slot i must hold token bit_reverse(i)'s
// partials for lane j of the result to be token j.
constexpr int bit_reverse(int i) {
  int r = 0;
  for (int b = 1; b < kLanes; b <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}
constexpr int kFoldLevels = kLanes == 16 ? 4 : kLanes == 8 ? 3 : 2;
inline V fold_pair(int L, V a, V b) {  // the tree's level L on one pair
  V lo, hi;
  switch (kFoldLevels - 1 - L) {
#if JAXLLM_LANES >= 16
    case 3: interleave<8>(a, b, lo, hi); break;
#endif
#if JAXLLM_LANES >= 8
    case 2: interleave<4>(a, b, lo, hi); break;
#endif
    case 1: interleave<2>(a, b, lo, hi); break;
    default: interleave<1>(a, b, lo, hi); break;
  }
  return lo + hi;
}

struct Problem {
  const float* q;
  const void* k;  // [N, B, Hkv, D] of the kernel's element type
  const void* v;
  const float* k_scale;  // [N, B, Hkv]: int8 caches only
  const float* v_scale;
  float* out;
  const int32_t* kv_lens;
  const int32_t* tables;
  const int32_t* qsl;
  int64_t num_tokens, num_heads, head_dim, num_blocks, block_size, num_kv_heads, max_blocks;
  float sm_scale;
  int32_t window;  // 0: none
  float soft_cap;  // 0: none
  bool causal;  // false: every row sees every key of its sequence (an encoder: BERT), no window
  // Batch-invariant (the `invariant` attribute): a row's output is the same bits in any
  // batch. Every row takes the decode path, its keys in chunks at multiples of kChunk
  // from position 0, and no common prefix pass: the sums of a row then never depend on
  // the other rows of its item or step.
  bool invariant;
  // The prefill path multiplies on AMX's tiles (a bfloat16 cache, head_dim a multiple of
  // 64, a CPU and OS with AMX, not `invariant`): attend_chunk_amx.
  bool amx;
  // The prefill path's queries and probabilities multiplied as bfloat16 (the
  // `bf16_products` attribute: a bfloat16 model's; a bfloat16 cache): on AMX as one part
  // each (attend_chunk_amx<D, 1>), else with AVX512_BF16 and head_dim a multiple of 32
  // by vdpbf16ps (score_tiles_paired, value_slice_paired).
  bool bf16_products;
  // The common prefix pass (0 tokens: none): keys [0, prefix_tokens) of every sequence
  // are the same blocks, attended once for all query rows; its state per (row, head)
  // in prefix_m, prefix_l [T][H] and prefix_o [T][H][D] starts each item.
  int64_t prefix_tokens;
  const float* prefix_m;
  const float* prefix_l;
  const float* prefix_o;
};

struct Item {
  int32_t seq, row0, rows;
  int64_t cost;
};

inline M iota() {
  M v{};
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}
const M kIota = iota();  // 0, 1, ..., kLanes - 1

// Which of the kTile keys at positions t0.. (ntok of them real) a query at qpos sees.
inline M visible_keys(int64_t t0, int ntok, int64_t qpos, int32_t window) {
  const M pos = kIota + static_cast<int32_t>(t0);
  M vis = (kIota < ntok) & (pos <= static_cast<int32_t>(qpos));
  if (window > 0) vis &= pos > static_cast<int32_t>(qpos - window);
  return vis;
}

inline void visible_chunk(int64_t t0, int ntok, int ntiles, int64_t qpos, int32_t window, M* vis) {
  for (int j = 0; j < ntiles; ++j) vis[j] = visible_keys(t0 + j * kTile, ntok - j * kTile, qpos, window);
}

// exp(x) for the online softmax's x = score - running max (<= 0; -inf for a masked
// key): vexp's polynomial (simd.h) without its clamps, 0 below -87.3 (masked keys too),
// n = round(x / ln 2) by a shifter constant (1.5 * 2^23 leaves it in t's low mantissa
// bits, whence 2^n's exponent) instead of vexp's float-int-float floor. Under AVX2, 20
// instructions a vector against 27 for vexp and the mask select (its clamps are
// compare-and-blend pairs; what that bought: docs/cpu_kernels.md).
using U = uint32_t __attribute__((vector_size(sizeof(V))));
inline V exp_scores(V x) {
  constexpr float kShifter = 12582912.f;
  const V t = x * 1.44269504088896341f + kShifter;
  U bits;
  std::memcpy(&bits, &t, sizeof bits);
  bits = (bits << 23) + (127u << 23);
  V two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return select(x < -87.3f, splat(0.f), jaxllm::vexp_reduced(x, t - kShifter) * two_n);
}

// Folds one chunk's scores (ntiles vectors of kTile keys) of a query into its online
// softmax (running max m, sum l, unnormalized output o of D floats); the probabilities
// go to p (zeros where not visible). False, state untouched, if it sees no key here.
template <int D>
inline bool softmax_update(V* s, const M* vis, int ntiles, float soft_cap, float& m, float& l, float* o, float* p) {
  V mx = splat(kNegInf);
  for (int j = 0; j < ntiles; ++j) {
    if (soft_cap > 0.f)
      for (int i = 0; i < kTile; ++i) s[j][i] = soft_cap * std::tanh(s[j][i] / soft_cap);
    s[j] = select(vis[j], s[j], splat(kNegInf));
    mx = vmax(mx, s[j]);
  }
  const float mxs = hmax(mx);
  if (mxs == kNegInf) {
    for (int j = 0; j < ntiles; ++j) store(p + j * kTile, splat(0.f));
    return false;
  }
  const float m_new = std::max(m, mxs);
  const float scale = m == kNegInf ? 0.f : m == m_new ? 1.f : std::exp(m - m_new);
  V sum = splat(0.f);
  for (int j = 0; j < ntiles; ++j) {
    const V pv = exp_scores(s[j] - m_new);  // masked keys are -inf: 0
    sum += pv;
    store(p + j * kTile, pv);
  }
  l = l * scale + hsum(sum);
  m = m_new;
  if (scale != 1.f)
    for (int c = 0; c < D / kLanes; ++c) store(o + kLanes * c, load(o + kLanes * c) * scale);
  return true;
}

// o[G][D] += p[G][t] * v_t over the chunk's ntok value rows: GV queries x CV vectors of D
// at a time (as many accumulators as fit the registers: all of a row where they fit,
// else a slice of it for more queries, so a value vector loaded feeds several queries'
// FMAs: under AVX2 at D = 64, 3 queries x 4 vectors, where one query x 8 loaded each
// vector three times). Each output is the same sum in the same order either way.
template <int C, int G>
constexpr int value_slice() {  // the widest slice dividing C whose G x slice accumulators fit
  for (int cv = C; cv > 1; --cv)
    if (C % cv == 0 && G * cv <= kAccumulators) return cv;
  return 1;
}
template <int D, int G, class R>
inline void accumulate_values(const R* const* vrow, int ntok, const float (*p)[kChunk], float* o) {
  constexpr int C = D / kLanes;
  constexpr int GV = G <= kAccumulators ? G : kAccumulators;
  constexpr int CV = value_slice<C, GV>();
  for (int g0 = 0; g0 < G; g0 += GV) {
    for (int c0 = 0; c0 < C; c0 += CV) {
      constexpr bool eo = kEvenOdd<D, R> && CV % 2 == 0;  // each output's sum as before, in another lane
      constexpr auto lanes = std::make_index_sequence<kLanes>{};
      V acc[GV][CV];
      for (int g = 0; g < GV; ++g)
        for (int c = 0; c < CV; ++c) {
          const float* og = o + (g0 + g) * D + kLanes * (c0 + c);
          if (g0 + g >= G) acc[g][c] = splat(0.f);
          else if constexpr (eo) {
            if (c % 2 == 0) deinterleave(load(og), load(og + kLanes), acc[g][c], acc[g][c + 1], lanes);
          } else acc[g][c] = load(og);
        }
      for (int t = 0; t < ntok; ++t) {
        V vv[CV];
        if constexpr (eo)
          for (int c = 0; c < CV; c += 2) load_even_odd(vrow[t] + kLanes * (c0 + c), vv[c], vv[c + 1]);
        else
          for (int c = 0; c < CV; ++c) vv[c] = load_row(vrow[t] + kLanes * (c0 + c));
        for (int g = 0; g < GV; ++g) {
          const V w = splat(g0 + g < G ? p[g0 + g][t] : 0.f);
          for (int c = 0; c < CV; ++c) acc[g][c] += w * vv[c];
        }
      }
      for (int g = 0; g < GV && g0 + g < G; ++g)
        for (int c = 0; c < CV; ++c) {
          float* og = o + (g0 + g) * D + kLanes * (c0 + c);
          if constexpr (eo) {
            if (c % 2 == 0) {
              V a, b;
              interleave_pairs(acc[g][c], acc[g][c + 1], a, b, lanes);
              store(og, a);
              store(og + kLanes, b);
            }
          } else store(og, acc[g][c]);
        }
    }
  }
}

// One token's K and V rows (D elements each) prefetched into L2 (locality 2: prefetcht1),
// one prefetch per 64-byte line: the decode paths' read of the next chunk.
template <int D, class R>
inline void prefetch_rows_l2(const R* k, const R* v) {
  for (int b = 0; b < D * static_cast<int>(sizeof(R)); b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(k) + b, 0, 2);
    __builtin_prefetch(reinterpret_cast<const char*>(v) + b, 0, 2);
  }
}

// Slot i's partial sums (acc) joined to a tile's fold (the tree above: slot i, token
// bit_reverse(i), joins level L when bit L of i is set; level: one vector per level),
// the tile's sums going to `sums` with its last slot.
inline void fold_slot(int i, V acc, V* level, V& sums) {
  int L = 0;
  for (; (i >> L) & 1; ++L) acc = fold_pair(L, level[L], acc);
  if (L < kFoldLevels) level[L] = acc;
  else sums = acc;
}

// The decode paths' scores of GT queries against a chunk's first ntiles tiles of keys:
// partial(row, sums) gives a key row's GT partial-sum vectors (the path's dot products),
// each tile's kLanes of them folded into one as they come (fold_slot: slot i, token
// bit_reverse(i), so at most one vector per level and query is live; the same sums in
// the same order), into s[g][tile]. The same loop prefetches what it reads one chunk
// later, one prefetch per 64-byte line, into L2 (locality 2: prefetcht1), not L1: a
// head's next chunk (16 KB of K and V at D = 64 in bfloat16) beside the chunk being read
// would overflow a 32 KB L1 (why, and what L2 bought: docs/cpu_kernels.md).
template <int D, int GT, class R, class Partial>
inline void fold_scores(const R* const* krow, const R* const* knext, const R* const* vnext, int ntiles,
                        V (*s)[kTiles], Partial&& partial) {
  for (int j = 0; j < ntiles; ++j) {
    V level[GT][kFoldLevels];
#pragma GCC unroll 16
    for (int i = 0; i < kTile; ++i) {
      const int t = bit_reverse(i);
      V sums[GT];
      partial(krow[j * kTile + t], sums);
      if (knext != nullptr) prefetch_rows_l2<D>(knext[j * kTile + t], vnext[j * kTile + t]);
      for (int g = 0; g < GT; ++g) fold_slot(i, sums[g], level[g], s[g][j]);
    }
  }
}

// Decode path: one KV head's GT query vectors (of one row) against a chunk of keys.
// Scores as dot products along D, each tile's kLanes partial-sum vectors folded into one.
// Scaled (int8) caches: ks, vs hold the chunk's key and value rows' scales.
template <int D, int GT, class R>
inline void attend_chunk(const Problem& pb, const float* q, const R* const* krow, const R* const* vrow,
                         const R* const* knext, const R* const* vnext, const float* ks, const float* vs, int ntok,
                         int ntiles, const M* vis, float* o, float* m, float* l) {
  constexpr int C = D / kLanes;
  V s[GT][kTiles];
  fold_scores<D, GT>(krow, knext, vnext, ntiles, s, [&](const R* row, V* sums) {
    V kv[C];
    if constexpr (kEvenOdd<D, R>)  // q's blocks in the same order (even_odd_blocks)
      for (int c = 0; c < C; c += 2) load_even_odd(row + kLanes * c, kv[c], kv[c + 1]);
    else
      for (int c = 0; c < C; ++c) kv[c] = load_row(row + kLanes * c);
    for (int g = 0; g < GT; ++g) {
      V acc = load(q + g * D) * kv[0];
      for (int c = 1; c < C; ++c) acc += load(q + g * D + kLanes * c) * kv[c];
      sums[g] = acc;
    }
  });
  if constexpr (kScaled<R>)
    for (int g = 0; g < GT; ++g)
      for (int j = 0; j < ntiles; ++j) s[g][j] *= load(ks + j * kTile);
  alignas(64) float p[GT][kChunk];
  bool any = false;
  for (int g = 0; g < GT; ++g) any |= softmax_update<D>(s[g], vis, ntiles, pb.soft_cap, m[g], l[g], o + g * D, p[g]);
  if constexpr (kScaled<R>)
    for (int g = 0; g < GT; ++g)
      for (int j = 0; j < ntiles; ++j) store(p[g] + j * kTile, load(p[g] + j * kTile) * load(vs + j * kTile));
  if (any) accumulate_values<D, GT>(vrow, ntok, p, o);
}

// Query heads per decode call: a key row's vectors and their accumulators fit the
// registers (their query vectors are read as memory operands).
constexpr int kGroupTile = kLanes >= 8 ? 4 : 1;

// A KV head's whole query group of one row, in calls of at most kGroupTile query heads:
// call(std::integral_constant<int, GT>, g, knext, vnext) for the GT heads from g, the
// first call's prefetching the next chunk (knext, vnext; null for the others).
template <class R, class Call>
inline void in_group_calls(int group, const R* const* knext, const R* const* vnext, Call&& call) {
  int g = 0;
  for (; g + kGroupTile <= group; g += kGroupTile, knext = vnext = nullptr)
    call(std::integral_constant<int, kGroupTile>{}, g, knext, vnext);
  switch (group - g) {
    case 3: call(std::integral_constant<int, 3>{}, g, knext, vnext); break;
    case 2: call(std::integral_constant<int, 2>{}, g, knext, vnext); break;
    case 1: call(std::integral_constant<int, 1>{}, g, knext, vnext); break;
    default: break;
  }
}

template <int D, class R>
inline void attend_group(const Problem& pb, int group, const float* q, const R* const* krow, const R* const* vrow,
                         const R* const* knext, const R* const* vnext, const float* ks, const float* vs, int ntok,
                         int ntiles, const M* vis, float* o, float* m, float* l) {
  in_group_calls(group, knext, vnext, [&](auto gt, int g, const R* const* kn, const R* const* vn) {
    attend_chunk<D, decltype(gt)::value>(pb, q + g * D, krow, vrow, kn, vn, ks, vs, ntok, ntiles, vis, o + g * D,
                                         m + g, l + g);
  });
}

// kLanes rows of kLanes floats (row t at rows[t]) transposed into out[d * stride + t]:
// one stage per bit of the row index, each swapping it with one bit of the lane index.
template <int B>
inline void transpose_stage(V* v) {
  V w[kLanes];
  for (int t = 0; t < kLanes; ++t)
    if (!(t & B)) interleave<B>(v[t], v[t | B], w[t], w[t | B]);
  for (int t = 0; t < kLanes; ++t) v[t] = w[t];
}
// kLanes vectors transposed in place (v[t][d] to v[d][t]): every stage.
inline void transpose_lanes(V* v) {
  transpose_stage<1>(v);
  transpose_stage<2>(v);
  if constexpr (kLanes >= 8) transpose_stage<4>(v);
  if constexpr (kLanes >= 16) transpose_stage<8>(v);
}
// Scaled rows (int8) are multiplied by their scales (scale[t]) first.
template <class R>
inline void transpose_tile(const R* const* rows, const float* scale, float* out, int64_t stride) {
  V v[kLanes];
  for (int t = 0; t < kLanes; ++t) {
    v[t] = load_row(rows[t]);
    if constexpr (kScaled<R>) v[t] *= splat(scale[t]);
  }
  transpose_lanes(v);
  for (int d = 0; d < kLanes; ++d) store(out + d * stride, v[d]);
}

// The prefill path's register blocks: per step, a few vector loads and broadcasts feed
// kAccumulators FMAs (12 with AVX2 or SSE, 24 with AVX-512 or NEON), leaving a register
// for the broadcast and one per loaded vector. Scores: kScoreBlock queries x kScoreTiles
// key tiles (AVX2 6 x 2: two key vectors and six broadcasts for 12 FMAs; AVX-512 6 x 4,
// the whole chunk). Values: kValueBlock queries x a slice of kValueCols vectors of D
// (AVX2 6 x 2, AVX-512 6 x 4 at D = 64), the slices in turn. Under AVX2 a 3 x 4 value
// block (12 + 4 + 1 registers) spilled its row vectors and ran ~15% slower.
constexpr int kScoreTiles = std::min(kTiles, kRegisters / 8);
constexpr int kScoreBlock = kAccumulators / kScoreTiles;
template <int D>
constexpr int kValueCols = std::min(D / kLanes, kRegisters / 8);
template <int D>
constexpr int kValueBlock = kAccumulators / kValueCols<D>;

// The chunk's ntiles tiles of keys (rows krow[t], D floats) transposed into kt [D][kChunk].
template <int D, class R>
inline void transpose_chunk(const R* const* krow, const float* ks, int ntiles, float* kt) {
  for (int j = 0; j < ntiles; ++j)
    for (int c = 0; c < D / kLanes; ++c) {
      const R* rows[kTile];
      for (int t = 0; t < kTile; ++t) rows[t] = krow[j * kTile + t] + kLanes * c;
      transpose_tile(rows, kScaled<R> ? ks + j * kTile : nullptr, kt + kLanes * c * kChunk + j * kTile, kChunk);
    }
}

// Scores of kScoreBlock queries (qb, D apart) against NT key tiles from tile j0 of kt,
// into s[i][j0 ..]: per head_dim step NT key vectors and kScoreBlock broadcasts.
template <int D, int NT>
inline void score_tiles(const float* kt, const float* qb, int j0, V (*s)[kTiles]) {
  V acc[kScoreBlock][NT];
  for (int i = 0; i < kScoreBlock; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = splat(0.f);
  const float* kd = kt + j0 * kTile;
  for (int d = 0; d < D; ++d, kd += kChunk) {
    V kv[NT];
    for (int j = 0; j < NT; ++j) kv[j] = load(kd + j * kTile);
    for (int i = 0; i < kScoreBlock; ++i) {
      const V qv = splat(qb[i * D + d]);
      for (int j = 0; j < NT; ++j) acc[i][j] += qv * kv[j];
    }
  }
  for (int i = 0; i < kScoreBlock; ++i)
    for (int j = 0; j < NT; ++j) s[i][j0 + j] = acc[i][j];
}

// The scores in bfloat16 products (Problem::bf16_products): the queries rounded to
// bfloat16, as a bfloat16 model's attention rounds them (vLLM's, or any on bfloat16
// tensors), times the cache's bfloat16 keys as they lie, by vdpbf16ps: two elements of
// head_dim a lane, each product exact, float32 sums (a pair's two products added in
// turn). Twice the float32 FMAs' products an instruction; the softmax stays float32, and
// the values are multiplied likewise (below). The keys transposed as pairs: kt2
// [D/2][kChunk] words, word (d, t) holding elements 2d and 2d + 1 of key t; the queries'
// pairs q2 [nq][D/2] likewise.
#if defined(__AVX512BF16__)
template <int D>
constexpr bool kPaired = kLanes == 16 && D % (2 * kLanes) == 0;

template <int D>
inline void transpose_pairs(const BF16* const* krow, int ntiles, uint32_t* kt2) {
  for (int j = 0; j < ntiles; ++j)
    for (int c = 0; c < D / (2 * kLanes); ++c) {
      V v[kLanes];  // the bits of kLanes words of each of kLanes keys
      for (int t = 0; t < kLanes; ++t) std::memcpy(&v[t], krow[j * kTile + t] + 2 * kLanes * c, sizeof(V));
      transpose_lanes(v);  // shuffles only: the bits move as they are
      for (int d = 0; d < kLanes; ++d) std::memcpy(kt2 + (kLanes * c + d) * kChunk + j * kTile, &v[d], sizeof(V));
    }
}

// score_tiles on the pairs: per step of two elements of D, NT key vectors and
// kScoreBlock broadcast query pairs (qb2, D/2 words apart).
template <int D, int NT>
inline void score_tiles_paired(const uint32_t* kt2, const uint32_t* qb2, int j0, V (*s)[kTiles]) {
  __m512 acc[kScoreBlock][NT];
  for (int i = 0; i < kScoreBlock; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint32_t* kd = kt2 + j0 * kTile;
  for (int d = 0; d < D / 2; ++d, kd += kChunk) {
    __m512bh kv[NT];
    for (int j = 0; j < NT; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kd + j * kTile);
    for (int i = 0; i < kScoreBlock; ++i) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qb2[i * (D / 2) + d]));
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv, kv[j]);
    }
  }
  for (int i = 0; i < kScoreBlock; ++i)
    for (int j = 0; j < NT; ++j) s[i][j0 + j] = (V)acc[i][j];
}

// The values likewise (Problem::bf16_products): the probabilities rounded to bfloat16,
// as FlashAttention's on bfloat16 tensors are (the softmax's sum keeps them unrounded),
// as pairs p2 [nq][kChunk/2] words (the probabilities of keys 2k and 2k + 1), times the
// values in pairs of keys as the AMX path's value product takes them (value_tiles).
//
// The chunk's values as the value product's B tiles: vb[s][c] (step s of 32 keys, block
// c of 16 of D) holds in row tt, for each of the block's 16 elements, keys 32 s + 2 tt
// and + 1 side by side. Keys past ntok: zeros.
template <int D>
inline void value_tiles(const BF16* const* vrow, int ntok, uint16_t* vb) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m256i zero = _mm256_setzero_si256();
  for (int t = 0; t < kChunk; t += 2) {
    const int s = t / 32, tt = (t % 32) / 2;
    for (int c = 0; c < D / 16; ++c) {
      const __m256i a = t < ntok ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[t] + 16 * c)) : zero;
      const __m256i b = t + 1 < ntok ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[t + 1] + 16 * c)) : zero;
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(vb + ((s * (D / 16) + c) * 16 + tt) * 32, _mm512_permutexvar_epi16(pairs, ab));
    }
  }
}
// A query's kChunk probabilities (p) as kChunk/2 pairs (p2), rounded to nearest even.
inline void probability_pairs(const float* p, uint32_t* p2) {
  for (int k = 0; k < kChunk / 32; ++k)
    _mm512_storeu_si512(p2 + 16 * k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 32 * k + 16),
                                                                   _mm512_loadu_ps(p + 32 * k)));
}
// value_slice on the pairs: per pair of keys k, the slice's vectors of the value tiles
// (vb: value_tiles's, 16 words of keys 2k and 2k + 1 per block c of 16 of D) and
// kValueBlock broadcast probability pairs (pm2, kChunk/2 words apart).
template <int D>
inline void value_slice_paired(const uint16_t* vb, int npairs, const uint32_t* pm2, int c0, int mb, float* ob) {
  constexpr int QB = kValueBlock<D>, CB = kValueCols<D>;
  __m512 acc[QB][CB];
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < CB; ++c)
      acc[i][c] = i < mb ? _mm512_loadu_ps(ob + i * D + kLanes * (c0 + c)) : _mm512_setzero_ps();
  for (int k = 0; k < npairs; ++k) {
    __m512bh vv[CB];
    for (int c = 0; c < CB; ++c)
      vv[c] = (__m512bh)_mm512_loadu_si512(vb + (((k / 16) * (D / 16) + c0 + c) * 16 + k % 16) * 32);
    for (int i = 0; i < QB; ++i) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pm2[i * (kChunk / 2) + k]));
      for (int c = 0; c < CB; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w, vv[c]);
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(ob + i * D + kLanes * (c0 + c), acc[i][c]);
}
#else
template <int D>
constexpr bool kPaired = false;
#endif

// The paired path's buffers (q2 null: the float path).
struct PairedBuffers {
  const uint32_t* q2;  // the queries' pairs (query_pairs), [nq + padding][D/2]
  uint32_t* p2;        // the probabilities' pairs, [nq + padding][kChunk/2] (zeros past nq)
  uint16_t* vb;        // the chunk's values in pairs of keys (value_tiles), kChunk * D
};

// Whether an item's prefill path takes the paired products (built for R and D, and asked).
template <int D, class R>
inline bool paired_path(const Problem& pb) {
  return kPaired<D> && std::is_same_v<R, BF16> && pb.bf16_products && !pb.amx;
}

// The queries' pairs (q2: n query vectors of D, rounded to bfloat16) of q.
template <int D>
inline void query_pairs(const float* q, int64_t n, uint32_t* q2) {
  for (int64_t i = 0; i < n * D / 2; ++i)
    q2[i] = static_cast<uint32_t>(jaxllm::bf16_bits(q[2 * i])) |
            static_cast<uint32_t>(jaxllm::bf16_bits(q[2 * i + 1])) << 16;
}

#if defined(__AVX512BF16__)
// The decode path of a bfloat16 model (Problem::bf16_products) on a bfloat16 cache: as
// attend_chunk, the products rounded as the paired prefill path's are. Scores: the
// query's pairs (q2, its D/2 words; the g-th query D/2 words on) times each key row as
// it lies, two elements a lane by vdpbf16ps, the tile's partial-sum vectors folded as
// attend_chunk's. Values: the probabilities as pairs of keys (keys 2k, 2k + 1 in word
// k), times the value rows of keys 2k and 2k + 1 interleaved element by element
// (vpunpcklwd / vpunpckhwd of 32 elements of each: elements 0-3, 8-11, 16-19, 24-27 of the
// 32 in `lo`, the others in `hi`), the outputs' accumulators loaded and stored in that
// order (outputs_in_pair_order, outputs_from_pair_order).
inline void outputs_in_pair_order(const float* o, __m512& lo, __m512& hi) {
  const __m512 a = _mm512_loadu_ps(o), b = _mm512_loadu_ps(o + 16);
  lo = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  hi = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
}
inline void outputs_from_pair_order(__m512 lo, __m512 hi, float* o) {
  const __m512 a = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 b = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
  _mm512_storeu_ps(o, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(3, 1, 2, 0)));
  _mm512_storeu_ps(o + 16, _mm512_shuffle_f32x4(b, b, _MM_SHUFFLE(3, 1, 2, 0)));
}

// The scores of GT queries (pairs q2) against the chunk's keys, into s (as attend_chunk's).
template <int D, int GT>
inline void paired_decode_scores(const uint32_t* q2, const BF16* const* krow, const BF16* const* knext,
                                 const BF16* const* vnext, int ntiles, V (*s)[kTiles]) {
  constexpr int C = D / 32;  // vectors of 32 elements a row
  fold_scores<D, GT>(krow, knext, vnext, ntiles, s, [&](const BF16* row, V* sums) {
    __m512bh kv[C];
    for (int c = 0; c < C; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(row + 32 * c);
    for (int g = 0; g < GT; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c)
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q2 + g * (D / 2) + 16 * c), kv[c]);
      sums[g] = reinterpret_cast<V>(sum);
    }
  });
}

// o[g] += the probabilities' pairs (p2[g], kChunk/2 words) times the values of keys
// [0, 2 npairs), in slices of 64 elements of D (GT x 4 accumulators).
template <int D, int GT>
inline void paired_decode_values(const uint32_t (*p2)[kChunk / 2], const BF16* const* vrow, int npairs, float* o) {
  constexpr int CS = std::min(D / 32, 2);  // 32-element blocks of D a slice
  for (int c0 = 0; c0 < D / 32; c0 += CS) {
    __m512 acc[GT][CS][2];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < CS; ++c) outputs_in_pair_order(o + g * D + 32 * (c0 + c), acc[g][c][0], acc[g][c][1]);
    for (int k = 0; k < npairs; ++k) {
      __m512bh lo[CS], hi[CS];
      for (int c = 0; c < CS; ++c) {
        const __m512i a = _mm512_loadu_si512(vrow[2 * k] + 32 * (c0 + c));
        const __m512i b = _mm512_loadu_si512(vrow[2 * k + 1] + 32 * (c0 + c));
        lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < GT; ++g) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(p2[g][k]));
        for (int c = 0; c < CS; ++c) {
          acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], w, lo[c]);
          acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], w, hi[c]);
        }
      }
    }
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < CS; ++c) outputs_from_pair_order(acc[g][c][0], acc[g][c][1], o + g * D + 32 * (c0 + c));
  }
}

template <int D, int GT>
inline void attend_chunk_paired(const Problem& pb, const uint32_t* q2, const BF16* const* krow,
                                const BF16* const* vrow, const BF16* const* knext, const BF16* const* vnext,
                                int ntok, int ntiles, const M* vis, float* o, float* m, float* l) {
  V s[GT][kTiles];
  paired_decode_scores<D, GT>(q2, krow, knext, vnext, ntiles, s);
  alignas(64) float p[GT][kChunk];
  bool any = false;
  for (int g = 0; g < GT; ++g) any |= softmax_update<D>(s[g], vis, ntiles, pb.soft_cap, m[g], l[g], o + g * D, p[g]);
  if (!any) return;
  alignas(64) uint32_t p2[GT][kChunk / 2];  // keys past the last tile: probability 0
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < ntiles; j += 2) {
      const __m512 lo = _mm512_load_ps(p[g] + j * kTile);
      const __m512 hi = j + 1 < ntiles ? _mm512_load_ps(p[g] + (j + 1) * kTile) : _mm512_setzero_ps();
      _mm512_store_si512(p2[g] + j * kTile / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  paired_decode_values<D, GT>(p2, vrow, (ntok + 1) / 2, o);  // an odd ntok's last pair: a zero row at 0
}
#endif

// attend_group on the paired path (attend_chunk_paired): q2 the group's query pairs.
template <int D, class R>
inline void attend_group_paired(const Problem& pb, int group, const uint32_t* q2, const R* const* krow,
                                const R* const* vrow, const R* const* knext, const R* const* vnext, int ntok,
                                int ntiles, const M* vis, float* o, float* m, float* l) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<R, BF16> && kPaired<D>)
    in_group_calls(group, knext, vnext, [&](auto gt, int g, const R* const* kn, const R* const* vn) {
      attend_chunk_paired<D, decltype(gt)::value>(pb, q2 + g * (D / 2), krow, vrow, kn, vn, ntok, ntiles, vis,
                                                  o + g * D, m + g, l + g);
    });
#endif
}

// Whether an item's decode path takes the paired products (built for R and D, and asked),
// not where the AMX prefill path runs (Problem::amx): those Xeons issue vdpbf16ps far
// slower than FMAs and this path lost to the float one there (docs/cpu_kernels.md and its
// log). At a head_dim the AMX path does not take (not a multiple of 64) it runs there too.
template <int D, class R>
inline bool paired_decode(const Problem& pb) {
  return kPaired<D> && std::is_same_v<R, BF16> && pb.bf16_products && !pb.amx;
}

// o[i][c0 ..] += sum_t p[i][t] * v_t[c0 ..] for kValueBlock queries (ob, D apart; pm,
// kChunk apart) over a slice of kValueCols vectors of D from c0: per key token, the
// slice's vectors of its value row and kValueBlock broadcasts. Rows from mb on are
// padding: computed, not stored.
template <int D, class R>
inline void value_slice(const R* const* vrow, int ntok, const float* pm, int c0, int mb, float* ob) {
  constexpr int QB = kValueBlock<D>, CB = kValueCols<D>;
  V acc[QB][CB];
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < CB; ++c) acc[i][c] = i < mb ? load(ob + i * D + kLanes * (c0 + c)) : splat(0.f);
  for (int t = 0; t < ntok; ++t) {
    V vv[CB];
    for (int c = 0; c < CB; ++c) vv[c] = load_row(vrow[t] + kLanes * (c0 + c));
    for (int i = 0; i < QB; ++i) {
      const V w = splat(pm[i * kChunk + t]);
      for (int c = 0; c < CB; ++c) acc[i][c] += w * vv[c];
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int c = 0; c < CB; ++c) store(ob + i * D + kLanes * (c0 + c), acc[i][c]);
}

// How many of the chunk's ntok keys (from position t0) queries [m0, m0 + n) can see at
// most: causally, those up to their rows' last position (row_pos per row, group queries
// a row).
inline int keys_seen(const int32_t* row_pos, int group, int m0, int n, int64_t t0, int ntok) {
  int32_t last = row_pos[m0 / group];
  for (int r = m0 / group + 1; r <= (m0 + n - 1) / group; ++r) last = std::max(last, row_pos[r]);
  return static_cast<int>(std::clamp<int64_t>(last - t0 + 1, 0, ntok));
}

// Prefill path: all nq queries of one KV head (rows x group, row-major; row r at position
// row_pos[r]) against a chunk of keys, as two small matrix products: K transposed once
// into kt [D][kChunk], then scores and values in the register blocks above (the scratch
// is padded past nq with zero queries and probabilities: a partial block reads them).
template <int D, class R>
void attend_chunk_many(const Problem& pb, int nq, int group, int m_first, const int32_t* row_pos, int64_t t0, int ntok,
                       int ntiles, const R* const* krow, const R* const* vrow, const float* ks, const float* vs,
                       float* kt, float* p, const float* q, const PairedBuffers& pair, float* o, float* m, float* l) {
  [[maybe_unused]] const uint32_t* const q2 = pair.q2;
  [[maybe_unused]] uint32_t* const kt2 = reinterpret_cast<uint32_t*>(kt);  // the paired scores' keys
  bool paired = false;
#if defined(__AVX512BF16__)
  if constexpr (kPaired<D> && std::is_same_v<R, BF16>) {
    paired = q2 != nullptr;
    if (paired) transpose_pairs<D>(krow, ntiles, kt2);
  }
#endif
  if (!paired) transpose_chunk<D>(krow, ks, ntiles, kt);
  for (int m0 = m_first; m0 < nq; m0 += kScoreBlock) {
    const int mb = std::min(kScoreBlock, nq - m0);
    const int nt = (keys_seen(row_pos, group, m0, mb, t0, ntok) + kTile - 1) / kTile;  // tiles after: masked
    alignas(64) V s[kScoreBlock][kTiles];
    int j = 0;
#if defined(__AVX512BF16__)
    if (paired) {
      const uint32_t* qb2 = q2 + static_cast<int64_t>(m0) * (D / 2);
      for (; j + kScoreTiles <= nt; j += kScoreTiles) score_tiles_paired<D, kScoreTiles>(kt2, qb2, j, s);
      for (; j < nt; ++j) score_tiles_paired<D, 1>(kt2, qb2, j, s);
    }
#endif
    const float* qb = q + static_cast<int64_t>(m0) * D;
    for (; j + kScoreTiles <= nt; j += kScoreTiles) score_tiles<D, kScoreTiles>(kt, qb, j, s);
    for (; j < nt; ++j) score_tiles<D, 1>(kt, qb, j, s);
    for (int i = 0; i < mb; ++i) {
      const int mq = m0 + i;
      float* pq = p + static_cast<int64_t>(mq) * kChunk;
      M vis[kTiles];
      visible_chunk(t0, ntok, nt, row_pos[mq / group], pb.window, vis);
      softmax_update<D>(s[i], vis, nt, pb.soft_cap, m[mq], l[mq], o + static_cast<int64_t>(mq) * D, pq);
      if constexpr (kScaled<R>)
        for (int j = 0; j < nt; ++j) store(pq + j * kTile, load(pq + j * kTile) * load(vs + j * kTile));
      for (int j = nt; j < ntiles; ++j) store(pq + j * kTile, splat(0.f));
    }
  }
#if defined(__AVX512BF16__)
  if constexpr (kPaired<D> && std::is_same_v<R, BF16>) {
    if (paired) {
      value_tiles<D>(vrow, ntok, pair.vb);
      for (int mq = m_first; mq < nq; ++mq)
        probability_pairs(p + static_cast<int64_t>(mq) * kChunk, pair.p2 + static_cast<int64_t>(mq) * (kChunk / 2));
      for (int m0 = m_first; m0 < nq; m0 += kValueBlock<D>) {
        const int mb = std::min(kValueBlock<D>, nq - m0);
        const int npairs = (keys_seen(row_pos, group, m0, mb, t0, ntok) + 1) / 2;
        for (int c0 = 0; c0 < D / kLanes; c0 += kValueCols<D>)
          value_slice_paired<D>(pair.vb, npairs, pair.p2 + static_cast<int64_t>(m0) * (kChunk / 2), c0, mb,
                                o + static_cast<int64_t>(m0) * D);
      }
      return;
    }
  }
#endif
  for (int m0 = m_first; m0 < nq; m0 += kValueBlock<D>) {
    const int mb = std::min(kValueBlock<D>, nq - m0);
    const int nk = keys_seen(row_pos, group, m0, mb, t0, ntok);
    for (int c0 = 0; c0 < D / kLanes; c0 += kValueCols<D>)
      value_slice<D>(vrow, nk, p + static_cast<int64_t>(m0) * kChunk, c0, mb, o + static_cast<int64_t>(m0) * D);
  }
}

// Per item, per KV head h, its nq = rows * group query vectors (row-major: r * group +
// g): q and o [Hkv][nq (+ padding)][D], m and l [Hkv][nq]; kt and p for the prefill path.
struct Scratch {
  jaxllm::LineVector<float> q, o, m, l, zeros, kt, p;
  std::vector<int32_t> row_pos;
  // the AMX path's: q's bfloat16 parts, a chunk's value tiles (the paired path's too) and keys
  jaxllm::LineVector<uint16_t> qa, vb, kc;
  jaxllm::LineVector<uint32_t> qt;          // and the queries' parts as tiles (query_tiles)
  jaxllm::LineVector<uint32_t> q2, p2;  // the paired path's (PairedBuffers; its values in vb)
};

constexpr int kManyQueries = 8;  // an item with at least this many queries per KV head takes the prefill path
constexpr int kPadQueries = 32;  // >= kScoreBlock and every kValueBlock
static_assert(kPadQueries >= kScoreBlock && kPadQueries >= kValueBlock<16>);  // D = 16: the largest
// The AMX path's bfloat16 parts of a float32 operand (the queries, the probabilities):
// three keep float32's precision; one, a bfloat16 model's (Problem::bf16_products), rounds
// them as the paired path does. Tiles 2-4 and 4-6 hold at most three.
constexpr int kFloatParts = 3;
constexpr int kAmxQueries = 16;  // and its queries per tile of sums

#ifdef JAXLLM_AMX
// The prefill path on AMX's tiles (bfloat16 caches, D a multiple of 64). Per item and KV
// head the queries' parts are laid out once as tiles (query_tiles), per chunk the keys
// gathered as they lie and the values as tile operands (value_tiles); then per 16
// queries: the chunk's 64 keys' scores against them, transposed (four 16 x 16 tiles of
// sums, a key a row), the online softmax with a query a lane (softmax_transposed: no
// reduction across lanes), and the probabilities, transposed back, times the values
// (D / 16 tiles of sums), added to the outputs. The keys and values are bfloat16 already;
// the queries and the probabilities are float32, so each is multiplied as P
// bfloat16 parts. With kFloatParts (x = a + b + c to float32's 24 bits: a and b the top 8
// significant bits of what the parts before left, truncated, so each difference is exact;
// c the rest, at most 8 bits, so its rounding is exact) the products are exact and summed
// in float32 by the tile unit, so the outputs agree with the float paths' to float32's
// rounding (in another order), not to bfloat16's. With one part (a bfloat16 model's,
// Problem::bf16_products) each is rounded to bfloat16, as the paired path does.

// x[0, n) (n a multiple of 16) as its P bfloat16 parts (each part but the last x's
// remainder with its low 16 bits cleared, the last the remainder rounded), `stride`
// elements apart; 32 at a time, two vectors to one vcvtne2ps2bf16, where n allows.
inline __m512 truncated_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// 32 values (lo, hi) as their P parts, out[0, 32) of each part, `stride` elements apart.
template <int P>
inline void split_two_bf16(__m512 lo, __m512 hi, uint16_t* out, int64_t stride) {
  for (int s = 0; s + 1 < P; ++s) {
    const __m512 a = truncated_bf16(lo), b = truncated_bf16(hi);
    _mm512_storeu_si512(out + s * stride, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    lo = _mm512_sub_ps(lo, a);
    hi = _mm512_sub_ps(hi, b);
  }
  _mm512_storeu_si512(out + (P - 1) * stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
template <int P>
inline void split_bf16(const float* x, int64_t n, uint16_t* out, int64_t stride) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) split_two_bf16<P>(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i + 16), out + i, stride);
  for (; i < n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    for (int s = 0; s + 1 < P; ++s) {
      const __m512 a = truncated_bf16(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + s * stride + i), (__m256i)_mm512_cvtneps_pbh(a));
      v = _mm512_sub_ps(v, a);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (P - 1) * stride + i), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// The queries' parts (qa: P parts `part` elements apart, nq16 rows of D) as the
// score product's B tiles: qt[part][b][st] (queries 16 b.., step st of 32 of D) holds in
// row kk, column n the pair of elements 32 st + 2 kk, + 1 of query 16 b + n (one 32-bit
// word): each 16 x 16 block of the queries' words transposed. Once per item and KV head.
template <int D, int P>
inline void query_tiles(const uint16_t* qa, int64_t part, int64_t nq16, uint32_t* qt) {
  constexpr int S = D / 32;
  const int64_t blocks = nq16 / kAmxQueries;
  for (int sp = 0; sp < P; ++sp)
    for (int64_t b = 0; b < blocks; ++b)
      for (int st = 0; st < S; ++st) {
        V v[kLanes];
        for (int n = 0; n < kLanes; ++n)  // a vector load (a copy through the stack stalls its reload)
          v[n] = reinterpret_cast<V>(_mm512_loadu_ps(qa + sp * part + (b * kAmxQueries + n) * D + 32 * st));
        transpose_lanes(v);
        std::memcpy(qt + ((sp * blocks + b) * S + st) * 256, v, sizeof v);
      }
}

// Both products' step: tiles 0-1 (sums) += the P parts of an A operand (tiles 2-4:
// rows `lda` bytes apart, the parts `part` elements apart) times two B tiles (5-6: 16 rows
// of 64 bytes at b0, b1). The two sums' products alternate, so each waits on its previous
// part's product one product later rather than at once (a tile of sums takes each part in
// turn, in the same order as before: the same sums).
template <int P>
inline void two_tiles_step(const uint16_t* a, int64_t lda, int64_t part, const void* b0, const void* b1) {
  _tile_loadd(2, a, lda);
  if constexpr (P > 1) _tile_loadd(3, a + part, lda);
  if constexpr (P > 2) _tile_loadd(4, a + 2 * part, lda);
  _tile_loadd(5, b0, 64);
  _tile_loadd(6, b1, 64);
  _tile_dpbf16ps(0, 2, 5);
  _tile_dpbf16ps(1, 2, 6);
  if constexpr (P > 1) {
    _tile_dpbf16ps(0, 3, 5);
    _tile_dpbf16ps(1, 3, 6);
  }
  if constexpr (P > 2) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
  }
}
// Tiles 0-1 side by side: tile J's 16 columns at out + 16 J, rows `ld` bytes apart.
inline void store_two_tiles(float* out, int64_t ld) {
  _tile_stored(0, out, ld);
  _tile_stored(1, out + 16, ld);
}

// Key tile J (rows 16 J.. of the chunk's keys kc, rows D apart) at step s times the
// queries' parts in tiles 4-6, into tile J; tile J stored to st's keys 16 J... (The tile
// numbers must be literals, hence macros.)
#define JAXLLM_KEY_TILE_PRODUCTS(J)                                \
  do {                                                              \
    _tile_loadd(7, kc + (J) * kTile * D + 32 * s, D * 2);           \
    _tile_dpbf16ps(J, 7, 4);                                        \
    if constexpr (P > 1) _tile_dpbf16ps(J, 7, 5);             \
    if constexpr (P > 2) _tile_dpbf16ps(J, 7, 6);             \
  } while (0)
#define JAXLLM_STORE_KEY_TILE(J) _tile_stored(J, st + (J) * kTile * kAmxQueries, kAmxQueries * 4)

// Scores transposed, st [kChunk][16] (key, query), of a block of 16 queries (qt: their
// parts' tiles, qpart words apart) against the chunk's first nt key tiles (kc [kChunk][D],
// the keys as A tiles): per step of 32 of D, the parts' three B tiles, then each key tile
// once (tile 7) times all three, into tiles 0-3. The same products summed in the same
// order as queries times transposed keys would be (a step's parts in turn).
template <int D, int P>
inline void amx_scores_transposed(const uint32_t* qt, int64_t qpart, const uint16_t* kc, int nt, float* st) {
  constexpr int S = D / 32;
  jaxllm::zero_four_tiles();
  for (int s = 0; s < S; ++s) {
    _tile_loadd(4, qt + s * 256, 64);
    if constexpr (P > 1) _tile_loadd(5, qt + qpart + s * 256, 64);
    if constexpr (P > 2) _tile_loadd(6, qt + 2 * qpart + s * 256, 64);
    JAXLLM_KEY_TILE_PRODUCTS(0);
    if (nt > 1) JAXLLM_KEY_TILE_PRODUCTS(1);
    if (nt > 2) JAXLLM_KEY_TILE_PRODUCTS(2);
    if (nt > 3) JAXLLM_KEY_TILE_PRODUCTS(3);
  }
  JAXLLM_STORE_KEY_TILE(0);
  if (nt > 1) JAXLLM_STORE_KEY_TILE(1);
  if (nt > 2) JAXLLM_STORE_KEY_TILE(2);
  if (nt > 3) JAXLLM_STORE_KEY_TILE(3);
}
#undef JAXLLM_KEY_TILE_PRODUCTS
#undef JAXLLM_STORE_KEY_TILE

// Elements per part of the value product's A tiles pa[part][s][16][32] (step s of 32 keys).
constexpr int64_t kProbabilityPart = (kChunk / 32) * kAmxQueries * 32;

// pv [16][D] = the probabilities (pa) times the chunk's values (vb), over `steps` steps of 32 keys.
template <int D, int P>
inline void amx_values(const uint16_t* pa, int steps, const uint16_t* vb, float* pv) {
  constexpr int C = D / 16;
  for (int c = 0; c < C; c += 2) {  // blocks c, c + 1 of D
    _tile_zero(0);
    _tile_zero(1);
    for (int s = 0; s < steps; ++s)  // block c of D, step s: vb[s][c]
      two_tiles_step<P>(pa + s * kAmxQueries * 32, 64, kProbabilityPart, vb + (s * C + c) * 16 * 32,
                     vb + (s * C + c + 1) * 16 * 32);
    store_two_tiles(pv + 16 * c, D * 4);
  }
}

// A lane's position where it sees no key (far below any key's, with room below for a
// window's subtraction).
constexpr int32_t kNoPosition = -(1 << 30);

// The online softmax of a block of 16 queries, a lane each, over the chunk's first nt key
// tiles, from their scores transposed (st [kChunk][16]: a vector per key, so the max and
// the sum run down the keys with no reduction across lanes). pos: each lane's position
// (kNoPosition: a lane this block does not update). The lanes' running maxima and sums
// (m, l: `lanes` of them) and output rows (o, D floats apart) are updated where a lane
// sees some key of the chunk, else left as they are; the probabilities, transposed back
// a 16 x 16 block at a time, go to the value product's A tiles as their parts (pa, the
// chunk's first ceil(nt / 2) steps of 32 keys; zeros where not visible). False if no
// lane sees a key.
template <int D, int P>
inline bool softmax_transposed(float* st, int nt, int64_t t0, int ntok, M pos, const Problem& pb, float* m,
                               float* l, int lanes, float* o, uint16_t* pa) {
  static_assert(kLanes == kAmxQueries, "a lane per query of the block");
  const int nk = nt * kTile;
  V mx = splat(kNegInf);
  for (int k = 0; k < nk; ++k) {
    V sk = load(st + k * kAmxQueries);
    if (pb.soft_cap > 0.f)
      for (int i = 0; i < kLanes; ++i) sk[i] = pb.soft_cap * std::tanh(sk[i] / pb.soft_cap);
    const M kp = M{} + static_cast<int32_t>(t0 + k);
    M vis = (kp <= pos) & (M{} + (k < ntok ? -1 : 0));
    if (pb.window > 0) vis &= kp > pos - pb.window;
    sk = select(vis, sk, splat(kNegInf));
    store(st + k * kAmxQueries, sk);
    mx = vmax(mx, sk);
  }
  const M seen = mx > splat(kNegInf);
  const __mmask16 mine = static_cast<__mmask16>((1u << lanes) - 1);
  const __mmask16 updated = _mm512_movepi32_mask(reinterpret_cast<__m512i>(seen)) & mine;
  if (updated == 0) return false;
  const V m_old = reinterpret_cast<V>(_mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), mine, m));
  const V l_old = reinterpret_cast<V>(_mm512_maskz_loadu_ps(mine, l));
  const V m_new = vmax(m_old, mx);
  const V scale = select(m_old == m_new, splat(1.f), exp_scores(m_old - m_new));  // m_old -inf: 0
  const V shift = select(seen, m_new, splat(0.f));  // a lane seeing nothing: all -inf, so zeros
  V sum = splat(0.f);
  for (int k = 0; k < nk; ++k) {
    const V pk = exp_scores(load(st + k * kAmxQueries) - shift);  // masked keys are -inf: 0
    sum += pk;
    store(st + k * kAmxQueries, pk);
  }
  _mm512_mask_storeu_ps(m, updated, reinterpret_cast<__m512>(m_new));
  _mm512_mask_storeu_ps(l, updated, reinterpret_cast<__m512>(l_old * scale + sum));
  for (int i = 0; i < lanes; ++i)
    if ((updated >> i & 1) && scale[i] != 1.f)
      for (int c = 0; c < D / kLanes; ++c) store(o + i * D + kLanes * c, load(o + i * D + kLanes * c) * scale[i]);
  const auto block = [&](int j, V* v) {  // key tile j's probabilities, a query a vector
    for (int t = 0; t < kLanes; ++t) v[t] = j < nt ? load(st + (j * kTile + t) * kAmxQueries) : splat(0.f);
    if (j < nt) transpose_lanes(v);
  };
  for (int s = 0; 2 * s < nt; ++s) {  // step s: key tiles 2 s, 2 s + 1
    V lo[kLanes], hi[kLanes];
    block(2 * s, lo);
    block(2 * s + 1, hi);
    for (int i = 0; i < kAmxQueries; ++i)
      split_two_bf16<P>(reinterpret_cast<__m512>(lo[i]), reinterpret_cast<__m512>(hi[i]), pa + (s * kAmxQueries + i) * 32,
                     kProbabilityPart);
  }
  return true;
}

// attend_chunk_many on AMX: the same online softmax, each query's state updated only
// where its rows see the chunk (queries before m_first are left as they are). qt: the
// KV head's queries' parts as tiles (query_tiles, `qpart` words apart). Per block of 16
// queries: the scores transposed (keys x queries: the chunk's keys, gathered, are the A
// tiles as they lie), the softmax across the block's queries (softmax_transposed), then
// the probabilities, transposed back, times the values.
template <int D, int P>
void attend_chunk_amx(const Problem& pb, int nq, int group, int m_first, const int32_t* row_pos, int64_t t0, int ntok,
                      int ntiles, const BF16* const* krow, const BF16* const* vrow, const uint32_t* qt, int64_t qpart,
                      Scratch& sc, float* o, float* m, float* l) {
  constexpr int S = D / 32;
  sc.kc.resize(kChunk * D);
  for (int t = 0; t < ntiles * kTile; ++t) std::memcpy(sc.kc.data() + t * D, krow[t], D * sizeof(uint16_t));
  sc.vb.resize(kChunk / 32 * (D / 16) * 16 * 32);
  value_tiles<D>(vrow, ntok, sc.vb.data());
  alignas(64) float st[kChunk * kAmxQueries], pv[kAmxQueries * D];
  alignas(64) uint16_t pa[P * kProbabilityPart];
  for (int m0 = m_first / kAmxQueries * kAmxQueries; m0 < nq; m0 += kAmxQueries) {
    const int first = std::max(m0, m_first), mb = std::min(kAmxQueries, nq - m0);
    const int nk = keys_seen(row_pos, group, first, m0 + mb - first, t0, ntok);
    if (nk == 0) continue;
    const int nt = (nk + kTile - 1) / kTile;
    amx_scores_transposed<D, P>(qt + (m0 / kAmxQueries) * S * 256, qpart, sc.kc.data(), nt, st);
    M pos;
    for (int i = 0; i < kLanes; ++i) pos[i] = i < mb && m0 + i >= m_first ? row_pos[(m0 + i) / group] : kNoPosition;
    if (!softmax_transposed<D, P>(st, nt, t0, ntok, pos, pb, m + m0, l + m0, mb, o + static_cast<int64_t>(m0) * D, pa))
      continue;
    amx_values<D, P>(pa, (nk + 31) / 32, sc.vb.data(), pv);
    for (int i = first - m0; i < mb; ++i) {
      float* oq = o + static_cast<int64_t>(m0 + i) * D;
      for (int c = 0; c < D / kLanes; ++c) store(oq + kLanes * c, load(oq + kLanes * c) + load(pv + i * D + kLanes * c));
    }
  }
}

#endif

// Whether the prefill path runs on AMX for a cache of R at head_dim D (Problem::amx).
template <int D, class R>
inline bool amx_attention(const Problem& pb) {
#ifdef JAXLLM_AMX
  if constexpr (std::is_same_v<R, BF16> && D % 64 == 0) return pb.amx;
#endif
  return false;
}

// The queries' parts as attend_amx's tiles, qt (query_tiles): n floats, nq16 rows of D;
// qa holds the parts meanwhile. One part for a bfloat16 model's, else kFloatParts.
template <int D, int P>
inline void queries_as_parts(const float* q, int64_t n, int64_t nq16, Scratch& sc, uint32_t* qt) {
#ifdef JAXLLM_AMX
  sc.qa.resize(P * n);
  split_bf16<P>(q, n, sc.qa.data(), n);
  query_tiles<D, P>(sc.qa.data(), n, nq16, qt);
#endif
}
template <int D>
inline void queries_as_tiles(const Problem& pb, const float* q, int64_t n, int64_t nq16, Scratch& sc, uint32_t* qt) {
  if (pb.bf16_products)
    queries_as_parts<D, 1>(q, n, nq16, sc, qt);
  else
    queries_as_parts<D, kFloatParts>(q, n, nq16, sc, qt);
}

// attend_chunk_amx where it is built for R and D (amx_attention: the callers ask only then).
template <int D, class R>
inline void attend_amx(const Problem& pb, int nq, int group, int m_first, const int32_t* row_pos, int64_t t0,
                       int ntok, int ntiles, const R* const* krow, const R* const* vrow, const uint32_t* qt,
                       int64_t qpart, Scratch& sc, float* o, float* m, float* l) {
#ifdef JAXLLM_AMX
  if constexpr (std::is_same_v<R, BF16> && D % 64 == 0) {
    if (pb.bf16_products)
      attend_chunk_amx<D, 1>(pb, nq, group, m_first, row_pos, t0, ntok, ntiles, krow, vrow, qt, qpart, sc, o, m, l);
    else
      attend_chunk_amx<D, kFloatParts>(pb, nq, group, m_first, row_pos, t0, ntok, ntiles, krow, vrow, qt, qpart, sc,
                                       o, m, l);
  }
#endif
}


inline void prefetch_rows(const float* base, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(base);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// The cache rows (block * BS + offset) of tokens [t0, t0 + n) through a block table, one
// division for all of them; block ids are clamped into the pool.
inline void token_rows(const Problem& pb, const int32_t* table, int64_t t0, int n, int64_t* rows) {
  const int64_t BS = pb.block_size;
  int64_t b = t0 / BS, within = t0 % BS;
  int64_t base = std::min<int64_t>(std::max<int64_t>(table[b], 0), pb.num_blocks - 1) * BS;
  for (int t = 0; t < n; ++t) {
    rows[t] = base + within;
    if (++within == BS && t + 1 < n) {
      within = 0;
      base = std::min<int64_t>(std::max<int64_t>(table[++b], 0), pb.num_blocks - 1) * BS;
    }
  }
}

// A scaled cache's scales of KV head h for the chunk's rows (row -1: padding, scale 0).
inline void gather_scales(const Problem& pb, const int64_t* row, int n, int64_t h, float* ks, float* vs) {
  for (int t = 0; t < n; ++t) {
    const int64_t i = row[t] * pb.num_kv_heads + h;
    ks[t] = row[t] < 0 ? 0.f : pb.k_scale[i];
    vs[t] = row[t] < 0 ? 0.f : pb.v_scale[i];
  }
}

template <int D, class R>
void run_item(const Problem& pb, const Item& it, Scratch& sc) {
  const int64_t H = pb.num_heads, Hkv = pb.num_kv_heads, BS = pb.block_size;
  const int group = static_cast<int>(H / Hkv);
  const int rows = it.rows;
  const int nq = rows * group;
  const bool many = nq >= kManyQueries && !pb.invariant;
  const int64_t nq_padded = many ? nq + kPadQueries : nq;  // the prefill path's blocks read past nq
  const int64_t row_stride = H * D;  // floats per query row
  const int64_t token_stride = Hkv * D;  // floats per cached token
  const int32_t s = it.seq;
  const int64_t q_len = pb.qsl[s + 1] - pb.qsl[s];
  const int64_t kv_len = std::min<int64_t>(pb.kv_lens[s], pb.max_blocks * BS);
  const int64_t qpos0 = kv_len - q_len + (it.row0 - pb.qsl[s]);
  // exclusive: the last row's position + 1 (bidirectional: the sequence's end, every
  // row then seeing all of it as the last position would)
  const int64_t kv_end = pb.causal ? qpos0 + rows : kv_len;
  int64_t k_first = pb.prefix_tokens;  // the common prefix pass did the keys before it
  if (pb.window > 0) k_first = std::max<int64_t>(k_first, qpos0 - pb.window + 1);
  if (pb.invariant) k_first = k_first / kChunk * kChunk;  // the chunks skipped are invisible to every row

  sc.q.assign(Hkv * nq_padded * D, 0.f);
  sc.o.assign(Hkv * nq_padded * D, 0.f);
  sc.m.assign(Hkv * nq, kNegInf);
  sc.l.assign(Hkv * nq, 0.f);
  if (pb.prefix_tokens > 0)
    for (int r = 0; r < rows; ++r)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int g = 0; g < group; ++g) {
          const int64_t from = (it.row0 + r) * H + h * group + g, to = h * nq + r * group + g;
          sc.m[to] = pb.prefix_m[from];
          sc.l[to] = pb.prefix_l[from];
          std::memcpy(sc.o.data() + (h * nq_padded + r * group + g) * D, pb.prefix_o + from * D, D * sizeof(float));
        }
  sc.row_pos.resize(rows);
  for (int r = 0; r < rows; ++r) sc.row_pos[r] = static_cast<int32_t>(pb.causal ? qpos0 + r : kv_len - 1);
  if (static_cast<int64_t>(sc.zeros.size()) < token_stride) sc.zeros.assign(token_stride, 0.f);
  if (many) {
    sc.kt.resize(D * kChunk);
    sc.p.assign(nq_padded * kChunk, 0.f);
  }
  const float* src = pb.q + static_cast<int64_t>(it.row0) * row_stride;
  for (int r = 0; r < rows; ++r)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int g = 0; g < group; ++g) {
        const float* from = src + r * row_stride + (h * group + g) * D;
        float* to = sc.q.data() + (h * nq_padded + r * group + g) * D;
        for (int d = 0; d < D; ++d) to[d] = from[d] * pb.sm_scale;
      }
  const int64_t nq16 = (nq + kAmxQueries - 1) / kAmxQueries * kAmxQueries, part = nq16 * D;
  const bool amx = many && amx_attention<D, R>(pb);
  if (amx) {
    sc.qt.resize(Hkv * kFloatParts * part / 2);
    for (int64_t h = 0; h < Hkv; ++h)
      queries_as_tiles<D>(pb, sc.q.data() + h * nq_padded * D, part, nq16, sc,
                          sc.qt.data() + h * kFloatParts * part / 2);
  }
  const bool paired = many && paired_path<D, R>(pb);
  const bool paired_dec = !many && paired_decode<D, R>(pb);
  if (paired_dec) {
    sc.q2.resize(Hkv * nq_padded * D / 2);
    query_pairs<D>(sc.q.data(), Hkv * nq_padded, sc.q2.data());
  }
  if constexpr (kEvenOdd<D, R>)
    if (!many && !paired_dec) even_odd_blocks(sc.q.data(), Hkv * nq_padded * D / (2 * kLanes));  // attend_chunk's order
  if (paired) {
    sc.q2.resize(Hkv * nq_padded * D / 2);
    query_pairs<D>(sc.q.data(), Hkv * nq_padded, sc.q2.data());
    sc.p2.assign(nq_padded * kChunk / 2, 0u);
    sc.vb.resize(kChunk * D);
  }

  const int32_t* table = pb.tables + static_cast<int64_t>(s) * pb.max_blocks;
  const R* const kbase = static_cast<const R*>(pb.k);
  const R* const vbase = static_cast<const R*>(pb.v);
  const R* const zeros = reinterpret_cast<const R*>(sc.zeros.data());  // zero bits: 0 in every type
  const R* krow[kChunk];
  const R* vrow[kChunk];
  const R* knext[kChunk];
  const R* vnext[kChunk];
  const R* kh[kChunk];
  const R* vh[kChunk];
  const R* kn[kChunk];
  const R* vn[kChunk];
  int64_t row[kChunk];  // the token's cache row (block * BS + offset), for the scales
  alignas(64) float ks[kChunk], vs[kChunk];
  for (int64_t t0 = k_first / kTile * kTile; t0 < kv_end; t0 += kChunk) {
    const int ntok = static_cast<int>(std::min<int64_t>(kChunk, kv_end - t0));
    const int ntiles = (ntok + kTile - 1) / kTile;
    int64_t rows_now[kChunk], rows_next[kChunk];
    token_rows(pb, table, t0, ntok, rows_now);
    const int64_t t1 = t0 + kChunk;  // the next chunk's tokens, for prefetching
    const int nnext = static_cast<int>(std::clamp<int64_t>(kv_end - t1, 0, kChunk));
    if (nnext > 0) token_rows(pb, table, t1, nnext, rows_next);
    for (int t = 0; t < ntiles * kTile; ++t) {
      row[t] = t < ntok ? rows_now[t] : -1;
      krow[t] = t < ntok ? kbase + rows_now[t] * token_stride : zeros;
      vrow[t] = t < ntok ? vbase + rows_now[t] * token_stride : zeros;
      knext[t] = t < nnext ? kbase + rows_next[t] * token_stride : zeros;
      vnext[t] = t < nnext ? vbase + rows_next[t] * token_stride : zeros;
    }
    // Rows whose position is before the chunk see none of it (causal).
    const int r_first = pb.causal ? static_cast<int>(std::max<int64_t>(0, t0 - qpos0)) : 0;
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int t = 0; t < ntiles * kTile; ++t) {
        kh[t] = krow[t] + h * D;  // the zeros row is token_stride long too
        vh[t] = vrow[t] + h * D;
        kn[t] = knext[t] + h * D;
        vn[t] = vnext[t] + h * D;
      }
      if constexpr (kScaled<R>) gather_scales(pb, row, ntiles * kTile, h, ks, vs);
      float* qh = sc.q.data() + h * nq_padded * D;
      float* oh = sc.o.data() + h * nq_padded * D;
      float* mh = sc.m.data() + h * nq;
      float* lh = sc.l.data() + h * nq;
      if (amx) {
        attend_amx<D>(pb, nq, group, r_first * group, sc.row_pos.data(), t0, ntok, ntiles, kh, vh,
                      sc.qt.data() + h * kFloatParts * part / 2, part / 2, sc, oh, mh, lh);
        continue;
      }
      if (many) {
        attend_chunk_many<D>(pb, nq, group, r_first * group, sc.row_pos.data(), t0, ntok, ntiles, kh, vh, ks, vs,
                             sc.kt.data(), sc.p.data(), qh,
                             PairedBuffers{paired ? sc.q2.data() + h * nq_padded * D / 2 : nullptr, sc.p2.data(),
                                           sc.vb.data()},
                             oh, mh, lh);
        continue;
      }
      for (int r = r_first; r < rows; ++r) {
        const int64_t qpos = sc.row_pos[r];
        if (pb.window > 0 && t0 + ntok - 1 <= qpos - pb.window) continue;
        M vis[kTiles];
        visible_chunk(t0, ntok, ntiles, qpos, pb.window, vis);
        const bool first = r == r_first;  // one row per chunk prefetches the next chunk
        if (paired_dec) {
          attend_group_paired<D>(pb, group, sc.q2.data() + (h * nq_padded + r * group) * (D / 2), kh, vh,
                                 first ? kn : nullptr, first ? vn : nullptr, ntok, ntiles, vis, oh + r * group * D,
                                 mh + r * group, lh + r * group);
          continue;
        }
        attend_group<D>(pb, group, qh + r * group * D, kh, vh, first ? kn : nullptr, first ? vn : nullptr, ks, vs,
                        ntok, ntiles, vis, oh + r * group * D, mh + r * group, lh + r * group);
      }
    }
  }
  float* dst = pb.out + static_cast<int64_t>(it.row0) * row_stride;
  for (int r = 0; r < rows; ++r)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int g = 0; g < group; ++g) {
        const int64_t mq = h * nq + r * group + g;
        const float lsum = sc.l[mq];
        const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
        const float* from = sc.o.data() + (h * nq_padded + r * group + g) * D;
        float* to = dst + r * row_stride + (h * group + g) * D;
        for (int d = 0; d < D; ++d) to[d] = from[d] * inv;
      }
}

// The common prefix pass: query rows [row0, row0 + rows) (of any sequences; positions in
// row_pos) of KV head h against keys [k0, k1) of the prefix (sequence 0's block table),
// with the prefill path; the online-softmax state goes to the out_* buffers of the
// item's part of the keys (merged afterwards).
struct PrefixItem {
  int32_t head, row0, rows;
  int64_t k0, k1;
  int32_t part;
};

template <int D, class R>
void run_prefix_item(const Problem& pb, const PrefixItem& it, const int32_t* row_pos, float* out_m, float* out_l,
                     float* out_o, Scratch& sc) {
  const int64_t H = pb.num_heads;
  const int group = static_cast<int>(H / pb.num_kv_heads);
  const int nq = it.rows * group;
  const int64_t nq_padded = nq + kPadQueries;
  const int64_t h = it.head;
  sc.q.assign(nq_padded * D, 0.f);
  sc.o.assign(nq_padded * D, 0.f);
  sc.m.assign(nq, kNegInf);
  sc.l.assign(nq, 0.f);
  sc.kt.resize(D * kChunk);
  sc.p.assign(nq_padded * kChunk, 0.f);
  for (int r = 0; r < it.rows; ++r)
    for (int g = 0; g < group; ++g) {
      const float* from = pb.q + ((it.row0 + r) * H + h * group + g) * D;
      float* to = sc.q.data() + (r * group + g) * D;
      for (int d = 0; d < D; ++d) to[d] = from[d] * pb.sm_scale;
    }
  const int64_t part = (nq + kAmxQueries - 1) / kAmxQueries * kAmxQueries * D;
  const bool amx = amx_attention<D, R>(pb);
  if (amx) {
    sc.qt.resize(kFloatParts * part / 2);
    queries_as_tiles<D>(pb, sc.q.data(), part, part / D, sc, sc.qt.data());
  }
  const bool paired = paired_path<D, R>(pb);
  if (paired) {
    sc.q2.resize(nq_padded * D / 2);
    query_pairs<D>(sc.q.data(), nq_padded, sc.q2.data());
    sc.p2.assign(nq_padded * kChunk / 2, 0u);
    sc.vb.resize(kChunk * D);
  }
  const int32_t* table = pb.tables;  // sequence 0's: every sequence's first blocks are these
  const int64_t token_stride = pb.num_kv_heads * D;
  const R* kh[kChunk];
  const R* vh[kChunk];
  int64_t row[kChunk];
  alignas(64) float ks[kChunk], vs[kChunk];
  for (int64_t t0 = it.k0; t0 < it.k1; t0 += kChunk) {
    const int ntok = static_cast<int>(std::min<int64_t>(kChunk, it.k1 - t0));
    const int ntiles = (ntok + kTile - 1) / kTile;  // k1 - k0 is a multiple of kTile
    token_rows(pb, table, t0, ntok, row);
    for (int t = 0; t < ntok; ++t) {
      kh[t] = static_cast<const R*>(pb.k) + row[t] * token_stride + h * D;
      vh[t] = static_cast<const R*>(pb.v) + row[t] * token_stride + h * D;
    }
    if constexpr (kScaled<R>) gather_scales(pb, row, ntok, h, ks, vs);
    if (amx)
      attend_amx<D>(pb, nq, group, 0, row_pos + it.row0, t0, ntok, ntiles, kh, vh, sc.qt.data(), part / 2, sc,
                    sc.o.data(), sc.m.data(), sc.l.data());
    else
      attend_chunk_many<D>(pb, nq, group, 0, row_pos + it.row0, t0, ntok, ntiles, kh, vh, ks, vs, sc.kt.data(),
                           sc.p.data(), sc.q.data(),
                           PairedBuffers{paired ? sc.q2.data() : nullptr, sc.p2.data(), sc.vb.data()}, sc.o.data(),
                           sc.m.data(), sc.l.data());
  }
  for (int r = 0; r < it.rows; ++r)
    for (int g = 0; g < group; ++g) {
      const int64_t to = (it.row0 + r) * H + h * group + g, from = r * group + g;
      out_m[to] = sc.m[from];
      out_l[to] = sc.l[from];
      std::memcpy(out_o + to * D, sc.o.data() + from * D, D * sizeof(float));
    }
}

// The kernels of float16, float8_e4m3fn and int8 caches are instantiated in an object of
// their own (paged_attention_more_types.cc: this file with JAXLLM_ATTENTION_MORE_TYPES),
// compiled beside this one's float32 and bfloat16 ones: five cache types' instantiations
// in one object were the build's longest step by far (docs/cpu_kernels.md, "Building them").
#define JAXLLM_KERNELS_OF(PREFIX, D, R)                                                                \
  PREFIX template void run_item<D, R>(const Problem&, const Item&, Scratch&);                          \
  PREFIX template void run_prefix_item<D, R>(const Problem&, const PrefixItem&, const int32_t*, float*, \
                                             float*, float*, Scratch&);
#define JAXLLM_KERNELS_OF_TYPE(PREFIX, R)                                                          \
  JAXLLM_KERNELS_OF(PREFIX, 16, R) JAXLLM_KERNELS_OF(PREFIX, 32, R) JAXLLM_KERNELS_OF(PREFIX, 64, R) \
  JAXLLM_KERNELS_OF(PREFIX, 128, R) JAXLLM_KERNELS_OF(PREFIX, 256, R)
#ifdef JAXLLM_ATTENTION_MORE_TYPES
JAXLLM_KERNELS_OF_TYPE(, F16)
JAXLLM_KERNELS_OF_TYPE(, F8E4M3)
JAXLLM_KERNELS_OF_TYPE(, int8_t)
#else
JAXLLM_KERNELS_OF_TYPE(extern, F16)
JAXLLM_KERNELS_OF_TYPE(extern, F8E4M3)
JAXLLM_KERNELS_OF_TYPE(extern, int8_t)

using ItemFn = void (*)(const Problem&, const Item&, Scratch&);
using PrefixItemFn = void (*)(const Problem&, const PrefixItem&, const int32_t*, float*, float*, float*, Scratch&);

template <class R>
bool set_kernels(int64_t head_dim, ItemFn& item, PrefixItemFn& prefix) {
  switch (head_dim) {
    case 16: item = run_item<16, R>, prefix = run_prefix_item<16, R>; return true;
    case 32: item = run_item<32, R>, prefix = run_prefix_item<32, R>; return true;
    case 64: item = run_item<64, R>, prefix = run_prefix_item<64, R>; return true;
    case 128: item = run_item<128, R>, prefix = run_prefix_item<128, R>; return true;
    case 256: item = run_item<256, R>, prefix = run_prefix_item<256, R>; return true;
    default: return false;
  }
}

// The kernels of a head_dim and cache element type (its numpy name; the buffers may
// hold its bits as unsigned integers), and the element's bytes (0: not built for them).
int64_t kernels_for(int64_t head_dim, std::string_view type, ItemFn& item, PrefixItemFn& prefix) {
  if (type == "float32") return set_kernels<float>(head_dim, item, prefix) ? 4 : 0;
  if (type == "bfloat16") return set_kernels<BF16>(head_dim, item, prefix) ? 2 : 0;
  if (type == "float16") return set_kernels<F16>(head_dim, item, prefix) ? 2 : 0;
  if (type == "float8_e4m3fn") return set_kernels<F8E4M3>(head_dim, item, prefix) ? 1 : 0;
  if (type == "int8") return set_kernels<int8_t>(head_dim, item, prefix) ? 1 : 0;
  return 0;
}

// This thread's scratch buffers (the callers of parallel_for and the pool's threads).
Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

constexpr int kPrefixRows = 32;  // query rows per common-prefix item
constexpr int64_t kMinPrefixTokens = kChunk;  // a shorter common prefix is not worth a pass
constexpr int kPrefixItemsPerThread = 4;  // the prefix's keys are split into parts until there are this many items

// Folds online-softmax state b into a (max m, sum l, unnormalized output o of D floats).
inline void merge_state(float& ma, float& la, float* oa, float mb, float lb, const float* ob, int64_t D) {
  if (mb == kNegInf) return;
  const float m = std::max(ma, mb);
  const float sa = ma == kNegInf ? 0.f : std::exp(ma - m), sb = std::exp(mb - m);
  for (int64_t d = 0; d < D; ++d) oa[d] = oa[d] * sa + ob[d] * sb;
  la = la * sa + lb * sb;
  ma = m;
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                                ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> num_seqs,
                                ffi::Buffer<ffi::S32> common_prefix_blocks, ffi::ResultBuffer<ffi::F32> out,
                                float sm_scale, int32_t sliding_window, float soft_cap,
                                std::string_view cache_dtype, int32_t causal, int32_t invariant,
                                int32_t bf16_products) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: q must be [T,H,D], caches [N,B,Hkv,D], tables [S,MB]");
  if (v_cache.element_type() != k_cache.element_type() || v_cache.element_count() != k_cache.element_count())
    return ffi::Error::InvalidArgument("ragged_paged_attention: k and v caches differ");
  const bool scaled = cache_dtype == "int8";
  const size_t rows = static_cast<size_t>(kd[0] * kd[1] * kd[2]);
  if (scaled && (k_scale.element_count() != rows || v_scale.element_count() != rows))
    return ffi::Error::InvalidArgument("ragged_paged_attention: an int8 cache needs scales [N,B,Hkv]");
  Problem pb{q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(), k_scale.typed_data(),
             v_scale.typed_data(), out->typed_data(), kv_lens.typed_data(), block_tables.typed_data(),
             query_start_loc.typed_data(), qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1], sm_scale,
             sliding_window, soft_cap, causal != 0, invariant != 0, false, bf16_products != 0, 0, nullptr, nullptr,
             nullptr};
#ifdef JAXLLM_AMX
  pb.amx = cache_dtype == "bfloat16" && pb.head_dim % 64 == 0 && !pb.invariant && jaxllm::amx_ready();
  const jaxllm::ThreadHooks hooks = pb.amx ? jaxllm::kAmxHooks : jaxllm::ThreadHooks{};
#else
  const jaxllm::ThreadHooks hooks{};
#endif
  if (!pb.causal && pb.window > 0)
    return ffi::Error::InvalidArgument("ragged_paged_attention: a sliding window needs causal attention");
  if (kd[3] != pb.head_dim || pb.num_heads % pb.num_kv_heads != 0)
    return ffi::Error::InvalidArgument("ragged_paged_attention: head_dim or head counts do not match");
  ItemFn item_fn;
  PrefixItemFn prefix_fn;
  const int64_t elem_bytes = kernels_for(pb.head_dim, cache_dtype, item_fn, prefix_fn);
  if (elem_bytes == 0)
    return ffi::Error::InvalidArgument("ragged_paged_attention: head_dim must be 16, 32, 64, 128 or 256 and the "
                                       "cache float32, bfloat16, float16, float8_e4m3fn or int8");
  if (static_cast<int64_t>(k_cache.size_bytes()) != elem_bytes * static_cast<int64_t>(k_cache.element_count()))
    return ffi::Error::InvalidArgument("ragged_paged_attention: the cache buffers are not of cache_dtype's width");

  const int64_t H = pb.num_heads, D = pb.head_dim, T = pb.num_tokens;
  const int64_t slots = td[0];
  const int64_t n_seqs = std::min<int64_t>(std::max<int32_t>(num_seqs.typed_data()[0], 0), slots);
  std::vector<Item> items;
  std::vector<int32_t> row_pos(T, 0);
  int64_t covered = 0;
  int64_t min_computed = std::numeric_limits<int64_t>::max();  // tokens in cache before this step, least of all
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t begin = std::clamp<int64_t>(pb.qsl[s], 0, T), end = std::clamp<int64_t>(pb.qsl[s + 1], begin, T);
    covered = std::max(covered, end);
    const int64_t kv = std::min<int64_t>(pb.kv_lens[s], pb.max_blocks * pb.block_size);
    if (end - begin > kv) {  // more new tokens than the sequence holds: nothing to read
      std::memset(pb.out + begin * H * D, 0, (end - begin) * H * D * sizeof(float));
      min_computed = 0;
      continue;
    }
    if (end > begin) min_computed = std::min(min_computed, kv - (end - begin));
    for (int64_t r = begin; r < end; ++r) row_pos[r] = static_cast<int32_t>(pb.causal ? kv - (end - r) : kv - 1);
    for (int64_t r = begin; r < end; r += kRowTile) {
      const int32_t rows = static_cast<int32_t>(std::min<int64_t>(kRowTile, end - r));
      const int64_t last_pos = pb.causal ? kv - (end - begin) + (r - begin) + rows : kv;
      items.push_back(Item{static_cast<int32_t>(s), static_cast<int32_t>(r), rows, rows * last_pos});
    }
  }
  // Rows past the last sequence are padding: zeros, as the references give.
  std::memset(pb.out + covered * H * D, 0, (T - covered) * H * D * sizeof(float));

  // The common prefix: the caller's promise (the first blocks of every block table are
  // the same), bounded by what every sequence had in cache before this step, in whole
  // kTile-key tiles.
  int64_t prefix = static_cast<int64_t>(std::max<int32_t>(common_prefix_blocks.typed_data()[0], 0)) * pb.block_size;
  prefix = std::min(prefix, n_seqs > 1 && items.size() > 1 && !pb.invariant ? min_computed : 0) / kTile * kTile;
  std::vector<float> prefix_m, prefix_l, prefix_o;
  if (prefix >= kMinPrefixTokens) {
    pb.prefix_tokens = prefix;
    prefix_m.assign(covered * H, kNegInf);
    prefix_l.assign(covered * H, 0.f);
    prefix_o.assign(covered * H * D, 0.f);
    pb.prefix_m = prefix_m.data(), pb.prefix_l = prefix_l.data(), pb.prefix_o = prefix_o.data();
    // Items (KV head, block of rows, part of the keys): the keys are split into parts
    // (whole chunks) until there are enough items for the threads; part 0 writes the
    // prefix_* buffers, part j > 0 its own, merged into part 0's afterwards.
    const int64_t row_blocks = (covered + kPrefixRows - 1) / kPrefixRows;
    const int64_t chunks = (prefix + kChunk - 1) / kChunk;
    const int64_t want = kPrefixItemsPerThread * std::max<int64_t>(pool.num_threads(), 1);
    const int64_t parts = std::clamp<int64_t>((want + pb.num_kv_heads * row_blocks - 1) / (pb.num_kv_heads * row_blocks),
                                              1, chunks);
    const int64_t chunks_per_part = (chunks + parts - 1) / parts;
    std::vector<float> part_m((parts - 1) * covered * H, kNegInf), part_l((parts - 1) * covered * H, 0.f),
        part_o((parts - 1) * covered * H * D, 0.f);
    std::vector<PrefixItem> prefix_items;
    for (int64_t j = 0; j < parts; ++j) {
      const int64_t k0 = j * chunks_per_part * kChunk, k1 = std::min(prefix, (j + 1) * chunks_per_part * kChunk);
      if (k0 >= k1) continue;
      for (int64_t h = 0; h < pb.num_kv_heads; ++h)
        for (int64_t r = 0; r < covered; r += kPrefixRows)
          prefix_items.push_back(PrefixItem{static_cast<int32_t>(h), static_cast<int32_t>(r),
                                            static_cast<int32_t>(std::min<int64_t>(kPrefixRows, covered - r)), k0, k1,
                                            static_cast<int32_t>(j)});
    }
    parallel_for(pool, static_cast<int64_t>(prefix_items.size()), [&](int64_t i) {
      Scratch& sc = thread_scratch();
      const PrefixItem& it = prefix_items[i];
      const int64_t off = (it.part - 1) * covered * H;  // part j > 0: its slice of the part_* buffers
      if (it.part == 0)
        prefix_fn(pb, it, row_pos.data(), prefix_m.data(), prefix_l.data(), prefix_o.data(), sc);
      else
        prefix_fn(pb, it, row_pos.data(), part_m.data() + off, part_l.data() + off, part_o.data() + off * D, sc);
    }, hooks);
    for (int64_t j = 1; j < parts; ++j) {
      const int64_t off = (j - 1) * covered * H;
      for (int64_t i = 0; i < covered * H; ++i)
        merge_state(prefix_m[i], prefix_l[i], prefix_o.data() + i * D, part_m[off + i], part_l[off + i],
                    part_o.data() + (off + i) * D, D);
    }
  }

  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  parallel_for(pool, static_cast<int64_t>(items.size()), [&](int64_t i) { item_fn(pb, items[i], thread_scratch()); },
               hooks);
  return ffi::Error::Success();
}

#endif  // JAXLLM_ATTENTION_MORE_TYPES

}  // namespace jaxllm_attention

#ifndef JAXLLM_ATTENTION_MORE_TYPES
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmRaggedPagedAttention, jaxllm_attention::RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()  // k_cache [N, B, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()  // v_cache [N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale [N, B, Hkv] (int8 cache; else [1])
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, MB]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [] or [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // common_prefix_blocks [] or [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<std::string_view>("cache_dtype")
                                  .Attr<int32_t>("causal")  // 0: bidirectional (an encoder)
                                  .Attr<int32_t>("invariant")  // 1: batch-invariant (Problem::invariant)
                                  .Attr<int32_t>("bf16_products"));  // 1: Problem::bf16_products
#endif
