// Greedy argmax over logits for XLA:CPU, as an XLA FFI custom call: ids[S] = the first
// index of each row's maximum of x[S, V] (float32), as jnp.argmax: a NaN counts as the
// maximum, so a row with NaNs gives its first NaN.
//
// Why on CPU: after the output projection of a decode step of 64 rows (64 x 49152
// logits, 12.6 MB), XLA:CPU's top_k(1) took ~5 ms and argmax's variadic reduce ~7 ms,
// both on one thread; this reads the logits once on both threads in well under 1 ms.
//
// Each row: 16 lanes keep their running maximum and its first index (a later equal value
// does not replace it), then the lanes are reduced (the greatest value, the least index
// among lanes that hold it). Rows are items on XLA's intra-op pool.
//
// Portable C++17 with GCC/Clang vector extensions (simd.h); built by jaxllm/cpu_kernels/build.py.

#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxllm::f32xN;  // the native width (simd.h): 16-lane vectors without AVX-512 go through the stack
using jaxllm::i32xN;
using jaxllm::kLanes;
using jaxllm::loadN;

namespace {

// Whether v comes before `best` in argmax order: greater, or a NaN against a number.
inline bool beats(float v, float best) { return v > best || (std::isnan(v) && !std::isnan(best)); }

// The first index of the maximum of row[0..V).
int32_t row_argmax(const float* row, int64_t V) {
  int64_t best_index = 0;
  float best = row[0];
  int64_t i = 0;
  if (V >= kLanes) {
    f32xN vbest = loadN(row);
    i32xN vindex;
    for (int l = 0; l < kLanes; ++l) vindex[l] = l;
    i32xN lane_index = vindex;
    for (i = kLanes; i + kLanes <= V; i += kLanes) {
      const f32xN v = loadN(row + i);
      lane_index += kLanes;
      const i32xN take = (v > vbest) | ((v != v) & (vbest == vbest));  // beats, per lane
      vbest = take ? v : vbest;
      vindex = take ? lane_index : vindex;
    }
    best = vbest[0];
    best_index = vindex[0];
    for (int l = 1; l < kLanes; ++l) {  // the lanes' winners: a tie goes to the least index
      if (beats(vbest[l], best) || (!beats(best, vbest[l]) && vindex[l] < best_index)) {
        best = vbest[l];
        best_index = vindex[l];
      }
    }
  }
  for (; i < V; ++i) {  // the tail (or a row shorter than a vector): later indices, so only a win counts
    if (beats(row[i], best)) {
      best = row[i];
      best_index = i;
    }
  }
  return static_cast<int32_t>(best_index);
}

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> ids) {
  const auto xd = x.dimensions(), od = ids->dimensions();
  if (xd.size() != 2 || od.size() != 1 || od[0] != xd[0])
    return ffi::Error::InvalidArgument("argmax: x must be [S, V] and ids [S]");
  const int64_t S = xd[0], V = xd[1];
  if (V == 0 && S > 0) return ffi::Error::InvalidArgument("argmax: rows of length 0");
  const float* X = x.typed_data();
  int32_t* out = ids->typed_data();
  jaxllm::parallel_for(pool, S, [&](int64_t r) { out[r] = row_argmax(X + r * V, V); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmArgmaxF32, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [S, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // ids [S]
