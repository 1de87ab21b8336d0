// What the interpreter derives from a plan, and the plans it refuses, on any machine.
#include "executor/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "tests/support/cuda_test_plans.h"

namespace dc {
namespace {

using testing::TinyPlan;
using testing::TinyPlanOptions;

proto::Schedule Plan(const TinyPlanOptions& options) {
  auto plan = TinyPlan(options);
  EXPECT_TRUE(plan.ok()) << plan.status().message();
  return plan.ok() ? *plan : proto::Schedule();
}

ScheduleLayout Layout(const proto::Schedule& plan) {
  auto layout = MakeScheduleLayout(plan);
  EXPECT_TRUE(layout.ok()) << layout.status().message();
  return layout.ok() ? *layout : ScheduleLayout();
}

void ExpectRefused(const proto::Schedule& plan, const std::string& expect) {
  auto layout = MakeScheduleLayout(plan);
  ASSERT_FALSE(layout.ok());
  EXPECT_NE(layout.status().message().find(expect), std::string::npos) << layout.status().message();
  EXPECT_NE(layout.status().message().find("re-plan"), std::string::npos)
      << layout.status().message();
}

TEST(ScheduleLayout, WaitsOnlyForDependenciesOnOtherStreams) {
  TinyPlanOptions options;
  options.world_size = 2;
  const proto::Schedule plan = Plan(options);
  const ScheduleLayout layout = Layout(plan);
  ASSERT_EQ(layout.waits.size(), static_cast<size_t>(plan.instructions_size()));
  int cross = 0;
  for (int i = 0; i < plan.instructions_size(); ++i) {
    const proto::Instruction& instr = plan.instructions(i);
    std::set<int> expected;
    for (int d : instr.deps()) {
      if (plan.instructions(d).stream() != instr.stream()) expected.insert(d);
    }
    EXPECT_EQ(std::set<int>(layout.waits[i].begin(), layout.waits[i].end()), expected) << i;
    for (int d : layout.waits[i]) EXPECT_TRUE(layout.records_event[d]) << d;
    cross += static_cast<int>(expected.size());
  }
  EXPECT_GT(cross, 0);  // computes wait for gathers, reduce-scatters for computes
  // Only instructions some other stream waits for record an event.
  const int recording =
      static_cast<int>(std::count(layout.records_event.begin(), layout.records_event.end(), true));
  EXPECT_GT(recording, 0);
  EXPECT_LT(recording, plan.instructions_size());
}

TEST(ScheduleLayout, StagingOnlyWhereElementsDoNotDivideByTheWorld) {
  TinyPlanOptions options;
  options.world_size = 2;  // every tiny param divides by 2
  const ScheduleLayout two = Layout(Plan(options));
  for (int64_t bytes : two.staging_bytes) EXPECT_EQ(bytes, 0);

  options.world_size = 3;  // hidden 64: the norm gains and most matrices do not divide by 3
  const proto::Schedule plan = Plan(options);
  const ScheduleLayout three = Layout(plan);
  const int gather = DeviceStreamIndex(proto::STREAM_GATHER);
  const int reduce = DeviceStreamIndex(proto::STREAM_REDUCE);
  EXPECT_GT(three.staging_bytes[gather], 0);
  EXPECT_GT(three.staging_bytes[reduce], 0);
  EXPECT_EQ(three.staging_bytes[DeviceStreamIndex(proto::STREAM_COMPUTE)], 0);
  for (int64_t bytes : three.staging_bytes) EXPECT_EQ(bytes % kStagingAlignmentBytes, 0);
  // A norm gain of 64 elements pads to 66 over 3 ranks.
  for (const proto::Tensor& t : plan.program().tensors()) {
    if (t.role() != proto::ROLE_PARAM || NumElements(t) != 64) continue;
    EXPECT_TRUE(NeedsStaging(t, 3));
    EXPECT_EQ(StagingBytes(t, 3, proto::DTYPE_F32), 512);  // 66 * 4 bytes, aligned to 256
    EXPECT_EQ(StagingBytes(t, 3, proto::DTYPE_BF16), 256);
    break;
  }
}

TEST(ScheduleLayout, BufferShapesAgreeWithThePlannersAccounting) {
  TinyPlanOptions options;
  options.world_size = 2;
  options.compute_dtype = proto::DTYPE_BF16;
  const proto::Schedule plan = Plan(options);
  const proto::Program& program = plan.program();
  const std::vector<int64_t> persistent = PersistentBytesByKind(program, 2);
  int64_t shard_bytes = 0;
  for (const proto::Tensor& t : program.tensors()) {
    if (t.role() == proto::ROLE_PARAM) {
      const BufferShape gathered = TransientShape(program, t);
      EXPECT_EQ(gathered.dtype, proto::DTYPE_BF16) << t.name();
      EXPECT_EQ(gathered.size_bytes, TransientBytes(program, t)) << t.name();
      EXPECT_EQ(gathered.size_bytes, NumElements(t) * 2) << t.name();
      const BufferShape shard = ShardShape(t, 2);
      EXPECT_EQ(shard.dtype, proto::DTYPE_F32);
      shard_bytes += shard.size_bytes;
    } else if (t.role() == proto::ROLE_ACTIVATION || t.role() == proto::ROLE_INPUT) {
      EXPECT_EQ(TransientShape(program, t).size_bytes, SizeBytes(t)) << t.name();
      EXPECT_EQ(TransientShape(program, t).dtype, t.dtype()) << t.name();
    }
  }
  EXPECT_EQ(shard_bytes, persistent[static_cast<int>(BufferKind::kShard)]);
}

TEST(ScheduleLayout, AcceptsTheMemoryPlanOfADcPlan) {
  TinyPlanOptions options;
  options.world_size = 2;
  options.policy = "dc";
  options.compute_dtype = proto::DTYPE_BF16;
  const proto::Schedule plan = Plan(options);
  ASSERT_GT(plan.memory_plan().arena_bytes(), 0);
  const ScheduleLayout layout = Layout(plan);
  // tokens and targets, one micro-batch each: micro_batch * seq int32.
  const proto::ModelConfig& config = plan.program().config();
  ASSERT_EQ(layout.input_bytes.size(), 2u);
  for (const auto& [tensor, bytes] : layout.input_bytes) {
    EXPECT_EQ(bytes, config.micro_batch() * config.seq() * 4);
  }
  EXPECT_EQ(layout.gas, 2);
}

TEST(ScheduleLayout, ReloadsWaitForTheirOffloadsCopy) {
  TinyPlanOptions options;
  options.world_size = 2;
  options.passes = {"zero3", "offload-all", "memory-plan"};
  const proto::Schedule plan = Plan(options);
  const ScheduleLayout layout = Layout(plan);
  ASSERT_FALSE(layout.host_shard_bytes.empty());
  int reloads = 0;
  for (int i = 0; i < plan.instructions_size(); ++i) {
    const proto::Instruction& instr = plan.instructions(i);
    if (instr.kind() != proto::INSTR_RELOAD) continue;
    ++reloads;
    for (int t : instr.tensors()) {
      EXPECT_EQ(layout.host_shard_bytes.at(t), ShardShape(plan.program().tensors(t), 2).size_bytes);
      bool waits_for_offload = false;
      for (int w : layout.waits[i]) {
        const proto::Instruction& before = plan.instructions(w);
        if (before.kind() != proto::INSTR_OFFLOAD) continue;
        for (int u : before.tensors()) waits_for_offload |= u == t;
      }
      EXPECT_TRUE(waits_for_offload) << "reload " << i;
    }
  }
  EXPECT_GT(reloads, 0);
}

// ZeRO-3 offload's Adam on the host: every param's master and states in pinned host memory for
// the whole run, staging for the largest op's grad shards and compute-dtype shards, and every
// host op waiting (on the host) for the end of the backward.
TEST(ScheduleLayout, HostOptimizerKeepsMastersAndStatesInPinnedMemory) {
  TinyPlanOptions options;
  options.world_size = 2;
  options.compute_dtype = proto::DTYPE_BF16;
  options.policy = "zero3-offload";
  const proto::Schedule plan = Plan(options);
  const ScheduleLayout layout = Layout(plan);
  const proto::Program& program = plan.program();
  int host_resident = 0;
  for (const proto::Tensor& t : program.tensors()) {
    const bool host = t.role() == proto::ROLE_PARAM || t.role() == proto::ROLE_OPTIMIZER_STATE;
    EXPECT_EQ(layout.host_resident[t.id()], host) << t.name();
    if (!host) continue;
    ++host_resident;
    EXPECT_EQ(layout.host_shard_bytes.at(t.id()), ShardShape(t, 2).size_bytes) << t.name();
  }
  EXPECT_GT(host_resident, 0);
  int64_t largest = 0;
  for (int i = 0; i < plan.instructions_size(); ++i) {
    const proto::Instruction& instr = plan.instructions(i);
    if (instr.stream() != proto::STREAM_HOST) continue;
    EXPECT_FALSE(layout.waits[i].empty()) << "host op " << i;
    for (int w : layout.waits[i]) EXPECT_TRUE(layout.records_event[w]);
    int64_t staging = 0;
    for (int t : program.ops(instr.op()).inputs()) {
      const proto::Tensor& tensor = program.tensors(t);
      if (tensor.role() == proto::ROLE_GRAD) staging += ShardShape(tensor, 2).size_bytes;
      if (tensor.role() == proto::ROLE_PARAM) staging += ComputeShardBytes(program, tensor, 2);
    }
    largest = std::max(largest, staging);
  }
  EXPECT_GE(layout.host_optimizer_staging_bytes, largest);
  EXPECT_LT(layout.host_optimizer_staging_bytes, largest + 2 * kStagingAlignmentBytes);
  // The memory plan places the bf16 shards (micro-step -3) and no master or state.
  ASSERT_GT(plan.memory_plan().arena_bytes(), 0);
  int compute_shards = 0;
  for (const proto::BufferPlacement& p : plan.memory_plan().placements()) {
    const proto::Tensor& t = program.tensors(p.tensor());
    if (p.micro_step() == kComputeShardMicroStep) {
      ++compute_shards;
      EXPECT_EQ(p.size_bytes() >= ComputeShardBytes(program, t, 2), true) << t.name();
    } else if (p.instruction() < 0) {
      EXPECT_FALSE(layout.host_resident[t.id()]) << t.name() << " placed on the device";
    }
  }
  EXPECT_EQ(compute_shards, host_resident / 3);  // a param's master, m and v; one bf16 shard
}

// A bf16 shard beside an offloaded master is placed at its own size, not its master's.
TEST(ScheduleLayout, AcceptsTheBf16ShardsBesideOffloadedMasters) {
  TinyPlanOptions options;
  options.world_size = 2;
  options.compute_dtype = proto::DTYPE_BF16;
  options.passes = {"zero3", "offload-all", "memory-plan"};
  const proto::Schedule plan = Plan(options);
  const std::vector<bool> compute_shard = ComputeShardParams(plan);
  ASSERT_GT(std::count(compute_shard.begin(), compute_shard.end(), true), 0);
  ASSERT_GT(plan.memory_plan().arena_bytes(), 0);
  Layout(plan);
}

// A dc plan of a recomputing program keeps activations: its renames pass the layout's checks.
TEST(ScheduleLayout, AcceptsTheRenamesOfKeptActivations) {
  TinyPlanOptions options;
  options.world_size = 2;
  options.recompute = true;
  options.policy = "dc";
  const proto::Schedule plan = Plan(options);
  int renames = 0;
  for (const auto& instr : plan.instructions()) renames += instr.kind() == proto::INSTR_RENAME;
  EXPECT_GT(renames, 0);
  Layout(plan);
  proto::Schedule bad = plan;
  for (auto& instr : *bad.mutable_instructions()) {
    if (instr.kind() == proto::INSTR_RENAME) {
      instr.add_tensors(instr.tensors(0));
      break;
    }
  }
  ExpectRefused(bad, "does not match");
}

uint16_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The host's casts round as the device's do: to nearest, ties to the even neighbour.
TEST(ScheduleLayout, HostCastsRoundToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.5f), Bits(-2.5f));             // exact
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000u)), 0x3f80);  // tie, even below
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000u)), 0x3f82);  // tie, even above
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001u)), 0x3f81);  // just past the tie
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7fffffu)), 0x7f80);  // the largest float rounds to inf
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(FromBits(0x7f800001u)) & 0x7fc0, 0x7fc0);  // a NaN stays a quiet NaN
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);                // the largest half
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);                // its tie rounds to inf
  EXPECT_EQ(FloatToF16(1.0f + 1.0f / 2048), 0x3c00);      // tie, even below
  EXPECT_EQ(FloatToF16(1.0f + 3.0f / 2048), 0x3c02);      // tie, even above
  EXPECT_EQ(FloatToF16(5.960464477539063e-08f), 0x0001);  // the smallest subnormal
  const float values[] = {0.1f, -3.0f, 1e-3f};
  uint16_t half[3];
  CastOnHost(values, 3, proto::DTYPE_BF16, half);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(half[i], FloatToBf16(values[i]));
  float copy[3];
  CastOnHost(values, 3, proto::DTYPE_F32, copy);
  EXPECT_EQ(std::memcmp(copy, values, sizeof(copy)), 0);
}

TEST(ScheduleLayout, RefusesWhatTheExecutorCannotRun) {
  TinyPlanOptions options;
  options.world_size = 2;
  const proto::Schedule good = Plan(options);
  int compute = -1, later_dep = -1;
  for (int i = 0; i < good.instructions_size(); ++i) {
    if (good.instructions(i).kind() == proto::INSTR_COMPUTE && compute < 0) compute = i;
    if (good.instructions(i).deps_size() > 0 && later_dep < 0) later_dep = i;
  }
  ASSERT_GE(compute, 0);
  ASSERT_GE(later_dep, 0);

  proto::Schedule on_gather = good;
  on_gather.mutable_instructions(compute)->set_stream(proto::STREAM_GATHER);
  ExpectRefused(on_gather, "compute stream only");

  proto::Schedule forward_on_host = good;
  forward_on_host.mutable_instructions(compute)->set_stream(proto::STREAM_HOST);
  ExpectRefused(forward_on_host, "runs optimizer ops only");

  proto::Schedule no_stream = good;
  no_stream.mutable_instructions(0)->set_stream(proto::STREAM_UNSPECIFIED);
  ExpectRefused(no_stream, "no stream");

  proto::Schedule forward = good;
  forward.mutable_instructions(later_dep)->set_deps(0, later_dep);
  ExpectRefused(forward, "does not come before it");

  proto::Schedule reload = good;
  proto::Instruction* instr = reload.add_instructions();
  instr->set_kind(proto::INSTR_RELOAD);
  instr->set_stream(proto::STREAM_H2D);
  for (const proto::Tensor& t : good.program().tensors()) {
    if (t.role() == proto::ROLE_OPTIMIZER_STATE) {
      instr->add_tensors(t.id());
      break;
    }
  }
  ExpectRefused(reload, "no earlier instruction offloads");
}

// The index of micro-step 0's op writing the loss, found by scanning for it.
int LossInstruction(const proto::Schedule& plan) {
  for (int i = 0; i < plan.instructions_size(); ++i) {
    const proto::Instruction& instr = plan.instructions(i);
    if (instr.kind() != proto::INSTR_COMPUTE || instr.micro_step() != 0) continue;
    for (int t : plan.program().ops(instr.op()).outputs()) {
      if (plan.program().tensors(t).name() == "loss") return i;
    }
  }
  return -1;
}

TEST(EvaluationPrefix, EndsWithMicroStepZerosLoss) {
  for (const std::string policy : {"baseline", "dc", "zero3-offload", "deepcompile"}) {
    TinyPlanOptions options;
    options.world_size = 2;
    options.policy = policy;
    const proto::Schedule plan = Plan(options);
    ASSERT_TRUE(MakeScheduleLayout(plan).ok()) << policy;
    auto prefix = EvaluationPrefix(plan);
    ASSERT_TRUE(prefix.ok()) << policy << ": " << prefix.status().message();
    const int loss = LossInstruction(plan);
    ASSERT_GE(loss, 0) << policy;
    EXPECT_EQ(*prefix, loss + 1) << policy;
    // Nothing of the backward or the optimizer in it.
    for (int i = 0; i < *prefix; ++i) {
      const proto::Instruction& instr = plan.instructions(i);
      EXPECT_NE(instr.kind(), proto::INSTR_REDUCE_SCATTER) << policy << " " << i;
      if (instr.kind() == proto::INSTR_COMPUTE) {
        EXPECT_EQ(plan.program().ops(instr.op()).phase(), proto::PHASE_FORWARD) << policy << i;
      }
    }
  }
}

TEST(EvaluationPrefix, RefusesAPlanWhoseForwardIsNotAPrefix) {
  TinyPlanOptions options;
  options.world_size = 2;
  const proto::Schedule good = Plan(options);
  const int loss = LossInstruction(good);
  ASSERT_GT(loss, 0);
  int backward = -1, reduce = -1;
  for (int i = 0; i < good.instructions_size(); ++i) {
    const proto::Instruction& instr = good.instructions(i);
    if (backward < 0 && instr.kind() == proto::INSTR_COMPUTE &&
        good.program().ops(instr.op()).phase() == proto::PHASE_BACKWARD) {
      backward = i;
    }
    if (reduce < 0 && instr.kind() == proto::INSTR_REDUCE_SCATTER) reduce = i;
  }
  ASSERT_GT(backward, loss);
  ASSERT_GT(reduce, loss);
  auto expect_refused = [&](proto::Schedule plan, const std::string& expect) {
    auto prefix = EvaluationPrefix(plan);
    ASSERT_FALSE(prefix.ok()) << expect;
    EXPECT_NE(prefix.status().message().find(expect), std::string::npos)
        << prefix.status().message();
    EXPECT_NE(prefix.status().message().find("cannot run alone for an evaluation"),
              std::string::npos)
        << prefix.status().message();
  };
  // A backward op moved before the loss (as a plan interleaving micro-steps would).
  proto::Schedule early_backward = good;
  early_backward.mutable_instructions()->SwapElements(0, backward);
  expect_refused(early_backward, "runs a backward or optimizer op");
  proto::Schedule early_reduce = good;
  early_reduce.mutable_instructions()->SwapElements(0, reduce);
  expect_refused(early_reduce, "reduces grads");
  proto::Schedule other_micro = good;
  other_micro.mutable_instructions(loss)->set_micro_step(1);
  expect_refused(other_micro, "runs micro-step 1's forward");

  proto::Schedule no_loss = good;
  no_loss.mutable_instructions()->DeleteSubrange(loss, no_loss.instructions_size() - loss);
  auto prefix = EvaluationPrefix(no_loss);
  ASSERT_FALSE(prefix.ok());
  EXPECT_NE(prefix.status().message().find("never computes micro-step 0's loss"), std::string::npos)
      << prefix.status().message();
}

}  // namespace
}  // namespace dc
