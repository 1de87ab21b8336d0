#include "rewriter/search.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <vector>

#include "models/model.h"

namespace dc {
namespace {

PlanRequest TinyRequest() {
  auto config = MakeConfig("tiny", ModelOverrides());
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  PlanRequest request;
  request.program = *program;
  request.world_size = 2;
  request.policy = "baseline";
  return request;
}

// Deps stay linear in the schedule: passes that drop instructions (unshard's bridges) keep only
// the latest dep on each stream, where chains of dropped gathers once made every backward
// instruction wait for about every earlier one (100 layers: 8k deps became 819k, and planning
// time and memory grew with the square of the depth). The plan is the same either way.
TEST(Search, DepsStayLinearInDeepModels) {
  ModelOverrides overrides;
  overrides.layers = 200;
  auto config = MakeConfig("tiny", overrides);
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok());
  PlanRequest request;
  request.program = *program;
  request.world_size = 2;
  request.policy = "dc";
  auto plan = MakePlan(request);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  int64_t deps = 0;
  int most = 0;
  for (const proto::Instruction& instr : plan->instructions()) {
    deps += instr.deps_size();
    most = std::max(most, instr.deps_size());
  }
  EXPECT_LE(deps, 2 * plan->instructions_size());
  EXPECT_LE(most, 16) << "an instruction waits for " << most << " others";
}

// The baseline's peak with no budget (the smallest budget it meets).
int64_t BaselinePeak(const PlanRequest& request) {
  auto unlimited = MakePlan(request);
  EXPECT_TRUE(unlimited.ok()) << unlimited.status().message();
  return unlimited.ok() ? unlimited->prediction().peak_device_bytes() : 0;
}

// The search's precision at `budget`.
int64_t PrecisionBytes(const BudgetSearchOptions& options, int64_t budget) {
  return std::max<int64_t>(options.min_step_bytes,
                           static_cast<int64_t>(options.precision * static_cast<double>(budget)));
}

TEST(Search, SmallestBudgetIsTheBaselinesPeakWithinThePrecision) {
  PlanRequest request = TinyRequest();
  const int64_t peak = BaselinePeak(request);
  ASSERT_GT(peak, 0);
  request.budget_bytes = peak / 2;
  const auto failed = MakePlan(request);
  ASSERT_FALSE(failed.ok());
  // The baseline's check says how far over the budget its peak is.
  ASSERT_TRUE(failed.status().over_budget()) << failed.status().message();
  EXPECT_EQ(failed.status().shortfall_bytes(), peak - request.budget_bytes);
  BudgetSearchOptions options;
  const int64_t precision_bytes = PrecisionBytes(options, peak);
  // Without the shortfall: growth from the budget, then bisection to the precision.
  int blind_plans = 0;
  const std::optional<int64_t> blind = SmallestBudget(request, 0, options, &blind_plans);
  ASSERT_TRUE(blind.has_value());
  // The baseline fits exactly at its peak: the search brackets it to the precision.
  EXPECT_GE(*blind, peak);
  EXPECT_LE(*blind - peak, precision_bytes);
  // From the shortfall: the peak itself, found in two plans (it plans; a step below does not).
  int plans = 0;
  EXPECT_EQ(SmallestBudget(request, failed.status().shortfall_bytes(), options, &plans), peak);
  EXPECT_EQ(plans, 2);
  EXPECT_GT(blind_plans, plans);
  request.budget_bytes = 0;
  EXPECT_FALSE(SmallestBudget(request).has_value());  // nothing to search without a budget
}

// A shortfall is a place to start, not trusted beyond what the plans show: one that overshoots
// (the budget below it plans) and one that falls short (it does not plan) both end within the
// precision of the peak.
TEST(Search, SmallestBudgetFromAShortfallThatIsWrongEitherWay) {
  PlanRequest request = TinyRequest();
  const int64_t peak = BaselinePeak(request);
  ASSERT_GT(peak, 0);
  request.budget_bytes = peak / 2;
  BudgetSearchOptions options;
  const int64_t precision_bytes = PrecisionBytes(options, peak);
  for (const int64_t shortfall : {peak, peak / 4, peak / 2 - 3 * precision_bytes}) {
    const std::optional<int64_t> smallest = SmallestBudget(request, shortfall, options);
    ASSERT_TRUE(smallest.has_value()) << shortfall;
    EXPECT_GE(*smallest, peak) << shortfall;
    EXPECT_LE(*smallest - peak, precision_bytes) << shortfall;
  }
}

// The dc policy's refusal names the least shortfall of its candidates' checks, which no budget
// it meets is below.
TEST(Search, DcsRefusalsShortfallBoundsTheSmallestBudget) {
  PlanRequest request = TinyRequest();
  request.policy = "dc";
  request.budget_bytes = 1 << 20;
  const auto failed = MakePlan(request);
  ASSERT_FALSE(failed.ok());
  ASSERT_TRUE(failed.status().over_budget()) << failed.status().message();
  const int64_t shortfall = failed.status().shortfall_bytes();
  ASSERT_GT(shortfall, 0) << failed.status().message();
  BudgetSearchOptions options;
  int plans = 0, blind_plans = 0;
  const std::optional<int64_t> smallest = SmallestBudget(request, shortfall, options, &plans);
  const std::optional<int64_t> blind = SmallestBudget(request, 0, options, &blind_plans);
  ASSERT_TRUE(smallest.has_value() && blind.has_value());
  const int64_t precision_bytes = PrecisionBytes(options, *blind);
  EXPECT_GE(*blind, request.budget_bytes + shortfall - precision_bytes);
  EXPECT_LE(std::llabs(*smallest - *blind), 2 * precision_bytes) << *smallest << " " << *blind;
  EXPECT_LT(plans, blind_plans);
}

TEST(Search, RoundsReplanWithWhatWasMeasuredAndKeepTheFastest) {
  PlanRequest request = TinyRequest();
  auto first = MakePlan(request);
  ASSERT_TRUE(first.ok());
  const std::vector<double> measured = {0.3, 0.1, 0.2};
  std::vector<std::string> planned_from;
  auto measure = [&](int round, const proto::Schedule& plan) -> StatusOr<RoundMeasurement> {
    planned_from.push_back(plan.profile_digest());
    RoundMeasurement m;
    m.step_seconds = measured[round - 1];
    m.costs.release_seconds = 1e-6 * round;  // a different model each round
    m.profile_digest = "round-" + std::to_string(round);
    return m;
  };
  std::vector<RoundRecord> records;
  auto best = PlanInRounds(request, *first, 3, measure,
                           [&](const RoundRecord& r) { records.push_back(r); });
  ASSERT_TRUE(best.ok()) << best.status().message();
  // Round 2 measured fastest; its plan was made from round 1's measurement.
  EXPECT_EQ(best->plan.profile_digest(), "round-1");
  EXPECT_EQ(best->kept_round, 2);
  EXPECT_DOUBLE_EQ(best->kept_step_seconds, 0.1);
  EXPECT_DOUBLE_EQ(best->costs.release_seconds, 1e-6);  // the costs that predicted it
  EXPECT_EQ(planned_from, (std::vector<std::string>{"", "round-1", "round-2"}));
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[1].round, 2);
  EXPECT_DOUBLE_EQ(records[1].measured_step_seconds, 0.1);

  // No rounds: the plan as it came, nothing measured.
  planned_from.clear();
  auto none = PlanInRounds(request, *first, 0, measure, nullptr);
  ASSERT_TRUE(none.ok()) << none.status().message();
  EXPECT_EQ(none->kept_round, 0);
  EXPECT_TRUE(planned_from.empty());

  auto failing = [](int round, const proto::Schedule&) -> StatusOr<RoundMeasurement> {
    return Status::Error("round " + std::to_string(round) + ": dc-run failed");
  };
  auto failed = PlanInRounds(request, *first, 2, failing, nullptr);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().message(), "round 1: dc-run failed");
}

// Round 1's plan measured 20% off its prediction: a runner-up predicted 5% behind it is as
// likely faster, so round 2 measures it (and keeps it, measured faster) instead of re-planning.
// Where round 1 measured 1% off, the runner-up stays unmeasured and round 2 re-plans.
TEST(Search, RoundsMeasureARunnerUpWithinTheMeasuredError) {
  PlanRequest request = TinyRequest();
  auto first = MakePlan(request);
  ASSERT_TRUE(first.ok());
  const double predicted = first->prediction().step_seconds();
  RunnerUp runner{"the rival's plan", *first};
  runner.plan.mutable_prediction()->set_step_seconds(1.05 * predicted);
  runner.plan.set_profile_digest("runner-up");
  for (const double round_one_ratio : {1.2, 1.01}) {
    SCOPED_TRACE(round_one_ratio);
    std::vector<std::string> measured_plans;
    auto measure = [&](int round, const proto::Schedule& plan) -> StatusOr<RoundMeasurement> {
      measured_plans.push_back(plan.profile_digest());
      RoundMeasurement m;
      m.step_seconds = round == 1 ? round_one_ratio * predicted : 0.9 * predicted;
      m.profile_digest = "round-" + std::to_string(round);
      return m;
    };
    std::vector<RoundRecord> records;
    auto best = PlanInRounds(request, *first, 2, measure,
                             [&](const RoundRecord& r) { records.push_back(r); }, {runner});
    ASSERT_TRUE(best.ok()) << best.status().message();
    ASSERT_EQ(records.size(), 2u);
    EXPECT_EQ(records[0].source, "the plan");
    EXPECT_EQ(best->kept_round, 2);
    if (round_one_ratio > 1.05) {
      EXPECT_EQ(measured_plans, (std::vector<std::string>{"", "runner-up"}));
      EXPECT_EQ(records[1].source, "the rival's plan, a runner-up within round 1's measured error");
      EXPECT_EQ(best->plan.profile_digest(), "runner-up");
    } else {
      EXPECT_EQ(measured_plans, (std::vector<std::string>{"", "round-1"}));
      EXPECT_EQ(records[1].source, "re-planned from round 1's trace");
    }
  }
}

// Rounds 1 and 2 measured 0.5% apart (0.161 s, 0.160 s), nearer than a few steps on a shared
// machine can tell: both plans are measured again, round 1's plan after round 2's, and the means
// keep round 1's (0.1555 s against 0.1615 s). Plans of the same instructions are not measured
// again.
TEST(Search, RoundsMeasureAgainPlansTheyCannotTellApart) {
  PlanRequest request = TinyRequest();
  auto first = MakePlan(request);
  ASSERT_TRUE(first.ok());
  RunnerUp runner{"the rival's plan", *first};
  // Another plan: its last instruction in another bucket (other instructions, the same work).
  proto::Instruction* last = runner.plan.mutable_instructions(runner.plan.instructions_size() - 1);
  last->set_bucket(last->bucket() + 1);
  runner.plan.set_profile_digest("runner-up");
  const std::map<int, double> steps = {{1, 0.161}, {2, 0.160}, {3, 0.163}, {4, 0.150}};
  std::vector<std::pair<int, std::string>> measured_plans;
  auto measure = [&](int round, const proto::Schedule& plan) -> StatusOr<RoundMeasurement> {
    measured_plans.push_back({round, plan.profile_digest()});
    RoundMeasurement m;
    if (!steps.count(round)) return Status::Error("no round " + std::to_string(round));
    m.step_seconds = steps.at(round);
    m.profile_digest = "round-" + std::to_string(round);
    return m;
  };
  // Round 1 measured 20% off its prediction: round 2 measures the runner-up.
  const double predicted = first->prediction().step_seconds();
  runner.plan.mutable_prediction()->set_step_seconds(1.05 * predicted);
  auto scaled = [&](int round, const proto::Schedule& plan) -> StatusOr<RoundMeasurement> {
    auto m = measure(round, plan);
    if (m.ok()) m->step_seconds *= predicted / 0.161 * 1.2;
    return m;
  };
  std::vector<RoundRecord> records;
  auto best = PlanInRounds(request, *first, 2, scaled,
                           [&](const RoundRecord& r) { records.push_back(r); }, {runner});
  ASSERT_TRUE(best.ok()) << best.status().message();
  EXPECT_EQ(measured_plans, (std::vector<std::pair<int, std::string>>{
                                {1, ""}, {2, "runner-up"}, {3, "runner-up"}, {4, ""}}));
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(records[2].source, "round 2's plan again: rounds 1 and 2 measured within 3%");
  EXPECT_EQ(records[3].source, "round 1's plan again: rounds 1 and 2 measured within 3%");
  EXPECT_EQ(best->kept_round, 1);
  EXPECT_EQ(best->plan.profile_digest(), "");
  EXPECT_NEAR(best->kept_step_seconds, (0.161 + 0.150) / 2 * predicted / 0.161 * 1.2, 1e-12);

  // The same instructions twice (a runner-up, or a re-plan, that changed nothing): the faster
  // measurement stands.
  RunnerUp twin{"the same plan", *first};
  twin.plan.mutable_prediction()->set_step_seconds(1.05 * predicted);
  measured_plans.clear();
  auto same = PlanInRounds(request, *first, 2, scaled, nullptr, {twin});
  ASSERT_TRUE(same.ok()) << same.status().message();
  EXPECT_EQ(measured_plans.size(), 2u);
  EXPECT_EQ(same->kept_round, 2);
}

}  // namespace
}  // namespace dc
