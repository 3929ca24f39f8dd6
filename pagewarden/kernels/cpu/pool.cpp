// The item pool the C++ kernels share (pool.h is their side): one per process,
// workers started at first use, the calling thread always taking part.
//
// Why not OpenMP: with the engine's OMP_WAIT_POLICY=PASSIVE, every parallel region wakes
// the sleeping OpenMP threads by futex, and a decode step opens about 150 of them (4
// GEMMs and the attention per layer); each wake costs tens of microseconds in a VM. Here
// a worker that finished a task keeps polling for the next one for `spin_us` (default
// 100), so inside a forward pass, where kernels follow one another within microseconds,
// it is awake when the next task comes; between steps it sleeps. The poll is polite:
// it calls sched_yield every few dozen pauses, and if a yield took long (another thread
// wanted this core: the HTTP front end, a load generator, another process) it goes to
// sleep at once, so on a busy machine the pool behaves as PASSIVE OpenMP does.
//
// One task at a time: run() publishes (fn, ctx, n) under a new generation number and
// wakes sleeping workers (if any); every thread then claims items from `claim_`, a 64-bit
// word holding (generation << 32 | next item), by compare-and-swap, so a worker that
// arrives after the task ended (or read the fields of another task) claims nothing.
// run() returns when `done_` counts n finished items. A worker thread `i` takes part
// while i < the caller's at::get_num_threads() (torch.set_num_threads governs the pool
// too); a call from inside an item, or while another thread's call runs, returns false
// and the caller's fallback (at::parallel_for) runs the items.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <tuple>

#include "pool_bind.h"

namespace {

using ItemFn = void (*)(void*, int64_t, int);

constexpr uint64_t kClosed = 0xffffffffu;  // item part of `claim_` while a task is set up
constexpr int kMaxThreads = 256;
constexpr int64_t kYieldBusyNs = 20000;  // a yield this long: someone else ran on the core
constexpr int kPausesPerYield = 32;

thread_local bool t_inside_item = false;

// A spin-wait hint to the core (x86 pause, arm yield); nothing elsewhere.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

class Pool {
 public:
  Pool() { pthread_atfork(nullptr, nullptr, [] { instance().after_fork_in_child(); }); }

  static Pool& instance() {
    static Pool* pool = new Pool();  // never destroyed: detached workers may outlive exit
    return *pool;
  }

  int threads() const { return std::max(1, std::min(at::get_num_threads(), kMaxThreads)); }

  bool run(int64_t n, ItemFn fn, void* ctx) {
    if (n <= 0) return true;
    if (t_inside_item || n >= int64_t(kClosed)) return false;
    bool idle = false;
    if (!busy_.compare_exchange_strong(idle, true)) return false;
    struct Release {
      std::atomic<bool>& busy;
      ~Release() { busy.store(false); }
    } release{busy_};
    const int limit = threads();
    if (limit == 1 || n == 1) {
      for (int64_t i = 0; i < n; ++i) fn(ctx, i, 0);
      return true;
    }
    start_workers(limit - 1);
    const uint32_t gen = gen_.load() + 1;
    claim_.store(uint64_t(gen) << 32 | kClosed);  // stragglers of the last task claim nothing
    fn_.store(fn);
    ctx_.store(ctx);
    n_.store(n);
    limit_.store(limit);
    done_.store(0);
    error_ = nullptr;
    claim_.store(uint64_t(gen) << 32);
    gen_.store(gen);
    if (sleepers_.load() > 0) {
      futex_wake_all(&gen_);
      wakes_.fetch_add(1, std::memory_order_relaxed);
    }
    runs_.fetch_add(1, std::memory_order_relaxed);
    work(gen, 0);
    for (int64_t spins = 1; done_.load() < n; ++spins) {  // a worker finishing its last item
      cpu_relax();
      if (spins % 1024 == 0) sched_yield();
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  void set_spin_us(int64_t us) { spin_ns_.store(std::max<int64_t>(0, us) * 1000); }
  int64_t spin_us() const { return spin_ns_.load() / 1000; }

  pybind11::dict stats() const {
    pybind11::dict d;
    d["workers"] = num_workers_.load();
    d["runs"] = runs_.load();
    d["wakes"] = wakes_.load();
    d["sleeps"] = sleeps_.load();
    d["yields_lost"] = yields_lost_.load();
    d["spin_us"] = spin_us();
    return d;
  }

 private:
  void start_workers(int wanted) {
    std::lock_guard<std::mutex> lock(start_mu_);
    for (int i = num_workers_.load(); i < wanted; ++i) {
      std::thread([this, i, seen = gen_.load()] { worker(i + 1, seen); }).detach();
      num_workers_.store(i + 1);
    }
  }

  // The fork child has this memory but none of the threads: start afresh.
  void after_fork_in_child() {
    num_workers_.store(0);
    sleepers_.store(0);
    busy_.store(false);
  }

  // Claims and runs items of task `gen` until none is left.
  void work(uint32_t gen, int thread) {
    const ItemFn fn = fn_.load();
    void* const ctx = ctx_.load();
    const uint64_t n = uint64_t(n_.load());
    uint64_t word = claim_.load();
    for (;;) {
      if (uint32_t(word >> 32) != gen || (word & kClosed) >= n) return;
      if (!claim_.compare_exchange_weak(word, word + 1)) continue;
      t_inside_item = true;
      try {
        fn(ctx, int64_t(word & kClosed), thread);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      t_inside_item = false;
      done_.fetch_add(1);
      word = claim_.load();
    }
  }

  void worker(int thread, uint32_t seen) {
    for (;;) {
      seen = wait_for_task(seen);
      if (thread < limit_.load()) work(seen, thread);
    }
  }

  // The next generation after `seen`: polled politely for spin_us, then slept for.
  uint32_t wait_for_task(uint32_t seen) {
    const int64_t spin = spin_ns_.load(), start = now_ns();
    for (int i = 1; spin > 0; ++i) {
      const uint32_t gen = gen_.load();
      if (gen != seen) return gen;
      cpu_relax();
      if (i % kPausesPerYield != 0) continue;
      const int64_t before = now_ns();
      if (before - start > spin) break;
      sched_yield();
      if (now_ns() - before > kYieldBusyNs) {
        yields_lost_.fetch_add(1, std::memory_order_relaxed);
        break;
      }
    }
    sleeps_.fetch_add(1, std::memory_order_relaxed);
    sleepers_.fetch_add(1);
    uint32_t gen;
    while ((gen = gen_.load()) == seen) futex_wait(&gen_, seen);
    sleepers_.fetch_sub(1);
    return gen;
  }

  std::mutex start_mu_;
  std::atomic<int> num_workers_{0};
  std::atomic<bool> busy_{false};  // a caller is inside run()
  std::atomic<uint32_t> gen_{0};   // the futex word workers sleep on
  std::atomic<int> sleepers_{0};
  std::atomic<ItemFn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0};
  std::atomic<int> limit_{1};
  std::atomic<uint64_t> claim_{kClosed};
  std::atomic<int64_t> done_{0};
  std::mutex error_mu_;
  std::exception_ptr error_;
  std::atomic<int64_t> spin_ns_{100 * 1000};
  std::atomic<int64_t> runs_{0}, wakes_{0}, sleeps_{0}, yields_lost_{0};
};

bool api_run(int64_t n, ItemFn fn, void* ctx) { return Pool::instance().run(n, fn, ctx); }
int api_threads() { return Pool::instance().threads(); }

const PwPoolApi kApi{kPwPoolApiVersion, &api_run, &api_threads};

pybind11::object api_capsule() {
  return pybind11::reinterpret_steal<pybind11::object>(
      PyCapsule_New(const_cast<PwPoolApi*>(&kApi), kPwPoolCapsuleName, nullptr));
}

// For the tests: runs n items through the pool (or its fallback) and returns how often
// each ran and on which thread; item `throw_at` raises.
std::tuple<at::Tensor, at::Tensor> exercise(int64_t n, int64_t throw_at, int64_t work_ns) {
  at::Tensor runs = at::zeros({n}, at::kInt), thread_of = at::full({n}, -1, at::kInt);
  int32_t* rp = runs.data_ptr<int32_t>();
  int32_t* tp = thread_of.data_ptr<int32_t>();
  const int threads = pw::max_threads();
  pw::parallel_items(n, [&](int64_t i, int thread) {
    TORCH_CHECK(thread >= 0 && thread < threads, "thread ", thread, " outside [0, ", threads, ")");
    const int64_t until = now_ns() + work_ns;
    while (now_ns() < until) cpu_relax();
    reinterpret_cast<std::atomic<int32_t>*>(rp + i)->fetch_add(1);
    tp[i] = thread;
    TORCH_CHECK(i != throw_at, "item ", i, " raised on purpose");
  });
  return {runs, thread_of};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("api", &api_capsule, "the pool's capsule, for the kernel extensions' set_pool");
  m.def("set_spin_us", [](int64_t us) { Pool::instance().set_spin_us(us); }, "worker poll time");
  m.def("stats", [] { return Pool::instance().stats(); }, "counters since start");
  m.def("set_pool", &pw::set_pool, "bind exercise() to a pool capsule (None: OpenMP)");
  m.def("exercise", &exercise, "test hook: run n items, count each",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
