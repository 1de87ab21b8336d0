#include "rewriter/search.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace dc {

std::optional<int64_t> SmallestBudget(PlanRequest request, int64_t shortfall_bytes,
                                      const BudgetSearchOptions& options, int* plans_made) {
  if (request.budget_bytes <= 0) return std::nullopt;
  int made = 0;
  if (!plans_made) plans_made = &made;
  auto plans_at = [&](int64_t budget) {
    ++*plans_made;
    request.budget_bytes = budget;
    return MakePlan(request).ok();
  };
  // The bracket is narrow enough once it is within the precision of its top.
  auto step_below = [&](int64_t budget) {
    return std::max<int64_t>(options.min_step_bytes,
                             static_cast<int64_t>(options.precision * static_cast<double>(budget)));
  };
  int64_t lo = request.budget_bytes, hi = lo;  // lo fails; hi plans once found
  bool found = false;
  if (shortfall_bytes > 0 && lo <= std::numeric_limits<int64_t>::max() - shortfall_bytes) {
    const int64_t needed = lo + shortfall_bytes;
    if (plans_at(needed)) {
      const int64_t below = needed - step_below(needed);
      if (below <= lo || !plans_at(below)) return needed;
      hi = below;  // the shortfall bounded nothing: bisect from the request's budget
      found = true;
    } else {
      lo = needed;
      hi = needed + step_below(needed);
      found = plans_at(hi);
      if (!found) lo = hi;
    }
  }
  for (int step = 0; !found; ++step) {
    if (step == options.max_growth_steps) return std::nullopt;
    hi = static_cast<int64_t>(static_cast<double>(lo) * options.growth);
    found = plans_at(hi);
    if (!found) lo = hi;
  }
  while (hi - lo > step_below(hi)) {
    const int64_t mid = lo + (hi - lo) / 2;
    (plans_at(mid) ? hi : lo) = mid;
  }
  return hi;
}

StatusOr<RoundsResult> PlanInRounds(PlanRequest request, proto::Schedule plan, int rounds,
                                    const MeasureFn& measure,
                                    const std::function<void(const RoundRecord&)>& on_round,
                                    std::vector<RunnerUp> runners_up) {
  RoundsResult best;
  best.plan = plan;
  best.kept_step_seconds = std::numeric_limits<double>::infinity();
  std::string source = "the plan";
  for (int round = 1; round <= rounds; ++round) {
    DC_ASSIGN_OR_RETURN(RoundMeasurement measured, measure(round, plan));
    const double predicted = plan.prediction().step_seconds();
    if (on_round) {
      on_round({round, source, predicted, measured.step_seconds, plan.instructions_size(),
                measured.threads_per_rank});
    }
    if (measured.step_seconds < best.kept_step_seconds) {
      best.kept_step_seconds = measured.step_seconds;
      best.kept_round = round;
      best.plan = plan;
    }
    if (round == rounds) break;
    // A runner-up predicted behind by less than this plan's measured error is as likely faster.
    const double error = predicted > 0 ? std::abs(measured.step_seconds / predicted - 1) : 0;
    if (!runners_up.empty() &&
        runners_up.front().plan.prediction().step_seconds() <= predicted * (1 + error)) {
      plan = std::move(runners_up.front().plan);
      source = runners_up.front().source + ", a runner-up within round " + std::to_string(round) +
               "'s measured error";
      runners_up.erase(runners_up.begin());
      continue;
    }
    request.costs = measured.costs;
    request.profile_digest = measured.profile_digest;
    request.runners_up = &runners_up;
    DC_ASSIGN_OR_RETURN(plan, MakePlan(request));
    source = "re-planned from round " + std::to_string(round) + "'s trace";
  }
  return best;
}

}  // namespace dc
