#include "executor/executor.h"

#include <algorithm>
#include <memory>

#include "executor/cpu_device.h"
#include "executor/interpreter.h"
#include "schemas/effects.h"
#include "schemas/plan_check.h"

namespace dc {

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string DescribeInstruction(const proto::Schedule& schedule, int index, int rank) {
  const proto::Program& program = schedule.program();
  const auto& instr = schedule.instructions(index);
  std::string text = "instruction " + std::to_string(index) + " (" + InstrKindName(instr.kind());
  if (instr.kind() == proto::INSTR_COMPUTE) {
    text += " " + program.ops(instr.op()).name();
  } else if (instr.tensors_size() > 0) {
    text += " " + program.tensors(instr.tensors(0)).name();
    if (instr.tensors_size() > 1) text += " +" + std::to_string(instr.tensors_size() - 1);
  }
  return text + ") on rank " + std::to_string(rank);
}

Status CheckRunnable(const proto::Schedule& schedule, int world_size, const std::string& backend) {
  if (schedule.backend() != backend) {
    return Status::Error("the plan is for the '" + schedule.backend() +
                         "' backend and this run uses '" + backend +
                         "'; re-plan with dc-plan for " + backend);
  }
  if (schedule.world_size() != world_size) {
    return Status::Error("the plan is for " + std::to_string(schedule.world_size()) +
                         " rank(s) and this run has " + std::to_string(world_size) +
                         "; pass --nproc " + std::to_string(schedule.world_size()) +
                         " (under an outside launcher: start that many ranks, WORLD_SIZE=" +
                         std::to_string(schedule.world_size()) + ") or re-plan");
  }
  // Every index, offset, shape and buffer effect holds before a backend touches a device (the
  // plan file's reader checked the same, but a plan may come from memory): a plan edited by hand
  // fails here with the planner's own message, not halfway through a step. On the cpu backend
  // the device's memory is this host's.
  PlanLimits limits;
  if (backend == "cpu") limits.memory_bytes = PhysicalMemoryBytes();
  if (Status valid = ValidatePlan(schedule, limits); !valid.ok()) {
    return Status::Error(valid.message() + "; re-plan with dc-plan");
  }
  return Status::Ok();
}

StatusOr<RunResult> RunSchedule(const proto::Schedule& schedule, const RunOptions& options,
                                Communicator* comm, ExecutionTracer* tracer) {
  DC_RETURN_IF_ERROR(CheckRunnable(schedule, comm->world_size()));
  DC_ASSIGN_OR_RETURN(const CpuDeviceOptions streams, CpuDeviceOptionsFromEnv());
  DC_ASSIGN_OR_RETURN(std::unique_ptr<RankDevice> device,
                      MakeCpuDevice(comm, options.num_threads, streams, tracer));
  return Interpret(schedule, options, device.get(), comm, tracer);
}

}  // namespace dc
