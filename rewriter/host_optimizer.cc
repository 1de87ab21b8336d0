#include "rewriter/host_optimizer.h"

#include <algorithm>
#include <vector>

#include "machine/cost_model.h"
#include "rewriter/schedule_editor.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc {

std::string HostOptimizerPass::OptionsText() const {
  return "device_share_of_budget=" + std::to_string(options_.device_share_of_budget);
}

StatusOr<bool> HostOptimizerPass::Run(proto::Schedule* schedule, const PassContext& context) {
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
  // The host's step starts once the backward and every reduce-scatter are done.
  const std::vector<int> end_of_backward =
      rewriter_internal::EndOfBackward(*schedule, first_optimizer);

  std::vector<int> optimizer_ops;
  for (int i = first_optimizer; i < n; ++i) {
    const proto::Instruction& instr = schedule->instructions(i);
    // The steps only: a shard reduction (the grads' norm) stays on the device, by the grads.
    if (instr.kind() == proto::INSTR_COMPUTE && instr.op() >= 0 &&
        instr.op() < program.ops_size() && IsOptimizerStep(program, program.ops(instr.op()))) {
      optimizer_ops.push_back(i);
    }
  }
  if (optimizer_ops.empty()) {
    return Status::Error("the schedule has no optimizer op to run on the host");
  }
  const int world_size = std::max(1, schedule->world_size());
  std::vector<char> on_host(n, 1);
  const int64_t budget =
      context.final_budget_bytes > 0 ? context.final_budget_bytes : context.budget_bytes;
  if (options_.device_share_of_budget > 0 && budget > 0) {
    // The largest params first (the fewest ops for the bytes; ties: schedule order), until the
    // device's persistent shards fit. Each frees its master and states, less its compute shard.
    on_host.assign(n, 0);
    std::vector<std::pair<int64_t, int>> by_size;
    for (int i : optimizer_ops) {
      by_size.push_back({HostOptimizerElements(program, world_size, schedule->instructions(i)), i});
    }
    std::stable_sort(by_size.begin(), by_size.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    const auto target =
        static_cast<int64_t>(static_cast<double>(budget) * options_.device_share_of_budget);
    int64_t persistent = 0;
    for (int64_t b : PersistentBytesByKind(*schedule)) persistent += b;
    for (const auto& [elements, i] : by_size) {
      if (persistent <= target) break;
      on_host[i] = 1;
      for (int t : program.ops(schedule->instructions(i).op()).inputs()) {
        const proto::Tensor& tensor = program.tensors(t);
        if (tensor.role() == proto::ROLE_OPTIMIZER_STATE) {
          persistent -= ShardBytes(tensor, world_size);
        } else if (tensor.role() == proto::ROLE_PARAM) {
          persistent -=
              ShardBytes(tensor, world_size) - ComputeShardBytes(program, tensor, world_size);
        }
      }
    }
  }
  for (int i : optimizer_ops) {
    if (!on_host[i]) continue;
    proto::Instruction* instr = schedule->mutable_instructions(i);
    instr->set_stream(proto::STREAM_HOST);
    std::vector<int> deps(instr->deps().begin(), instr->deps().end());
    deps.insert(deps.end(), end_of_backward.begin(), end_of_backward.end());
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    instr->clear_deps();
    for (int d : deps) instr->add_deps(d);
    ++stats_.host_ops;
  }
  if (stats_.host_ops == 0) return false;  // the device holds the step already

  const std::vector<bool> host = HostResidentTensors(*schedule);
  const std::vector<bool> compute_shard = ComputeShardParams(*schedule);
  for (int t = 0; t < program.tensors_size(); ++t) {
    const proto::Tensor& tensor = program.tensors(t);
    if (host[t]) {
      stats_.host_resident_bytes += ShardBytes(tensor, world_size);
    }
    if (compute_shard[t]) {
      stats_.compute_shard_bytes += ComputeShardBytes(program, tensor, world_size);
    }
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
