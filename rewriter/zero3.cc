#include "rewriter/zero3.h"

#include <algorithm>
#include <map>
#include <vector>

namespace dc {
namespace {

// Last op index (within [begin, end)) that reads or writes each tensor; -1 if none.
std::vector<int> LastUse(const proto::Program& program, int begin, int end) {
  std::vector<int> last(program.tensors_size(), -1);
  for (int i = begin; i < end; ++i) {
    for (int t : program.ops(i).inputs()) last[t] = i;
    for (int t : program.ops(i).outputs()) last[t] = i;
  }
  return last;
}

class StreamBuilder {
 public:
  explicit StreamBuilder(proto::Schedule* schedule) : schedule_(schedule) {}

  int Emit(proto::InstrKind kind, proto::Stream stream, int micro_step, int op,
           const std::vector<int>& tensors, const std::vector<int>& deps) {
    auto* instr = schedule_->add_instructions();
    instr->set_kind(kind);
    instr->set_stream(stream);
    instr->set_micro_step(micro_step);
    instr->set_op(op);
    for (int t : tensors) instr->add_tensors(t);
    for (int d : deps) instr->add_deps(d);
    return schedule_->instructions_size() - 1;
  }

 private:
  proto::Schedule* schedule_;
};

}  // namespace

std::string Zero3Pass::OptionsText() const {
  return "lookahead_ops=" + std::to_string(options_.lookahead_ops);
}

StatusOr<bool> Zero3Pass::Run(proto::Schedule* schedule, const PassContext& /*context*/) {
  const proto::Program& program = schedule->program();
  DC_RETURN_IF_ERROR(ValidateProgram(program));
  if (schedule->world_size() < 1) return Status::Error("world size must be at least 1");
  const int gas = static_cast<int>(std::max<int64_t>(1, program.config().gas()));

  int forward_end = 0, backward_end = 0;
  for (const auto& op : program.ops()) {
    if (op.phase() == proto::PHASE_FORWARD) forward_end = op.id() + 1;
    if (op.phase() != proto::PHASE_OPTIMIZER) backward_end = op.id() + 1;
  }
  // Params are released after their last use within their phase (and gathered again for
  // backward); activations, inputs and grads after their last use in the micro-step.
  const std::vector<int> last_forward = LastUse(program, 0, forward_end);
  const std::vector<int> last_backward = LastUse(program, forward_end, backward_end);
  const std::vector<int> last_micro = LastUse(program, 0, backward_end);

  schedule->clear_instructions();
  StreamBuilder out(schedule);
  std::map<int, std::vector<int>> grad_reductions;  // grad tensor -> reduce-scatter indices

  // The release of each param's latest gathered copy: its next gather waits for it.
  std::vector<int> last_release(program.tensors_size(), -1);
  std::vector<int> computes;  // compute instructions of the step so far
  int gathers = 0, reductions = 0;
  for (int micro = 0; micro < gas; ++micro) {
    std::vector<bool> gathered(program.tensors_size(), false);
    for (int op_id = 0; op_id < backward_end; ++op_id) {
      const proto::Op& op = program.ops(op_id);
      const bool forward = op.phase() == proto::PHASE_FORWARD;
      std::vector<int> deps;
      const int issue_after = static_cast<int>(computes.size()) - 1 - options_.lookahead_ops;
      for (int t : op.inputs()) {
        if (program.tensors(t).role() != proto::ROLE_PARAM || gathered[t]) continue;
        std::vector<int> gather_deps;
        if (issue_after >= 0) gather_deps.push_back(computes[issue_after]);
        if (last_release[t] >= 0) gather_deps.push_back(last_release[t]);
        std::sort(gather_deps.begin(), gather_deps.end());
        gather_deps.erase(std::unique(gather_deps.begin(), gather_deps.end()), gather_deps.end());
        deps.push_back(
            out.Emit(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, micro, -1, {t}, gather_deps));
        gathered[t] = true;
        ++gathers;
      }
      const int compute =
          out.Emit(proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, micro, op_id, {}, deps);
      computes.push_back(compute);

      std::vector<int> released;
      auto release_if_last = [&](int t) {
        const proto::Tensor& tensor = program.tensors(t);
        if (tensor.role() == proto::ROLE_GRAD) return;  // released after its reduce-scatter
        if (tensor.role() == proto::ROLE_PARAM) {
          const int last = forward ? last_forward[t] : last_backward[t];
          if (last == op_id && gathered[t]) {
            released.push_back(t);
            gathered[t] = false;
          }
        } else if (last_micro[t] == op_id) {
          released.push_back(t);
        }
      };
      for (int t : op.inputs()) release_if_last(t);
      for (int t : op.outputs()) release_if_last(t);
      if (!released.empty()) {
        const int release =
            out.Emit(proto::INSTR_RELEASE, proto::STREAM_COMPUTE, micro, -1, released, {compute});
        for (int t : released) {
          if (program.tensors(t).role() == proto::ROLE_PARAM) last_release[t] = release;
        }
      }
      for (int t : op.outputs()) {
        if (program.tensors(t).role() != proto::ROLE_GRAD) continue;
        const int rs =
            out.Emit(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, micro, -1, {t}, {compute});
        grad_reductions[t].push_back(rs);
        ++reductions;
        out.Emit(proto::INSTR_RELEASE, proto::STREAM_REDUCE, micro, -1, {t}, {rs});
      }
    }
  }
  // The optimizer phase. A shard reduction's outputs (the grads' squared norm) are the rank's
  // partials: an all-reduce on the reduce stream makes them global before any op reads them, and
  // a release after their last reader frees them.
  std::map<int, int> all_reduced;                // tensor -> its all-reduce
  std::map<int, std::vector<int>> step_readers;  // optimizer-phase tensor -> reading computes
  const std::vector<int> last_optimizer = LastUse(program, backward_end, program.ops_size());
  for (int op_id = backward_end; op_id < program.ops_size(); ++op_id) {
    const proto::Op& op = program.ops(op_id);
    std::vector<int> deps;
    for (int t : op.inputs()) {
      auto it = grad_reductions.find(t);
      if (it != grad_reductions.end()) deps.push_back(it->second.back());
      auto reduced = all_reduced.find(t);
      if (reduced != all_reduced.end()) deps.push_back(reduced->second);
    }
    const int compute = out.Emit(proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, -1, op_id, {}, deps);
    if (IsShardReduction(program, op)) {
      for (int t : op.outputs()) {
        all_reduced[t] =
            out.Emit(proto::INSTR_ALL_REDUCE, proto::STREAM_REDUCE, -1, -1, {t}, {compute});
        step_readers[t].push_back(all_reduced[t]);
      }
    }
    for (int t : op.inputs()) {
      auto readers = step_readers.find(t);
      if (readers == step_readers.end()) continue;
      readers->second.push_back(compute);
      if (last_optimizer[t] == op_id) {
        out.Emit(proto::INSTR_RELEASE, proto::STREAM_COMPUTE, -1, -1, {t}, readers->second);
      }
    }
  }
  summary_ = std::to_string(schedule->instructions_size()) +
             " instructions: " + std::to_string(gathers) + " all-gathers (" +
             std::to_string(options_.lookahead_ops) + " op of lookahead), " +
             std::to_string(reductions) + " reduce-scatters over " + std::to_string(gas) +
             " micro-step(s)";
  return true;
}

}  // namespace dc
