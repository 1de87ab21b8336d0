#include "rewriter/verifier.h"

#include <cstdio>
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
  // This runs on every check of a schedule of up to hundreds of thousands of instructions: a
  // 64-bit hash combine per pair of 32-bit fields, each instruction hashed on its own from a
  // seed (no chain of multiplies through the whole schedule to wait on), then folded in.
  constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull, kPrime = 0x100000001b3ull;
  auto mix = [](uint64_t hash, uint64_t value) {
    return (hash ^ (value + kGolden + (hash << 6) + (hash >> 2))) * kPrime;
  };
  auto pair = [](int32_t high, int32_t low) {
    return static_cast<uint64_t>(static_cast<uint32_t>(high)) << 32 | static_cast<uint32_t>(low);
  };
  auto mix_ints = [&](uint64_t hash, const google::protobuf::RepeatedField<int32_t>& values) {
    const int n = values.size();
    int k = 0;
    for (; k + 1 < n; k += 2) hash = mix(hash, pair(values[k], values[k + 1]));
    if (k < n) hash = mix(hash, pair(values[k], 0));
    return hash;
  };
  uint64_t hash = mix(kGolden, static_cast<uint64_t>(schedule.instructions_size()));
  for (const proto::Instruction& instr : schedule.instructions()) {
    uint64_t h = mix(kGolden, pair(instr.kind(), instr.stream()));
    h = mix(h, pair(instr.micro_step(), instr.op()));
    h = mix(h, pair(instr.bucket(), instr.tensors_size()));
    h = mix_ints(h, instr.tensors());
    h = mix(h, static_cast<uint64_t>(instr.deps_size()));
    h = mix_ints(h, instr.deps());
    hash = ((hash << 5 | hash >> 59) ^ h) * kPrime;
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
  // The streams run concurrently: the plan's deps must order what the replay checked in issue
  // order (schemas/happens_before.h), checked in the simulation's replay of the effects.
  if (context.simulations && context.costs) {
    DC_ASSIGN_OR_RETURN(
        sim, context.simulations->SimulateAndCheckOrder(schedule, *context.costs, options));
  } else {
    const CostModel fallback;
    HappensBeforeCheck order(schedule);
    options.also_listening = &order;
    DC_ASSIGN_OR_RETURN(sim,
                        Simulate(schedule, context.costs ? *context.costs : fallback, options));
    DC_RETURN_IF_ERROR(order.status());
  }
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
