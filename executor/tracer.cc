#include "executor/tracer.h"

#include <algorithm>

#include "schemas/effects.h"

namespace dc {

TracedInstruction TraceOf(const proto::Schedule& schedule, int index) {
  const proto::Program& program = schedule.program();
  const proto::Instruction& instr = schedule.instructions(index);
  TracedInstruction traced;
  traced.kind = instr.kind();
  traced.stream = instr.stream();
  traced.micro_step = instr.micro_step();
  traced.tensors = instr.tensors_size();
  traced.bucket = instr.bucket();
  if (instr.kind() == proto::INSTR_COMPUTE) traced.op_name = program.ops(instr.op()).name();
  traced.bytes = InstructionBytes(program, instr) +
                 CopyBytes(program, std::max(1, schedule.world_size()), instr);
  return traced;
}

}  // namespace dc
