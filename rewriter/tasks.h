// Work split over threads for the planner: independent tasks whose results the caller reads in
// their order afterwards, so what is planned does not depend on the number of threads. Private
// to rewriter/.
#pragma once

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <vector>

namespace dc::rewriter_internal {

// Runs task(i) for every i in [0, n), on up to `threads` threads at once (the caller's among
// them), started in order of i; returns when every task has run. Each task must touch only its
// own results and what no other task writes.
template <typename Task>
void RunTasks(int n, int threads, const Task& task) {
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int i = next++; i < n; i = next++) task(i);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::min(threads, n); ++t) {
    // Where the system starts no more threads, those started (and the caller) take the rest.
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;
    }
  }
  worker();
  for (std::thread& thread : pool) thread.join();
}

}  // namespace dc::rewriter_internal
