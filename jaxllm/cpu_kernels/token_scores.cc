// Prompt-logprob scores for XLA:CPU, as an XLA FFI custom call. For each row r of
// logits x[S, V] (float32) whose target t = targets[r] is in [0, V):
//   logprob[r] = x[r, t] - logsumexp(x[r])             (log_softmax at the target)
//   rank[r]    = 1 + #{v : x[r, v] > x[r, t]}
//   top_ids[r], top_logprobs[r] = the K largest of log_softmax(x[r]) in descending
//                order, equal values by ascending index (as lax.top_k)
// Rows with a negative target are not read; their outputs are zeros.
//
// Why on CPU: a 512-token prefill that scores its prompt has 512 x 49152 logits (100 MB).
// log_softmax, top_k(20) and the rank count in XLA:CPU took ~110, ~56 and ~41 ms (one
// thread each, log_softmax materializing a second 100 MB array); here each row is read
// twice (the second time from L2), on all threads.
//
// Per row, pass 1 (in vectors of the native width: 16 lanes with AVX-512, 8 with AVX2;
// 16-lane vectors without AVX-512 are lowered through the stack by GCC): the running
// maximum, the count of values above x[t], and
// the top K kept sorted (a block is looked at lane by lane only when one of its
// values beats the current K-th). Pass 2: the sum of exp(x - max). Logits are assumed
// finite (they come from a matmul).
//
// Portable C++17 with GCC/Clang vector extensions (simd.h); built by jaxllm/cpu_kernels/build.py.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxllm::f32xN;  // the native width: 16 lanes with AVX-512, 8 with AVX2 (simd.h)
using jaxllm::hmax;
using jaxllm::hsum;
using jaxllm::i32xN;
using jaxllm::kLanes;
using jaxllm::loadN;
using jaxllm::splatN;
using jaxllm::vexp;
using jaxllm::vmax;

namespace {

constexpr int kMaxTop = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline bool any(i32xN mask) {
  uint64_t w[sizeof(i32xN) / 8];
  std::memcpy(w, &mask, sizeof w);
  uint64_t bits = 0;
  for (uint64_t x : w) bits |= x;
  return bits != 0;
}

// The K largest values seen so far, descending; a value equal to one already kept goes
// after it (it has a greater index), so the order is lax.top_k's.
struct TopK {
  int k, n = 0;
  float values[kMaxTop];
  int32_t ids[kMaxTop];

  float threshold() const { return n < k ? kNegInf : values[k - 1]; }

  void offer(float v, int32_t id) {
    if (n == k && !(v > values[k - 1])) return;
    int j = n < k ? n++ : k - 1;
    for (; j > 0 && values[j - 1] < v; --j) {
      values[j] = values[j - 1];
      ids[j] = ids[j - 1];
    }
    values[j] = v;
    ids[j] = id;
  }
};

struct RowScore {
  float logprob;
  int32_t rank;
};

RowScore score_row(const float* row, int64_t V, int32_t target, TopK& top) {
  const float xt = row[target];
  int64_t i = 0;
  float m = kNegInf;
  int64_t above = 0;
  if (V >= kLanes) {
    f32xN vm = splatN(kNegInf);
    i32xN vabove = {};
    const f32xN vt = splatN(xt);
    float thr = top.threshold();
    for (; i + kLanes <= V; i += kLanes) {
      const f32xN v = loadN(row + i);
      vm = vmax(vm, v);
      vabove -= v > vt;  // a true lane is -1
      if (any(v > splatN(thr))) {
        for (int l = 0; l < kLanes; ++l) top.offer(v[l], static_cast<int32_t>(i + l));
        thr = top.threshold();
      }
    }
    m = hmax(vm);
    for (int l = 0; l < kLanes; ++l) above += vabove[l];
  }
  for (int64_t j = i; j < V; ++j) {
    m = std::max(m, row[j]);
    above += row[j] > xt;
    top.offer(row[j], static_cast<int32_t>(j));
  }
  // The sum goes 16 values at a time in 16 / kLanes chains, added up as AVX-512's one
  // 16-lane chain is: the same float sum whatever the build's vector width.
  constexpr int kChains = 16 / kLanes;
  float sum = 0.f;
  i = 0;
  if (V >= 16) {
    f32xN vs[kChains] = {};
    const f32xN vm = splatN(m);
    for (; i + 16 <= V; i += 16)
      for (int c = 0; c < kChains; ++c) vs[c] += vexp(loadN(row + i + c * kLanes) - vm);
    if constexpr (kChains == 4) {
      sum = hsum((vs[0] + vs[2]) + (vs[1] + vs[3]));
    } else if constexpr (kChains == 2) {
      sum = hsum(vs[0] + vs[1]);
    } else {
      sum = hsum(vs[0]);
    }
  }
  for (; i < V; ++i) sum += std::exp(row[i] - m);
  const float lse = m + std::log(sum);
  for (int j = 0; j < top.n; ++j) top.values[j] -= lse;
  return {xt - lse, static_cast<int32_t>(above + 1)};
}

ffi::Error TokenScores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> targets,
                       ffi::ResultBuffer<ffi::F32> logprob, ffi::ResultBuffer<ffi::S32> rank,
                       ffi::ResultBuffer<ffi::S32> top_ids, ffi::ResultBuffer<ffi::F32> top_logprobs) {
  const auto xd = x.dimensions(), td = targets.dimensions(), kd = top_ids->dimensions();
  if (xd.size() != 2 || td.size() != 1 || td[0] != xd[0] || kd.size() != 2 || kd[0] != xd[0] ||
      top_logprobs->dimensions()[1] != kd[1])
    return ffi::Error::InvalidArgument("token_scores: x [S, V], targets [S], top [S, K] expected");
  const int64_t S = xd[0], V = xd[1], K = kd[1];
  if (K < 1 || K > kMaxTop || K > V) return ffi::Error::InvalidArgument("token_scores: need 1 <= K <= min(V, 64)");
  const float* X = x.typed_data();
  const int32_t* T = targets.typed_data();
  float* lp = logprob->typed_data();
  int32_t* rk = rank->typed_data();
  int32_t* ids = top_ids->typed_data();
  float* tlp = top_logprobs->typed_data();
  jaxllm::parallel_for(pool, S, [&](int64_t r) {
    const int32_t t = T[r];
    if (t < 0 || t >= V) {
      lp[r] = 0.f;
      rk[r] = 0;
      std::memset(ids + r * K, 0, K * sizeof(int32_t));
      std::memset(tlp + r * K, 0, K * sizeof(float));
      return;
    }
    TopK top{static_cast<int>(K)};
    const RowScore s = score_row(X + r * V, V, t, top);
    lp[r] = s.logprob;
    rk[r] = s.rank;
    std::memcpy(ids + r * K, top.ids, K * sizeof(int32_t));
    std::memcpy(tlp + r * K, top.values, K * sizeof(float));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmTokenScoresF32, TokenScores,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [S, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // targets [S]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // logprob [S]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // rank [S]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // top_ids [S, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // top_logprobs [S, K]
