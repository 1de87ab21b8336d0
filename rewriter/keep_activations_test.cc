#include "rewriter/keep_activations.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "machine/estimate.h"
#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/memory_plan.h"
#include "rewriter/planner.h"
#include "rewriter/verifier.h"
#include "rewriter/zero3.h"

namespace dc {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kGas = 2;

proto::Schedule TinyZero3(bool recompute, CostModel* costs) {
  ModelOverrides overrides;
  overrides.layers = 4;
  overrides.gas = kGas;
  overrides.recompute_layers = recompute;
  auto config = MakeConfig("tiny", overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  proto::Schedule s;
  s.set_world_size(kWorld);
  *s.mutable_program() = *program;
  Zero3Pass zero3;
  EXPECT_TRUE(zero3.Run(&s, PassContext{}).ok());
  auto hw = FindHardware("h100-sxm");
  EXPECT_TRUE(hw.ok()) << hw.status().message();
  *costs = EstimateCostModel(*program, *hw, ClusterShape{1, kWorld});
  return s;
}

int RecomputeOps(const proto::Program& program) {
  return static_cast<int>(std::count_if(program.ops().begin(), program.ops().end(),
                                        [](const proto::Op& op) { return op.has_recompute_of(); }));
}

int Count(const proto::Schedule& s, proto::InstrKind kind) {
  return static_cast<int>(
      std::count_if(s.instructions().begin(), s.instructions().end(),
                    [kind](const proto::Instruction& i) { return i.kind() == kind; }));
}

// Without a budget every recomputed layer keeps its activations: each recompute op becomes a
// rename of its forward twin's outputs, and the verifier (every op once per micro-step), the
// simulator and the memory plan accept the result.
TEST(KeepActivations, UnlimitedMemoryKeepsEveryLayer) {
  CostModel costs;
  proto::Schedule s = TinyZero3(true, &costs);
  const int recomputes = RecomputeOps(s.program());
  ASSERT_GT(recomputes, 0);
  auto before = Simulate(s, costs);
  ASSERT_TRUE(before.ok());
  KeepActivationsPass pass;
  auto changed = pass.Run(&s, PassContext{&costs, 0});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(pass.stats().candidates, 4 * kGas);
  EXPECT_EQ(pass.stats().kept, 4 * kGas);
  EXPECT_EQ(pass.stats().renames, recomputes * kGas);
  EXPECT_EQ(Count(s, proto::INSTR_RENAME), recomputes * kGas);
  const proto::Program& program = s.program();
  for (const proto::Instruction& instr : s.instructions()) {
    if (instr.kind() == proto::INSTR_COMPUTE) {
      EXPECT_FALSE(program.ops(instr.op()).has_recompute_of())
          << program.ops(instr.op()).name() << " still runs";
    }
    if (instr.kind() != proto::INSTR_RENAME) continue;
    const proto::Op& op = program.ops(instr.op());
    ASSERT_EQ(instr.tensors_size(), op.outputs_size());
    ASSERT_TRUE(op.has_recompute_of()) << op.name();
    const proto::Op& forward = program.ops(op.recompute_of());
    for (int k = 0; k < op.outputs_size(); ++k) {
      EXPECT_EQ(instr.tensors(k), forward.outputs(k)) << op.name();
    }
  }
  EXPECT_TRUE(VerifySchedule(s, PassContext{&costs, 0}).ok());
  auto after = Simulate(s, costs);
  ASSERT_TRUE(after.ok()) << after.status().message();
  EXPECT_GT(after->peak_device_bytes, before->peak_device_bytes);
  EXPECT_LT(after->compute_seconds, before->compute_seconds);
  // The skipped ops' seconds, each stretched by at most the overlap slowdown where it ran
  // beside a collective.
  const double saved = before->compute_seconds - after->compute_seconds;
  EXPECT_GE(saved, pass.stats().recompute_seconds_saved * (1 - 1e-9));
  EXPECT_LE(saved,
            pass.stats().recompute_seconds_saved * costs.overlap_compute_slowdown * (1 + 1e-9));
  auto plan = PlanMemory(s, MemoryPlanOptions{}, 0, &costs, nullptr);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_GE(plan->arena_bytes(), after->peak_device_bytes);
}

// A budget below what keeping everything needs keeps some layers, and the result fits it.
TEST(KeepActivations, ABudgetKeepsWhatFits) {
  CostModel costs;
  proto::Schedule all = TinyZero3(true, &costs);
  auto recomputing = Simulate(all, costs);
  ASSERT_TRUE(recomputing.ok());
  proto::Schedule kept_all = all;
  KeepActivationsPass unlimited;
  ASSERT_TRUE(unlimited.Run(&kept_all, PassContext{&costs, 0}).ok());
  auto keeping = Simulate(kept_all, costs);
  ASSERT_TRUE(keeping.ok());
  const int64_t budget = (recomputing->peak_device_bytes + keeping->peak_device_bytes) / 2;
  KeepActivationsPass pass;
  auto changed = pass.Run(&all, PassContext{&costs, budget});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_GT(pass.stats().kept, 0);
  EXPECT_LT(pass.stats().kept, pass.stats().candidates);
  auto sim = Simulate(all, costs);
  ASSERT_TRUE(sim.ok());
  EXPECT_LE(sim->peak_device_bytes, budget);
  // At the recomputing schedule's own peak nothing more fits.
  proto::Schedule none = TinyZero3(true, &costs);
  KeepActivationsPass tight;
  auto unchanged = tight.Run(&none, PassContext{&costs, recomputing->peak_device_bytes});
  ASSERT_TRUE(unchanged.ok());
  auto tight_sim = Simulate(none, costs);
  ASSERT_TRUE(tight_sim.ok());
  EXPECT_LE(tight_sim->peak_device_bytes, recomputing->peak_device_bytes);
}

// dc plans a recomputing program with and without kept activations, and with half or all of
// Adam's state to spend before offload, and keeps the fastest: never slower than any of them.
TEST(KeepActivations, DcKeepsTheFastestOfItsAlternatives) {
  CostModel costs;
  const proto::Schedule zero3 = TinyZero3(true, &costs);
  auto baseline = Simulate(zero3, costs);
  ASSERT_TRUE(baseline.ok());
  PlanRequest request;
  request.program = zero3.program();
  request.world_size = kWorld;
  request.costs = costs;
  request.budget_bytes = baseline->peak_device_bytes * 11 / 10;
  auto dc = MakePlan(request);
  ASSERT_TRUE(dc.ok()) << dc.status().message();
  const std::vector<std::vector<std::string>> alternatives = {
      {"zero3", "keep-activations", "bucket", "prefetch", "unshard", "prefetch", "offload",
       "memory-plan"},
      {"zero3", "bucket", "prefetch", "unshard", "prefetch", "offload", "memory-plan"}};
  for (const auto& passes : alternatives) {
    PlanRequest one = request;
    one.policy = "";
    one.passes = passes;
    auto plan = MakePlan(one);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    EXPECT_LE(dc->prediction().step_seconds(), plan->prediction().step_seconds())
        << passes.size() << " passes";
  }
  EXPECT_LE(dc->prediction().peak_device_bytes(), request.budget_bytes);
}

TEST(KeepActivations, NothingToDoWithoutRecompute) {
  CostModel costs;
  proto::Schedule s = TinyZero3(false, &costs);
  const proto::Schedule before = s;
  KeepActivationsPass pass;
  auto changed = pass.Run(&s, PassContext{&costs, 0});
  ASSERT_TRUE(changed.ok());
  EXPECT_FALSE(*changed);
  EXPECT_EQ(s.instructions_size(), before.instructions_size());
  EXPECT_EQ(pass.Summary(), "no recomputed layer");
}

// A rename of a buffer that is not live, or into the wrong sizes, is refused by the simulator.
TEST(KeepActivations, TheSimulatorChecksRenames) {
  CostModel costs;
  proto::Schedule s = TinyZero3(true, &costs);
  KeepActivationsPass pass;
  ASSERT_TRUE(pass.Run(&s, PassContext{&costs, 0}).ok());
  int rename = -1;
  for (int i = 0; i < s.instructions_size() && rename < 0; ++i) {
    if (s.instructions(i).kind() == proto::INSTR_RENAME) rename = i;
  }
  ASSERT_GE(rename, 0);
  proto::Schedule twice = s;
  *twice.add_instructions() = s.instructions(rename);
  auto refused = Simulate(twice, costs);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("which is not live"), std::string::npos)
      << refused.status().message();
  proto::Schedule wrong = s;
  wrong.mutable_instructions(rename)->set_tensors(0, wrong.program().tensors_size() - 1);
  EXPECT_FALSE(Simulate(wrong, costs).ok());
}

}  // namespace
}  // namespace dc
