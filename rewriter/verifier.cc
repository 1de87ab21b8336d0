#include "rewriter/verifier.h"

#include <cstdio>
#include <optional>
#include <vector>

#include "machine/simulator.h"
#include "rewriter/simulation_cache.h"
#include "schemas/effects.h"
#include "schemas/happens_before.h"
#include "schemas/units.h"

namespace dc {

namespace {

Status CheckOpCounts(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  const int gas = static_cast<int>(std::max<int64_t>(1, program.config().gas()));
  // counts[op * (gas + 1) + micro + 1]; micro = -1 is the optimizer phase.
  const size_t stride = static_cast<size_t>(gas) + 1;
  std::vector<int> counts(static_cast<size_t>(program.ops_size()) * stride, 0);
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const auto& instr = schedule.instructions(i);
    for (int d : instr.deps()) {
      if (d < 0 || d >= i) {
        return Status::Error("instruction " + std::to_string(i) + " depends on instruction " +
                             std::to_string(d) + ", which does not come before it");
      }
    }
    // A rename stands in for its op's run (its outputs kept from the forward).
    if (instr.kind() != proto::INSTR_COMPUTE && instr.kind() != proto::INSTR_RENAME) continue;
    if (instr.op() < 0 || instr.op() >= program.ops_size()) {
      return Status::Error("instruction " + std::to_string(i) + " computes a bad op id");
    }
    if (instr.micro_step() < -1 || instr.micro_step() >= gas) {
      return Status::Error("instruction " + std::to_string(i) + " has a bad micro-step");
    }
    ++counts[instr.op() * stride + (instr.micro_step() + 1)];
  }
  for (int op = 0; op < program.ops_size(); ++op) {
    const bool optimizer = program.ops(op).phase() == proto::PHASE_OPTIMIZER;
    for (int m = -1; m < gas; ++m) {
      const int want = (optimizer == (m == -1)) ? 1 : 0;
      const int count = counts[op * stride + (m + 1)];
      if (count != want) {
        return Status::Error("op " + program.ops(op).name() + " runs " + std::to_string(count) +
                             " times in micro-step " + std::to_string(m) + ", expected " +
                             std::to_string(want));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

uint64_t InstructionsFingerprint(const proto::Schedule& schedule) {
  // One multiply per field (a 64-bit hash combine), not one per byte: this runs on every check.
  constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull, kPrime = 0x100000001b3ull;
  uint64_t hash = kGolden;
  auto mix = [&hash](int64_t value) {
    hash = (hash ^ (static_cast<uint64_t>(value) + kGolden + (hash << 6) + (hash >> 2))) * kPrime;
  };
  mix(schedule.instructions_size());
  for (const proto::Instruction& instr : schedule.instructions()) {
    mix(instr.kind());
    mix(instr.stream());
    mix(instr.micro_step());
    mix(instr.op());
    mix(instr.bucket());
    mix(instr.tensors_size());
    for (int t : instr.tensors()) mix(t);
    mix(instr.deps_size());
    for (int d : instr.deps()) mix(d);
  }
  return hash;
}

Status VerifySchedule(const proto::Schedule& schedule, const PassContext& context,
                      SimResult* simulated) {
  if (schedule.instructions_size() == 0) {
    return Status::Error(
        "the schedule has no instructions; plan it with a pipeline that starts "
        "with zero3");
  }
  DC_RETURN_IF_ERROR(CheckOpCounts(schedule));
  DC_RETURN_IF_ERROR(CheckShardReductions(schedule));
  // Simulate checks every reference and buffer effect (schemas/effects.h) before it times; the
  // plan's simulations hold its results for identical instructions under the same costs.
  SimOptions options;
  options.memory_timeline = false;  // the peak is all a check needs
  SimResult sim;
  // The instructions' fingerprint, for the plan's kept simulations and order checks.
  const std::optional<uint64_t> fingerprint =
      context.simulations ? std::optional<uint64_t>(InstructionsFingerprint(schedule))
                          : std::nullopt;
  if (context.simulations && context.costs) {
    DC_ASSIGN_OR_RETURN(
        sim, context.simulations->Simulate(schedule, *context.costs, options, fingerprint));
  } else {
    const CostModel fallback;
    DC_ASSIGN_OR_RETURN(sim,
                        Simulate(schedule, context.costs ? *context.costs : fallback, options));
  }
  // The streams run concurrently: the plan's deps must order what the replay checked in issue
  // order (references are checked: by the simulation, or the one of identical instructions).
  DC_RETURN_IF_ERROR(context.simulations
                         ? context.simulations->CheckHappensBefore(schedule, fingerprint)
                         : CheckHappensBefore(schedule));
  if (context.budget_bytes > 0 && sim.peak_device_bytes > context.budget_bytes) {
    return Status::OverBudget("the schedule needs " + FormatBytes(sim.peak_device_bytes) +
                                  " of device memory at its peak (instruction " +
                                  std::to_string(sim.peak_instruction) + "), over the budget of " +
                                  FormatBytes(context.budget_bytes) + "; raise --budget",
                              sim.peak_device_bytes - context.budget_bytes);
  }
  if (simulated) *simulated = std::move(sim);
  return Status::Ok();
}

}  // namespace dc
