// Hammers the CPU kernels' work sharing (kernels/cpu_parallel.h): many short jobs of varying sizes, more threads
// than cores, so helpers are descheduled at every point of a job. Every item must run exactly once per job and be
// done when the job returns. Prints the faults found; exits 1 on any.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu_parallel.h"

int main(int argc, char** argv) {
  const long jobs = argc > 1 ? std::atol(argv[1]) : 200000;
  std::vector<std::atomic<int>> runs(64);
  std::atomic<long> faults{0};
  for (long job = 0; job < jobs; ++job) {
    const int64_t n = 2 + (job * 7919) % 61;  // sizes that differ from one job to the next
    for (int64_t i = 0; i < n; ++i) runs[i].store(0, std::memory_order_relaxed);
    auto fn = [&](int64_t i) {
      if (i < 0 || i >= n) {
        faults.fetch_add(1);
      } else {
        runs[i].fetch_add(1);
      }
    };
    sgjax_cpu::ParallelFor(n, 1 << 20, fn);
    for (int64_t i = 0; i < n; ++i) {
      if (runs[i].load() != 1) faults.fetch_add(1);
    }
  }
  std::printf("%ld faults in %ld jobs on %ld threads\n", faults.load(), jobs,
              static_cast<long>(sgjax_cpu::Threads()));
  return faults.load() != 0;
}
