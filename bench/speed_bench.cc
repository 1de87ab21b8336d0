// speed_bench: how long the planner's building blocks take at Llama-3 70B scale, beside the
// targets the tests once asserted. Speed is measured here and never asserted in a test: a test
// must not fail because a sanitizer build or a busy machine is slower.
//
//   speed_bench    each step once (the best of kRepeats), one line each:
//                  "<step>: <seconds> s (target <seconds> s) ok|OVER"
//
// The steps: building the 70B program; its roofline estimate; the zero3 schedule of 70B at GAS 16
// on 16 ranks simulated (about 127k instructions); that schedule's memory plan in simulated time
// and in instruction order; dc's whole plan of 70B at GAS 1 on 32 ranks (80 GB budget). Run it
// pinned to one core (taskset -c 0) for times that mean something. Exits 1 only on an error,
// never on a time over target.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>

#include "machine/estimate.h"
#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/memory_packer.h"
#include "rewriter/planner.h"
#include "rewriter/zero3.h"

namespace {

constexpr int kRepeats = 3;

// Best wall-clock seconds of `step` over kRepeats runs; false when a run fails.
bool Time(const char* name, double target_seconds, const std::function<bool()>& step) {
  double best = 1e300;
  for (int i = 0; i < kRepeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (!step()) {
      std::fprintf(stderr, "speed_bench: %s failed\n", name);
      return false;
    }
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("%-44s %8.3f s (target %.3f s) %s\n", name, best, target_seconds,
              best <= target_seconds ? "ok" : "OVER");
  return true;
}

}  // namespace

int main() {
  using namespace dc;
  ModelOverrides overrides;
  overrides.seq = 1024;
  overrides.micro_batch = 1;
  auto config = MakeConfig("llama3-70b", overrides);
  if (!config.ok()) return 1;
  proto::Program program;
  bool ok = Time("build llama3-70b", 0.1, [&] {
    auto built = BuildProgram(*config);
    if (built.ok()) program = *built;
    return built.ok();
  });
  auto hw = FindHardware("h100-sxm");
  if (!ok || !hw.ok()) return 1;
  const ClusterShape cluster{4, 8};
  CostModel costs;
  ok = Time("estimate llama3-70b (32 ranks)", 0.05, [&] {
    costs = EstimateCostModel(program, *hw, cluster);
    return static_cast<int>(costs.op_seconds.size()) == program.ops_size();
  });
  if (!ok) return 1;

  overrides.gas = 16;
  auto gas16_config = MakeConfig("llama3-70b", overrides);
  if (!gas16_config.ok()) return 1;
  auto gas16 = BuildProgram(*gas16_config);
  if (!gas16.ok()) return 1;
  proto::Schedule s;
  s.set_world_size(16);
  *s.mutable_program() = *gas16;
  if (!Zero3Pass().Run(&s, PassContext{}).ok()) return 1;
  const CostModel gas16_costs = EstimateCostModel(*gas16, *hw, ClusterShape{2, 8});
  ok = Time("simulate zero3 of 70B, GAS 16, 16 ranks", 0.5,
            [&] { return Simulate(s, gas16_costs).ok(); });
  ok = ok && Time("memory plan of it (simulated time)", 0.4, [&] {
         return PlanMemory(s, MemoryPlanOptions{}, 0, &gas16_costs, nullptr).ok();
       });
  MemoryPlanOptions in_order;
  in_order.lifetimes = MemoryPlanOptions::Lifetimes::kInstructionOrder;
  ok = ok && Time("memory plan of it (instruction order)", 0.4,
                  [&] { return PlanMemory(s, in_order, 0, &gas16_costs, nullptr).ok(); });
  if (!ok) return 1;

  PlanRequest request;
  request.program = program;
  request.world_size = cluster.nodes * cluster.gpus_per_node;
  request.backend = "cuda";
  request.device = hw->name;
  request.budget_bytes = 80'000'000'000;
  request.policy = "dc";
  request.costs = costs;
  ok = Time("dc plan of 70B, GAS 1, 32 ranks, 80 GB", 1.0, [&] { return MakePlan(request).ok(); });
  return ok ? 0 : 1;
}
