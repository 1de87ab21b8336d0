// Trace-replay regression: a trace recorded by the cpu backend is checked in with a golden
// summary of its plans. Planning it again must reproduce the summary exactly; a change to the
// planner that moves it must update the golden file on purpose:
//   DC_UPDATE_GOLDEN=1 build/tests/replay_test
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "analyzer/profile.h"
#include "analyzer/trace.h"
#include "rewriter/planner.h"

namespace dc {
namespace {

const std::string kTrace = std::string(DC_SOURCE_DIR) + "/tests/data/tiny-2rank.db";
const std::string kGolden = std::string(DC_SOURCE_DIR) + "/tests/data/tiny-2rank.golden.txt";

std::string Summary(const proto::Schedule& plan) {
  std::map<std::string, int> counts;
  for (const auto& instr : plan.instructions()) ++counts[InstrKindName(instr.kind())];
  std::ostringstream out;
  out << "policy " << plan.policy() << "\n";
  out << "instructions " << plan.instructions_size() << "\n";
  for (const auto& [kind, n] : counts) out << "  " << kind << " " << n << "\n";
  char line[160];
  std::snprintf(line, sizeof(line), "predicted step_seconds %.9g peak_device_bytes %lld\n",
                plan.prediction().step_seconds(),
                static_cast<long long>(plan.prediction().peak_device_bytes()));
  out << line;
  std::snprintf(line, sizeof(line), "baseline step_seconds %.9g peak_device_bytes %lld\n",
                plan.baseline().step_seconds(),
                static_cast<long long>(plan.baseline().peak_device_bytes()));
  out << line;
  out << "passes";
  for (const auto& p : plan.passes()) out << " " << p.name() << (p.changed() ? "+" : "-");
  out << "\n";
  return out.str();
}

TEST(Replay, CheckedInTracePlansToTheGoldenSummary) {
  auto trace = Trace::Open(kTrace);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  auto profile = BuildProfile(**trace);
  ASSERT_TRUE(profile.ok()) << profile.status().message();
  std::string summary;
  for (const std::string& policy : PolicyNames()) {
    PlanRequest request;
    request.program = *(*trace)->program();
    request.world_size = static_cast<int>((*trace)->ranks().size());
    request.policy = policy;
    request.costs = profile->costs;
    request.profile_digest = profile->digest;
    auto plan = MakePlan(request);
    ASSERT_TRUE(plan.ok()) << policy << ": " << plan.status().message();
    summary += Summary(*plan);
  }
  if (std::getenv("DC_UPDATE_GOLDEN")) {
    std::ofstream(kGolden) << summary;
    GTEST_SKIP() << "wrote " << kGolden;
  }
  std::ifstream golden(kGolden);
  ASSERT_TRUE(golden.good()) << kGolden << " is missing; run with DC_UPDATE_GOLDEN=1";
  std::stringstream expected;
  expected << golden.rdbuf();
  EXPECT_EQ(summary, expected.str());
}

}  // namespace
}  // namespace dc
