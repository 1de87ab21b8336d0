#include "rewriter/host_optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "machine/estimate.h"
#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/memory_plan.h"
#include "rewriter/offload_all.h"
#include "rewriter/planner.h"
#include "rewriter/verifier.h"
#include "rewriter/zero3.h"
#include "schemas/op_kinds.h"

namespace dc {
namespace {

constexpr int kWorld = 2;

// The zero3 schedule of tiny in `dtype` on two H100s, and its cost model.
proto::Schedule TinyZero3(proto::DType dtype, CostModel* costs,
                          const ModelOverrides& overrides = {}) {
  auto config = MakeConfig("tiny", overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  config->set_compute_dtype(dtype);
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

int64_t Sum(const std::vector<int64_t>& bytes) {
  int64_t sum = 0;
  for (int64_t b : bytes) sum += b;
  return sum;
}

// With clipping, the grads' norm stays on the device (beside the grads) and its all-reduce on
// the reduce stream; every step on the host keeps its wait for the all-reduce, and the schedule
// verifies (the order of CheckShardReductions included).
TEST(HostOptimizer, ClippingKeepsTheNormOnTheDeviceAndTheStepsWaitForItsAllReduce) {
  CostModel costs;
  ModelOverrides clip;
  clip.clip_grad_norm = 1.0;
  proto::Schedule s = TinyZero3(proto::DTYPE_BF16, &costs, clip);
  HostOptimizerPass pass;
  auto changed = pass.Run(&s, PassContext{&costs, 0});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  const proto::Program& program = s.program();
  int all_reduce = -1, norm = -1, steps = 0;
  for (int i = 0; i < s.instructions_size(); ++i) {
    const proto::Instruction& instr = s.instructions(i);
    if (instr.kind() == proto::INSTR_ALL_REDUCE) {
      all_reduce = i;
      EXPECT_EQ(instr.stream(), proto::STREAM_REDUCE);
      ASSERT_EQ(instr.deps_size(), 1);
      EXPECT_EQ(instr.deps(0), norm);
    }
    if (instr.kind() != proto::INSTR_COMPUTE) continue;
    const proto::Op& op = program.ops(instr.op());
    if (op.kind() == op_kind::kGradNormSquared) {
      norm = i;
      EXPECT_EQ(instr.stream(), proto::STREAM_COMPUTE);
    }
    if (op.kind() != op_kind::kAdamW) continue;
    ++steps;
    EXPECT_EQ(instr.stream(), proto::STREAM_HOST) << op.name();
    ASSERT_GE(all_reduce, 0) << op.name() << " comes before the all-reduce";
    EXPECT_NE(std::find(instr.deps().begin(), instr.deps().end(), all_reduce), instr.deps().end())
        << op.name() << " does not wait for the all-reduce";
  }
  EXPECT_GT(steps, 0);
  EXPECT_EQ(pass.stats().host_ops, steps);
  const Status verified = VerifySchedule(s, PassContext{&costs, 0});
  EXPECT_TRUE(verified.ok()) << verified.message();
  // Without the wait, the verifier says which step reads the norm too early.
  for (auto& instr : *s.mutable_instructions()) {
    if (instr.stream() != proto::STREAM_HOST) continue;
    auto* deps = instr.mutable_deps();
    deps->erase(std::remove(deps->begin(), deps->end(), all_reduce), deps->end());
    break;
  }
  const Status early = VerifySchedule(s, PassContext{&costs, 0});
  EXPECT_NE(early.message().find("without waiting for its all-reduce"), std::string::npos)
      << early.message();
}

TEST(HostOptimizer, EveryOptimizerOpRunsOnTheHostAfterTheBackward) {
  CostModel costs;
  proto::Schedule s = TinyZero3(proto::DTYPE_BF16, &costs);
  const proto::Schedule before = s;
  HostOptimizerPass pass;
  auto changed = pass.Run(&s, PassContext{&costs, 0});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_TRUE(*changed);
  ASSERT_EQ(s.instructions_size(), before.instructions_size());
  const proto::Program& program = s.program();
  int first_optimizer = s.instructions_size();
  for (int i = 0; i < s.instructions_size(); ++i) {
    if (s.instructions(i).micro_step() < 0) first_optimizer = std::min(first_optimizer, i);
  }
  int host_ops = 0;
  for (int i = 0; i < s.instructions_size(); ++i) {
    const proto::Instruction& instr = s.instructions(i);
    const bool optimizer = instr.kind() == proto::INSTR_COMPUTE &&
                           program.ops(instr.op()).phase() == proto::PHASE_OPTIMIZER;
    EXPECT_EQ(instr.stream() == proto::STREAM_HOST, optimizer) << i;
    if (!optimizer) {
      EXPECT_EQ(instr.stream(), before.instructions(i).stream()) << i;
      continue;
    }
    ++host_ops;
    // It waits for the last instruction of every stream before the optimizer phase.
    for (int stream = proto::STREAM_COMPUTE; stream <= proto::STREAM_D2H; ++stream) {
      int last = -1;
      for (int j = 0; j < first_optimizer; ++j) {
        if (s.instructions(j).stream() == stream) last = j;
      }
      if (last < 0) continue;
      EXPECT_NE(std::find(instr.deps().begin(), instr.deps().end(), last), instr.deps().end())
          << "host op " << i << " does not wait for " << last;
    }
  }
  EXPECT_EQ(host_ops, pass.stats().host_ops);
  EXPECT_GT(host_ops, 0);
  EXPECT_TRUE(VerifySchedule(s, PassContext{&costs, 0}).ok());
}

// Adam's m and v and the fp32 masters leave the device for the whole run; the bf16 shards stay.
TEST(HostOptimizer, MastersAndStatesNeverTakeDeviceMemory) {
  for (const proto::DType dtype : {proto::DTYPE_F32, proto::DTYPE_BF16}) {
    CostModel costs;
    proto::Schedule s = TinyZero3(dtype, &costs);
    auto base = Simulate(s, costs);
    ASSERT_TRUE(base.ok()) << base.status().message();
    const std::vector<int64_t> before = PersistentBytesByKind(s);
    HostOptimizerPass pass;
    ASSERT_TRUE(pass.Run(&s, PassContext{&costs, 0}).ok());
    const std::vector<int64_t> after = PersistentBytesByKind(s);
    const int states = static_cast<int>(BufferKind::kOptimizerState);
    const int shards = static_cast<int>(BufferKind::kShard);
    EXPECT_GT(before[states], 0);
    EXPECT_EQ(after[states], 0);
    EXPECT_EQ(after[shards], dtype == proto::DTYPE_BF16 ? before[shards] / 2 : before[shards]);
    EXPECT_EQ(pass.stats().compute_shard_bytes, after[shards]);
    EXPECT_EQ(pass.stats().host_resident_bytes, before[states] + before[shards]);
    auto sim = Simulate(s, costs);
    ASSERT_TRUE(sim.ok()) << sim.status().message();
    EXPECT_EQ(sim->peak_device_bytes, base->peak_device_bytes - (Sum(before) - Sum(after)));
    // The memory plan places no master or state, and every bf16 shard.
    auto plan = PlanMemory(s, MemoryPlanOptions{}, 0, &costs, nullptr);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    const std::vector<bool> host = HostResidentTensors(s);
    int compute_shards = 0;
    for (const proto::BufferPlacement& p : plan->placements()) {
      if (p.micro_step() == kComputeShardMicroStep) {
        ++compute_shards;
      } else if (p.instruction() < 0) {
        EXPECT_FALSE(host[p.tensor()]) << s.program().tensors(p.tensor()).name();
      }
    }
    EXPECT_EQ(compute_shards, pass.stats().host_ops);
  }
}

// The host's Adam costs the rank's shard elements over the host's rate, on its own stream.
TEST(HostOptimizer, HostStepCostsTheElementsOverTheHostsRate) {
  CostModel costs;
  proto::Schedule s = TinyZero3(proto::DTYPE_BF16, &costs);
  HostOptimizerPass pass;
  ASSERT_TRUE(pass.Run(&s, PassContext{&costs, 0}).ok());
  costs.host_optimizer_elements_per_second = 1e6;
  const proto::Program& program = s.program();
  double host_seconds = 0;
  for (const proto::Instruction& instr : s.instructions()) {
    if (instr.stream() != proto::STREAM_HOST) continue;
    int64_t elements = 0;
    for (int t : program.ops(instr.op()).inputs()) {
      if (program.tensors(t).role() == proto::ROLE_PARAM) {
        elements += ShardElements(NumElements(program.tensors(t)), kWorld);
      }
    }
    EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, kWorld, instr), elements / 1e6);
    host_seconds += elements / 1e6;
  }
  auto slow = Simulate(s, costs);
  ASSERT_TRUE(slow.ok());
  costs.host_optimizer_elements_per_second = 2e6;
  auto fast = Simulate(s, costs);
  ASSERT_TRUE(fast.ok());
  // The host ops run one after another after the backward: half the rate, twice their time.
  EXPECT_NEAR(slow->step_seconds - fast->step_seconds, host_seconds / 2, 1e-9);
  // Rate 0: the host is the device, an op costs its own seconds.
  costs.host_optimizer_elements_per_second = 0;
  for (const proto::Instruction& instr : s.instructions()) {
    if (instr.stream() != proto::STREAM_HOST) continue;
    EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, kWorld, instr),
                     costs.OpSeconds(program, instr.op()));
  }
}

// Below what the optimizer step on the device needs (every shard resident), dc falls back to
// Adam on the host and still spends the freed memory on communication: never slower than ZeRO-3
// offload.
TEST(HostOptimizer, DcFallsBackToTheHostWhereTheDeviceCannotHoldTheStep) {
  CostModel costs;
  const proto::Schedule zero3 = TinyZero3(proto::DTYPE_BF16, &costs);
  PlanRequest request;
  request.program = zero3.program();
  request.world_size = kWorld;
  request.costs = costs;
  request.policy = "zero3-offload";
  auto host = MakePlan(request);
  ASSERT_TRUE(host.ok()) << host.status().message();
  int64_t persistent = 0;
  for (int64_t b : PersistentBytesByKind(zero3)) persistent += b;
  // Room for ZeRO-3 offload's peak, not for every shard the device's optimizer step holds.
  request.budget_bytes =
      std::max(host->prediction().peak_device_bytes(), host->memory_plan().arena_bytes());
  ASSERT_LT(request.budget_bytes, persistent);
  request.policy = "dc";
  auto dc = MakePlan(request);
  ASSERT_TRUE(dc.ok()) << dc.status().message();
  int host_ops = 0;
  for (const proto::Instruction& instr : dc->instructions()) {
    host_ops += instr.stream() == proto::STREAM_HOST;
  }
  EXPECT_GT(host_ops, 0);
  EXPECT_LE(dc->prediction().step_seconds(), host->prediction().step_seconds());
  EXPECT_LE(dc->prediction().peak_device_bytes(), request.budget_bytes);
  ASSERT_GT(dc->notes_size(), 0);
  EXPECT_NE(dc->notes(0).find("host-optimizer"), std::string::npos) << dc->notes(0);
}

// The partial pass moves the largest params' steps to the host, just until the device's shards
// fit its share of the final budget; the rest stay on the device.
TEST(HostOptimizer, PartMovesTheLargestParamsUntilTheShardsFit) {
  CostModel costs;
  proto::Schedule s = TinyZero3(proto::DTYPE_BF16, &costs);
  int64_t persistent = 0;
  for (int64_t b : PersistentBytesByKind(s)) persistent += b;
  HostOptimizerPass pass(HostOptimizerOptions{0.9});
  EXPECT_EQ(pass.name(), "host-optimizer-part");
  EXPECT_FALSE(pass.FreesMemory());             // the offload pass after it frees the rest
  PassContext context{&costs, persistent * 2};  // relaxed: what the pass must not aim at
  context.final_budget_bytes = persistent;      // room for 90%: a few ops move
  auto changed = pass.Run(&s, context);
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_TRUE(*changed);
  int64_t after = 0;
  for (int64_t b : PersistentBytesByKind(s)) after += b;
  EXPECT_LE(after, persistent * 9 / 10);
  const proto::Program& program = s.program();
  int64_t smallest_on_host = std::numeric_limits<int64_t>::max(), largest_on_device = 0;
  int on_host = 0, on_device = 0;
  for (const proto::Instruction& instr : s.instructions()) {
    if (instr.kind() != proto::INSTR_COMPUTE ||
        program.ops(instr.op()).phase() != proto::PHASE_OPTIMIZER) {
      continue;
    }
    const int64_t elements = HostOptimizerElements(program, kWorld, instr);
    if (instr.stream() == proto::STREAM_HOST) {
      ++on_host;
      smallest_on_host = std::min(smallest_on_host, elements);
    } else {
      ++on_device;
      largest_on_device = std::max(largest_on_device, elements);
    }
  }
  EXPECT_EQ(on_host, pass.stats().host_ops);
  EXPECT_GT(on_host, 0);
  EXPECT_GT(on_device, 0);
  EXPECT_GE(smallest_on_host, largest_on_device);
  // One op fewer would not have fit: the last one moved was needed.
  EXPECT_GT(after + 10 * smallest_on_host, persistent * 9 / 10);
}

TEST(HostOptimizer, RefusesAScheduleThatAlreadyOffloads) {
  CostModel costs;
  proto::Schedule s = TinyZero3(proto::DTYPE_BF16, &costs);
  ZeroOffloadPass offload;
  ASSERT_TRUE(offload.Run(&s, PassContext{&costs, 0}).ok());
  HostOptimizerPass pass;
  auto changed = pass.Run(&s, PassContext{&costs, 0});
  ASSERT_FALSE(changed.ok());
  EXPECT_NE(changed.status().message().find("instead of the offload passes"), std::string::npos)
      << changed.status().message();
}

// A device optimizer op cannot read a master the host keeps, nor a host op one on the device.
TEST(HostOptimizer, TheSimulatorChecksWhereTheOptimizerReads) {
  CostModel costs;
  proto::Schedule s = TinyZero3(proto::DTYPE_BF16, &costs);
  int first = -1;
  for (int i = 0; i < s.instructions_size(); ++i) {
    const proto::Instruction& instr = s.instructions(i);
    if (instr.kind() == proto::INSTR_COMPUTE &&
        s.program().ops(instr.op()).phase() == proto::PHASE_OPTIMIZER) {
      first = i;
      break;
    }
  }
  ASSERT_GE(first, 0);
  // One host op: its param's master and states are host-resident; the rest stay on the device.
  proto::Schedule one = s;
  one.mutable_instructions(first)->set_stream(proto::STREAM_HOST);
  EXPECT_TRUE(Simulate(one, costs).ok());
  // An offload of a host-resident state is refused.
  int state = -1;
  for (int t : s.program().ops(s.instructions(first).op()).inputs()) {
    if (s.program().tensors(t).role() == proto::ROLE_OPTIMIZER_STATE) state = t;
  }
  ASSERT_GE(state, 0);
  proto::Instruction* offload = one.mutable_instructions()->Add();
  offload->set_kind(proto::INSTR_OFFLOAD);
  offload->set_stream(proto::STREAM_D2H);
  offload->set_micro_step(-1);
  offload->add_tensors(state);
  auto refused = Simulate(one, costs);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("already offloaded"), std::string::npos)
      << refused.status().message();
}

}  // namespace
}  // namespace dc
