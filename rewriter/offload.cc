#include "rewriter/offload.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>

#include "machine/simulator.h"
#include "rewriter/memory_plan.h"
#include "rewriter/offload_planner.h"
#include "schemas/units.h"

namespace dc {

using rewriter_internal::AnalyzeLayout;
using rewriter_internal::CostsOf;
using rewriter_internal::Layout;
using rewriter_internal::OffloadPlanner;
using rewriter_internal::SimulateInput;
using rewriter_internal::StatsSummary;

std::string OffloadPass::OptionsText() const {
  return std::string("order=") +
         (options_.order == OffloadOptions::Order::kLargestFirst ? "largest-first"
                                                                 : "last-optimizer-op-first") +
         ",prune=" + (options_.prune ? "1" : "0") +
         ",max_iterations=" + std::to_string(options_.max_iterations) +
         ",fit_memory_plan=" + (options_.fit_memory_plan ? "1" : "0") +
         ",max_arena_rounds=" + std::to_string(options_.max_arena_rounds) +
         ",arena_overshoot_factor=" + std::to_string(options_.arena_overshoot_factor) +
         ",arena_refine_rounds=" + std::to_string(options_.arena_refine_rounds) +
         ",arena_refine_min_bytes=" + std::to_string(options_.arena_refine_min_bytes) +
         ",min_gain_to_weigh_waits=" + std::to_string(options_.min_gain_to_weigh_waits) +
         ",memory_plan={" + MemoryPlanOptionsText(options_.memory_plan) + "}";
}

// The step `schedule` predicts once the memory-plan pass has packed it under the context's
// budget, its reuse that waits included; nullopt where no memory plan fits.
StatusOr<std::optional<double>> OffloadPass::StepWithReuseThatWaits(
    const proto::Schedule& schedule, const PassContext& context) const {
  proto::Schedule planned = schedule;
  // Without the repair rounds: the waits' cost is an upper bound then, for a fraction of the
  // packings.
  MemoryPlanOptions quick = options_.memory_plan;
  quick.repaired_orders.clear();
  quick.last_orders.clear();
  quick.over_budget_repair_rounds = 0;
  MemoryPlanPass pass(quick);
  PassContext plan_context{context.costs, context.budget_bytes};
  plan_context.threads = context.threads;
  plan_context.thread_share = context.thread_share;
  const StatusOr<bool> changed = pass.Run(&planned, plan_context);
  if (!changed.ok()) {
    if (changed.status().over_budget()) return std::optional<double>();
    return changed.status();
  }
  SimOptions options;
  options.memory_timeline = false;
  DC_ASSIGN_OR_RETURN(const SimResult sim, Simulate(planned, CostsOf(context), options));
  return std::optional<double>(sim.step_seconds);
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
    DC_ASSIGN_OR_RETURN(
        const int64_t arena_bytes,
        ArenaBytesWithoutWaits(*schedule, options_.memory_plan, budget, context.costs, &base,
                               context.packings, context.threads, context.thread_share));
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
  // Where a lowered planning budget has no plan, the next round goes back up halfway to the
  // planning budget of the last plan (`out`), from the least the failed one said a plan needs.
  int64_t out_planning_budget = -1;
  int64_t no_plan_below = -1;  // no plan exists at a planning budget under this
  // The planning budget of the last plan whose arena was over the budget (-1: none).
  int64_t over_planning_budget = -1;
  // The first plan, where its arena is over the budget: the memory-plan pass would make some
  // reuse wait in it, which may cost the step less than the offloading that makes room.
  std::optional<proto::Schedule> first_over;
  double first_over_step_seconds = 0;
  OffloadStats first_over_stats;
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
      if (planned.status().over_budget()) {
        no_plan_below =
            std::max(no_plan_below,
                     planning_budget + std::max<int64_t>(1, planned.status().shortfall_bytes()));
      }
      if (planned.status().over_budget() && round < options_.max_arena_rounds &&
          no_plan_below < out_planning_budget) {
        stats_ = out_stats;
        planning_budget = no_plan_below + (out_planning_budget - no_plan_below) / 2;
        continue;
      }
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
    out_planning_budget = planning_budget;
    // A plan already no faster than the one in hand cannot win: more rounds only offload more
    // (the pipeline stops after this pass, Status::CannotWin, unless the first plan is kept).
    const double to_beat = StepToBeatSeconds(context);
    if (to_beat > 0 && out_simulation.step_seconds >= to_beat) {
      stats_.arena_bytes = 0;  // this plan's arena is not packed
      stats_.arena_rounds = round + 1;
      out_stats = stats_;
      break;
    }
    if (options_.fit_memory_plan) {
      DC_ASSIGN_OR_RETURN(
          stats_.arena_bytes,
          ArenaBytesWithoutWaits(out, options_.memory_plan, budget, context.costs, &out_simulation,
                                 context.packings, context.threads, context.thread_share));
      stats_.arena_rounds = round + 1;
    }
    out_stats = stats_;
    if (!options_.fit_memory_plan || stats_.arena_bytes <= budget ||
        round == options_.max_arena_rounds) {
      break;
    }
    over_planning_budget = planning_budget;
    if (!first_over) {
      first_over = out;
      first_over_step_seconds = out_simulation.step_seconds;
      first_over_stats = stats_;
    }
    // Doubling the factor each round: a plan moves whole fragments, so an excess of a few bytes
    // lowered by a few bytes gives the same plan again, round after round. Not under a budget
    // known to have no plan: halfway down to it instead.
    planning_budget -= static_cast<int64_t>(static_cast<double>(stats_.arena_bytes - budget) *
                                            options_.arena_overshoot_factor *
                                            static_cast<double>(int64_t{1} << round));
    if (no_plan_below >= 0) {
      planning_budget =
          std::max(planning_budget, no_plan_below + (out_planning_budget - no_plan_below) / 2);
      if (planning_budget >= out_planning_budget) break;
    }
  }
  // A plan that fits (or stopped as too slow) only after rounds that lowered the planning budget
  // by multiples of the excess may have offloaded far more than the arena needed: halfway back
  // up to the last planning budget whose arena was over, while that still fits and steps faster.
  if (options_.fit_memory_plan && out_stats.arena_bytes <= budget &&
      over_planning_budget > out_planning_budget) {
    int64_t fits = out_planning_budget, over = over_planning_budget;
    for (int round = 0; round < options_.arena_refine_rounds; ++round) {
      const int64_t between = fits + (over - fits) / 2;
      if (over - fits < options_.arena_refine_min_bytes) break;
      stats_ = out_stats;
      stats_.planning_budget_bytes = between;
      OffloadPlanner planner(*schedule, layout, costs, between, mode, &stats_);
      StatusOr<proto::Schedule> planned = planner.Run(base);
      if (!planned.ok() ||
          planner.output_simulation().step_seconds >= out_simulation.step_seconds) {
        over = between;
        continue;
      }
      // Its arena is near the budget (between one over it and one under): every packing without
      // waits the memory-plan pass would make, not only the check's first few.
      MemoryPlanOptions every_packing = options_.memory_plan;
      every_packing.budget_check_packings = 0;
      DC_ASSIGN_OR_RETURN(stats_.arena_bytes,
                          ArenaBytesWithoutWaits(*planned, every_packing, budget, context.costs,
                                                 &planner.output_simulation(), context.packings,
                                                 context.threads, context.thread_share));
      if (stats_.arena_bytes > budget) {
        over = between;
        continue;
      }
      fits = between;
      out = std::move(planned).value();
      out_simulation = planner.output_simulation();
      out_planning_budget = between;
      stats_.arena_rounds = out_stats.arena_rounds + round + 1;
      out_stats = stats_;
    }
    stats_ = out_stats;
  }
  const double to_beat = first_over ? StepToBeatSeconds(context) : 0;
  const bool first_may_win = to_beat <= 0 || first_over_step_seconds < to_beat;
  if (first_over && first_may_win &&
      out_simulation.step_seconds >
          first_over_step_seconds * (1 + options_.min_gain_to_weigh_waits)) {
    DC_ASSIGN_OR_RETURN(const std::optional<double> waiting,
                        StepWithReuseThatWaits(*first_over, context));
    if (waiting && *waiting < out_simulation.step_seconds) {
      out = std::move(*first_over);
      stats_ = first_over_stats;
      char note[192];
      std::snprintf(note, sizeof note,
                    " over the budget: the memory plan's waits in it cost the step less (%.4f s) "
                    "than offloading room for its arena (%.4f s)",
                    *waiting, out_simulation.step_seconds);
      arena_note_ =
          "; kept the plan whose arena is " + FormatBytes(stats_.arena_bytes - budget) + note;
    }
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

std::unique_ptr<Pass> MakeOffloadPass(OffloadOptions options) {
  return std::make_unique<OffloadPass>(options);
}

}  // namespace dc
