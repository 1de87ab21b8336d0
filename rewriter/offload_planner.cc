#include "rewriter/offload_planner.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>

#include "rewriter/live_curve.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc::rewriter_internal {
namespace {

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
  std::string message =
      "even with all " + std::to_string(layout.fragments.size()) + " optimizer-state fragments (" +
      FormatBytes(all) + " freed: " + FragmentKinds(layout) + ") on the host, the step needs " +
      missing + " more than the budget of " + FormatBytes(budget_bytes) + " (simulated peak " +
      FormatBytes(peak_bytes) + " with everything resident); raise --budget by at least " +
      missing + " or use more ranks (each rank holds 1/world of every shard)";
  return Status::OverBudget(std::move(message), missing_bytes);
}

Status OptimizerPhaseError(const Layout& layout, int64_t held_bytes, int64_t budget_bytes) {
  std::string message =
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
      FormatBytes(held_bytes) + " or use more ranks";
  return Status::OverBudget(std::move(message), held_bytes - budget_bytes);
}

}  // namespace

OffloadPlanner::OffloadPlanner(const proto::Schedule& input, const Layout& layout,
                               const CostModel& costs, int64_t budget_bytes, Mode mode,
                               OffloadStats* stats)
    : input_(input),
      layout_(layout),
      costs_(costs),
      budget_bytes_(budget_bytes),
      mode_(std::move(mode)),
      stats_(stats) {}

StatusOr<proto::Schedule> OffloadPlanner::Run(const SimResult& base) {
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
      return MissingBytesError(layout_, base.peak_device_bytes, need_bytes - stats_->fragment_bytes,
                               budget_bytes_);
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
  return Status::OverBudget("no offload plan fits the budget of " + FormatBytes(budget_bytes_) +
                            " after " + std::to_string(mode_.options.max_iterations) +
                            " rounds; raise --budget or the offload pass's max_iterations");
}

std::vector<int> OffloadPlanner::All(int64_t headroom_bytes) const {
  std::vector<int> all;
  for (int i = 0; i < static_cast<int>(layout_.fragments.size()); ++i) {
    const int64_t resident = layout_.fragments[i].resident_bytes;
    if (resident > headroom_bytes) continue;
    headroom_bytes -= resident;
    all.push_back(i);
  }
  return all;
}

StatusOr<std::vector<int>> OffloadPlanner::Choose(int64_t target_bytes, int64_t peak_bytes,
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
    // Masters go first (they are chosen last), and a state goes only once no master is left:
    // a master moves only once every Adam state has.
    std::vector<int> by_size = chosen;
    std::stable_sort(by_size.begin(), by_size.end(), [&](int a, int b) {
      if (f[a].master != f[b].master) return f[a].master;
      return f[a].bytes > f[b].bytes;
    });
    std::vector<bool> dropped(f.size(), false);
    bool master_kept = false;
    for (int i : by_size) {
      if (!f[i].master && master_kept) break;
      if (chosen_bytes - f[i].bytes >= target_bytes) {
        chosen_bytes -= f[i].bytes;
        dropped[i] = true;
      } else if (f[i].master) {
        master_kept = true;
      }
    }
    std::erase_if(chosen, [&](int i) { return dropped[i]; });
  }
  return chosen;
}

std::vector<std::pair<int, int>> OffloadPlanner::WaitOrdinals(
    const Waits& waits, const std::vector<int>& offloads) const {
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

Status OffloadPlanner::Repair(const Plan& plan, const Built& late, const SimResult& sim,
                              Waits* waits, int64_t* target_bytes) const {
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

void OffloadPlanner::PlaceReloads(const Built& late, const SimResult& sim, int64_t ceiling_bytes,
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

StatusOr<proto::Schedule> OffloadPlanner::Finish(const Plan& plan, Built built,
                                                 const SimResult& sim) {
  output_simulation_ = sim;
  stats_->offloaded = static_cast<int>(plan.offloads.size());
  stats_->offloaded_bytes = 0;
  stats_->masters_offloaded = 0;
  for (int f : plan.offloads) {
    stats_->offloaded_bytes += layout_.fragments[f].bytes;
    stats_->masters_offloaded += layout_.fragments[f].master ? 1 : 0;
  }
  stats_->early_reloads = 0;
  for (int after : plan.reload_after) stats_->early_reloads += after >= 0;
  stats_->end_reloads = static_cast<int>(plan.reloads.size()) - stats_->early_reloads;
  stats_->offload_waits = static_cast<int>(plan.waits.size());
  stats_->peak_after_bytes = sim.peak_device_bytes;
  stats_->step_after_seconds = sim.step_seconds;
  return std::move(built.schedule);
}

}  // namespace dc::rewriter_internal
