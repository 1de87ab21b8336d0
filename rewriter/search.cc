#include "rewriter/search.h"

#include <algorithm>
#include <limits>

namespace dc {

std::optional<int64_t> SmallestBudget(PlanRequest request, const BudgetSearchOptions& options) {
  if (request.budget_bytes <= 0) return std::nullopt;
  auto plans_at = [&](int64_t budget) {
    request.budget_bytes = budget;
    return MakePlan(request).ok();
  };
  int64_t lo = request.budget_bytes, hi = lo;
  for (int step = 0;; ++step) {
    if (step == options.max_growth_steps) return std::nullopt;
    hi = static_cast<int64_t>(static_cast<double>(hi) * options.growth);
    if (plans_at(hi)) break;
    lo = hi;
  }
  while (hi - lo >
         std::max<int64_t>(options.min_step_bytes, static_cast<int64_t>(options.precision * hi))) {
    const int64_t mid = lo + (hi - lo) / 2;
    (plans_at(mid) ? hi : lo) = mid;
  }
  return hi;
}

StatusOr<RoundsResult> PlanInRounds(PlanRequest request, proto::Schedule plan, int rounds,
                                    const MeasureFn& measure,
                                    const std::function<void(const RoundRecord&)>& on_round) {
  RoundsResult best;
  best.plan = plan;
  best.kept_step_seconds = std::numeric_limits<double>::infinity();
  for (int round = 1; round <= rounds; ++round) {
    DC_ASSIGN_OR_RETURN(RoundMeasurement measured, measure(round, plan));
    if (on_round) {
      on_round({round, plan.prediction().step_seconds(), measured.step_seconds,
                plan.instructions_size()});
    }
    if (measured.step_seconds < best.kept_step_seconds) {
      best.kept_step_seconds = measured.step_seconds;
      best.kept_round = round;
      best.plan = plan;
    }
    if (round == rounds) break;
    request.costs = measured.costs;
    request.profile_digest = measured.profile_digest;
    DC_ASSIGN_OR_RETURN(plan, MakePlan(request));
  }
  return best;
}

}  // namespace dc
