#include "executor/layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "schemas/effects.h"
#include "schemas/op_kinds.h"

namespace dc {
namespace {

int64_t AlignUp(int64_t bytes, int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

std::string Where(const proto::Schedule& schedule, int index) {
  return InstructionWhere(index, schedule.instructions(index));
}

}  // namespace

void CastOnHost(const float* in, int64_t elements, proto::DType dtype, void* out) {
  if (dtype == proto::DTYPE_F32) {
    std::memcpy(out, in, static_cast<size_t>(elements) * sizeof(float));
    return;
  }
  auto* half = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < elements; ++i) {
    half[i] = dtype == proto::DTYPE_BF16 ? FloatToBf16(in[i]) : FloatToF16(in[i]);
  }
}

BufferShape ShardShape(const proto::Tensor& tensor, int world_size) {
  const int64_t elements = ShardElements(NumElements(tensor), world_size);
  return {proto::DTYPE_F32, elements, elements * kShardElementBytes};
}

BufferShape TransientShape(const proto::Program& program, const proto::Tensor& tensor) {
  const proto::DType dtype =
      tensor.role() == proto::ROLE_PARAM ? program.config().compute_dtype() : tensor.dtype();
  // TransientBytes is the accounting the planner uses; the buffer is exactly that large.
  return {dtype, NumElements(tensor), TransientBytes(program, tensor)};
}

bool NeedsStaging(const proto::Tensor& tensor, int world_size) {
  return NumElements(tensor) % world_size != 0;
}

int64_t StagingBytes(const proto::Tensor& tensor, int world_size, proto::DType dtype) {
  const int64_t padded = ShardElements(NumElements(tensor), world_size) * world_size;
  return AlignUp(padded * DTypeSizeBytes(dtype), kStagingAlignmentBytes);
}

StatusOr<ScheduleLayout> MakeScheduleLayout(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  const int world = schedule.world_size();
  if (world < 1) return Status::Error("the plan has world size " + std::to_string(world));
  const int n = schedule.instructions_size();
  ScheduleLayout layout;
  layout.world_size = world;
  layout.gas = static_cast<int>(std::max<int64_t>(1, program.config().gas()));
  layout.waits.resize(n);
  layout.records_event.assign(n, false);
  const proto::DType compute_dtype = program.config().compute_dtype();
  // The latest OFFLOAD of each tensor in issue order: a RELOAD's host copy comes from it, and the
  // RELOAD waits for it (schemas/happens_before.h counts that wait as an ordering).
  std::map<int, int> last_offload;

  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    const int stream = DeviceStreamIndex(instr.stream());
    const bool on_host = instr.stream() == proto::STREAM_HOST;
    if (on_host) {
      if (instr.kind() != proto::INSTR_COMPUTE || instr.op() < 0 ||
          instr.op() >= program.ops_size() ||
          program.ops(instr.op()).phase() != proto::PHASE_OPTIMIZER) {
        return Status::Error(Where(schedule, i) +
                             " is on the host stream, which runs optimizer ops only; re-plan it");
      }
      int64_t staging = 0;
      for (int t : program.ops(instr.op()).inputs()) {
        const proto::Tensor& tensor = program.tensors(t);
        if (tensor.role() == proto::ROLE_GRAD) {
          staging += AlignUp(ShardShape(tensor, world).size_bytes, kStagingAlignmentBytes);
        } else if (tensor.role() == proto::ROLE_PARAM) {
          staging += AlignUp(ComputeShardBytes(program, tensor, world), kStagingAlignmentBytes);
        } else if (!IsPersistentRole(tensor.role())) {  // the grads' squared norm
          staging += AlignUp(SizeBytes(tensor), kStagingAlignmentBytes);
        }
      }
      layout.host_optimizer_staging_bytes = std::max(layout.host_optimizer_staging_bytes, staging);
    } else if (stream < 0 || stream >= kNumDeviceStreams) {
      return Status::Error(Where(schedule, i) + " has no stream dc knows (" +
                           std::to_string(static_cast<int>(instr.stream())) + "); re-plan it");
    }
    if (instr.kind() == proto::INSTR_COMPUTE && instr.stream() != proto::STREAM_COMPUTE &&
        !on_host) {
      return Status::Error(Where(schedule, i) + " computes on the " + StreamName(instr.stream()) +
                           " stream; dc runs compute on the compute stream only; "
                           "re-plan it");
    }
    for (int t : instr.tensors()) {
      if (t < 0 || t >= program.tensors_size()) {
        return Status::Error(Where(schedule, i) + " names tensor id " + std::to_string(t) +
                             ", which the program lacks; re-plan it");
      }
    }
    std::vector<int> waits;
    for (int d : instr.deps()) {
      if (d < 0 || d >= i) {
        return Status::Error(Where(schedule, i) + " depends on instruction " + std::to_string(d) +
                             ", which does not come before it; re-plan it");
      }
      if (schedule.instructions(d).stream() != instr.stream()) waits.push_back(d);
    }
    switch (instr.kind()) {
      case proto::INSTR_ALL_GATHER:
      case proto::INSTR_REDUCE_SCATTER: {
        int64_t staging = 0;
        for (int t : instr.tensors()) {
          const proto::Tensor& tensor = program.tensors(t);
          // A gather moves the param in the compute dtype, a reduce-scatter the grad in its own.
          const proto::DType dtype =
              instr.kind() == proto::INSTR_ALL_GATHER ? compute_dtype : tensor.dtype();
          if (NeedsStaging(tensor, world)) staging += StagingBytes(tensor, world, dtype);
        }
        layout.staging_bytes[stream] = std::max(layout.staging_bytes[stream], staging);
        break;
      }
      case proto::INSTR_OFFLOAD:
        for (int t : instr.tensors()) {
          const proto::Tensor& tensor = program.tensors(t);
          if (!IsPersistentRole(tensor.role())) {
            return Status::Error(Where(schedule, i) + " offloads " + tensor.name() +
                                 ", which is not a persistent shard (dc offloads "
                                 "shards only); re-plan it");
          }
          layout.host_shard_bytes[t] = ShardShape(tensor, world).size_bytes;
          last_offload[t] = i;
        }
        break;
      case proto::INSTR_RELOAD:
        for (int t : instr.tensors()) {
          auto it = last_offload.find(t);
          if (it == last_offload.end()) {
            return Status::Error(Where(schedule, i) + " reloads " + program.tensors(t).name() +
                                 ", which no earlier instruction offloads; re-plan it");
          }
          if (schedule.instructions(it->second).stream() != instr.stream()) {
            waits.push_back(it->second);
          }
        }
        break;
      case proto::INSTR_RENAME:
        if (instr.op() < 0 || instr.op() >= program.ops_size() ||
            program.ops(instr.op()).outputs_size() != instr.tensors_size()) {
          return Status::Error(Where(schedule, i) + " renames to the outputs of op id " +
                               std::to_string(instr.op()) + ", which does not match; re-plan it");
        }
        break;
      case proto::INSTR_COMPUTE: {
        if (instr.op() < 0 || instr.op() >= program.ops_size()) {
          return Status::Error(Where(schedule, i) + " runs op id " + std::to_string(instr.op()) +
                               ", which the program lacks; re-plan it");
        }
        for (int t : program.ops(instr.op()).inputs()) {
          const proto::Tensor& tensor = program.tensors(t);
          if (tensor.role() == proto::ROLE_INPUT) layout.input_bytes[t] = SizeBytes(tensor);
        }
        break;
      }
      default:
        break;
    }
    std::sort(waits.begin(), waits.end());
    waits.erase(std::unique(waits.begin(), waits.end()), waits.end());
    for (int w : waits) layout.records_event[w] = true;
    layout.waits[i] = std::move(waits);
  }
  layout.host_resident = HostResidentTensors(schedule);
  for (int t = 0; t < program.tensors_size(); ++t) {
    if (layout.host_resident[t]) {
      layout.host_shard_bytes[t] = ShardShape(program.tensors(t), world).size_bytes;
    }
  }
  return layout;
}

StatusOr<int> EvaluationPrefix(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  auto refuse = [&](int i, const std::string& why) {
    return Status::Error(Where(schedule, i) + " " + why +
                         " before micro-step 0's loss, so the plan's forward cannot run alone "
                         "for an evaluation; evaluate with a plan of another policy");
  };
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    if (instr.kind() == proto::INSTR_REDUCE_SCATTER) return refuse(i, "reduces grads");
    if (instr.kind() != proto::INSTR_COMPUTE) continue;
    const proto::Op& op = program.ops(instr.op());
    if (op.phase() != proto::PHASE_FORWARD) return refuse(i, "runs a backward or optimizer op");
    if (instr.micro_step() != 0) {
      return refuse(i, "runs micro-step " + std::to_string(instr.micro_step()) + "'s forward");
    }
    for (int t : op.outputs()) {
      if (program.tensors(t).name() == op_kind::kLossName) return i + 1;
    }
  }
  return Status::Error("the plan's schedule never computes micro-step 0's loss; re-plan it");
}

}  // namespace dc
