// float32 / int32 vectors of one register of the ISA the library is built for (GCC/Clang
// vector extensions), their unaligned loads, stores and broadcast, lane-wise max / exp
// and horizontal max / sum, shared by the kernels of this directory.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace jaxllm {

// 16 lanes with AVX-512, 8 with AVX, 4 otherwise (SSE, NEON). Only the native width:
// GCC lowers a wider vector (16 lanes on AVX2) through the stack, 10x slower in the
// dense kernel and in attention's prefill path.
#if defined(__AVX512F__)
#define JAXLLM_LANES 16
#elif defined(__AVX__)
#define JAXLLM_LANES 8
#else
#define JAXLLM_LANES 4
#endif
constexpr int kLanes = JAXLLM_LANES;
typedef float f32xN __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t i32xN __attribute__((vector_size(kLanes * sizeof(int32_t))));

// Storage from a 64-byte boundary: a cache line, and one row of an AMX tile. A
// std::vector's own is 16-byte aligned, from where each 64-byte load (a tile row, an
// AVX-512 vector) spans two lines (docs/cpu_kernels.md: what it cost).
template <class T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kLine{64};
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kLine)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kLine); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
// The kernels' scratch buffers: what their tiles and vectors load from.
template <class T>
using LineVector = std::vector<T, LineAllocator<T>>;

inline f32xN loadN(const float* p) {
  f32xN v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storeN(float* p, f32xN v) { std::memcpy(p, &v, sizeof v); }
// A broadcast (not `f32xN{} + x`: without -ffast-math that is an add per call, since
// 0 + -0 is +0).
inline f32xN splatN(float x) {
#if JAXLLM_LANES == 16
  return f32xN{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif JAXLLM_LANES == 8
  return f32xN{x, x, x, x, x, x, x, x};
#else
  return f32xN{x, x, x, x};
#endif
}

// exp(x) / 2^n for n = round(x / ln 2) (nf, an integer-valued float): the range
// reduction and polynomial of vexp_of below, for callers that find n another way.
template <class F>
inline F vexp_reduced(F x, F nf) {
  F r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for float32 lanes (Cephes' expf: range reduction by ln 2, degree-6
// polynomial, 2^n by exponent bits); about 1 ulp. Lanes below -87.3 give ~1e-38,
// callers zero the masked ones.
template <class F, class I>
inline F vexp_of(F x) {
  x = (x < -87.3f) ? F{} - 87.3f : x;
  x = (x > 88.3f) ? F{} + 88.3f : x;
  F y = x * 1.44269504088896341f + 0.5f;
  I n = __builtin_convertvector(y, I);  // truncates toward zero
  F nf = __builtin_convertvector(n, F);
  I too_big = nf > y;  // -1 where truncation rounded up (negative y): floor
  n += too_big;
  nf = __builtin_convertvector(n, F);
  F p = vexp_reduced(x, nf);
  I bits = (n + 127) << 23;
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}


inline f32xN vexp(f32xN x) { return vexp_of<f32xN, i32xN>(x); }
inline f32xN vmax(f32xN a, f32xN b) { return a > b ? a : b; }

// v as computed so far, hidden from the compiler: a product kept apart from the add after
// it (no contraction into a fused multiply-add, which would round once where the kernels'
// definitions round twice).
inline void rounded(f32xN& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__SSE__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  volatile f32xN keep = v;
  v = keep;
#endif
}

// x rounded to bfloat16 (to nearest even; a NaN stays a NaN), as XLA converts it, and back.
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u | 0x00400000u) >> 16);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// The lanes' max and sum, halving the vector each step.
#if JAXLLM_LANES == 16
inline float hmax(f32xN v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  return std::max(v[0], v[1]);
}
inline float hsum(f32xN v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return v[0] + v[1];
}
#elif JAXLLM_LANES == 8
inline float hmax(f32xN v) {
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  return std::max(v[0], v[1]);
}
inline float hsum(f32xN v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
}
#else
inline float hmax(f32xN v) {
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));
  return std::max(v[0], v[1]);
}
inline float hsum(f32xN v) {
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
  return v[0] + v[1];
}
#endif

}  // namespace jaxllm
