#include "collector/cupti/execution_tracer.h"

namespace dc {

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
