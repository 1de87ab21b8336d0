// What both executors do for an INSTR_RENAME (schemas/schedule.proto): each live buffer of
// instr.tensors(k) in the instruction's micro-step goes on, in place, as the op's output k.
#pragma once

#include <map>
#include <string>

#include "schemas/effects.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Re-keys `live` (buffers by BufferKey) and, where given, `also` (anything else kept by the same
// keys). `what` names the instruction in errors.
template <typename Buffer, typename Also = int>
Status RenameLiveBuffers(const proto::Program& program, const proto::Instruction& instr,
                         const std::string& what, std::map<BufferKey, Buffer>* live,
                         std::map<BufferKey, Also>* also = nullptr) {
  const proto::Op& op = program.ops(instr.op());
  const int micro = instr.micro_step();
  if (op.outputs_size() != instr.tensors_size()) {
    return Status::Error(what + ": renames " + std::to_string(instr.tensors_size()) +
                         " tensors to the " + std::to_string(op.outputs_size()) + " outputs of " +
                         op.name());
  }
  for (int k = 0; k < instr.tensors_size(); ++k) {
    const BufferKey from = BufferKey::Transient(instr.tensors(k), micro);
    const BufferKey to = BufferKey::Transient(op.outputs(k), micro);
    if (!live->count(from)) {
      return Status::Error(what + ": renames " + program.tensors(from.tensor).name() +
                           ", which is not live");
    }
    if (live->count(to)) {
      return Status::Error(what + ": " + program.tensors(to.tensor).name() + " is already live");
    }
    auto node = live->extract(from);
    node.key() = to;
    live->insert(std::move(node));
    if (also == nullptr) continue;
    auto other = also->extract(from);
    if (other.empty()) continue;
    other.key() = to;
    also->insert(std::move(other));
  }
  return Status::Ok();
}

}  // namespace dc
