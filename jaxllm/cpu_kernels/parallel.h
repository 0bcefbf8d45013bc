// parallel_for on XLA's intra-op thread pool, shared by the kernels of this directory.
#pragma once

#include <algorithm>
#include <atomic>
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
// has returned, find nothing left, and drop its reference).
struct ParallelWork {
  std::function<void(int64_t)> task;
  int64_t n = 0;
  ThreadHooks hooks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run() {
    int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n) return;
    if (hooks.enter) hooks.enter();
    for (; i < n; i = next.fetch_add(1, std::memory_order_relaxed)) {
      task(i);
      done.fetch_add(1, std::memory_order_release);
    }
    if (hooks.leave) hooks.leave();
  }
};

inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> task,
                         ThreadHooks hooks = {}) {
  if (n <= 0) return;
  auto work = std::make_shared<ParallelWork>();
  work->task = std::move(task);
  work->n = n;
  work->hooks = hooks;
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jaxllm
