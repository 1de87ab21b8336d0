// `offload` (OffloadPass), dc's optimizer-state offload (what it moves and what every offload
// policy emits: rewriter/offload_plan.h; its plan-simulate-repair loop:
// rewriter/offload_planner.h). Frees only what the time-resolved memory timeline says must go
// (or, when the peak fits but its packed arena does not, what the arena's excess needs): the
// excess is the most the forward and backward hold over the budget; fragments are chosen in a
// documented order (every m and v before any master) until they cover it, then pruned. Each
// reload (earliest optimizer op first) starts after the earliest backward compute of the last
// micro-step from which the device can hold it, and everything reloaded before it, at every
// instant up to the end of backward, so the copies hide behind backward compute. The result is
// simulated again and repaired (waits on offload copies, more fragments, later reloads) until its
// peak fits; then its static memory plan is packed and, while the arena is over the budget,
// everything is planned again against a budget lowered by the excess.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "rewriter/memory_packer.h"
#include "rewriter/offload_plan.h"
#include "rewriter/pass.h"

namespace dc {

struct OffloadOptions {
  // The order in which fragments are chosen until the freed bytes cover the excess.
  enum class Order {
    // Fragments whose optimizer op runs last first: their reloads have the most time to hide
    // (the optimizer ops before theirs run while they copy). Ties: larger first.
    kLastOptimizerOpFirst,
    // Largest first: the fewest fragments (and copies) for the bytes. Ties: later op first.
    kLargestFirst,
  };
  Order order = Order::kLastOptimizerOpFirst;
  // After choosing, drop chosen fragments (largest first) whose bytes the excess does not need,
  // so the fewest bytes move.
  bool prune = true;
  // Plan-simulate-repair rounds before giving up (each round fixes the highest violation).
  int max_iterations = 64;
  // Also make the static arena fit (the input's too, when its peak fits without offloading):
  // once a plan's simulated peak fits, pack its memory plan
  // (with `memory_plan`'s lifetimes and first order, no reuse that waits) and, while the arena
  // is over the budget (fragmentation, lifetimes in simulated time), plan again against a
  // budget lowered by the difference, at most max_arena_rounds times. A lowered budget with no
  // plan sends the next round back up halfway to the last one that had a plan (from the least
  // the failed one needs); if none fits, keep the last plan (the memory-plan pass then spills).
  // Where the rounds' plan is slower than the first one (min_gain_to_weigh_waits), the first one
  // is kept if the memory-plan pass's waits in it cost the step less than that (llama-1b shapes
  // of issue 14's case on 8 ranks: 0.1429 s with 5 buffers' reuse waiting, 0.1552 s offloading
  // room for the arena; llama3-8b on 8 ranks, GAS 4, at 80% of the baseline's peak: 0.6358 s
  // against 0.6677 s). Off: only the simulated peak is held to the budget.
  bool fit_memory_plan = true;
  MemoryPlanOptions memory_plan;
  int max_arena_rounds = 4;
  // Each round lowers the planning budget by this many times the arena's excess (more than 1:
  // fragmentation moves a little between rounds), times 2^round (round 0 first): a plan moves
  // whole fragments, and an excess of a few hundred bytes lowered by as little plans the same
  // fragments again.
  double arena_overshoot_factor = 1.25;
  // Where the rounds above end with a plan under the budget (or too slow to win) after one whose
  // arena was over it, up to this many plans halfway between the two planning budgets, each kept
  // where it steps faster (offloads less) and its arena fits, packed in every order and repair
  // round without waits (its arena is near the budget: the check's first few packings misjudge
  // it). The rounds lower the planning budget by multiples of the excess and may overshoot:
  // llama3-8b on 8 ranks at GAS 1 and 80% of the baseline's peak, 0.2003 s -> 0.1989 s.
  int arena_refine_rounds = 2;
  int64_t arena_refine_min_bytes = int64_t{64} << 20;
  // The first plan is weighed against the rounds' (its memory plan packed with reuse that waits,
  // in every order but without repair rounds: an upper bound of the waits' cost, then
  // simulated) only where the rounds' plan steps slower by more than this fraction. Each
  // weighing costs about a memory-plan pass, and every candidate pipeline may weigh: with the
  // repair rounds too, llama3-8b on 8 ranks at GAS 16 planned 2.2x slower.
  double min_gain_to_weigh_waits = 0.005;
};

class OffloadPass : public Pass {
 public:
  bool FreesMemory() const override { return true; }
  explicit OffloadPass(OffloadOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "offload"; }
  std::string OptionsText() const override;
  // No change without a budget (PassContext::budget_bytes == 0) or when the peak fits and, with
  // fit_memory_plan, so does its arena (a peak just under the budget can leave no room for
  // fragmentation: then it offloads what the arena needs, or, if no plan frees that, changes
  // nothing). Errors when the budget cannot be met even with every fragment offloaded (saying
  // how many bytes are still missing) or when the optimizer step alone does not fit.
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override;
  // Its copies to the host and reloads only add work and waits to the step.
  bool NeverSpeedsUp() const override { return true; }
  const OffloadStats& stats() const { return stats_; }

 private:
  OffloadOptions options_;
  OffloadStats stats_;
  int64_t budget_bytes_ = 0;  // of the last Run
  std::string arena_note_;    // why the last Run's arena stays over the budget, if it does
  StatusOr<std::optional<double>> StepWithReuseThatWaits(const proto::Schedule& schedule,
                                                         const PassContext& context) const;
};

std::unique_ptr<Pass> MakeOffloadPass(OffloadOptions options = {});

}  // namespace dc
