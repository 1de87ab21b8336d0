#include "rewriter/search.h"

#include <gtest/gtest.h>

#include <algorithm>
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

TEST(Search, SmallestBudgetIsTheBaselinesPeakWithinThePrecision) {
  PlanRequest request = TinyRequest();
  auto unlimited = MakePlan(request);
  ASSERT_TRUE(unlimited.ok()) << unlimited.status().message();
  const int64_t peak = unlimited->prediction().peak_device_bytes();
  request.budget_bytes = peak / 2;
  ASSERT_FALSE(MakePlan(request).ok());
  BudgetSearchOptions options;
  const std::optional<int64_t> smallest = SmallestBudget(request, options);
  ASSERT_TRUE(smallest.has_value());
  // The baseline fits exactly at its peak: the search brackets it to the precision.
  EXPECT_GE(*smallest, peak);
  EXPECT_LE(*smallest - peak, std::max<int64_t>(options.min_step_bytes,
                                                static_cast<int64_t>(options.precision * peak)));
  request.budget_bytes = 0;
  EXPECT_FALSE(SmallestBudget(request).has_value());  // nothing to search without a budget
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
  EXPECT_EQ(planned_from, (std::vector<std::string>{"", "round-1", "round-2"}));
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[1].round, 2);
  EXPECT_DOUBLE_EQ(records[1].measured_step_seconds, 0.1);

  auto failing = [](int round, const proto::Schedule&) -> StatusOr<RoundMeasurement> {
    return Status::Error("round " + std::to_string(round) + ": dc-run failed");
  };
  auto failed = PlanInRounds(request, *first, 2, failing, nullptr);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().message(), "round 1: dc-run failed");
}

}  // namespace
}  // namespace dc
