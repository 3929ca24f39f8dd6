// How the C++ kernels (cpu_gemm, cpu_fused, kernels/cpu_attention) hand work items to
// threads: pw::parallel_items(n, f) calls f(item, thread) once for every item in [0, n),
// on the calling thread and the workers of the process's one item pool (cpu_pool.cpp,
// its own extension, reached through a capsule each kernel extension is given at load:
// set_pool). Items are claimed one at a time, so a thread that arrives late takes fewer;
// `thread` is in [0, pw::max_threads()), for per-thread scratch.
//
// Without the pool (not built, busy with another caller, or called from inside one of its
// items) the same items run through at::parallel_for, shared from an atomic counter.
//
// Light on purpose (no torch/extension.h, about 30 s of a translation unit's compile
// here): the kernels' own files include this; the extension's module file binds the pool
// through pool_bind.h.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// The pool's C interface, as its capsule carries it.
struct PwPoolApi {
  int version;
  // Runs fn(ctx, item, thread) for every item in [0, n); false (nothing run) where the
  // pool cannot take the call now. Rethrows the first exception an item threw.
  bool (*run)(int64_t n, void (*fn)(void*, int64_t, int), void* ctx);
  // Threads a call made now would use (the caller included).
  int (*threads)();
};

constexpr int kPwPoolApiVersion = 1;
constexpr const char* kPwPoolCapsuleName = "pagewarden.cpu_pool";

namespace pw {

inline const PwPoolApi*& pool_api() {
  static const PwPoolApi* api = nullptr;
  return api;
}

// An upper bound on the `thread` argument parallel_items passes, plus one.
inline int max_threads() {
  const PwPoolApi* api = pool_api();
  return std::max(api ? api->threads() : 1, at::get_num_threads());
}

template <typename F>
void parallel_items(int64_t n, const F& f) {
  if (n <= 0) return;
  if (const PwPoolApi* api = pool_api()) {
    auto call = [](void* ctx, int64_t item, int thread) { (*static_cast<const F*>(ctx))(item, thread); };
    if (api->run(n, call, const_cast<F*>(&f))) return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    const int thread = at::get_thread_num();
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i, thread);
  });
}

// f(b, e) over [begin, end) in runs of `grain` (the last one shorter), as items.
template <typename F>
void parallel_ranges(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  grain = std::max<int64_t>(grain, 1);
  parallel_items((end - begin + grain - 1) / grain, [&](int64_t i, int) {
    const int64_t b = begin + i * grain;
    f(b, std::min(end, b + grain));
  });
}

}  // namespace pw
