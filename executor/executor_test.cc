#include "executor/executor.h"

#include <gtest/gtest.h>

#include <set>

#include "models/model.h"
#include "rewriter/zero3.h"

namespace dc {
namespace {

proto::Schedule TinyBaseline(int64_t gas = 2) {
  ModelOverrides overrides;
  overrides.gas = gas;
  auto config = MakeConfig("tiny", overrides);
  auto program = BuildProgram(*config);
  proto::Schedule s;
  s.set_world_size(1);
  s.set_backend("cpu");
  *s.mutable_program() = *program;
  Zero3Pass pass;
  EXPECT_TRUE(pass.Run(&s, PassContext{}).ok());
  return s;
}

RunResult RunSteps(const proto::Schedule& s, int64_t capacity = 0) {
  auto comm = Connect(RendezvousOptions{});
  EXPECT_TRUE(comm.ok());
  RunOptions options;
  options.steps = 3;
  options.device_memory_bytes = capacity;
  auto result = RunSchedule(s, options, comm->get(), nullptr);
  EXPECT_TRUE(result.ok()) << result.status().message();
  return result.ok() ? *result : RunResult{};
}

// Moves instruction `from` to position `to` (< from), fixing every dep index.
void MoveEarlier(proto::Schedule* s, int from, int to) {
  auto* list = s->mutable_instructions();
  for (int j = from; j > to; --j) list->SwapElements(j, j - 1);
  for (auto& instr : *list) {
    for (auto& d : *instr.mutable_deps()) {
      if (d == from) {
        d = to;
      } else if (d >= to && d < from) {
        ++d;
      }
    }
  }
}

TEST(Executor, GroupedGathersGiveTheSameLosses) {
  const proto::Schedule base = TinyBaseline();
  proto::Schedule grouped = base;
  // Fuse each gather into the previous gather of the same micro-step (pairs), making the later
  // param live earlier; the emptied instruction stays as a no-op release.
  auto* list = grouped.mutable_instructions();
  int fused = 0, open = -1;
  for (int i = 0; i < list->size(); ++i) {
    auto& cur = (*list)[i];
    if (cur.kind() != proto::INSTR_ALL_GATHER) continue;
    bool released_between = false;  // the earlier gathered copy of cur's param is still live
    for (int j = std::max(open, 0); j < i && open >= 0; ++j) {
      for (int t : (*list)[j].tensors()) {
        released_between |= (*list)[j].kind() == proto::INSTR_RELEASE && t == cur.tensors(0);
      }
    }
    if (open >= 0 && !released_between && (*list)[open].micro_step() == cur.micro_step()) {
      (*list)[open].add_tensors(cur.tensors(0));
      (*list)[open].set_bucket(open + 1);
      cur.set_kind(proto::INSTR_RELEASE);
      cur.clear_tensors();
      ++fused;
      open = -1;
    } else {
      open = i;
    }
  }
  ASSERT_GT(fused, 0);
  EXPECT_EQ(RunSteps(grouped).losses, RunSteps(base).losses);
}

TEST(Executor, OffloadedOptimizerStatesGiveTheSameLossesWithALowerPeak) {
  const proto::Schedule base = TinyBaseline();
  proto::Schedule offloaded = base;
  std::vector<int> states;
  for (const auto& t : base.program().tensors()) {
    if (t.role() == proto::ROLE_OPTIMIZER_STATE) states.push_back(t.id());
  }
  // Offload every state first thing in the step, reload all before the optimizer phase.
  int first_optimizer = 0;
  while (offloaded.instructions(first_optimizer).micro_step() != -1) ++first_optimizer;
  proto::Instruction reload;
  reload.set_kind(proto::INSTR_RELOAD);
  reload.set_stream(proto::STREAM_H2D);
  reload.set_micro_step(1);
  reload.set_op(-1);
  for (int t : states) reload.add_tensors(t);
  *offloaded.mutable_instructions()->Add() = reload;
  MoveEarlier(&offloaded, offloaded.instructions_size() - 1, first_optimizer);
  proto::Instruction offload = reload;
  offload.set_kind(proto::INSTR_OFFLOAD);
  offload.set_stream(proto::STREAM_D2H);
  offload.set_micro_step(0);
  *offloaded.mutable_instructions()->Add() = offload;
  MoveEarlier(&offloaded, offloaded.instructions_size() - 1, 0);
  // The optimizer reads the states the h2d stream brings back: on streams that run at once (the
  // cpu device's threads, the GPU's), it must wait for the reload, as a planner's plan does.
  const int reloaded = first_optimizer + 1;
  ASSERT_EQ(offloaded.instructions(reloaded).kind(), proto::INSTR_RELOAD);
  for (int i = reloaded + 1; i < offloaded.instructions_size(); ++i) {
    if (offloaded.instructions(i).kind() == proto::INSTR_COMPUTE) {
      offloaded.mutable_instructions(i)->add_deps(reloaded);
    }
  }

  const RunResult a = RunSteps(base), b = RunSteps(offloaded);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_LT(b.peak_device_bytes, a.peak_device_bytes);
}

// Places every buffer at its own offset (no reuse): the arena path must give the same math.
TEST(Executor, ArenaPlacementGivesTheSameLosses) {
  const proto::Schedule base = TinyBaseline();
  proto::Schedule placed = base;
  const proto::Program& program = base.program();
  auto* plan = placed.mutable_memory_plan();
  int64_t offset = 0;
  auto place = [&](int instruction, int tensor, int micro, int64_t bytes) {
    auto* p = plan->add_placements();
    p->set_instruction(instruction);
    p->set_tensor(tensor);
    p->set_micro_step(micro);
    p->set_offset_bytes(offset);
    p->set_size_bytes(bytes);
    offset += (bytes + 255) / 256 * 256;
  };
  for (const auto& t : program.tensors()) {
    if (t.role() == proto::ROLE_PARAM || t.role() == proto::ROLE_GRAD ||
        t.role() == proto::ROLE_OPTIMIZER_STATE) {
      place(-1, t.id(), -1, ShardElements(NumElements(t), 1) * 4);
    }
  }
  std::set<std::pair<int, int>> inputs_seen;
  for (int i = 0; i < base.instructions_size(); ++i) {
    const auto& instr = base.instructions(i);
    if (instr.kind() == proto::INSTR_ALL_GATHER) {
      for (int t : instr.tensors()) place(i, t, -2, TransientBytes(program, program.tensors(t)));
    } else if (instr.kind() == proto::INSTR_COMPUTE && instr.micro_step() >= 0) {
      const auto& op = program.ops(instr.op());
      for (int t : op.inputs()) {
        if (program.tensors(t).role() == proto::ROLE_INPUT &&
            inputs_seen.insert({t, instr.micro_step()}).second) {
          place(i, t, instr.micro_step(), TransientBytes(program, program.tensors(t)));
        }
      }
      for (int t : op.outputs())
        place(i, t, instr.micro_step(), TransientBytes(program, program.tensors(t)));
    }
  }
  plan->set_arena_bytes(offset);
  EXPECT_EQ(RunSteps(placed).losses, RunSteps(base).losses);

  // A plan without a place for some buffer is refused, naming it.
  plan->mutable_placements()->RemoveLast();
  auto comm = Connect(RendezvousOptions{});
  RunOptions options;
  options.steps = 1;
  auto result = RunSchedule(placed, options, comm->get(), nullptr);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("no place for"), std::string::npos)
      << result.status().message();
}

TEST(Executor, GoingOverCapacityFailsLikeAnOutOfMemory) {
  const proto::Schedule base = TinyBaseline();
  const int64_t peak = RunSteps(base).peak_device_bytes;
  ASSERT_GT(peak, 0);
  EXPECT_EQ(RunSteps(base, peak).peak_device_bytes, peak);  // exactly enough is enough
  auto comm = Connect(RendezvousOptions{});
  RunOptions options;
  options.steps = 1;
  options.device_memory_bytes = peak - 1;
  auto result = RunSchedule(base, options, comm->get(), nullptr);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("out of device memory at instruction"),
            std::string::npos)
      << result.status().message();
}

TEST(Executor, RefusesAPlanForAnotherWorldOrBackend) {
  proto::Schedule s = TinyBaseline();
  s.set_world_size(2);
  EXPECT_NE(CheckRunnable(s, 1).message().find("--nproc 2"), std::string::npos);
  s.set_world_size(1);
  s.set_backend("cuda");
  EXPECT_NE(CheckRunnable(s, 1).message().find("cuda"), std::string::npos);
}

// A plan whose buffer effects do not hold (edited by hand, say) is refused before the first
// step, with the planner's own message, rather than halfway through one.
TEST(Executor, RefusesAnInconsistentScheduleBeforeTheFirstStep) {
  proto::Schedule s = TinyBaseline();
  EXPECT_TRUE(CheckRunnable(s, 1).ok());
  ASSERT_EQ(s.instructions(0).kind(), proto::INSTR_ALL_GATHER);
  s.mutable_instructions(0)->clear_tensors();  // the first compute reads an ungathered param
  const Status refused = CheckRunnable(s, 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.message().rfind("the plan's schedule: instruction ", 0), 0u)
      << refused.message();
  EXPECT_NE(refused.message().find(", which is not gathered; re-plan with dc-plan"),
            std::string::npos)
      << refused.message();
  auto comm = Connect(RendezvousOptions{});
  ASSERT_TRUE(comm.ok());
  auto run = RunSchedule(s, RunOptions{}, comm->get(), nullptr);
  ASSERT_FALSE(run.ok());
  EXPECT_EQ(run.status().message(), refused.message());
}

// The kernels take the schedule's rate: the first step of a 4-step warm-up from 3e-3 is exactly
// a step at the constant rate 3e-3 / 4 (powers of two: no rounding apart).
TEST(Executor, TheLearningRateScheduleDrivesTheOptimizer) {
  auto run = [](const ModelOverrides& overrides) {
    auto config = MakeConfig("tiny", overrides);
    EXPECT_TRUE(config.ok()) << config.status().message();
    proto::Schedule s;
    s.set_world_size(1);
    s.set_backend("cpu");
    *s.mutable_program() = *BuildProgram(*config);
    Zero3Pass pass;
    EXPECT_TRUE(pass.Run(&s, PassContext{}).ok());
    auto comm = Connect(RendezvousOptions{});
    RunOptions options;
    options.steps = 2;
    auto result = RunSchedule(s, options, comm->get(), nullptr);
    EXPECT_TRUE(result.ok()) << result.status().message();
    return result.ok() ? result->losses : std::vector<double>{};
  };
  ModelOverrides warm;
  warm.lr = 3e-3;
  warm.lr_warmup_steps = 4;
  ModelOverrides slow;
  slow.lr = 3e-3 / 4;
  ModelOverrides constant;
  constant.lr = 3e-3;
  const std::vector<double> a = run(warm), b = run(slow), c = run(constant);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a[1], c[1]);
}

}  // namespace
}  // namespace dc
