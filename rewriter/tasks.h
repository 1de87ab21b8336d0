// Work split over threads for the planner: independent tasks whose results the caller reads in
// their order afterwards, so what is planned does not depend on the number of threads. Private
// to rewriter/.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <set>
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

// The threads one plan may use at once (PlanRequest::threads), as slots shared by the work
// running at the same time: each thread that plans holds one (the planner's own from the start),
// a thread that waits gives its slot back, and a packing borrows idle ones for the packings it
// may make at once. What is planned never depends on how many were idle. Thread-safe.
class ThreadShare {
 public:
  // `threads` slots, one of them held by the creating thread.
  explicit ThreadShare(int threads) : threads_(std::max(1, threads)), idle_(threads_ - 1) {}
  ThreadShare(const ThreadShare&) = delete;
  ThreadShare& operator=(const ThreadShare&) = delete;

  int threads() const { return threads_; }
  // Threads waiting in Take now.
  int waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(waiting_.size());
  }
  // Up to `most` idle slots, at once (none while a thread waits to take one back); the caller
  // gives them back when done.
  int Borrow(int most) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!waiting_.empty()) return 0;
    const int n = std::clamp(most, 0, idle_);
    idle_ -= n;
    return n;
  }
  void GiveBack(int n) {
    if (n <= 0) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle_ += n;
    }
    changed_.notify_all();
  }
  // One slot, waiting until one is idle; of the waiting threads, the lowest `priority` first.
  void Take(int priority) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto me = waiting_.insert(priority);
    changed_.wait(lock, [&] { return idle_ > 0 && *waiting_.begin() == priority; });
    waiting_.erase(me);
    --idle_;
    lock.unlock();
    changed_.notify_all();
  }

 private:
  const int threads_;
  mutable std::mutex mu_;
  std::condition_variable changed_;
  int idle_;
  std::multiset<int> waiting_;
};

}  // namespace dc::rewriter_internal
