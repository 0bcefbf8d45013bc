// Loads the builds named on the command line (harness_lib.cc) and alternates them over
// each shape: the best of `reps` runs of each, as a share of one core's float32 FMA peak
// measured between them (12 independent 8-lane FMAs a loop, registers only; x86-64).
//   harness THREADS REPS M,K,N[;M,K,N...] build.so...
#include <dlfcn.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

using RunFn = double (*)(int64_t, int64_t, int64_t, int);
using SumFn = double (*)(int64_t, int64_t, int64_t);

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// GFLOP/s of one thread's FMAs alone (AVX2: 2 FMA units x 8 lanes x 2 flops a cycle).
static double fma_peak() {
  long n = 5000000;
  const double t0 = now();
  __asm__ volatile(
      "vxorps %%ymm0,%%ymm0,%%ymm0\n vxorps %%ymm1,%%ymm1,%%ymm1\n vxorps %%ymm2,%%ymm2,%%ymm2\n"
      "vxorps %%ymm3,%%ymm3,%%ymm3\n vxorps %%ymm4,%%ymm4,%%ymm4\n vxorps %%ymm5,%%ymm5,%%ymm5\n"
      "vxorps %%ymm6,%%ymm6,%%ymm6\n vxorps %%ymm7,%%ymm7,%%ymm7\n vxorps %%ymm8,%%ymm8,%%ymm8\n"
      "vxorps %%ymm9,%%ymm9,%%ymm9\n vxorps %%ymm10,%%ymm10,%%ymm10\n vxorps %%ymm11,%%ymm11,%%ymm11\n"
      "vxorps %%ymm12,%%ymm12,%%ymm12\n vxorps %%ymm13,%%ymm13,%%ymm13\n"
      "1:\n"
      "vfmadd231ps %%ymm12,%%ymm13,%%ymm0\n vfmadd231ps %%ymm12,%%ymm13,%%ymm1\n vfmadd231ps %%ymm12,%%ymm13,%%ymm2\n"
      "vfmadd231ps %%ymm12,%%ymm13,%%ymm3\n vfmadd231ps %%ymm12,%%ymm13,%%ymm4\n vfmadd231ps %%ymm12,%%ymm13,%%ymm5\n"
      "vfmadd231ps %%ymm12,%%ymm13,%%ymm6\n vfmadd231ps %%ymm12,%%ymm13,%%ymm7\n vfmadd231ps %%ymm12,%%ymm13,%%ymm8\n"
      "vfmadd231ps %%ymm12,%%ymm13,%%ymm9\n vfmadd231ps %%ymm12,%%ymm13,%%ymm10\n vfmadd231ps %%ymm12,%%ymm13,%%ymm11\n"
      "dec %0\n jnz 1b\n"
      : "+r"(n)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
  return 5000000.0 * 12 * 16 / (now() - t0) / 1e9;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s THREADS REPS M,K,N[;M,K,N...] build.so...\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]), reps = std::atoi(argv[2]);
  std::vector<std::vector<int64_t>> shapes;
  std::stringstream list(argv[3]);
  for (std::string item; std::getline(list, item, ';');) {
    std::vector<int64_t> s;
    std::stringstream dims(item);
    for (std::string d; std::getline(dims, d, ',');) s.push_back(std::atoll(d.c_str()));
    shapes.push_back(s);
  }
  std::vector<RunFn> runs;
  std::vector<SumFn> sums;
  for (int i = 4; i < argc; ++i) {
    void* h = dlopen(argv[i], RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      std::fprintf(stderr, "%s\n", dlerror());
      return 1;
    }
    runs.push_back(reinterpret_cast<RunFn>(dlsym(h, "run_once")));
    sums.push_back(reinterpret_cast<SumFn>(dlsym(h, "checksum")));
  }
  for (const auto& s : shapes) {
    std::vector<double> best(runs.size(), 1e30);
    double peak = 0;
    for (int r = 0; r < reps; ++r) {
      for (size_t v = 0; v < runs.size(); ++v) best[v] = std::min(best[v], runs[v](s[0], s[1], s[2], threads));
      peak = std::max(peak, fma_peak());
    }
    const double gflop = 2.0 * s[0] * s[1] * s[2] / 1e9;
    std::printf("%ld x %ld x %ld, one core's FMA peak %.1f GFLOP/s:", static_cast<long>(s[0]), static_cast<long>(s[1]),
                static_cast<long>(s[2]), peak);
    for (size_t v = 0; v < runs.size(); ++v)
      std::printf("  [%zu] %.1f GFLOP/s %.1f%% (sum %.3f)", v, gflop / best[v], 100 * gflop / best[v] / threads / peak,
                  sums[v](s[0], s[1], s[2]));
    std::printf("\n");
  }
}
