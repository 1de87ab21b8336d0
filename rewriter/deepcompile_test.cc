#include <gtest/gtest.h>

#include <chrono>

#include "rewriter/dc_prefetch.h"
#include "rewriter/dc_selective_gather.h"
#include "rewriter/planner.h"
#include "tests/support/prefetch_test_util.h"

namespace dc {
namespace {

using testing::GathersOf;
using testing::HandCosts;
using testing::HandProgram;
using testing::MakeModelCase;
using testing::MustSimulate;

// The checks DeepCompile's rules promise here: a valid stream within the budget, re-gathers
// after their previous copies' releases, the same output for the same input. (Not "no slower":
// their rules do not look at time.)
proto::Schedule RunChecked(Pass& pass, const proto::Schedule& input, const PassContext& context) {
  proto::Schedule out = input;
  auto changed = pass.Run(&out, context);
  EXPECT_TRUE(changed.ok()) << changed.status().message();
  const Status verified = VerifySchedule(out, context);
  EXPECT_TRUE(verified.ok()) << verified.message();
  const SimResult sim = MustSimulate(out, *context.costs);
  if (context.budget_bytes > 0) {
    EXPECT_LE(sim.peak_device_bytes, context.budget_bytes);
  }
  testing::ExpectCopiesInOrder(out, sim);
  proto::Schedule again = input;
  EXPECT_TRUE(pass.Run(&again, context).ok());
  EXPECT_EQ(again.SerializeAsString(), out.SerializeAsString());
  return out;
}

// The multi-tensor gathers of `s`, in stream order, with the compute-stream instruction each
// waits for (-1: none).
std::vector<std::pair<std::vector<int>, int>> GatherGroups(const proto::Schedule& s) {
  std::vector<std::pair<std::vector<int>, int>> groups;
  for (const auto& instr : s.instructions()) {
    if (instr.kind() != proto::INSTR_ALL_GATHER) continue;
    int issue = -1;
    for (int d : instr.deps()) {
      if (s.instructions(d).stream() == proto::STREAM_COMPUTE) issue = d;
    }
    groups.emplace_back(std::vector<int>(instr.tensors().begin(), instr.tensors().end()), issue);
  }
  return groups;
}

// Forward only: f0 reads p0, f1 p1 (both big), f2 p2, f3 p3 (both small).
struct FourGathers {
  FourGathers() {
    p0 = program.Param("p0", 400'000);
    p1 = program.Param("p1", 400'000);
    p2 = program.Param("p2", 4000);
    p3 = program.Param("p3", 4000);
    std::vector<int> a;
    for (const char* name : {"a0", "a1", "a2", "a3"}) a.push_back(program.Activation(name, 4000));
    program.Op("f0", proto::PHASE_FORWARD, {p0}, {a[0]});
    program.Op("f1", proto::PHASE_FORWARD, {a[0], p1}, {a[1]});
    program.Op("f2", proto::PHASE_FORWARD, {a[1], p2}, {a[2]});
    program.Op("f3", proto::PHASE_FORWARD, {a[2], p3}, {a[3]});
    schedule = program.Schedule(R"(
      0: all_gather gather m0 [p0]
      1: compute compute m0 f0 deps=0
      2: release compute m0 [p0] deps=1
      3: all_gather gather m0 [p1]
      4: compute compute m0 f1 deps=3
      5: release compute m0 [p1, a0] deps=4
      6: all_gather gather m0 [p2]
      7: compute compute m0 f2 deps=6
      8: release compute m0 [p2, a1] deps=7
      9: all_gather gather m0 [p3]
      10: compute compute m0 f3 deps=9
      11: release compute m0 [p3, a2, a3] deps=10
    )");
    // Gathers: 1 s + bytes at 40 kB/s: 1.1 s small, 11 s big.
    costs = HandCosts(program.program(), 1.0, 1.0, 40'000);
  }
  HandProgram program;
  int p0 = -1, p1 = -1, p2 = -1, p3 = -1;
  proto::Schedule schedule;
  CostModel costs;
};

constexpr int64_t kFourPersistent = 808'000;  // the params' fp32 shards on one rank

TEST(DcPrefetch, FusesByTheLatencyRuleAndHoistsToTheGraphStart) {
  FourGathers c;
  DcPrefetchPass pass;
  const proto::Schedule out = RunChecked(pass, c.schedule, PassContext{&c.costs, 0});
  // Walking back: p3 opens a group; p2 joins (max(1.1, 1.1) x 1.2 > t(8 kB) = 1.2); p1 joins
  // (11 x 1.2 > t(408 kB) = 11.2); p0 does not (11.2 x 1.2 < t(808 kB) = 21.2). Without a
  // memory limit both groups are issued at the graph's start.
  const auto groups = GatherGroups(out);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0], std::make_pair(std::vector<int>{c.p0}, -1));
  EXPECT_EQ(groups[1], std::make_pair(std::vector<int>{c.p1, c.p2, c.p3}, -1));
}

TEST(DcPrefetch, IssuesAGroupWhereThePreviousNodesPeakLeavesNoRoom) {
  FourGathers c;
  // f0's profiled peak is p0 + a0 = 404000 over the shards; hoisting the 408000 bytes of
  // p1..p3 above it would need 812000, over 90% of this budget (700000 over the shards): the
  // group is issued right after the node after f0 (p0's release).
  const int64_t budget = (kFourPersistent + 700'000) * 10 / 9;
  DcPrefetchPass pass;
  const proto::Schedule out = RunChecked(pass, c.schedule, PassContext{&c.costs, budget});
  const auto groups = GatherGroups(out);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0], std::make_pair(std::vector<int>{c.p0}, -1));
  EXPECT_EQ(groups[1].first, (std::vector<int>{c.p1, c.p2, c.p3}));
  ASSERT_GE(groups[1].second, 0);
  EXPECT_EQ(out.instructions(groups[1].second).kind(), proto::INSTR_RELEASE);
}

TEST(DcPrefetch, CapsTheBufferedBytes) {
  FourGathers c;
  DcPrefetchOptions options;
  options.max_buffered_bytes = 300'000;  // less than one big param
  DcPrefetchPass pass(options);
  const proto::Schedule out = RunChecked(pass, c.schedule, PassContext{&c.costs, 0});
  // Every group is issued as soon as it closes: nothing is hoisted past a big param's node.
  for (const auto& [tensors, issue] : GatherGroups(out)) {
    if (tensors.front() != c.p0) {
      EXPECT_GE(issue, 0);
    }
  }
}

// Two micro-steps; pa small and pb big read once per micro-step, pc (medium) twice.
struct ThreeParams {
  ThreeParams() : program(/*gas=*/2) {
    pa = program.Param("pa", 4000);
    pb = program.Param("pb", 400'000);
    pc = program.Param("pc", 40'000);
    const int a0 = program.Activation("a0", 4000);
    const int a1 = program.Activation("a1", 4000);
    const int a2 = program.Activation("a2", 4000);
    program.Op("f0", proto::PHASE_FORWARD, {pa, pc}, {a0});
    program.Op("f1", proto::PHASE_FORWARD, {a0, pb}, {a1});
    program.Op("f2", proto::PHASE_FORWARD, {a1, pc}, {a2});
    std::string text;
    for (int m = 0; m < 2; ++m) {
      const std::string mm = " m" + std::to_string(m) + " ";
      const int base = 10 * m;
      auto at = [&](int k) { return std::to_string(base + k); };
      text += "all_gather gather" + mm + "[pa]\n";
      text += "all_gather gather" + mm + "[pc]\n";
      text += "compute compute" + mm + "f0 deps=" + at(0) + "," + at(1) + "\n";
      text += "release compute" + mm + "[pa, pc] deps=" + at(2) + "\n";
      text += "all_gather gather" + mm + "[pb]\n";
      text += "compute compute" + mm + "f1 deps=" + at(4) + "\n";
      text += "release compute" + mm + "[pb, a0] deps=" + at(5) + "\n";
      text += "all_gather gather" + mm + "[pc]\n";
      text += "compute compute" + mm + "f2 deps=" + at(7) + "\n";
      text += "release compute" + mm + "[pc, a1, a2] deps=" + at(8) + "\n";
    }
    schedule = program.Schedule(text);
    // Gathers: 1 s + bytes at 400 kB/s. Seconds per byte over one micro-step: pa 1.01 / 4000,
    // pc 2 x 1.1 / 40000, pb 2 / 400000: pa, pc, pb.
    costs = HandCosts(program.program(), 1.0, 1.0, 400'000);
  }
  HandProgram program;
  int pa = -1, pb = -1, pc = -1;
  proto::Schedule schedule;
  CostModel costs;
};

TEST(DcSelectiveGather, PersistsTheLongestPrefixByTimePerByteThatFits) {
  ThreeParams c;
  const int64_t peak = testing::ReferenceSim(c.schedule, c.costs).peak_device_bytes;
  // available = 90% of the budget - the peak: room for pa and pc (44000), not pb.
  const int64_t budget = (peak + 45'000) * 10 / 9 + 1;
  DcSelectiveGatherPass pass;
  const proto::Schedule out = RunChecked(pass, c.schedule, PassContext{&c.costs, budget});
  EXPECT_EQ(GathersOf(out, c.pa), 1);
  EXPECT_EQ(GathersOf(out, c.pc), 1);
  EXPECT_EQ(GathersOf(out, c.pb), 2);
  // Only pa fits.
  const int64_t small = (peak + 10'000) * 10 / 9 + 1;
  const proto::Schedule only_pa = RunChecked(pass, c.schedule, PassContext{&c.costs, small});
  EXPECT_EQ(GathersOf(only_pa, c.pa), 1);
  EXPECT_EQ(GathersOf(only_pa, c.pc), 4);
  // Unlimited memory: everything.
  const proto::Schedule all = RunChecked(pass, c.schedule, PassContext{&c.costs, 0});
  EXPECT_EQ(GathersOf(all, c.pb), 1);
}

TEST(DeepCompilePolicy, KeepsTheInvariantsOnModels) {
  for (const auto& [preset, gas] :
       {std::make_pair("tiny", 1), std::make_pair("tiny", 3), std::make_pair("small", 2)}) {
    const auto c = MakeModelCase(preset, gas, ClusterShape{1, 2});
    const int64_t peak = MustSimulate(c.schedule, c.costs).peak_device_bytes;
    for (int64_t budget : {int64_t{0}, peak + peak / 4}) {
      const PassContext context{&c.costs, budget};
      DcPrefetchPass prefetch;
      DcSelectiveGatherPass selective;
      RunChecked(selective, RunChecked(prefetch, c.schedule, context), context);
    }
  }
}

// ----- the policies side by side -----

TEST(Policies, AreListedAndBuilt) {
  const std::vector<std::string> policies = PolicyNames();
  for (const char* name : {"baseline", "deepcompile", "dc"}) {
    EXPECT_NE(std::find(policies.begin(), policies.end(), name), policies.end()) << name;
    EXPECT_TRUE(MakePipeline(name).ok()) << name;
  }
  auto unknown = MakePipeline("fastest");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("deepcompile"), std::string::npos);
}

TEST(Policies, PipelinesCanBeNamedPassByPass) {
  auto pipeline = MakePipelineFromNames({"zero3", "bucket", "unshard", "prefetch"});
  ASSERT_TRUE(pipeline.ok());
  EXPECT_EQ((*pipeline)->PassNames(),
            (std::vector<std::string>{"zero3", "bucket", "unshard", "prefetch"}));
  auto unknown = MakePipelineFromNames({"zero3", "prefech"});
  ASSERT_FALSE(unknown.ok());
  const std::string message = unknown.status().message();
  EXPECT_NE(message.find("prefech"), std::string::npos);
  for (const std::string& known : PassNames()) {
    EXPECT_NE(message.find(known), std::string::npos) << known;
  }
}

TEST(Policies, APlanRequestCanNameItsPasses) {
  const auto c = MakeModelCase("tiny", 1, ClusterShape{1, 2});
  PlanRequest request;
  request.program = c.schedule.program();
  request.world_size = c.schedule.world_size();
  request.costs = c.costs;
  request.passes = {"zero3", "bucket"};
  auto plan = MakePlan(request);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  ASSERT_EQ(plan->passes_size(), 2);
  EXPECT_EQ(plan->passes(1).name(), "bucket");
  request.passes = {"zero3", "no-such-pass"};
  EXPECT_FALSE(MakePlan(request).ok());
}

struct PolicyResult {
  double step_seconds = 0;
  int64_t peak_bytes = 0;
  double plan_seconds = 0;
};

PolicyResult Plan(const std::string& policy, const testing::ModelCase& c, int64_t budget) {
  PlanRequest request;
  request.program = c.schedule.program();
  request.world_size = c.schedule.world_size();
  request.backend = "cuda";
  request.device = "h100-sxm";
  request.budget_bytes = budget;
  request.policy = policy;
  request.costs = c.costs;
  const auto start = std::chrono::steady_clock::now();
  auto plan = MakePlan(request);
  PolicyResult result;
  result.plan_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(plan.ok()) << policy << ": " << plan.status().message();
  if (!plan.ok()) return result;
  result.step_seconds = plan->prediction().step_seconds();
  result.peak_bytes = plan->prediction().peak_device_bytes();
  return result;
}

// Llama 3 70B on 32 simulated H100s (4 nodes of 8), sequence 1024, micro-batch 1, 80 GB.
class Llama70B : public ::testing::TestWithParam<int> {};

TEST_P(Llama70B, DcBeatsBaselineAndDeepCompileWithinTheBudget) {
  const int gas = GetParam();
  const auto c = MakeModelCase("llama3-70b", gas, ClusterShape{4, 8}, 1024);
  const int64_t budget = 80'000'000'000;
  const PolicyResult baseline = Plan("baseline", c, budget);
  const PolicyResult deepcompile = Plan("deepcompile", c, budget);
  const PolicyResult dc = Plan("dc", c, budget);
  EXPECT_LT(dc.step_seconds, baseline.step_seconds);
  EXPECT_LT(dc.step_seconds, deepcompile.step_seconds);
  EXPECT_LE(dc.peak_bytes, budget);
  EXPECT_LE(deepcompile.peak_bytes, budget);
  ::testing::Test::RecordProperty("baseline_step_seconds", std::to_string(baseline.step_seconds));
  ::testing::Test::RecordProperty("deepcompile_step_seconds",
                                  std::to_string(deepcompile.step_seconds));
  ::testing::Test::RecordProperty("dc_step_seconds", std::to_string(dc.step_seconds));
  ::testing::Test::RecordProperty("dc_plan_seconds", std::to_string(dc.plan_seconds));
  // Planning time is bench/plan_bench's and bench/speed_bench's to measure: tests never assert
  // speed.
}

INSTANTIATE_TEST_SUITE_P(Gas, Llama70B, ::testing::Values(1, 16));

}  // namespace
}  // namespace dc
