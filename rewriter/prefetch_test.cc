#include "rewriter/prefetch.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/support/prefetch_test_util.h"

namespace dc {
namespace {

using testing::HandCosts;
using testing::HandProgram;
using testing::MakeModelCase;
using testing::MustSimulate;
using testing::RunAndCheck;

// p0 feeds f0; f1 and f2 only move activations; p1 feeds f3. Only p1's gather has room to
// move: back over f2, f1, f0 as far as the live bytes allow.
struct OneGatherToMove {
  OneGatherToMove() {
    p0 = program.Param("p0", 4000);
    p1 = program.Param("p1", 4000);
    const int a0 = program.Activation("a0", 8000);
    const int a1 = program.Activation("a1", 12000);
    const int a2 = program.Activation("a2", 6000);
    const int a3 = program.Activation("a3", 1000);
    program.Op("f0", proto::PHASE_FORWARD, {p0}, {a0});
    program.Op("f1", proto::PHASE_FORWARD, {a0}, {a1});
    program.Op("f2", proto::PHASE_FORWARD, {a1}, {a2});
    program.Op("f3", proto::PHASE_FORWARD, {a2, p1}, {a3});
    schedule = program.Schedule(R"(
      0: all_gather gather m0 [p0]
      1: compute compute m0 f0 deps=0
      2: release compute m0 [p0] deps=1
      3: compute compute m0 f1
      4: release compute m0 [a0] deps=3
      5: compute compute m0 f2
      6: release compute m0 [a1] deps=5
      7: all_gather gather m0 [p1]
      8: compute compute m0 f3 deps=7
      9: release compute m0 [p1, a2, a3] deps=8
    )");
    costs = HandCosts(program.program(), 1.0, 0.5, 0);
  }
  // The compute-stream instruction p1's gather waits for after prefetch at `budget` (-1: none).
  int IssuePointOfP1(int64_t budget) {
    PrefetchOptions options;
    options.hide_slack = 0;  // as early as memory allows
    PrefetchPass pass(options);
    const proto::Schedule out = RunAndCheck(pass, schedule, PassContext{&costs, budget});
    for (const auto& instr : out.instructions()) {
      if (instr.kind() == proto::INSTR_ALL_GATHER && instr.tensors(0) == p1) {
        return instr.deps_size() == 0 ? -1 : instr.deps(instr.deps_size() - 1);
      }
    }
    return -2;
  }
  // The simulated peak with p1's gather issued after instruction `issue` (-1: at the start).
  int64_t PeakIfIssuedAfter(int issue) {
    proto::Schedule s = schedule;
    s.mutable_instructions(7)->clear_deps();
    if (issue >= 0) s.mutable_instructions(7)->add_deps(issue);
    return MustSimulate(s, costs).peak_device_bytes;
  }

  HandProgram program;
  int p0 = -1, p1 = -1;
  proto::Schedule schedule;
  CostModel costs;
};

TEST(Prefetch, MovesAGatherExactlyAsFarAsTheBudgetAllows) {
  OneGatherToMove c;
  const int64_t persistent = 8000;  // both params' fp32 shards on one rank
  // Live bytes besides p1: 20000 during f1, 18000 during f2, 11000 at the most after it. p1
  // (4000) issued after f1 lives through f2: 22000.
  const int64_t after_f1 = persistent + 22000;
  EXPECT_EQ(c.PeakIfIssuedAfter(3), after_f1);
  EXPECT_EQ(c.IssuePointOfP1(after_f1), 3);
  // One byte less: f2 is the last point that p1 may not overlap; issued after it.
  EXPECT_EQ(c.IssuePointOfP1(after_f1 - 1), 5);
  // With room for it during f1 too, it goes back to the start (the earliest issue point all
  // the way, as the peak does not grow further).
  EXPECT_EQ(c.IssuePointOfP1(persistent + 24000), -1);
}

TEST(Prefetch, AgreesWithTheSimulatorAtEveryBudget) {
  OneGatherToMove c;
  // The earliest issue point whose full simulation fits is what the incremental curve finds.
  const std::vector<int> points = {-1, 1, 2, 3, 4, 5, 6};
  for (int64_t budget = 8000 + 20000; budget <= 8000 + 25000; budget += 500) {
    int expected = 6;
    for (int point : points) {
      if (c.PeakIfIssuedAfter(point) <= budget) {
        expected = point;
        break;
      }
    }
    EXPECT_EQ(c.IssuePointOfP1(budget), expected) << budget;
  }
}

TEST(Prefetch, TheTimeRuleIssuesNoEarlierThanNeededToHide) {
  OneGatherToMove c;
  // Unlimited memory: p1 (0.5 s) is issued after the last instruction that leaves 2 x 0.5 s
  // before f3 starts: f2's end leaves none, f1's end leaves f2 (1 s).
  PrefetchPass pass;
  const proto::Schedule out = RunAndCheck(pass, c.schedule, PassContext{&c.costs, 0});
  EXPECT_EQ(out.instructions(7).deps_size(), 1);
  EXPECT_EQ(out.instructions(7).deps(0), 4);  // the release after f1, which ends with it
}

TEST(Prefetch, CapsTheGathersInFlight) {
  OneGatherToMove c;
  PrefetchOptions options;
  options.hide_slack = 0;
  options.unlimited_hide_slack = 100;  // would issue everything at the start
  options.max_gathers_in_flight = 1;   // but p1 waits for p0's use
  PrefetchPass pass(options);
  const proto::Schedule out = RunAndCheck(pass, c.schedule, PassContext{&c.costs, 0});
  ASSERT_EQ(out.instructions(7).deps_size(), 1);
  EXPECT_GE(out.instructions(7).deps(0), 1);
}

TEST(Prefetch, DoesNothingWhereStreamsAreSerial) {
  OneGatherToMove c;
  c.costs.serial_streams = true;
  PrefetchPass pass;
  proto::Schedule s = c.schedule;
  auto changed = pass.Run(&s, PassContext{&c.costs, 0});
  ASSERT_TRUE(changed.ok());
  EXPECT_FALSE(*changed);
  EXPECT_EQ(s.SerializeAsString(), c.schedule.SerializeAsString());
}

TEST(Prefetch, NeedsACostModel) {
  OneGatherToMove c;
  PrefetchPass pass;
  EXPECT_FALSE(pass.Run(&c.schedule, PassContext{}).ok());
}

class PrefetchOnModels : public ::testing::TestWithParam<std::tuple<const char*, int>> {};

TEST_P(PrefetchOnModels, KeepsTheInvariantsAtEveryBudget) {
  const auto [preset, gas] = GetParam();
  const auto c = MakeModelCase(preset, gas, ClusterShape{1, 2});
  const int64_t peak = MustSimulate(c.schedule, c.costs).peak_device_bytes;
  PrefetchPass pass;
  for (int64_t budget : {int64_t{0}, peak, peak + peak / 4}) {
    RunAndCheck(pass, c.schedule, PassContext{&c.costs, budget});
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, PrefetchOnModels,
                         ::testing::Values(std::make_tuple("tiny", 1), std::make_tuple("tiny", 3),
                                           std::make_tuple("small", 2)));

TEST(Prefetch, KeepsTheInvariantsOnLlama8BOnEightH100s) {
  const auto c = MakeModelCase("llama3-8b", 2, ClusterShape{1, 8}, 1024);
  const int64_t budget = 80'000'000'000;
  PrefetchPass pass;
  const proto::Schedule out = RunAndCheck(pass, c.schedule, PassContext{&c.costs, budget});
  // Every gather now waits for the compute-stream point it is issued after.
  for (const auto& instr : out.instructions()) {
    if (instr.kind() == proto::INSTR_ALL_GATHER && instr.micro_step() > 0) {
      EXPECT_GT(instr.deps_size(), 0);
    }
  }
}

}  // namespace
}  // namespace dc
