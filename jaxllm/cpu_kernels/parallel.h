// parallel_for on XLA's intra-op thread pool, shared by the kernels of this directory.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxllm {

// What a thread does before the first task it takes of one parallel_for and after its
// last (AMX's tile configuration: loading it costs about what a small tile product
// does, so once per thread and call rather than per task). Plain functions: the hooks
// outlive the caller's frame (a helper may leave after the caller has returned).
struct ThreadHooks {
  void (*enter)() = nullptr;
  void (*leave)() = nullptr;
};

// n tasks, taken by the caller and the pool's helpers in index order; returns when all
// are done. The state is shared with the helpers (a helper may start after the caller
// has returned, find nothing left, and drop its reference). A thread claims its tasks
// one at a time, or with `guided` a run of them: a share of what is left (1 / (2 x the
// threads), at least one). Each claim is a locked instruction, which waits until the
// stores before it (the last task's outputs) have reached the cache, a wait that small
// tasks of equal cost (the dense kernel's panels at decode sizes) paid once each
// (docs/bench-log/2026-12-03-xeon-amx.md). Tasks of unequal cost (the attention's items,
// longest first) are claimed one at a time, so the last ones even out.
struct ParallelWork {
  std::function<void(int64_t)> task;
  int64_t n = 0;
  ThreadHooks hooks;
  int64_t share = 0;  // guided: the divisor of what is left (0: one task a claim)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Tasks [first, end) for this thread; false when none is left.
  bool claim(int64_t& first, int64_t& end) {
    first = next.load(std::memory_order_relaxed);
    do {
      if (first >= n) return false;
      end = first + (share > 0 ? std::max<int64_t>(1, (n - first) / share) : 1);
    } while (!next.compare_exchange_weak(first, end, std::memory_order_relaxed));
    return true;
  }

  void run() {
    int64_t first, end, mine = 0;
    if (!claim(first, end)) return;
    if (hooks.enter) hooks.enter();
    do {
      for (int64_t i = first; i < end; ++i) task(i);
      mine += end - first;
    } while (claim(first, end));
    if (hooks.leave) hooks.leave();
    done.fetch_add(mine, std::memory_order_release);
  }
};

// How long parallel_for's caller yields while the helpers finish before it sleeps.
constexpr int kYieldMicros = 50;

inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> task,
                         ThreadHooks hooks = {}, bool guided = false) {
  if (n <= 0) return;
  auto work = std::make_shared<ParallelWork>();
  work->task = std::move(task);
  work->n = n;
  work->hooks = hooks;
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  work->share = guided ? 2 * (helpers + 1) : 0;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  // The caller, done with its claims, waits for the helpers' last tasks: yielding for a
  // moment (each helper on a core of its own ends within microseconds of it), then
  // sleeping a moment at a time. A helper the OS put aside mid-task (another process on
  // its core) otherwise waited out that process's time slice while the caller kept its
  // own core busy yielding to no one; a sleeping caller leaves its core to the helper or
  // to that process. Measured beside a spinning process and on a quiet CPU:
  // docs/bench-log/2026-12-07-zen3-avx2.md ("The kernels' wait for their helpers").
  const auto yield_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kYieldMicros);
  while (work->done.load(std::memory_order_acquire) < n) {
    if (std::chrono::steady_clock::now() < yield_until)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(1));
  }
}

}  // namespace jaxllm
