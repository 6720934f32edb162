// See thread_pool.h.
#include "thread_pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagestream {
namespace {

constexpr int64_t SPIN_NS = 200'000;  // in a StepScope, a worker spins this long for the next part

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

thread_local bool in_task = false;
thread_local int64_t step_scopes = 0;  // StepScopes alive on this thread

class Team {
 public:
  explicit Team(int64_t threads) {
    for (int64_t i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }

  ~Team() {
    stop_.store(true, std::memory_order_relaxed);
    publish(0);
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int64_t size() const { return static_cast<int64_t>(workers_.size()) + 1; }

  // Runs fn's chunks on the team; the caller holds the dispatch lock.
  // Its workers then spin spin_ns for the next part.
  void run(int64_t n, int64_t chunks, const std::function<void(int64_t, int64_t)>& fn,
           int64_t spin_ns) {
    fn_ = &fn;
    n_ = n;
    spin_ns_ = spin_ns;
    remaining_.store(chunks - 1, std::memory_order_relaxed);
    publish(chunks);
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    run_chunk(0, chunks);
    while (remaining_.load(std::memory_order_acquire) > 0) relax();
  }

  int64_t pin(const std::vector<int64_t>& cpus) {
    int64_t pinned = 0;
#if defined(__linux__)
    for (size_t i = 0; i < workers_.size() && i + 1 < cpus.size(); ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i + 1]), &set);
      pinned += pthread_setaffinity_np(workers_[i].native_handle(), sizeof(set), &set) == 0;
    }
#else
    (void)cpus;
#endif
    return pinned;
  }

 private:
  // A run is published as one word: its generation above CHUNK_BITS, its chunk count
  // below. A worker reads fn_ and n_ only for a run whose word says it takes part; that
  // run cannot end (nor the next overwrite them) before the worker reports. A worker the
  // run leaves out touches nothing of it: before, it read a shared chunk count, and one
  // that woke late could take the next run's count as this one's and run a chunk of that
  // run twice, the second time after its caller had returned (its fn gone).
  static constexpr int CHUNK_BITS = 16;
  static constexpr uint64_t CHUNK_MASK = (uint64_t{1} << CHUNK_BITS) - 1;

  void publish(int64_t chunks) {
    std::lock_guard<std::mutex> lock(sleep_mutex_);  // a sleeping worker sees the bump
    const uint64_t generation = (state_.load(std::memory_order_relaxed) >> CHUNK_BITS) + 1;
    state_.store(generation << CHUNK_BITS | static_cast<uint64_t>(chunks),
                 std::memory_order_release);
  }

  void run_chunk(int64_t index, int64_t chunks) {
    const int64_t begin = n_ * index / chunks, end = n_ * (index + 1) / chunks;
    in_task = true;
    if (begin < end) (*fn_)(begin, end);
    in_task = false;
  }

  // The next published word after `seen`: spins spin_ns, then sleeps.
  uint64_t next_state(uint64_t seen, int64_t spin_ns) {
    const auto start = std::chrono::steady_clock::now();
    uint64_t now;
    for (int64_t spins = 1; (now = state_.load(std::memory_order_acquire)) == seen; ++spins) {
      relax();
      if (spin_ns == 0 ||
          (spins % 1024 == 0 &&
           std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(spin_ns))) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        wake_.wait(lock, [&] { return state_.load(std::memory_order_acquire) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        return state_.load(std::memory_order_acquire);
      }
    }
    return now;
  }

  // A worker spins as the last run it took part in asked (read, like fn_, before it reports).
  void work(int64_t index) {
    int64_t spin_ns = 0;
    for (uint64_t seen = 0;;) {
      seen = next_state(seen, spin_ns);
      if (stop_.load(std::memory_order_relaxed)) return;
      const auto chunks = static_cast<int64_t>(seen & CHUNK_MASK);
      if (index < chunks) {
        run_chunk(index, chunks);
        spin_ns = spin_ns_;
        remaining_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> remaining_{0};
  std::atomic<int64_t> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<bool> stop_{false};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t spin_ns_ = 0;
};

std::mutex dispatch;  // one step at a time on the team; held while it runs or is rebuilt
std::unique_ptr<Team> team;

Team& current_team() {  // under `dispatch`
  if (!team) team = std::make_unique<Team>(std::max(1, at::get_num_threads()));
  return *team;
}

}  // namespace

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n <= grain || in_task) {
    fn(0, n);
    return;
  }
  std::unique_lock<std::mutex> lock(dispatch, std::try_to_lock);
  if (!lock.owns_lock()) {  // another thread's step holds the team: run here, alone
    fn(0, n);
    return;
  }
  Team& t = current_team();
  const int64_t chunks = std::min(t.size(), (n + grain - 1) / grain);
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  t.run(n, chunks, fn, step_scopes > 0 ? SPIN_NS : 0);
}

int64_t team_size() {
  std::lock_guard<std::mutex> lock(dispatch);
  return current_team().size();
}

void set_team_size(int64_t threads) {
  std::lock_guard<std::mutex> lock(dispatch);
  if (team && team->size() == std::max<int64_t>(1, threads)) return;
  team.reset();
  team = std::make_unique<Team>(std::max<int64_t>(1, threads));
}

int64_t pin_team(const std::vector<int64_t>& cpus) {
  std::lock_guard<std::mutex> lock(dispatch);
  return current_team().pin(cpus);
}

StepScope::StepScope() { ++step_scopes; }
StepScope::~StepScope() { --step_scopes; }

}  // namespace pagestream
