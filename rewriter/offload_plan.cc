#include "rewriter/offload_plan.h"

#include <algorithm>
#include <cstdio>

#include "rewriter/schedule_editor.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc::rewriter_internal {
namespace {

// Index before which a reload that follows `compute` goes: after the releases and
// reduce-scatters that trail the compute (they free memory first in instruction order).
int PositionAfter(const proto::Schedule& schedule, const Layout& layout, int compute) {
  int j = compute + 1;
  while (j < layout.first_optimizer) {
    const proto::InstrKind kind = schedule.instructions(j).kind();
    if (kind != proto::INSTR_RELEASE && kind != proto::INSTR_REDUCE_SCATTER) break;
    ++j;
  }
  return j;
}

proto::Instruction CopyInstruction(proto::InstrKind kind, proto::Stream stream, int micro_step,
                                   int tensor) {
  proto::Instruction instr;
  instr.set_kind(kind);
  instr.set_stream(stream);
  instr.set_micro_step(micro_step);
  instr.set_op(-1);
  instr.add_tensors(tensor);
  return instr;
}

}  // namespace

StatusOr<Layout> AnalyzeLayout(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  const int world_size = std::max(1, schedule.world_size());
  Layout layout;
  layout.num_instructions = schedule.instructions_size();
  layout.first_optimizer = layout.num_instructions;
  std::vector<bool> already_offloaded(program.tensors_size(), false);
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    layout.last_micro_step = std::max(layout.last_micro_step, instr.micro_step());
    if (instr.micro_step() < 0) layout.first_optimizer = std::min(layout.first_optimizer, i);
    if (instr.kind() == proto::INSTR_OFFLOAD) {
      for (int t : instr.tensors()) {
        if (t >= 0 && t < program.tensors_size()) already_offloaded[t] = true;
      }
    }
  }
  // The host optimizer's masters and states never come to the device.
  const std::vector<bool> host = HostResidentTensors(schedule);
  for (int t = 0; t < program.tensors_size(); ++t) {
    if (host[t]) already_offloaded[t] = true;
  }
  std::vector<int> fragment_of(program.tensors_size(), -1);
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    if (instr.kind() != proto::INSTR_COMPUTE) continue;
    if (instr.op() < 0 || instr.op() >= program.ops_size()) {
      return Status::Error("instruction " + std::to_string(i) + " computes a bad op id " +
                           std::to_string(instr.op()));
    }
    const proto::Op& op = program.ops(instr.op());
    if (op.phase() == proto::PHASE_FORWARD && instr.micro_step() == 0) {
      layout.forward_computes.push_back(i);
    }
    if (op.phase() == proto::PHASE_BACKWARD && instr.micro_step() == layout.last_micro_step) {
      layout.backward_computes.push_back(i);
    }
    if (op.phase() != proto::PHASE_OPTIMIZER) continue;
    for (const proto::Role role : {proto::ROLE_OPTIMIZER_STATE, proto::ROLE_PARAM}) {
      for (int t : op.inputs()) {
        const proto::Tensor& tensor = program.tensors(t);
        if (tensor.role() != role || already_offloaded[t]) continue;
        if (fragment_of[t] < 0) {
          Fragment fragment;
          fragment.tensor = t;
          fragment.master = role == proto::ROLE_PARAM;
          fragment.copy_bytes = ShardBytes(tensor, world_size);
          fragment.resident_bytes =
              fragment.master ? ComputeShardBytes(program, tensor, world_size) : 0;
          fragment.bytes = fragment.copy_bytes - fragment.resident_bytes;
          // A master in an fp32 program frees nothing: its compute shard is as large.
          if (fragment.bytes <= 0) continue;
          fragment_of[t] = static_cast<int>(layout.fragments.size());
          layout.fragments.push_back(std::move(fragment));
        }
        auto& readers = layout.fragments[fragment_of[t]].readers;
        if (readers.empty() || readers.back() != i) readers.push_back(i);
      }
    }
  }
  layout.persistent_by_kind = PersistentBytesByKind(schedule);
  for (int64_t b : layout.persistent_by_kind) layout.persistent_bytes += b;
  return layout;
}

Built Build(const proto::Schedule& input, const Layout& layout, const Plan& plan) {
  const int n = layout.num_instructions;
  // Inserted instructions before each old index (n = at the end); ids: offload k = k, reload r =
  // offloads + r.
  std::vector<std::vector<int>> before(n + 1);
  const int num_offloads = static_cast<int>(plan.offloads.size());
  for (int k = 0; k < num_offloads; ++k) before[0].push_back(k);
  const std::vector<int> end_deps = rewriter_internal::EndOfBackward(input, layout.first_optimizer);
  for (int r = 0; r < static_cast<int>(plan.reloads.size()); ++r) {
    const int after = plan.reload_after[r];
    const int position = after < 0 ? layout.first_optimizer : PositionAfter(input, layout, after);
    before[position].push_back(num_offloads + r);
  }

  Built built;
  rewriter_internal::CopyAllButInstructions(input, &built.schedule);
  built.new_of_old.assign(n, -1);
  built.offload_at.assign(num_offloads, -1);
  built.reload_at.assign(plan.reloads.size(), -1);
  auto* out = built.schedule.mutable_instructions();
  out->Reserve(n + num_offloads + static_cast<int>(plan.reloads.size()));
  auto emit_inserted = [&](int id) {
    built.old_of_new.push_back(-1);
    if (id < num_offloads) {
      built.offload_at[id] = out->size();
      *out->Add() = CopyInstruction(proto::INSTR_OFFLOAD, proto::STREAM_D2H, 0,
                                    layout.fragments[plan.offloads[id]].tensor);
      return;
    }
    const int r = id - num_offloads;
    built.reload_at[r] = out->size();
    proto::Instruction* reload = out->Add();
    *reload = CopyInstruction(proto::INSTR_RELOAD, proto::STREAM_H2D, layout.last_micro_step,
                              layout.fragments[plan.reloads[r]].tensor);
    if (plan.reload_after[r] >= 0) {
      reload->add_deps(built.new_of_old[plan.reload_after[r]]);
    } else {
      for (int d : end_deps) reload->add_deps(built.new_of_old[d]);
    }
  };
  for (int i = 0; i <= n; ++i) {
    for (int id : before[i]) emit_inserted(id);
    if (i == n) break;
    built.new_of_old[i] = out->size();
    built.old_of_new.push_back(i);
    proto::Instruction* instr = out->Add();
    *instr = input.instructions(i);
    for (int& d : *instr->mutable_deps()) d = built.new_of_old[d];
  }

  // Extra dependencies of old instructions: waits on offload copies, optimizer ops on reloads.
  std::vector<std::vector<int>> extra(n);
  for (const auto& [old, k] : plan.waits) extra[old].push_back(built.offload_at[k]);
  for (int r = 0; r < static_cast<int>(plan.reloads.size()); ++r) {
    for (int reader : layout.fragments[plan.reloads[r]].readers) {
      extra[reader].push_back(built.reload_at[r]);
    }
  }
  for (int i = 0; i < n; ++i) {
    if (extra[i].empty()) continue;
    proto::Instruction* instr = out->Mutable(built.new_of_old[i]);
    std::vector<int> deps(instr->deps().begin(), instr->deps().end());
    deps.insert(deps.end(), extra[i].begin(), extra[i].end());
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    instr->clear_deps();
    for (int d : deps) instr->add_deps(d);
  }
  return built;
}

// Simulates `schedule` and fills the "before" half of `stats`.
StatusOr<SimResult> SimulateInput(const proto::Schedule& schedule, const CostModel& costs,
                                  const Layout& layout, OffloadStats* stats) {
  DC_ASSIGN_OR_RETURN(SimResult sim, Simulate(schedule, costs));
  stats->fragments = static_cast<int>(layout.fragments.size());
  stats->fragment_bytes = 0;
  for (const Fragment& f : layout.fragments) stats->fragment_bytes += f.bytes;
  stats->peak_before_bytes = stats->peak_after_bytes = sim.peak_device_bytes;
  stats->step_before_seconds = stats->step_after_seconds = sim.step_seconds;
  return sim;
}

std::string StatsSummary(const OffloadStats& s, int64_t budget_bytes) {
  const std::string arena = s.arena_bytes > 0
                                ? "; memory-plan arena " + FormatBytes(s.arena_bytes) + " after " +
                                      std::to_string(s.arena_rounds) + " plans"
                                : std::string();
  const std::string masters = s.masters_offloaded > 0 ? ", " + std::to_string(s.masters_offloaded) +
                                                            " of them fp32 master weights"
                                                      : std::string();
  char text[640];
  std::snprintf(text, sizeof(text),
                "offloaded %d of %d optimizer-state fragments (%s of %s%s); reloads: %d in the "
                "last backward, %d after it; %d forward waits on offload copies; peak %s -> %s "
                "(budget %s); step %.4f s -> %.4f s; %d repair rounds%s",
                s.offloaded, s.fragments, FormatBytes(s.offloaded_bytes).c_str(),
                FormatBytes(s.fragment_bytes).c_str(), masters.c_str(), s.early_reloads,
                s.end_reloads, s.offload_waits, FormatBytes(s.peak_before_bytes).c_str(),
                FormatBytes(s.peak_after_bytes).c_str(),
                budget_bytes > 0 ? FormatBytes(budget_bytes).c_str() : "none",
                s.step_before_seconds, s.step_after_seconds, s.iterations, arena.c_str());
  return text;
}

const CostModel& CostsOf(const PassContext& context) {
  static const CostModel kFallback;
  return context.costs ? *context.costs : kFallback;
}

}  // namespace dc::rewriter_internal
