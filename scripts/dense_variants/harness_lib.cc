// One build of jaxllm/cpu_kernels/dense.cc (or a variant of it, -DDENSE_CC) as a shared
// library whose run_once() multiplies x [M, K] by K x N float32 panels the way the
// kernel's items do (x packed per tile, then each (row block, panel) item), without XLA:
// scripts/bench_dense_variants.py loads several builds into one process and alternates
// them, so a variant's rate is compared within the same seconds of a noisy host.
#include DENSE_CC
#include <chrono>
#include <pthread.h>
#include <random>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

using Wt = F32Weights;

struct Job {
  int64_t M, K, N;
  std::vector<float> x, panels, y, xt;
};

Job& job_for(int64_t M, int64_t K, int64_t N) {
  static std::vector<std::unique_ptr<Job>> jobs;
  for (auto& j : jobs)
    if (j->M == M && j->K == K && j->N == N) return *j;
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> u(-1, 1);
  auto j = std::make_unique<Job>(Job{M, K, N});
  j->x.resize(M * K);
  j->panels.resize(K * N);  // N / 32 panels of [K][32]: random values, any layout is one
  j->y.resize(M * N);
  j->xt.resize((M + kTileRows - 1) / kTileRows * kTileRows * K);
  for (auto& v : j->x) v = u(rng);
  for (auto& v : j->panels) v = u(rng);
  jobs.push_back(std::move(j));
  return *jobs.back();
}

// Items part, part + parts, ... of the call, in dense_rows' order (block-major): the row
// blocks as pack_then_multiply makes them, written again here because dense_rows runs on
// XLA's thread pool (an ffi::ThreadPool), which this harness has none of.
void items(Job& j, int part, int parts) {
  const int64_t tiles = (j.M + kTileRows - 1) / kTileRows, num_panels = j.N / kPanel;
  const int64_t blocks = (j.M + kRowBlock - 1) / kRowBlock, per_block = (tiles + blocks - 1) / blocks;
  const DenseCall<Wt, Wt> call{j.xt.data(), j.M, j.K, j.K, num_panels, j.N, j.panels.data(), Scales{}, Scales{}, 0};
  int64_t item = 0;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t p = 0; p < num_panels; ++p, ++item)
      if (item % parts == part) {
        const int64_t t0 = b * per_block, t1 = std::min(tiles, t0 + per_block);
        panel_times_tiles<Wt, kNoScales, 0>(call, p, t0, t1, j.y.data(), j.N, p * kPanel);
      }
}

struct Part {
  Job* job;
  int part, parts;
};

void* run_part(void* arg) {
  const auto* a = static_cast<Part*>(arg);
  items(*a->job, a->part, a->parts);
  return nullptr;
}

}  // namespace

// Seconds for one product of the (M, K, N) job on `threads` threads (1 or 2).
extern "C" double run_once(int64_t M, int64_t K, int64_t N, int threads) {
  Job& j = job_for(M, K, N);
  const double t0 = now();
  for (int64_t t = 0; t * kTileRows < M; ++t) Wt::pack(j.x.data(), M, K, t, j.xt.data() + t * kTileRows * K);
  if (threads == 1) {
    items(j, 0, 1);
  } else {
    pthread_t th[2];
    Part parts[2] = {{&j, 0, 2}, {&j, 1, 2}};
    for (int i = 0; i < 2; ++i) pthread_create(&th[i], nullptr, run_part, &parts[i]);
    for (int i = 0; i < 2; ++i) pthread_join(th[i], nullptr);
  }
  return now() - t0;
}

// A sum over y, so builds that must agree can be seen to.
extern "C" double checksum(int64_t M, int64_t K, int64_t N) {
  const Job& j = job_for(M, K, N);
  double s = 0;
  for (int64_t i = 0; i < M * N; i += 7) s += j.y[i];
  return s;
}
