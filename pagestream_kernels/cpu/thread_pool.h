// The one thread team of the C++ CPU kernels: the calling thread plus persistent workers,
// independent of OpenMP (libgomp keeps one team per thread that starts parallel regions,
// and a step thread's team next to the main thread's ran the native step slower). Inside a
// StepScope the workers spin between parts (a native step is ~150 short parts); elsewhere
// (the torch modules' ops, between torch's OpenMP matmuls) they sleep as soon as their part
// is done, leaving the cores to OpenMP.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace pagestream {

// fn(begin, end) over [0, n) split into contiguous chunks of at least `grain`, one per
// thread of the team (the caller runs the first); returns when all are done. Runs inline
// when the range fits one chunk, when called from inside a task, or while another thread
// holds the team.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// The team's size (threads, the caller included); set_team_size resizes it (>= 1), and
// pin_team pins worker i (i >= 1) to cpus[i] (the caller pins itself). Returns how many
// workers took their CPU.
int64_t team_size();
void set_team_size(int64_t threads);
int64_t pin_team(const std::vector<int64_t>& cpus);

// While one is alive on a thread, the parts that thread runs leave the workers spinning
// (SPIN_NS, then asleep) for the next part. Nests.
class StepScope {
 public:
  StepScope();
  ~StepScope();
  StepScope(const StepScope&) = delete;
  StepScope& operator=(const StepScope&) = delete;
};

}  // namespace pagestream
