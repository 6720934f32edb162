// Pins torch's intra-op (OpenMP) threads, one per CPU: thread i of the pool to cpus[i];
// the C++ kernels' team (thread_pool.h) is resized to as many threads and its worker i
// pinned to cpus[i] as well (the calling thread, OpenMP's thread 0, is both teams' first).
//
// The extension links the libgomp that torch loaded (same soname), so this parallel region
// runs on the very threads torch's parallel ops use. Linux only; elsewhere it pins nothing.
#include <torch/extension.h>

#include <vector>

#include "thread_pool.h"

#if defined(__linux__)
#include <omp.h>
#include <sched.h>
#endif

// Returns how many threads took their CPU (0 where pinning is unsupported).
int64_t pin_threads(const std::vector<int64_t>& cpus) {
#if defined(__linux__)
  const int n = static_cast<int>(cpus.size());
  if (n == 0) return 0;
  int pinned = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[omp_get_thread_num()]), &set);
    pinned += sched_setaffinity(0, sizeof(set), &set) == 0 ? 1 : 0;  // 0: this thread
  }
  pagestream::set_team_size(n);
  pagestream::pin_team(cpus);
  return pinned;
#else
  (void)cpus;
  return 0;
#endif
}
