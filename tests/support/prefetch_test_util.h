// Helpers shared by the tests of the gather-moving passes (prefetch, bucket, unshard and
// DeepCompile's rules): small hand-built programs whose schedules the tests write inline in the
// text form, model schedules with estimated H100 costs, and the invariants every pass keeps.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "machine/estimate.h"
#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/gather_index.h"
#include "rewriter/pass.h"
#include "rewriter/schedule_text.h"
#include "rewriter/verifier.h"
#include "rewriter/zero3.h"

namespace dc::testing {

// A program built by hand: fp32 tensors of a given size, ops in the given phase. Ops run in
// the order they are added; the tests write the schedule.
class HandProgram {
 public:
  explicit HandProgram(int gas = 1) {
    auto* config = program_.mutable_config();
    config->set_preset("hand");
    config->set_family("llama");
    config->set_compute_dtype(proto::DTYPE_F32);
    config->set_gas(gas);
    config->set_seq(1);
    config->set_micro_batch(1);
  }
  // A param of `bytes` bytes (a multiple of 4), and its grad when `with_grad`.
  int Param(const std::string& name, int64_t bytes) {
    return Add(name, bytes, proto::ROLE_PARAM, -1);
  }
  int Grad(const std::string& name, int param, int64_t bytes) {
    return Add(name, bytes, proto::ROLE_GRAD, param);
  }
  int Activation(const std::string& name, int64_t bytes) {
    return Add(name, bytes, proto::ROLE_ACTIVATION, -1);
  }
  int Op(const std::string& name, proto::Phase phase, const std::vector<int>& inputs,
         const std::vector<int>& outputs) {
    proto::Op* op = program_.add_ops();
    op->set_id(program_.ops_size() - 1);
    op->set_name(name);
    op->set_kind("add");
    op->set_phase(phase);
    op->set_layer(-1);
    for (int t : inputs) op->add_inputs(t);
    for (int t : outputs) op->add_outputs(t);
    return op->id();
  }
  const proto::Program& program() const { return program_; }

  // A schedule of this program over one rank, its stream parsed from `text`.
  proto::Schedule Schedule(const std::string& text) const {
    proto::Schedule schedule;
    schedule.set_world_size(1);
    *schedule.mutable_program() = program_;
    Status parsed = ParseScheduleText(text, &schedule);
    EXPECT_TRUE(parsed.ok()) << parsed.message();
    return schedule;
  }

 private:
  int Add(const std::string& name, int64_t bytes, proto::Role role, int param) {
    proto::Tensor* t = program_.add_tensors();
    t->set_id(program_.tensors_size() - 1);
    t->set_name(name);
    t->add_shape(bytes / 4);
    t->set_dtype(proto::DTYPE_F32);
    t->set_role(role);
    t->set_layer(-1);
    t->set_param(param);
    return t->id();
  }
  proto::Program program_;
};

// A cost model for hand programs: every op `op_seconds`, collectives `latency` +
// bytes / `bandwidth` (0: no byte term), nothing else costs time.
inline CostModel HandCosts(const proto::Program& program, double op_seconds, double latency,
                           double bandwidth) {
  CostModel costs;
  costs.op_seconds.assign(program.ops_size(), op_seconds);
  costs.all_gather = {latency, bandwidth};
  costs.reduce_scatter = {latency, bandwidth};
  return costs;
}

inline SimResult MustSimulate(const proto::Schedule& schedule, const CostModel& costs) {
  auto sim = Simulate(schedule, costs);
  EXPECT_TRUE(sim.ok()) << sim.status().message();
  return sim.ok() ? *sim : SimResult{};
}

// A model preset's zero3 stream, with the H100 estimate of its costs on `cluster`.
struct ModelCase {
  proto::Schedule schedule;
  CostModel costs;
};

inline ModelCase MakeModelCase(const std::string& preset, int64_t gas, ClusterShape cluster,
                               int64_t seq = 0) {
  ModelOverrides overrides;
  overrides.gas = gas;
  if (seq > 0) {
    overrides.seq = seq;
    overrides.micro_batch = 1;
  }
  auto config = MakeConfig(preset, overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  ModelCase c;
  c.schedule.set_world_size(cluster.world_size());
  *c.schedule.mutable_program() = *program;
  Zero3Pass zero3;
  EXPECT_TRUE(zero3.Run(&c.schedule, PassContext{}).ok());
  auto hw = FindHardware("h100-sxm");
  EXPECT_TRUE(hw.ok()) << hw.status().message();
  c.costs = EstimateCostModel(*program, *hw, cluster);
  return c;
}

// What a stream means, as the passes judge it: every all-gather after the release of its
// param's previous gathered copy (the zero3 stream leaves that order implicit).
inline SimResult ReferenceSim(const proto::Schedule& schedule, const CostModel& costs) {
  proto::Schedule ordered = schedule;
  rewriter_internal::OrderGathersAfterReleases(rewriter_internal::IndexGathers(ordered), &ordered);
  return MustSimulate(ordered, costs);
}

// No all-gather starts before the release of its param's previous copy has run.
inline void ExpectCopiesInOrder(const proto::Schedule& schedule, const SimResult& sim) {
  const auto index = rewriter_internal::IndexGathers(schedule);
  for (size_t param = 0; param < index.spans_by_param.size(); ++param) {
    const auto& spans = index.spans_by_param[param];
    for (size_t s = 1; s < spans.size(); ++s) {
      if (spans[s - 1].release < 0) continue;
      EXPECT_GE(sim.start_seconds[spans[s].gather], sim.end_seconds[spans[s - 1].release])
          << schedule.program().tensors(param).name() << " gathered again (instruction "
          << spans[s].gather << ") before its release (instruction " << spans[s - 1].release << ")";
    }
  }
}

// Runs `pass` on a copy of `input` and checks what every pass promises: the verifier passes,
// the simulated peak stays within the budget, the step is no slower than the input's (as
// ReferenceSim judges it), previous copies are released before re-gathers, and a second run
// on the same input gives a byte-identical stream. Returns the output.
inline proto::Schedule RunAndCheck(Pass& pass, const proto::Schedule& input,
                                   const PassContext& context) {
  proto::Schedule out = input;
  auto changed = pass.Run(&out, context);
  EXPECT_TRUE(changed.ok()) << pass.name() << ": " << changed.status().message();
  const Status verified = VerifySchedule(out, context);
  EXPECT_TRUE(verified.ok()) << pass.name() << ": " << verified.message();
  const SimResult before = ReferenceSim(input, *context.costs);
  const SimResult after = MustSimulate(out, *context.costs);
  if (context.budget_bytes > 0) {
    EXPECT_LE(after.peak_device_bytes, context.budget_bytes);
  }
  if (context.budget_bytes <= 0 || before.peak_device_bytes <= context.budget_bytes) {
    EXPECT_LE(after.step_seconds, before.step_seconds * (1 + 1e-12)) << pass.name();
  }
  ExpectCopiesInOrder(out, after);
  proto::Schedule again = input;
  EXPECT_TRUE(pass.Run(&again, context).ok());
  EXPECT_EQ(again.SerializeAsString(), out.SerializeAsString()) << pass.name();
  return out;
}

// How many all-gathers name `tensor`.
inline int GathersOf(const proto::Schedule& schedule, int tensor) {
  int n = 0;
  for (const auto& instr : schedule.instructions()) {
    if (instr.kind() != proto::INSTR_ALL_GATHER) continue;
    for (int t : instr.tensors()) n += t == tensor;
  }
  return n;
}

}  // namespace dc::testing
