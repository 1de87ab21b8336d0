#include "rewriter/zero3.h"

#include <gtest/gtest.h>

#include <map>

#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/planner.h"
#include "rewriter/verifier.h"

namespace dc {
namespace {

proto::Program TinyProgram(int64_t gas) {
  ModelOverrides overrides;
  overrides.gas = gas;
  auto config = MakeConfig("tiny", overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  return *program;
}

proto::Schedule Baseline(const proto::Program& program, int world) {
  proto::Schedule s;
  s.set_world_size(world);
  s.set_backend("cpu");
  *s.mutable_program() = program;
  Zero3Pass pass;
  auto changed = pass.Run(&s, PassContext{});
  EXPECT_TRUE(changed.ok()) << changed.status().message();
  return s;
}

// Params are gathered once per micro-step for each phase that reads them (the embedding table
// only in forward: its backward needs the tokens, not the table).
TEST(Zero3, GathersEachParamOncePerPhaseOfUseAndReducesEachGradOnce) {
  const int gas = 3;
  const proto::Program program = TinyProgram(gas);
  const proto::Schedule s = Baseline(program, 2);
  std::map<int, int> gathers, reductions;
  int params = 0, grads = 0;
  for (const auto& t : program.tensors()) {
    params += t.role() == proto::ROLE_PARAM;
    grads += t.role() == proto::ROLE_GRAD;
  }
  for (const auto& instr : s.instructions()) {
    for (int t : instr.tensors()) {
      if (instr.kind() == proto::INSTR_ALL_GATHER) ++gathers[t];
      if (instr.kind() == proto::INSTR_REDUCE_SCATTER) ++reductions[t];
    }
  }
  EXPECT_EQ(static_cast<int>(gathers.size()), params);
  for (const auto& [t, n] : gathers) {
    bool forward = false, backward = false;
    for (const auto& op : program.ops()) {
      for (int in : op.inputs()) {
        if (in != t) continue;
        forward |= op.phase() == proto::PHASE_FORWARD;
        backward |= op.phase() == proto::PHASE_BACKWARD;
      }
    }
    EXPECT_EQ(n, gas * (forward + backward)) << program.tensors(t).name();
  }
  // A projection weight is read by its matmul in forward and by the matmul's backward.
  int wq = -1;
  for (const auto& t : program.tensors()) {
    if (t.name() == "layers.0.attn.wq") wq = t.id();
  }
  ASSERT_GE(wq, 0);
  EXPECT_EQ(gathers[wq], 2 * gas);
  EXPECT_EQ(static_cast<int>(reductions.size()), grads);
  for (const auto& [t, n] : reductions) EXPECT_EQ(n, gas) << program.tensors(t).name();
}

TEST(Zero3, PassesTheVerifierAndLeavesNothingLive) {
  const proto::Schedule s = Baseline(TinyProgram(2), 2);
  EXPECT_TRUE(VerifySchedule(s, PassContext{}).ok()) << VerifySchedule(s, PassContext{}).message();
  CostModel costs;
  auto sim = Simulate(s, costs);
  ASSERT_TRUE(sim.ok()) << sim.status().message();
  ASSERT_FALSE(sim->memory_timeline.empty());
  // Only the persistent shards remain at the end of the step.
  const auto persistent = PersistentBytesByKind(s.program(), 2);
  int64_t persistent_total = 0;
  for (int64_t b : persistent) persistent_total += b;
  EXPECT_EQ(sim->memory_timeline.back().total_bytes, persistent_total);
  EXPECT_GT(sim->peak_device_bytes, persistent_total);
}

TEST(Zero3, OptimizerOpsWaitForTheirGradsLastReduction) {
  const proto::Schedule s = Baseline(TinyProgram(2), 2);
  for (int i = 0; i < s.instructions_size(); ++i) {
    const auto& instr = s.instructions(i);
    if (instr.micro_step() != -1) continue;
    ASSERT_EQ(instr.kind(), proto::INSTR_COMPUTE);
    ASSERT_EQ(instr.deps_size(), 1);
    const auto& rs = s.instructions(instr.deps(0));
    EXPECT_EQ(rs.kind(), proto::INSTR_REDUCE_SCATTER);
    EXPECT_EQ(rs.micro_step(), 1);
  }
}

TEST(Verifier, CatchesUseAfterRelease) {
  proto::Schedule s = Baseline(TinyProgram(1), 2);
  // Move the first release of a gathered param to right after its gather.
  for (int i = 0; i < s.instructions_size(); ++i) {
    if (s.instructions(i).kind() != proto::INSTR_ALL_GATHER) continue;
    const int param = s.instructions(i).tensors(0);
    proto::Instruction release;
    release.set_kind(proto::INSTR_RELEASE);
    release.set_stream(proto::STREAM_COMPUTE);
    release.set_micro_step(0);
    release.set_op(-1);
    release.add_tensors(param);
    auto* list = s.mutable_instructions();
    list->Add()->CopyFrom(release);
    for (int j = list->size() - 1; j > i + 1; --j) list->SwapElements(j, j - 1);
    break;
  }
  EXPECT_FALSE(VerifySchedule(s, PassContext{}).ok());
}

TEST(Verifier, CatchesAMissingOp) {
  proto::Schedule s = Baseline(TinyProgram(1), 2);
  for (int i = 0; i < s.instructions_size(); ++i) {
    if (s.instructions(i).micro_step() == -1) {
      s.mutable_instructions()->DeleteSubrange(i, 1);
      break;
    }
  }
  Status status = VerifySchedule(s, PassContext{});
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("runs 0 times"), std::string::npos) << status.message();
}

TEST(Planner, BudgetBelowTheBaselineIsAClearError) {
  PlanRequest request;
  request.program = TinyProgram(1);
  request.world_size = 2;
  request.budget_bytes = 1024;
  auto plan = MakePlan(request);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("over the budget"), std::string::npos)
      << plan.status().message();
  EXPECT_NE(plan.status().message().find("raise --budget"), std::string::npos);
}

TEST(Planner, PlansAreDeterministic) {
  PlanRequest request;
  request.program = TinyProgram(2);
  request.world_size = 2;
  auto a = MakePlan(request);
  auto b = MakePlan(request);
  ASSERT_TRUE(a.ok() && b.ok());
  for (auto* p : {&a.value(), &b.value()}) p->clear_passes();  // pass timings differ
  EXPECT_EQ(a->SerializeAsString(), b->SerializeAsString());
  EXPECT_EQ(a->cache_key(), b->cache_key());
  EXPECT_GT(a->prediction().step_seconds(), 0);
}

}  // namespace
}  // namespace dc
