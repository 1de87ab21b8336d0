#include "rewriter/host_optimizer.h"

#include <algorithm>
#include <vector>

#include "schemas/units.h"

namespace dc {

StatusOr<bool> HostOptimizerPass::Run(proto::Schedule* schedule, const PassContext&) {
  stats_ = HostOptimizerStats();
  const proto::Program& program = schedule->program();
  const int n = schedule->instructions_size();
  int first_optimizer = n;
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = schedule->instructions(i);
    if (instr.kind() == proto::INSTR_OFFLOAD || instr.kind() == proto::INSTR_RELOAD) {
      return Status::Error("instruction " + std::to_string(i) +
                           " already moves a fragment between host and device; run host-optimizer "
                           "instead of the offload passes, not after them");
    }
    if (instr.micro_step() < 0) first_optimizer = std::min(first_optimizer, i);
  }
  // The last instruction of each stream before the optimizer phase: the host's step starts once
  // the backward and every reduce-scatter into the grad shards are done.
  std::vector<int> last(proto::Stream_MAX + 1, -1);
  for (int i = 0; i < first_optimizer; ++i) {
    const int stream = schedule->instructions(i).stream();
    if (stream >= 0 && stream <= proto::Stream_MAX) last[stream] = i;
  }
  std::vector<int> end_of_backward;
  for (int i : last) {
    if (i >= 0) end_of_backward.push_back(i);
  }
  std::sort(end_of_backward.begin(), end_of_backward.end());

  for (int i = first_optimizer; i < n; ++i) {
    proto::Instruction* instr = schedule->mutable_instructions(i);
    if (instr->kind() != proto::INSTR_COMPUTE || instr->op() < 0 ||
        instr->op() >= program.ops_size() ||
        program.ops(instr->op()).phase() != proto::PHASE_OPTIMIZER) {
      continue;
    }
    instr->set_stream(proto::STREAM_HOST);
    std::vector<int> deps(instr->deps().begin(), instr->deps().end());
    deps.insert(deps.end(), end_of_backward.begin(), end_of_backward.end());
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    instr->clear_deps();
    for (int d : deps) instr->add_deps(d);
    ++stats_.host_ops;
  }
  if (stats_.host_ops == 0)
    return Status::Error("the schedule has no optimizer op to run on the host");

  const int world_size = std::max(1, schedule->world_size());
  const std::vector<bool> host = HostResidentTensors(*schedule);
  const std::vector<bool> compute_shard = ComputeShardParams(*schedule);
  constexpr int64_t kF32Bytes = 4;  // persistent shards are fp32 (schemas/program.h)
  for (int t = 0; t < program.tensors_size(); ++t) {
    const proto::Tensor& tensor = program.tensors(t);
    if (host[t])
      stats_.host_resident_bytes += ShardElements(NumElements(tensor), world_size) * kF32Bytes;
    if (compute_shard[t])
      stats_.compute_shard_bytes += ComputeShardBytes(program, tensor, world_size);
  }
  return true;
}

std::string HostOptimizerPass::Summary() const {
  return std::to_string(stats_.host_ops) +
         " optimizer ops on the host: " + FormatBytes(stats_.host_resident_bytes) +
         " of optimizer state and fp32 masters in host memory, " +
         FormatBytes(stats_.compute_shard_bytes) + " of compute-dtype shards on the device";
}

}  // namespace dc
