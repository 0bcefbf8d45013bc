// The layers' row-wise operations for XLA:CPU, as XLA FFI custom calls: RMSNorm, and the
// gated MLP's activation (act(gate) * up of a fused [gate | up] projection).
//
// Why on CPU: XLA:CPU runs RMSNorm's fixed-order row sums (jaxllm.models.llama.row_sums)
// as a chain of slices, and a residual add and the norm after it as separate passes; here
// every row is an item on XLA's intra-op pool, read once. docs/cpu_kernels.md has the
// measurements.
//
// RMSNorm: each row's squares summed in llama.row_sums' order (16 running sums over the
// row's slices of 16, then halved), so a row gives the same bits alone or in any batch;
// the mean square plus eps, its reciprocal square root as 1 / sqrt (correctly rounded
// parts: XLA's rsqrt differs from it in the last bit now and then), then x * r times
// (weight + offset), as llama.rms_norm. x and y float32 or bfloat16 (y as x; rounded to
// nearest even).
//
// The activation: activation.h's SiLU or GELU (tanh form), within a few ulp of XLA's,
// which computes exp and the reciprocal otherwise.
//
// Portable C++17 with GCC/Clang vector extensions (simd.h); built by jaxllm/cpu_kernels/build.py.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "activation.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxllm::f32xN;
using jaxllm::kLanes;
using jaxllm::loadN;
using jaxllm::splatN;
using jaxllm::storeN;

namespace {

constexpr int kSumLanes = 16;                 // llama.row_sums' running sums
constexpr int kSumVectors = kSumLanes / kLanes;  // native vectors holding them
// Elements per item at least: a norm's rows are a load and a store each, so 32 rows of 576
// stay one item (waking a helper costs more than their work); the activation's exp makes its
// elements dearer.
constexpr int64_t kNormItem = 32768, kGluItem = 16384;

using jaxllm::bf16_bits;
using jaxllm::bf16_value;
using jaxllm::rounded;

// The sum of row[0..D)'s squares in row_sums' order: slices of 16 (the last zero-padded)
// into 16 running sums, then halved (the first half plus the second) down to one.
float sum_of_squares(const float* row, int64_t D) {
  f32xN acc[kSumVectors] = {};
  int64_t k = 0;
  for (; k + kSumLanes <= D; k += kSumLanes)
    for (int v = 0; v < kSumVectors; ++v) {
      const f32xN x = loadN(row + k + v * kLanes);
      f32xN square = x * x;
      rounded(square);
      acc[v] = acc[v] + square;
    }
  if (k < D) {
    alignas(64) float tail[kSumLanes] = {};
    std::memcpy(tail, row + k, (D - k) * sizeof(float));
    for (int v = 0; v < kSumVectors; ++v) {
      const f32xN x = loadN(tail + v * kLanes);
      f32xN square = x * x;
      rounded(square);
      acc[v] = acc[v] + square;
    }
  }
  for (int n = kSumVectors; n > 1; n /= 2)
    for (int v = 0; v < n / 2; ++v) acc[v] = acc[v] + acc[v + n / 2];
  alignas(64) float lanes[kLanes];
  storeN(lanes, acc[0]);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) lanes[i] = lanes[i] + lanes[i + w];
  return lanes[0];
}

// y = x * r * scale for one float32 row.
void scale_row(const float* x, const float* scale, float r, int64_t D, float* y) {
  const f32xN vr = splatN(r);
  int64_t k = 0;
  for (; k + kLanes <= D; k += kLanes) storeN(y + k, loadN(scale + k) * (loadN(x + k) * vr));
  for (; k < D; ++k) y[k] = scale[k] * (x[k] * r);
}

// One row of x (plus y's, `add`) as float32 into `row`: the values the norm reads (a
// bfloat16 sum rounded to bfloat16 first, as XLA adds bfloat16 arrays).
template <typename T>
void load_row(const T* x, const T* y, int64_t D, float* row) {
  if constexpr (std::is_same_v<T, float>) {
    int64_t k = 0;
    for (; k + kLanes <= D; k += kLanes) storeN(row + k, loadN(x + k) + loadN(y + k));
    for (; k < D; ++k) row[k] = x[k] + y[k];
  } else {
    for (int64_t k = 0; k < D; ++k) {
      const float v = y ? bf16_value(x[k]) + bf16_value(y[k]) : bf16_value(x[k]);
      row[k] = y ? bf16_value(bf16_bits(v)) : v;
    }
  }
}

// Rows r0..r1 of N = rms_norm(X (+ Y)), and with Y the sums into S.
template <typename T>
void norm_rows(const T* X, const T* Y, const float* scale, int64_t r0, int64_t r1, int64_t D, float eps, T* S,
               T* N) {
  thread_local jaxllm::LineVector<float> in, out;
  in.resize(D);
  out.resize(D);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = in.data();
    float* n = out.data();
    if constexpr (std::is_same_v<T, float>) {
      if (Y == nullptr) x = X + r * D;
      n = N + r * D;
    }
    if (Y != nullptr || !std::is_same_v<T, float>) load_row(X + r * D, Y ? Y + r * D : nullptr, D, in.data());
    if (Y != nullptr) {
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(S + r * D, x, D * sizeof(float));
      } else {
        for (int64_t k = 0; k < D; ++k) S[r * D + k] = bf16_bits(x[k]);
      }
    }
    const float mean = sum_of_squares(x, D) / static_cast<float>(D) + eps;
    scale_row(x, scale, 1.0f / std::sqrt(mean), D, n);
    if constexpr (!std::is_same_v<T, float>)
      for (int64_t k = 0; k < D; ++k) N[r * D + k] = bf16_bits(n[k]);
  }
}

// Rows per item: whole rows, about `elements` elements.
inline int64_t rows_per_item(int64_t width, int64_t elements) {
  return std::max<int64_t>(1, elements / std::max<int64_t>(width, 1));
}

// rms_norm(x (+ y)) into n, the sums into s (with y): shapes and types checked by the callers.
ffi::Error norm_pass(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer* y,
                     const ffi::Buffer<ffi::F32>& weight, ffi::AnyBuffer* s, ffi::AnyBuffer& n, float eps,
                     float offset) {
  const int64_t M = x.dimensions()[0], D = x.dimensions()[1];
  if (M == 0 || D == 0) return ffi::Error::Success();
  jaxllm::LineVector<float> scale(weight.typed_data(), weight.typed_data() + D);
  if (offset != 0.0f)
    for (auto& v : scale) v = v + offset;
  const int64_t per = rows_per_item(D, kNormItem), items = (M + per - 1) / per;
  const auto rows = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const auto* X = static_cast<const T*>(x.untyped_data());
    const auto* Y = y ? static_cast<const T*>(y->untyped_data()) : nullptr;
    auto* S = s ? static_cast<T*>(s->untyped_data()) : nullptr;
    auto* N = static_cast<T*>(n.untyped_data());
    jaxllm::parallel_for(pool, items, [&](int64_t i) {
      norm_rows<T>(X, Y, scale.data(), i * per, std::min(M, (i + 1) * per), D, eps, S, N);
    });
  };
  if (x.element_type() == ffi::DataType::F32) {
    rows(static_cast<float*>(nullptr));
  } else {
    rows(static_cast<uint16_t*>(nullptr));
  }
  return ffi::Error::Success();
}

bool same_matrix(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  return ad.size() == 2 && bd.size() == 2 && ad[0] == bd[0] && ad[1] == bd[1] && a.element_type() == b.element_type();
}

bool norm_type(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::DataType::F32 || x.element_type() == ffi::DataType::BF16;
}

ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weight,
                   ffi::Result<ffi::AnyBuffer> y, float eps, float offset) {
  const auto wd = weight.dimensions();
  if (!same_matrix(x, *y) || wd.size() != 1 || wd[0] != x.dimensions()[1] || !norm_type(x))
    return ffi::Error::InvalidArgument("rms_norm: x must be [M, D], float32 or bfloat16, weight [D], y as x");
  return norm_pass(pool, x, nullptr, weight, nullptr, *y, eps, offset);
}

// The residual add and the next sublayer's norm in one pass: s = x + y, n = rms_norm(s).
ffi::Error AddRmsNorm(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer y, ffi::Buffer<ffi::F32> weight,
                      ffi::Result<ffi::AnyBuffer> s, ffi::Result<ffi::AnyBuffer> n, float eps, float offset) {
  const auto wd = weight.dimensions();
  if (!same_matrix(x, y) || !same_matrix(x, *s) || !same_matrix(x, *n) || wd.size() != 1 ||
      wd[0] != x.dimensions()[1] || !norm_type(x))
    return ffi::Error::InvalidArgument("add_rms_norm: x and y must be [M, D] of one type, float32 or bfloat16, "
                                       "weight [D], s and n as x");
  return norm_pass(pool, x, &y, weight, &(*s), *n, eps, offset);
}

void glu_rows(const float* X, int64_t r0, int64_t r1, int64_t F, float* Y, int32_t act) {
  for (int64_t r = r0; r < r1; ++r) jaxllm::glu_row(X + r * 2 * F, X + r * 2 * F + F, F, Y + r * F, act);
}

ffi::Error Glu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int32_t act) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || xd[1] != 2 * yd[1])
    return ffi::Error::InvalidArgument("glu: x must be [M, 2F] (gate | up) and y [M, F]");
  if (act != jaxllm::kSilu && act != jaxllm::kGeluTanh)
    return ffi::Error::InvalidArgument("glu: act must be 0 (silu) or 1 (gelu_tanh)");
  const int64_t M = xd[0], F = yd[1];
  if (M == 0 || F == 0) return ffi::Error::Success();
  const int64_t per = rows_per_item(F, kGluItem), items = (M + per - 1) / per;
  const float* X = x.typed_data();
  float* Y = y->typed_data();
  jaxllm::parallel_for(pool, items, [&](int64_t i) {
    const int64_t r0 = i * per, r1 = std::min(M, r0 + per);
    glu_rows(X, r0, r1, F, Y, act);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, D], float32 or bfloat16
                                  .Arg<ffi::Buffer<ffi::F32>>()   // weight [D]
                                  .Ret<ffi::AnyBuffer>()          // y [M, D], x's type
                                  .Attr<float>("eps")
                                  .Attr<float>("offset"));        // scaled by weight + offset (Gemma: 1)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmAddRmsNorm, AddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, D], float32 or bfloat16: the residual
                                  .Arg<ffi::AnyBuffer>()          // y [M, D], x's type: a sublayer's output
                                  .Arg<ffi::Buffer<ffi::F32>>()   // weight [D]
                                  .Ret<ffi::AnyBuffer>()          // s = x + y
                                  .Ret<ffi::AnyBuffer>()          // n = rms_norm(s)
                                  .Attr<float>("eps")
                                  .Attr<float>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGlu, Glu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, 2F]: gate | up
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, F] = act(gate) * up
                                  .Attr<int32_t>("act"));         // 0 silu, 1 gelu (tanh form)
