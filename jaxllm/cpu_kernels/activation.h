// The gated MLP's activations, lane-wise: act(gate) * up of a row, for the row-wise
// kernel (row_ops.cc) and for the dense kernel's gate/up projection that applies it to
// the sums it has just made (dense.cc). SiLU: g / (1 + exp(-g)); GELU's tanh form:
// g * sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3) (= 0.5 g (1 + tanh y), without
// the cancellation of 1 + tanh y for very negative y). exp by simd.h's vexp, the
// reciprocal by AVX-512's estimate refined by one Newton step (~1 ulp) or a division.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace jaxllm {

enum Activation : int32_t { kNoActivation = -1, kSilu = 0, kGeluTanh = 1 };

inline f32xN reciprocal(f32xN d) {
#if defined(__AVX512F__) && JAXLLM_LANES == 16
  f32xN r;
  const __m512 e = _mm512_rcp14_ps(reinterpret_cast<const __m512&>(d));
  std::memcpy(&r, &e, sizeof r);
  return r * (2.0f - d * r);
#else
  return 1.0f / d;
#endif
}

template <int32_t kAct>
inline f32xN activated(f32xN g) {
  f32xN z = g;
  if constexpr (kAct == kGeluTanh) z = 2.0f * (0.7978845608028654f * (g + 0.044715f * (g * g * g)));
  return g * reciprocal(1.0f + vexp(-z));
}

template <int32_t kAct>
inline float activated_one(float g) {
  float z = g;
  if constexpr (kAct == kGeluTanh) z = 2.0f * (0.7978845608028654f * (g + 0.044715f * (g * g * g)));
  return g / (1.0f + std::exp(-z));
}

// y[0..F) = act(gate[k]) * up[k].
template <int32_t kAct>
inline void glu_row(const float* gate, const float* up, int64_t F, float* y) {
  int64_t k = 0;
  for (; k + kLanes <= F; k += kLanes) storeN(y + k, activated<kAct>(loadN(gate + k)) * loadN(up + k));
  for (; k < F; ++k) y[k] = activated_one<kAct>(gate[k]) * up[k];
}

inline void glu_row(const float* gate, const float* up, int64_t F, float* y, int32_t act) {
  if (act == kSilu) {
    glu_row<kSilu>(gate, up, F, y);
  } else {
    glu_row<kGeluTanh>(gate, up, F, y);
  }
}

}  // namespace jaxllm
