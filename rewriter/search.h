// Searches over whole plans, on top of MakePlan: the smallest budget a policy meets, and
// profile-guided rounds (plan, measure, re-plan from the measurement, keep the fastest). The
// measuring is the caller's (dc-plan runs dc-run with collection); the search is here.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "machine/cost_model.h"
#include "rewriter/planner.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct BudgetSearchOptions {
  // Budgets grow by this factor from the one that failed until one plans (feasibility need not
  // be monotonic near the unconstrained peak, where the passes spend all they are given) ...
  double growth = 1.25;
  int max_growth_steps = 16;
  // ... then bisection narrows the bracket to this share of the budget, or min_step_bytes.
  double precision = 0.005;
  int64_t min_step_bytes = 4096;
};

// Where MakePlan(request) fails at request.budget_bytes: the smallest budget at which it plans
// (within the precision), or nothing (no budget given, or none found within max_growth_steps).
// `shortfall_bytes` (0: not known): the failure's Status::shortfall_bytes, the least any of the
// policy's checks said it needed beyond the budget. The search then plans there first: where
// that plans and a budget one precision step below does not, it is the answer (the baseline's
// peak, found in two plans); where it does not plan, the budgets below it are taken to fail and
// the search grows from it by one precision step, then by `growth` (llama3-70b on 32 ranks at
// 46.40 GiB: three plans instead of nine). A shortfall that turns out not to bound anything (the
// budget below it plans) costs one plan: the search bisects from the request's budget as without
// one. `plans_made` (optional) counts the MakePlan calls.
std::optional<int64_t> SmallestBudget(PlanRequest request, int64_t shortfall_bytes = 0,
                                      const BudgetSearchOptions& options = {},
                                      int* plans_made = nullptr);

// What one round measured of running a plan: its median step, and the costs and profile digest
// to plan the next round with.
struct RoundMeasurement {
  double step_seconds = 0;
  CostModel costs;
  std::string profile_digest;
  int threads_per_rank = 0;  // the BLAS threads per rank the run recorded (0: not recorded)
};
// Runs `plan` (round counts from 1) and measures it.
using MeasureFn = std::function<StatusOr<RoundMeasurement>(int round, const proto::Schedule& plan)>;

struct RoundRecord {
  int round = 0;
  // Where the round's plan came from: "the plan", "re-planned from round N's trace" or a
  // runner-up's source.
  std::string source;
  double predicted_step_seconds = 0;
  double measured_step_seconds = 0;
  int instructions = 0;
  int threads_per_rank = 0;  // as RoundMeasurement's
};

// The plan profile-guided rounds kept: the one whose measured step was fastest.
struct RoundsResult {
  proto::Schedule plan;
  int kept_round = 0;            // 1-based
  double kept_step_seconds = 0;  // the mean of its measurements
  CostModel costs;               // the costs that predicted it (a later round's: its trace's)
};

// Two plans whose rounds measured within this fraction of each other are measured again: a few
// steps on a shared machine move by that much (small on 2 cpu ranks: the same plan 0.148-0.154 s
// in six runs; a DeepCompile plan 7% slower measured 0.5% faster in one round).
constexpr double kRemeasureWithin = 0.03;

// Profile-guided rounds: measures `plan`, then the next plan, for `rounds` rounds; keeps the plan
// whose measured step was fastest (ties: the earliest). A plan of other instructions that
// measured within kRemeasureWithin of the fastest is measured again, alternately with it (round
// numbers after `rounds`, heard by `on_round` too), and the means of their measurements decide. The
// next plan is the fastest predicted runner-up of the plan just measured (`runners_up` for the
// first: MakePlan's, fastest first) where that plan was measured further from its prediction than
// the runner-up was predicted behind it (the simulator cannot tell them apart: measuring can), else
// a re-plan of `request` with the measured costs (whose runners-up are taken up the same way).
// `on_round` (optional) hears each round as it ends.
StatusOr<RoundsResult> PlanInRounds(PlanRequest request, proto::Schedule plan, int rounds,
                                    const MeasureFn& measure,
                                    const std::function<void(const RoundRecord&)>& on_round,
                                    std::vector<RunnerUp> runners_up = {});

}  // namespace dc
