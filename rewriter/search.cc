#include "rewriter/search.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "rewriter/verifier.h"

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

namespace {

// One round's plan and what it measured, for the rounds' final choice.
struct MeasuredPlan {
  int round = 0;
  proto::Schedule plan;
  CostModel costs;  // what predicted it
  uint64_t fingerprint = 0;
  std::vector<double> steps;  // each measurement's median step

  double Mean() const {
    double sum = 0;
    for (double s : steps) sum += s;
    return sum / static_cast<double>(steps.size());
  }
};

}  // namespace

StatusOr<RoundsResult> PlanInRounds(PlanRequest request, proto::Schedule plan, int rounds,
                                    const MeasureFn& measure,
                                    const std::function<void(const RoundRecord&)>& on_round,
                                    std::vector<RunnerUp> runners_up) {
  std::vector<MeasuredPlan> measured_plans;
  std::string source = "the plan";
  for (int round = 1; round <= rounds; ++round) {
    DC_ASSIGN_OR_RETURN(RoundMeasurement measured, measure(round, plan));
    const double predicted = plan.prediction().step_seconds();
    if (on_round) {
      on_round({round, source, predicted, measured.step_seconds, plan.instructions_size(),
                measured.threads_per_rank});
    }
    measured_plans.push_back(
        {round, plan, request.costs, InstructionsFingerprint(plan), {measured.step_seconds}});
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
  if (measured_plans.empty()) {  // no rounds: the plan as it came
    RoundsResult unmeasured;
    unmeasured.plan = std::move(plan);
    unmeasured.costs = request.costs;
    return unmeasured;
  }
  // The fastest measured (ties: the earliest). A plan of other instructions measured within
  // kRemeasureWithin of it is measured again, alternately with it (the later round's plan first:
  // with the rounds' order, A B B A, so that a drift of the machine falls on both alike), and the
  // mean of each's measurements decides.
  auto fastest = [&] {
    size_t best = 0;
    for (size_t i = 1; i < measured_plans.size(); ++i) {
      if (measured_plans[i].Mean() < measured_plans[best].Mean()) best = i;
    }
    return best;
  };
  size_t best = fastest();
  std::vector<size_t> contenders;
  for (size_t i = 0; i < measured_plans.size(); ++i) {
    const MeasuredPlan& m = measured_plans[i];
    if (i != best && m.fingerprint != measured_plans[best].fingerprint &&
        m.steps.front() <= measured_plans[best].steps.front() * (1 + kRemeasureWithin)) {
      contenders.push_back(i);
    }
  }
  int next_round = rounds + 1;
  for (size_t i : contenders) {
    if (i == best) continue;
    const size_t later = measured_plans[i].round > measured_plans[best].round ? i : best;
    for (const size_t k : {later, later == i ? best : i}) {
      MeasuredPlan& m = measured_plans[k];
      DC_ASSIGN_OR_RETURN(RoundMeasurement again, measure(next_round, m.plan));
      if (on_round) {
        char text[160];
        std::snprintf(
            text, sizeof(text), "round %d's plan again: rounds %d and %d measured within %.0f%%",
            m.round, std::min(measured_plans[i].round, measured_plans[best].round),
            std::max(measured_plans[i].round, measured_plans[best].round), 100 * kRemeasureWithin);
        on_round({next_round, text, m.plan.prediction().step_seconds(), again.step_seconds,
                  m.plan.instructions_size(), again.threads_per_rank});
      }
      m.steps.push_back(again.step_seconds);
      ++next_round;
    }
    best = fastest();
  }
  RoundsResult kept;
  kept.plan = measured_plans[best].plan;
  kept.kept_round = measured_plans[best].round;
  kept.kept_step_seconds = measured_plans[best].Mean();
  kept.costs = measured_plans[best].costs;
  return kept;
}

}  // namespace dc
