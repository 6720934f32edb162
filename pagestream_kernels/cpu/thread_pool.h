// The thread team of the native CPU step: the calling thread plus persistent workers that
// spin between the parallel parts of a step, independent of OpenMP.
//
// Why not torch's OpenMP team: libgomp keeps one team per thread that starts parallel
// regions, and a step thread's team next to the main thread's ran the decode step ~1.5x
// slower than the main thread's own (measured: 11.0 vs 7.3 ms on a 2-core Zen 4). A decode
// step is ~150 short parallel parts; these workers spin on a counter between them (and
// sleep after SPIN_NS idle, so they never hold cores between steps).
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

}  // namespace pagestream
