#include "rewriter/optimizer_order.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/prefetch_test_util.h"

namespace dc {
namespace {

using testing::HandProgram;
using testing::MakeModelCase;
using testing::MustSimulate;
using testing::RunAndCheck;

// The names of the optimizer phase's ops, in stream order.
std::vector<std::string> OptimizerOps(const proto::Schedule& schedule) {
  std::vector<std::string> names;
  for (const auto& instr : schedule.instructions()) {
    if (instr.kind() == proto::INSTR_COMPUTE && instr.micro_step() == -1) {
      names.push_back(schedule.program().ops(instr.op()).name());
    }
  }
  return names;
}

TEST(OptimizerOrder, StepsEachParamOnceItsGradIsReduced) {
  // llama3-8b on 8 H100s: zero3 emits the optimizer phase in param order, so the embedding's
  // step (its grad is the backward's last, and its reduce-scatter of a 128256 x 4096 table the
  // longest) comes first and every other param's step waits behind it.
  const auto c = MakeModelCase("llama3-8b", 1, {1, 8}, 1024);
  const std::vector<std::string> before = OptimizerOps(c.schedule);
  ASSERT_FALSE(before.empty());
  EXPECT_EQ(before.front(), "embed.adamw");

  OptimizerOrderPass pass;
  const proto::Schedule out = RunAndCheck(pass, c.schedule, PassContext{&c.costs, 0});
  const std::vector<std::string> after = OptimizerOps(out);
  ASSERT_EQ(after.size(), before.size());
  // The same ops, the embedding's last: the output layer's grad is reduced first.
  EXPECT_EQ(after.back(), "embed.adamw");
  EXPECT_EQ(after.front(), "lm_head.adamw");
  std::vector<std::string> sorted_before = before, sorted_after = after;
  std::sort(sorted_before.begin(), sorted_before.end());
  std::sort(sorted_after.begin(), sorted_after.end());
  EXPECT_EQ(sorted_before, sorted_after);
  EXPECT_LT(MustSimulate(out, c.costs).step_seconds,
            MustSimulate(c.schedule, c.costs).step_seconds);
  EXPECT_NE(pass.Summary().find("reordered"), std::string::npos) << pass.Summary();

  // Run again on its own output, the order stands.
  proto::Schedule again = out;
  auto changed = pass.Run(&again, PassContext{&c.costs, 0});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_FALSE(*changed) << pass.Summary();
}

TEST(OptimizerOrder, KeepsDepsInsideThePhaseInOrder) {
  // Two grads, g1 reduced first; the steps s0 (after g0's reduce-scatter) and s1 (after g1's),
  // then `tail`, which waits for both. Ops take 1 s, a reduce-scatter 1 s (the reduce stream
  // runs g1's at 2-3 s, g0's at 3-4 s). In stream order s0 waits for g0's, then s1 and tail:
  // 7 s. Ready first, s1 runs beside g0's reduce-scatter: 6 s, and tail stays after both.
  HandProgram program;
  const int x = program.Activation("x", 4000);
  const int p0 = program.Param("p0", 1000), p1 = program.Param("p1", 1000);
  const int g0 = program.Grad("g0", p0, 4000), g1 = program.Grad("g1", p1, 4000);
  program.Op("seed", proto::PHASE_FORWARD, {}, {x});
  program.Op("b1", proto::PHASE_BACKWARD, {x}, {g1});
  program.Op("b0", proto::PHASE_BACKWARD, {x}, {g0});
  program.Op("s0", proto::PHASE_OPTIMIZER, {}, {});
  program.Op("s1", proto::PHASE_OPTIMIZER, {}, {});
  program.Op("tail", proto::PHASE_OPTIMIZER, {}, {});
  const proto::Schedule schedule = program.Schedule(R"(
    0: compute compute m0 seed
    1: compute compute m0 b1
    2: reduce_scatter reduce m0 [g1] deps=1
    3: release reduce m0 [g1] deps=2
    4: compute compute m0 b0
    5: reduce_scatter reduce m0 [g0] deps=4
    6: release reduce m0 [g0] deps=5
    7: release compute m0 [x] deps=4
    8: compute compute opt s0 deps=5
    9: compute compute opt s1 deps=2
    10: compute compute opt tail deps=8,9
  )");
  const CostModel costs = testing::HandCosts(program.program(), 1.0, 1.0, 0);
  EXPECT_NEAR(MustSimulate(schedule, costs).step_seconds, 7, 1e-9);
  OptimizerOrderPass pass;
  const proto::Schedule out = RunAndCheck(pass, schedule, PassContext{&costs, 0});
  EXPECT_EQ(OptimizerOps(out), (std::vector<std::string>{"s1", "s0", "tail"}));
  EXPECT_NEAR(MustSimulate(out, costs).step_seconds, 6, 1e-9);
}

}  // namespace
}  // namespace dc
