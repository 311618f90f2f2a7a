// The CPU kernels' work sharing (kernels/cpu_attention.cc, kernels/cpu_matmul.cc): one helper thread per further
// core, kept spinning for a while after each job.
//
// Decode calls the kernels many times a step (four matrix products and an attention per layer), each call a short
// piece of work. XLA's intra-op pool wakes a sleeping thread per task, which took longer than the work: a second
// thread gained nothing (docs/journal/engine-cpu.md). These helpers wait for kSpinMicros after a job before they sleep, so within a step
// they start at once; they yield the core while they wait (other processes' work, e.g. a second test worker's
// compiles, goes first), and jobs below kMinParallelBytes run on the caller alone (a tiny model's step would keep
// the helpers waiting for nothing).

#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace sgjax_cpu {

constexpr int64_t kSpinMicros = 300;
constexpr int64_t kMinParallelBytes = 128 << 10;  // the bytes a job reads below which it is not shared
constexpr int64_t kPauses = 256;                  // pause instructions before a helper starts yielding
constexpr uint64_t kItemMask = 0xffffffffu;
constexpr uint64_t kClosed = kItemMask;  // the item of a finished job: past any job's n

inline void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Jobs of n independent items, fn(ctx, i), run by the caller and the helpers. `next` packs the job's generation
// (high 32 bits) with the next unclaimed item (low 32 bits); a finished job is closed (item kClosed) before its
// caller returns. One job at a time: a caller that finds the pool busy (another thread's job) runs its own items.
//
// A helper reads a job's fields (call, ctx, n) only inside `active_` and only after it saw the job open there; the
// caller returns only once the job is closed and no helper is inside. Without that, a helper delayed between seeing
// job G and reading its fields read the next job's n (or ctx) and claimed items of G past G's end: it ran items of
// the next job twice and counted them done, so a caller could return while an item still wrote its output: heap
// corruption, a suspect in test workers crashing far from here (tests/kernels/test_cpu_pool.py hammers this).
class Pool {
 public:
  static Pool& Get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may still spin at exit
    return *pool;
  }

  int helpers() const { return helpers_; }

  template <typename Fn>
  void Run(int64_t n, Fn& fn, int64_t bytes) {
    auto call = [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); };
    if (n <= 1 || helpers_ == 0 || bytes < kMinParallelBytes) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || getpid() != pid_) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    call_.store(call, std::memory_order_relaxed);
    ctx_.store(&fn, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++gen_;
    next_.store(gen << 32, std::memory_order_seq_cst);  // publishes the job
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    Work(gen, call, &fn, n);
    while (done_.load(std::memory_order_acquire) < n) Pause();
    next_.store((gen << 32) | kClosed, std::memory_order_seq_cst);
    for (int spins = 0; active_.load(std::memory_order_seq_cst) != 0; ++spins) {
      if (spins < kPauses) {
        Pause();
      } else {
        sched_yield();  // a helper descheduled inside: let it run
      }
    }
  }

 private:
  Pool() : pid_(getpid()) {
    cpu_set_t set;
    int cores = static_cast<int>(std::thread::hardware_concurrency());
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
    if (const char* threads = std::getenv("SGJAX_CPU_THREADS")) cores = std::max(1, std::atoi(threads));
    helpers_ = std::max(0, cores - 1);
    for (int i = 0; i < helpers_; ++i) std::thread([this] { Helper(); }).detach();
  }

  // Claims and runs items of job `gen` until none is left.
  void Work(uint64_t gen, void (*call)(void*, int64_t), void* ctx, int64_t n) {
    uint64_t v = next_.load(std::memory_order_acquire);
    while ((v >> 32) == gen && static_cast<int64_t>(v & kItemMask) < n) {
      if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) {
        call(ctx, static_cast<int64_t>(v & kItemMask));
        done_.fetch_add(1, std::memory_order_release);
        v = next_.load(std::memory_order_acquire);
      }
    }
  }

  void Helper() {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      uint64_t v = next_.load(std::memory_order_acquire);
      for (int spins = 0; (v >> 32) == seen; ++spins) {
        if (spins < kPauses) {
          Pause();
        } else {
          sched_yield();
        }
        if ((spins & 15) == 15 && std::chrono::steady_clock::now() - start >
                                      std::chrono::microseconds(kSpinMicros)) {
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return (next_.load(std::memory_order_seq_cst) >> 32) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_seq_cst);
          start = std::chrono::steady_clock::now();
        }
        v = next_.load(std::memory_order_acquire);
      }
      seen = v >> 32;
      if ((v & kItemMask) == kClosed) continue;
      active_.fetch_add(1, std::memory_order_seq_cst);
      v = next_.load(std::memory_order_seq_cst);
      if ((v >> 32) == seen && (v & kItemMask) != kClosed) {
        // open, and it stays job `seen` (its fields unchanged) until this helper leaves `active_`
        Work(seen, call_.load(std::memory_order_relaxed), ctx_.load(std::memory_order_relaxed),
             n_.load(std::memory_order_relaxed));
      }
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const pid_t pid_;  // a forked child has no helpers: it runs its jobs alone
  int helpers_ = 0;
  std::mutex run_mu_, sleep_mu_;
  std::condition_variable wake_;
  uint64_t gen_ = 0;
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0}, n_{0};
  std::atomic<int> sleeping_{0}, active_{0};
  std::atomic<void (*)(void*, int64_t)> call_{nullptr};
  std::atomic<void*> ctx_{nullptr};
};

// Runs fn(0 .. n-1) on the calling thread and the pool's helpers; `bytes`, about what the items read together,
// decides whether sharing them pays.
template <typename Fn>
void ParallelFor(int64_t n, int64_t bytes, Fn fn) {
  Pool::Get().Run(n, fn, bytes);
}

// The threads a job may use: the caller and the helpers.
inline int64_t Threads() { return Pool::Get().helpers() + 1; }

}  // namespace sgjax_cpu
