// The planner's threads: the share of slots (rewriter/tasks.h) and candidates planned at once,
// which stop where they would have stopped planned one by one.
#include "rewriter/tasks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "machine/estimate.h"
#include "machine/hardware.h"
#include "models/model.h"
#include "rewriter/planner.h"

namespace dc {
namespace {

using rewriter_internal::ThreadShare;

// Waits until `count` threads wait in share.Take.
void UntilWaiting(const ThreadShare& share, int count) {
  while (share.waiting() < count) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

TEST(ThreadShare, LendsIdleSlotsAndATakeWaitsForOne) {
  ThreadShare share(3);  // one held by this thread
  EXPECT_EQ(share.threads(), 3);
  EXPECT_EQ(share.Borrow(5), 2);
  EXPECT_EQ(share.Borrow(1), 0);
  share.GiveBack(1);
  EXPECT_EQ(share.Borrow(1), 1);
  std::atomic<bool> taken{false};
  std::thread waiter([&] {
    share.Take(0);
    taken = true;
    share.GiveBack(1);
  });
  UntilWaiting(share, 1);
  EXPECT_FALSE(taken);
  share.GiveBack(1);
  waiter.join();
  EXPECT_TRUE(taken);
  EXPECT_EQ(share.waiting(), 0);
  EXPECT_EQ(share.Borrow(3), 1);  // this thread's slot and the one still borrowed are not idle
}

TEST(ThreadShare, TheLowestPriorityWaitingTakesTheFirstSlot) {
  ThreadShare share(1);
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread> waiters;
  for (int priority : {3, 1, 2}) {
    waiters.emplace_back([&, priority] {
      share.Take(priority);
      {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(priority);
      }
      share.GiveBack(1);
    });
  }
  UntilWaiting(share, 3);
  share.GiveBack(1);  // this thread's: the one slot
  for (std::thread& t : waiters) t.join();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

// llama-shaped with recompute at the GPU's memory: dc plans its own split and three others (without
// keep-activations, and both at a relaxed budget), which cannot beat the first before their
// offload and memory plan. Planned at once, they run the passes they run one by one and no more
// (each waits there for the step of the ones before it), and the plan is the same.
TEST(PlannerThreads, ACandidatePlannedAtOnceStopsWhereItWouldOneByOne) {
  ModelOverrides overrides;
  overrides.layers = 4;
  overrides.gas = 4;
  overrides.recompute_layers = true;
  auto config = MakeConfig("llama3-8b", overrides);
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok()) << program.status().message();
  auto hw = FindHardware("h100-sxm");
  ASSERT_TRUE(hw.ok());
  auto cluster = MakeCluster(8, 8);
  ASSERT_TRUE(cluster.ok());
  PlanRequest request;
  request.program = *program;
  request.world_size = 8;
  request.backend = "cuda";
  request.device = hw->name;
  request.costs = EstimateCostModel(*program, *hw, *cluster);
  request.budget_bytes = hw->device_memory_bytes;
  auto passes_run = [&](int threads, proto::Schedule* plan) {
    std::mutex mu;
    std::vector<std::string> names;
    PlanRequest r = request;
    r.threads = threads;
    r.on_pass = [&](const proto::PassRecord& record) {
      std::lock_guard<std::mutex> lock(mu);
      names.push_back(record.name());
    };
    auto made = MakePlan(r);
    EXPECT_TRUE(made.ok()) << made.status().message();
    if (made.ok()) *plan = *made;
    std::sort(names.begin(), names.end());
    return names;
  };
  proto::Schedule one, at_once;
  const std::vector<std::string> one_by_one = passes_run(1, &one);
  const std::vector<std::string> three = passes_run(3, &at_once);
  // Four splits (with and without keep-activations, at two relaxed budgets) ran up to their
  // offload; only the first went on to offload and pack its memory plan, the others stopping
  // there for its step.
  EXPECT_EQ(std::count(one_by_one.begin(), one_by_one.end(), "zero3"), 4);
  EXPECT_EQ(std::count(one_by_one.begin(), one_by_one.end(), "offload"), 1);
  EXPECT_EQ(std::count(one_by_one.begin(), one_by_one.end(), "memory-plan"), 1);
  EXPECT_EQ(three, one_by_one);
  for (auto* plan : {&one, &at_once}) {
    for (auto& record : *plan->mutable_passes()) record.set_seconds(0);
  }
  EXPECT_EQ(at_once.SerializeAsString(), one.SerializeAsString());
}

}  // namespace
}  // namespace dc
