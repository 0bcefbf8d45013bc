// 16-lane float32 / int32 vectors (GCC/Clang vector extensions: one AVX-512 register, two
// AVX2 or four NEON registers) and their unaligned loads, stores and broadcast, shared by
// the kernels of this directory.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxllm {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline f32x16 splat(float x) { return f32x16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

}  // namespace jaxllm
