#include "rewriter/offload.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <numeric>
#include <utility>
#include <vector>

#include "machine/simulator.h"
#include "rewriter/live_curve.h"
#include "rewriter/schedule_editor.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc {
namespace {

using rewriter_internal::SimulatedTimeline;

// One fragment that may move: the rank's fp32 shard of one optimizer-state tensor (Adam m or
// v), or of one param (its master weight). A master on the host leaves a compute-dtype shard on
// the device for the gathers (schemas/program.h's ComputeShardParams), for the whole step.
struct Fragment {
  int tensor = -1;
  bool master = false;
  int64_t bytes = 0;           // freed on the device while it is on the host
  int64_t copy_bytes = 0;      // moved by its offload and its reload (the fp32 shard)
  int64_t resident_bytes = 0;  // held on the device all the time once chosen (a compute shard)
  std::vector<int> readers;    // optimizer-phase computes that read it, in index order
};

// What the passes need to know about the input schedule.
struct Layout {
  int num_instructions = 0;
  int last_micro_step = 0;
  int first_optimizer = 0;  // index of the first optimizer-phase instruction (or the count)
  // In list order: by first reader, then the reader's optimizer states by position among its
  // inputs (m before v), then its param's master.
  std::vector<Fragment> fragments;
  std::vector<int> forward_computes;   // forward ops of micro-step 0, index order
  std::vector<int> backward_computes;  // backward ops of the last micro-step, index order
  // This rank's persistent shards: all of them, and by BufferKind.
  int64_t persistent_bytes = 0;
  std::vector<int64_t> persistent_by_kind;
};

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

// Where everything goes. Fragments are indices into Layout::fragments; instructions are indices
// of the input schedule ("old" indices).
struct Plan {
  std::vector<int> offloads;      // in d2h order, all at the head of the step
  std::vector<int> reloads;       // in h2d order
  std::vector<int> reload_after;  // per reload: the backward compute it follows; -1 = the end
  std::vector<std::pair<int, int>> waits;  // (old instruction, offload ordinal it waits for)
};

// The rewritten schedule and where the old and new instructions landed.
struct Built {
  proto::Schedule schedule;
  std::vector<int> new_of_old;
  std::vector<int> old_of_new;  // -1 for inserted instructions
  std::vector<int> offload_at;  // new index of each offload ordinal
  std::vector<int> reload_at;   // new index of each reload ordinal
};

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

// The end of the forward and backward: when the last instruction before the optimizer phase
// ends.
double EndOfBackwardSeconds(const SimResult& sim, const Layout& layout) {
  double end = 0;
  for (int i = 0; i < layout.first_optimizer; ++i) end = std::max(end, sim.end_seconds[i]);
  return end;
}

// The most the optimizer phase holds (every persistent shard is back by then).
int64_t OptimizerPhaseBytes(const SimResult& sim, const Layout& layout) {
  const double backward_end = EndOfBackwardSeconds(sim, layout);
  int64_t most = layout.persistent_bytes;
  for (const MemoryPoint& p : sim.memory_timeline) {
    if (p.time_seconds > backward_end) most = std::max(most, p.total_bytes);
  }
  return most;
}

// Reloads in h2d order: by the first optimizer op that needs them (earliest deadline first),
// then tensor id.
std::vector<int> DeadlineOrder(const Layout& layout, std::vector<int> fragments) {
  std::sort(fragments.begin(), fragments.end(), [&](int a, int b) {
    const Fragment& fa = layout.fragments[a];
    const Fragment& fb = layout.fragments[b];
    if (fa.readers.front() != fb.readers.front()) return fa.readers.front() < fb.readers.front();
    return fa.tensor < fb.tensor;
  });
  return fragments;
}

// What the fragments are, for messages: "Adam m and v" and, where masters can move, "fp32
// master weights".
std::string FragmentKinds(const Layout& layout) {
  const bool masters = std::any_of(layout.fragments.begin(), layout.fragments.end(),
                                   [](const Fragment& f) { return f.master; });
  return masters ? "Adam m and v, and fp32 master weights" : "Adam m and v";
}

Status MissingBytesError(const Layout& layout, int64_t peak_bytes, int64_t missing_bytes,
                         int64_t budget_bytes) {
  int64_t all = 0;
  for (const Fragment& f : layout.fragments) all += f.bytes;
  const std::string missing = FormatBytes(missing_bytes);
  return Status::Error(
      "even with all " + std::to_string(layout.fragments.size()) + " optimizer-state fragments (" +
      FormatBytes(all) + " freed: " + FragmentKinds(layout) + ") on the host, the step needs " +
      missing + " more than the budget of " + FormatBytes(budget_bytes) + " (simulated peak " +
      FormatBytes(peak_bytes) + " with everything resident); raise --budget by at least " +
      missing + " or use more ranks (each rank holds 1/world of every shard)");
}

Status OptimizerPhaseError(const Layout& layout, int64_t held_bytes, int64_t budget_bytes) {
  return Status::Error(
      "the optimizer step keeps every persistent shard on the device (" +
      FormatBytes(layout.persistent_bytes) + ": param shards " +
      FormatBytes(layout.persistent_by_kind[static_cast<int>(BufferKind::kShard)]) +
      ", grad shards " +
      FormatBytes(layout.persistent_by_kind[static_cast<int>(BufferKind::kGradShard)]) +
      ", optimizer state " +
      FormatBytes(layout.persistent_by_kind[static_cast<int>(BufferKind::kOptimizerState)]) +
      ") and holds " + FormatBytes(held_bytes) + " at its peak, over the budget of " +
      FormatBytes(budget_bytes) +
      "; offloading optimizer state cannot help there since the step runs on the device; raise "
      "--budget to at least " +
      FormatBytes(held_bytes) + " or use more ranks");
}

// The plan-simulate-repair loop shared by `offload` and `offload-all`.
class OffloadPlanner {
 public:
  struct Mode {
    bool minimal = true;        // choose the fewest bytes (else every fragment)
    bool early_reloads = true;  // reload inside the last backward (else all at its end)
    OffloadOptions options;
  };

  OffloadPlanner(const proto::Schedule& input, const Layout& layout, const CostModel& costs,
                 int64_t budget_bytes, Mode mode, OffloadStats* stats)
      : input_(input),
        layout_(layout),
        costs_(costs),
        budget_bytes_(budget_bytes),
        mode_(std::move(mode)),
        stats_(stats) {}

  // `base` is the simulation of the input schedule (with its memory timeline).
  StatusOr<proto::Schedule> Run(const SimResult& base) {
    const double backward_end = EndOfBackwardSeconds(base, layout_);
    int64_t need_bytes = 0, tail_bytes = 0;
    for (const MemoryPoint& p : base.memory_timeline) {
      if (p.time_seconds <= backward_end) {
        need_bytes = std::max(need_bytes, p.total_bytes - budget_bytes_);
      } else {
        tail_bytes = std::max(tail_bytes, p.total_bytes);
      }
    }
    if (budget_bytes_ > 0) {
      if (layout_.persistent_bytes > budget_bytes_) {
        return OptimizerPhaseError(layout_, layout_.persistent_bytes, budget_bytes_);
      }
      if (tail_bytes > budget_bytes_) {
        return OptimizerPhaseError(layout_, tail_bytes, budget_bytes_);
      }
      if (need_bytes > stats_->fragment_bytes) {
        return MissingBytesError(layout_, base.peak_device_bytes,
                                 need_bytes - stats_->fragment_bytes, budget_bytes_);
      }
    }
    // The optimizer phase holds every persistent shard: the compute-dtype shards that offloaded
    // masters leave behind must fit beside them.
    const int64_t tail_headroom_bytes = budget_bytes_ > 0
                                            ? budget_bytes_ - OptimizerPhaseBytes(base, layout_)
                                            : std::numeric_limits<int64_t>::max();
    int64_t target_bytes = need_bytes;
    int64_t reload_margin_bytes = 0;
    Waits waits;
    for (int iteration = 1; iteration <= mode_.options.max_iterations; ++iteration) {
      stats_->iterations = iteration;
      std::vector<int> chosen;
      if (mode_.minimal) {
        DC_ASSIGN_OR_RETURN(chosen,
                            Choose(target_bytes, base.peak_device_bytes, tail_headroom_bytes));
      } else {
        chosen = All(tail_headroom_bytes);
      }
      Plan plan;
      plan.offloads = chosen;
      plan.reloads = DeadlineOrder(layout_, chosen);
      plan.reload_after.assign(plan.reloads.size(), -1);
      plan.waits = WaitOrdinals(waits, plan.offloads);
      Built late = Build(input_, layout_, plan);
      SimOptions options;
      options.memory_timeline = mode_.early_reloads || budget_bytes_ > 0;
      DC_ASSIGN_OR_RETURN(SimResult late_sim, Simulate(late.schedule, costs_, options));
      if (budget_bytes_ > 0 && late_sim.peak_device_bytes > budget_bytes_) {
        DC_RETURN_IF_ERROR(Repair(plan, late, late_sim, &waits, &target_bytes));
        continue;
      }
      if (!mode_.early_reloads || budget_bytes_ <= 0) {
        return Finish(plan, std::move(late), late_sim);
      }

      PlaceReloads(late, late_sim, budget_bytes_ - reload_margin_bytes, &plan);
      Built early = Build(input_, layout_, plan);
      DC_ASSIGN_OR_RETURN(SimResult early_sim, Simulate(early.schedule, costs_));
      if (early_sim.peak_device_bytes <= budget_bytes_) {
        return Finish(plan, std::move(early), early_sim);
      }
      // A reload came back too soon (the timing moved under it): plan the next round against
      // a lower ceiling.
      reload_margin_bytes += early_sim.peak_device_bytes - budget_bytes_;
    }
    return Status::Error("no offload plan fits the budget of " + FormatBytes(budget_bytes_) +
                         " after " + std::to_string(mode_.options.max_iterations) +
                         " rounds; raise --budget or the offload pass's max_iterations");
  }

  // The simulation of the schedule the last successful Run returned.
  const SimResult& output_simulation() const { return output_simulation_; }

 private:
  // Every fragment, but masters only while their compute-dtype shards fit `headroom_bytes`
  // (list order).
  std::vector<int> All(int64_t headroom_bytes) const {
    std::vector<int> all;
    for (int i = 0; i < static_cast<int>(layout_.fragments.size()); ++i) {
      const int64_t resident = layout_.fragments[i].resident_bytes;
      if (resident > headroom_bytes) continue;
      headroom_bytes -= resident;
      all.push_back(i);
    }
    return all;
  }

  // The fewest bytes (in the options' order, then pruned) that cover `target_bytes`. Masters
  // come after every optimizer state: one moves its whole fp32 shard to free what its compute
  // shard does not hold (half of it in bf16), so it is the dearest byte to free; and only while
  // their compute shards fit `headroom_bytes`.
  StatusOr<std::vector<int>> Choose(int64_t target_bytes, int64_t peak_bytes,
                                    int64_t headroom_bytes) const {
    std::vector<int> order(layout_.fragments.size());
    std::iota(order.begin(), order.end(), 0);
    const auto& f = layout_.fragments;
    auto later_op = [&](int a, int b) { return f[a].readers.front() > f[b].readers.front(); };
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      if (f[a].master != f[b].master) return f[b].master;
      if (mode_.options.order == OffloadOptions::Order::kLargestFirst) {
        if (f[a].bytes != f[b].bytes) return f[a].bytes > f[b].bytes;
        return later_op(a, b);
      }
      if (f[a].readers.front() != f[b].readers.front()) return later_op(a, b);
      return f[a].bytes > f[b].bytes;
    });
    std::vector<int> chosen;
    int64_t chosen_bytes = 0;
    for (int i : order) {
      if (chosen_bytes >= target_bytes) break;
      if (f[i].resident_bytes > headroom_bytes) continue;
      headroom_bytes -= f[i].resident_bytes;
      chosen.push_back(i);
      chosen_bytes += f[i].bytes;
    }
    if (chosen_bytes < target_bytes) {
      return MissingBytesError(layout_, peak_bytes, target_bytes - chosen_bytes, budget_bytes_);
    }
    if (mode_.options.prune) {
      std::vector<int> by_size = chosen;
      std::stable_sort(by_size.begin(), by_size.end(),
                       [&](int a, int b) { return f[a].bytes > f[b].bytes; });
      std::vector<bool> dropped(f.size(), false);
      for (int i : by_size) {
        if (chosen_bytes - f[i].bytes >= target_bytes) {
          chosen_bytes -= f[i].bytes;
          dropped[i] = true;
        }
      }
      std::erase_if(chosen, [&](int i) { return dropped[i]; });
    }
    return chosen;
  }

  // Per old instruction: the bytes the offloads (cumulative, in d2h order) must have freed
  // before it starts. Kept in bytes so it survives a change of the chosen fragments.
  using Waits = std::map<int, int64_t>;

  std::vector<std::pair<int, int>> WaitOrdinals(const Waits& waits,
                                                const std::vector<int>& offloads) const {
    std::vector<int64_t> freed(offloads.size());  // bytes freed once ordinal k has ended
    int64_t total = 0;
    for (size_t k = 0; k < offloads.size(); ++k)
      freed[k] = total += layout_.fragments[offloads[k]].copy_bytes;
    std::vector<std::pair<int, int>> ordinals;
    if (offloads.empty()) return ordinals;
    for (const auto& [old, bytes] : waits) {
      const auto it = std::lower_bound(freed.begin(), freed.end(), bytes);
      const int k = it == freed.end() ? static_cast<int>(freed.size()) - 1
                                      : static_cast<int>(it - freed.begin());
      ordinals.emplace_back(old, k);
    }
    return ordinals;
  }

  // `late` (every reload after the backward) is over the budget. Inside the offload window
  // (before the last offload copy ends) every instruction that starts at an instant over the
  // budget waits for as many copies as cover its excess, all in one round; past the window, or
  // if the waits are already there, more bytes must go.
  Status Repair(const Plan& plan, const Built& late, const SimResult& sim, Waits* waits,
                int64_t* target_bytes) const {
    const int64_t over_bytes = sim.peak_device_bytes - budget_bytes_;
    const int peak = sim.peak_instruction;
    const int peak_old = peak >= 0 ? late.old_of_new[peak] : -1;
    if (peak_old < 0 || peak_old >= layout_.first_optimizer) {
      return OptimizerPhaseError(layout_, sim.peak_device_bytes, budget_bytes_);
    }
    // Offload copies end in d2h order: freed_by[k] bytes are gone once copy k has ended.
    std::vector<double> copy_end;
    std::vector<int64_t> freed_by;
    int64_t offloaded = 0;
    for (size_t k = 0; k < plan.offloads.size(); ++k) {
      copy_end.push_back(sim.end_seconds[late.offload_at[k]]);
      freed_by.push_back(offloaded += layout_.fragments[plan.offloads[k]].copy_bytes);
    }
    const double window_end = copy_end.empty() ? 0 : copy_end.back();
    bool waited = false;
    int64_t missing_bytes = 0;
    if (sim.peak_at_seconds < window_end) {
      const SimulatedTimeline timeline(
          sim.memory_timeline, SimulatedTimeline::kNoHorizon,
          sim.memory_timeline.empty() ? 0 : sim.memory_timeline[0].total_bytes);
      for (int j = 0; j < late.schedule.instructions_size(); ++j) {
        const int old = late.old_of_new[j];
        const double start = sim.start_seconds[j];
        if (old < 0 || start >= window_end) continue;
        const int64_t excess = timeline.MaxIn(start, start) - budget_bytes_;
        if (excess <= 0) continue;
        const size_t done =
            std::upper_bound(copy_end.begin(), copy_end.end(), start) - copy_end.begin();
        const int64_t freed = done == 0 ? 0 : freed_by[done - 1];
        int64_t needed = freed + excess;
        if (needed > offloaded) {
          missing_bytes = std::max(missing_bytes, needed - offloaded);
          needed = offloaded;
        }
        int64_t& wait = (*waits)[old];
        if (needed > wait) {
          wait = needed;
          waited = true;
        }
      }
    }
    if (waited && missing_bytes == 0) return Status::Ok();
    // Even with the copies done the forward or backward holds too much: free more.
    if (missing_bytes == 0) missing_bytes = over_bytes;
    if (!mode_.minimal) {
      return MissingBytesError(layout_, sim.peak_device_bytes, missing_bytes, budget_bytes_);
    }
    *target_bytes += missing_bytes;
    return Status::Ok();
  }

  // Moves each reload (deadline order) to the earliest backward compute of the last micro-step
  // after which the device can hold it and everything reloaded before it at every instant up to
  // the end of backward; the h2d stream copies one at a time, so a reload that queues behind
  // others is issued after the last compute that ends before its copy starts.
  void PlaceReloads(const Built& late, const SimResult& sim, int64_t ceiling_bytes,
                    Plan* plan) const {
    if (plan->reloads.empty()) return;
    const double horizon = sim.start_seconds[late.reload_at[0]];
    const SimulatedTimeline timeline(
        sim.memory_timeline, horizon,
        sim.memory_timeline.empty() ? 0 : sim.memory_timeline[0].total_bytes);
    double h2d_free = 0;
    for (int i = 0; i < layout_.first_optimizer; ++i) {
      if (input_.instructions(i).stream() == proto::STREAM_H2D) {
        h2d_free = std::max(h2d_free, sim.end_seconds[late.new_of_old[i]]);
      }
    }
    const auto& candidates = layout_.backward_computes;
    size_t c = 0;
    int64_t reloaded_bytes = 0;
    for (size_t r = 0; r < plan->reloads.size(); ++r) {
      const int64_t bytes = layout_.fragments[plan->reloads[r]].copy_bytes;
      reloaded_bytes += bytes;
      for (; c < candidates.size(); ++c) {
        const double start = std::max(sim.end_seconds[late.new_of_old[candidates[c]]], h2d_free);
        if (start >= horizon) {
          c = candidates.size();
          break;
        }
        if (reloaded_bytes + timeline.MaxFrom(start) <= ceiling_bytes) {
          // Issue it after the last compute that ends by the time the h2d stream takes it, so
          // its place in issue order is when it starts (the memory plan counts it from there).
          while (c + 1 < candidates.size() &&
                 sim.end_seconds[late.new_of_old[candidates[c + 1]]] <= start) {
            ++c;
          }
          plan->reload_after[r] = candidates[c];
          h2d_free = start + costs_.host_to_device.Seconds(bytes);
          break;
        }
      }
      if (c == candidates.size()) break;  // this and every later reload: after the backward
    }
  }

  StatusOr<proto::Schedule> Finish(const Plan& plan, Built built, const SimResult& sim) {
    output_simulation_ = sim;
    stats_->offloaded = static_cast<int>(plan.offloads.size());
    stats_->offloaded_bytes = 0;
    for (int f : plan.offloads) stats_->offloaded_bytes += layout_.fragments[f].bytes;
    stats_->early_reloads = 0;
    for (int after : plan.reload_after) stats_->early_reloads += after >= 0;
    stats_->end_reloads = static_cast<int>(plan.reloads.size()) - stats_->early_reloads;
    stats_->offload_waits = static_cast<int>(plan.waits.size());
    stats_->peak_after_bytes = sim.peak_device_bytes;
    stats_->step_after_seconds = sim.step_seconds;
    return std::move(built.schedule);
  }

  const proto::Schedule& input_;
  const Layout& layout_;
  const CostModel& costs_;
  const int64_t budget_bytes_;
  const Mode mode_;
  OffloadStats* stats_;
  SimResult output_simulation_;
};

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
  char text[640];
  std::snprintf(text, sizeof(text),
                "offloaded %d of %d optimizer-state fragments (%s of %s); reloads: %d in the "
                "last backward, %d after it; %d forward waits on offload copies; peak %s -> %s "
                "(budget %s); step %.4f s -> %.4f s; %d repair rounds%s",
                s.offloaded, s.fragments, FormatBytes(s.offloaded_bytes).c_str(),
                FormatBytes(s.fragment_bytes).c_str(), s.early_reloads, s.end_reloads,
                s.offload_waits, FormatBytes(s.peak_before_bytes).c_str(),
                FormatBytes(s.peak_after_bytes).c_str(),
                budget_bytes > 0 ? FormatBytes(budget_bytes).c_str() : "none",
                s.step_before_seconds, s.step_after_seconds, s.iterations, arena.c_str());
  return text;
}

const CostModel& CostsOf(const PassContext& context) {
  static const CostModel kFallback;
  return context.costs ? *context.costs : kFallback;
}

}  // namespace

// ----- offload -----

std::string OffloadPass::OptionsText() const {
  return std::string("order=") +
         (options_.order == OffloadOptions::Order::kLargestFirst ? "largest-first"
                                                                 : "last-optimizer-op-first") +
         ",prune=" + (options_.prune ? "1" : "0") +
         ",max_iterations=" + std::to_string(options_.max_iterations) +
         ",fit_memory_plan=" + (options_.fit_memory_plan ? "1" : "0") +
         ",max_arena_rounds=" + std::to_string(options_.max_arena_rounds) +
         ",arena_overshoot_factor=" + std::to_string(options_.arena_overshoot_factor) +
         ",memory_plan={" + MemoryPlanOptionsText(options_.memory_plan) + "}";
}

StatusOr<bool> OffloadPass::Run(proto::Schedule* schedule, const PassContext& context) {
  stats_ = OffloadStats();
  arena_note_.clear();
  budget_bytes_ = context.budget_bytes;
  if (context.budget_bytes <= 0) return false;
  const CostModel& costs = CostsOf(context);
  DC_ASSIGN_OR_RETURN(Layout layout, AnalyzeLayout(*schedule));
  DC_ASSIGN_OR_RETURN(SimResult base, SimulateInput(*schedule, costs, layout, &stats_));
  const int64_t budget = context.budget_bytes;
  int64_t planning_budget = budget;
  const bool peak_fits = base.peak_device_bytes <= budget;
  if (peak_fits) {
    if (!options_.fit_memory_plan) return false;
    // A peak a few MiB under the budget (passes before this one fill it) may still leave no
    // room for the arena's fragmentation; the memory-plan pass would then make reuse wait.
    DC_ASSIGN_OR_RETURN(const int64_t arena_bytes,
                        ArenaBytesWithoutWaits(*schedule, options_.memory_plan, budget,
                                               context.costs, &base, context.packings));
    if (arena_bytes <= budget) return false;
    planning_budget -= static_cast<int64_t>(static_cast<double>(arena_bytes - budget) *
                                            options_.arena_overshoot_factor);
  }
  OffloadPlanner::Mode mode;
  mode.options = options_;
  proto::Schedule out;
  SimResult out_simulation;
  const OffloadStats input_stats = stats_;
  OffloadStats out_stats;
  for (int round = 0;; ++round) {
    stats_.planning_budget_bytes = planning_budget;
    OffloadPlanner planner(*schedule, layout, costs, planning_budget, mode, &stats_);
    StatusOr<proto::Schedule> planned = planner.Run(base);
    if (!planned.ok()) {
      if (round == 0 && peak_fits) {
        // No plan frees room for the arena alone: keep the input (memory-plan can spill).
        stats_ = input_stats;
        return false;
      }
      if (round == 0) return planned.status();
      // The last plan fits the simulated peak but not its arena, and no plan against a lower
      // budget exists: keep it; the memory-plan pass decides (it can fall back to instruction
      // order).
      stats_ = out_stats;
      arena_note_ = "; no plan leaves room for the arena's " +
                    FormatBytes(stats_.arena_bytes - budget) + " over the budget (" +
                    planned.status().message() + ")";
      break;
    }
    out = std::move(planned).value();
    out_simulation = planner.output_simulation();
    if (options_.fit_memory_plan) {
      DC_ASSIGN_OR_RETURN(stats_.arena_bytes,
                          ArenaBytesWithoutWaits(out, options_.memory_plan, budget, context.costs,
                                                 &out_simulation, context.packings));
      stats_.arena_rounds = round + 1;
    }
    out_stats = stats_;
    if (!options_.fit_memory_plan || stats_.arena_bytes <= budget ||
        round == options_.max_arena_rounds) {
      break;
    }
    planning_budget -= static_cast<int64_t>(static_cast<double>(stats_.arena_bytes - budget) *
                                            options_.arena_overshoot_factor);
  }
  if (stats_.offloaded == 0) return false;
  *schedule = std::move(out);
  return true;
}

std::string OffloadPass::Summary() const {
  if (budget_bytes_ <= 0) return "no budget: nothing offloaded";
  if (stats_.offloaded == 0) {
    return "peak " + FormatBytes(stats_.peak_before_bytes) + " fits the budget of " +
           FormatBytes(budget_bytes_) + ": nothing offloaded";
  }
  return StatsSummary(stats_, budget_bytes_) + arena_note_;
}

// ----- offload-all -----

StatusOr<bool> ZeroOffloadPass::Run(proto::Schedule* schedule, const PassContext& context) {
  stats_ = OffloadStats();
  budget_bytes_ = context.budget_bytes;
  const CostModel& costs = CostsOf(context);
  DC_ASSIGN_OR_RETURN(Layout layout, AnalyzeLayout(*schedule));
  if (layout.fragments.empty()) return false;
  DC_ASSIGN_OR_RETURN(SimResult base, SimulateInput(*schedule, costs, layout, &stats_));
  OffloadPlanner::Mode mode;
  mode.minimal = false;
  mode.early_reloads = false;
  OffloadPlanner planner(*schedule, layout, costs, context.budget_bytes, mode, &stats_);
  DC_ASSIGN_OR_RETURN(proto::Schedule out, planner.Run(base));
  *schedule = std::move(out);
  return true;
}

std::string ZeroOffloadPass::Summary() const { return StatsSummary(stats_, budget_bytes_); }

// ----- dc-offload -----

std::string DcOffloadPass::OptionsText() const {
  char text[64];
  std::snprintf(text, sizeof(text), "margin=%.9g", options_.margin);
  return text;
}

StatusOr<bool> DcOffloadPass::Run(proto::Schedule* schedule, const PassContext& context) {
  stats_ = OffloadStats();
  budget_bytes_ = context.budget_bytes;
  if (context.budget_bytes <= 0) return false;
  const CostModel& costs = CostsOf(context);
  DC_ASSIGN_OR_RETURN(Layout layout, AnalyzeLayout(*schedule));
  // Adam's m and v only. DeepCompile's list also holds the fp32 master partition, but in
  // DeepSpeed a param's bf16 partition stays on the device anyway, so a master moved there
  // frees all its bytes; here it leaves a compute-dtype shard behind and frees half. The rule's
  // profile leaves out the fragments that stay, and its fixed margin covers them only when they
  // are few: with masters in the list, Llama-3 70B on 16 H100s ends 0.3 GiB under the budget
  // live and 0.6 GiB over it in a packed arena. Kept to m and v, the rule fits as in the paper.
  std::erase_if(layout.fragments, [](const Fragment& f) { return f.master; });
  DC_ASSIGN_OR_RETURN(SimResult base, SimulateInput(*schedule, costs, layout, &stats_));
  const double total_mem = static_cast<double>(context.budget_bytes) * (1.0 - options_.margin);

  // DeepCompile profiles with every optimizer state evicted: the floor.
  const int64_t states_bytes = stats_.fragment_bytes;
  const SimulatedTimeline timeline(
      base.memory_timeline, SimulatedTimeline::kNoHorizon,
      base.memory_timeline.empty() ? 0 : base.memory_timeline[0].total_bytes);
  auto node_peak = [&](int i) {
    return timeline.MaxIn(base.start_seconds[i], base.end_seconds[i]) - states_bytes;
  };

  // Forward: offload in list order while the running peak leaves no room for what stays.
  Plan plan;
  size_t next_task = 0;
  int64_t resident_bytes = states_bytes;
  int64_t peak_mem = std::numeric_limits<int64_t>::min();
  for (int node : layout.forward_computes) {
    peak_mem = std::max(peak_mem, node_peak(node));
    while (total_mem - static_cast<double>(peak_mem) - static_cast<double>(resident_bytes) < 0 &&
           next_task < layout.fragments.size()) {
      const int task = static_cast<int>(next_task++);
      resident_bytes -= layout.fragments[task].bytes;
      plan.waits.emplace_back(node, static_cast<int>(plan.offloads.size()));
      plan.offloads.push_back(task);
    }
  }
  if (plan.offloads.empty()) return false;

  // Backward: reload after a node while the peak from it to the end of backward leaves room.
  const auto& backward = layout.backward_computes;
  std::vector<int64_t> peak_to_end(backward.size());
  int64_t running = std::numeric_limits<int64_t>::min();
  for (int b = static_cast<int>(backward.size()) - 1; b >= 0; --b) {
    running = std::max(running, node_peak(backward[b]));
    peak_to_end[b] = running;
  }
  plan.reloads = plan.offloads;
  plan.reload_after.assign(plan.reloads.size(), -1);
  size_t next_reload = 0;
  int64_t reloaded_bytes = 0;
  for (size_t b = 0; b < backward.size() && next_reload < plan.reloads.size(); ++b) {
    while (next_reload < plan.reloads.size()) {
      const int64_t next_bytes = layout.fragments[plan.reloads[next_reload]].copy_bytes;
      if (!(total_mem > static_cast<double>(peak_to_end[b] + reloaded_bytes + next_bytes))) break;
      plan.reload_after[next_reload++] = backward[b];
      reloaded_bytes += next_bytes;
    }
  }

  Built built = Build(*schedule, layout, plan);
  DC_ASSIGN_OR_RETURN(SimResult sim, Simulate(built.schedule, costs, SimOptions{false}));
  stats_.iterations = 1;
  stats_.offloaded = static_cast<int>(plan.offloads.size());
  for (int f : plan.offloads) stats_.offloaded_bytes += layout.fragments[f].bytes;
  stats_.early_reloads = static_cast<int>(next_reload);
  stats_.end_reloads = static_cast<int>(plan.reloads.size() - next_reload);
  stats_.offload_waits = static_cast<int>(plan.waits.size());
  stats_.peak_after_bytes = sim.peak_device_bytes;
  stats_.step_after_seconds = sim.step_seconds;
  *schedule = std::move(built.schedule);
  return true;
}

std::string DcOffloadPass::Summary() const {
  if (budget_bytes_ <= 0) return "no budget: nothing offloaded";
  if (stats_.offloaded == 0) return "DeepCompile's rule offloads nothing at this budget";
  return StatsSummary(stats_, budget_bytes_);
}

std::unique_ptr<Pass> MakeOffloadPass(OffloadOptions options) {
  return std::make_unique<OffloadPass>(options);
}
std::unique_ptr<Pass> MakeZeroOffloadPass() { return std::make_unique<ZeroOffloadPass>(); }
std::unique_ptr<Pass> MakeDcOffloadPass(DcOffloadOptions options) {
  return std::make_unique<DcOffloadPass>(options);
}

}  // namespace dc
