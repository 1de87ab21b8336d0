#include "collector/cupti/execution_tracer.h"

#include "collector/trace_blobs.h"

namespace dc {

std::function<Status(collector_internal::Database*)> StreamScheduleBlobs(
    const proto::Schedule& schedule) {
  const proto::Schedule* plan = &schedule;
  return [plan](collector_internal::Database* db) {
    return collector_internal::WriteScheduleBlobs(db, *plan);
  };
}

void CuptiExecutionTracer::DescribeInstruction(int index, const TracedInstruction& instruction) {
  InstructionInfo info;
  info.kind = InstrKindName(instruction.kind);
  info.micro_step = instruction.micro_step;
  info.bytes = instruction.bytes;
  info.tensors = instruction.tensors;
  info.bucket = instruction.bucket;
  collector_->DescribeInstruction(index, std::move(info));
}

}  // namespace dc
