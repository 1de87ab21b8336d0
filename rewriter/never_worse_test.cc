// dc is never worse than a rule (issue 14): over random Llama shapes, 1 to 32 ranks, the
// h100-sxm, h200 and a100-80gb profiles and budgets from 35% to 130% of the baseline's peak,
// dc's plan is no slower than the baseline's, zero3-offload's or deepcompile's, and dc plans
// wherever one of them does. Every plan's step is at least the lower bound
// (machine/lower_bound.h).
//
// The cases come from one fixed seed (std::mt19937_64 is specified bit for bit; draws use its raw
// output), so a failure names the case that reproduces it. A longer run:
//   DC_NEVER_WORSE_CASES=500 DC_NEVER_WORSE_SEED=7 build/rewriter/rewriter_test
//     --gtest_filter='*NeverWorse*'   (one command line)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "machine/estimate.h"
#include "machine/hardware.h"
#include "machine/lower_bound.h"
#include "models/model.h"
#include "rewriter/planner.h"

namespace dc {
namespace {

constexpr uint64_t kSeed = 20261125;
// Cases per run in CI; DC_NEVER_WORSE_CASES sets another count, DC_NEVER_WORSE_SEED another seed.
constexpr int kCases = 40;
// dc's step may exceed a rule's by this relative rounding slack at most (the same simulator on
// the same schedule gives the same number; this covers sums in another order).
constexpr double kStepSlack = 1e-9;
// Budgets are this range of shares of the baseline's unbounded peak (issue 14's 124 cases).
constexpr double kMinBudgetShare = 0.35, kMaxBudgetShare = 1.30;

const char* const kRules[] = {"baseline", "zero3-offload", "deepcompile"};

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  return std::strtoull(text, nullptr, 10);
}

int64_t Draw(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
}
template <typename T>
T Pick(std::mt19937_64& rng, const std::vector<T>& choices) {
  return choices[static_cast<size_t>(Draw(rng, 0, static_cast<int64_t>(choices.size()) - 1))];
}

struct RandomCase {
  uint64_t seed = 0;
  ModelOverrides overrides;
  int world = 1;
  std::string hardware;
  double budget_share = 1;
};

RandomCase MakeCase(int index) {
  RandomCase c;
  c.seed = EnvOr("DC_NEVER_WORSE_SEED", kSeed) * 1000003 + static_cast<uint64_t>(index);
  std::mt19937_64 rng(c.seed);
  ModelOverrides& o = c.overrides;
  o.layers = Draw(rng, 1, 4);
  o.hidden = Pick<int64_t>(rng, {1024, 2048, 4096});
  o.heads = Pick<int64_t>(rng, {8, 16, 32});
  std::vector<int64_t> kv_heads;
  for (int64_t k = 1; k <= *o.heads; k *= 2) kv_heads.push_back(k);
  o.kv_heads = Pick(rng, kv_heads);
  o.ffn = Pick<int64_t>(rng, {2048, 4096, 8192, 14336});
  o.vocab = Pick<int64_t>(rng, {32000, 128256});
  o.seq = Pick<int64_t>(rng, {256, 512, 1024});
  o.micro_batch = Draw(rng, 1, 4);
  o.gas = Draw(rng, 1, 4);
  o.recompute_layers = rng() % 3 == 0;
  c.world = Pick<int>(rng, {1, 2, 4, 8, 16, 32});
  c.hardware = Pick<std::string>(rng, {"h100-sxm", "h200", "a100-80gb"});
  const double unit = static_cast<double>(rng() >> 11) / static_cast<double>(1ull << 53);
  c.budget_share = kMinBudgetShare + unit * (kMaxBudgetShare - kMinBudgetShare);
  return c;
}

std::string Describe(const RandomCase& c, int64_t budget_bytes) {
  const ModelOverrides& o = c.overrides;
  char text[400];
  std::snprintf(text, sizeof(text),
                "case seed %llu: dc-plan --synthetic --model llama-1b --layers %lld --hidden %lld "
                "--heads %lld --kv-heads %lld --ffn %lld --vocab %lld --seq %lld --micro-batch "
                "%lld --gas %lld%s --world %d --gpus-per-node %d --hardware %s --budget %lld",
                static_cast<unsigned long long>(c.seed), static_cast<long long>(*o.layers),
                static_cast<long long>(*o.hidden), static_cast<long long>(*o.heads),
                static_cast<long long>(*o.kv_heads), static_cast<long long>(*o.ffn),
                static_cast<long long>(*o.vocab), static_cast<long long>(*o.seq),
                static_cast<long long>(*o.micro_batch), static_cast<long long>(*o.gas),
                *o.recompute_layers ? " --recompute" : "", c.world, std::min(c.world, 8),
                c.hardware.c_str(), static_cast<long long>(budget_bytes));
  return text;
}

PlanRequest RequestFor(const ModelOverrides& overrides, int world, const std::string& hardware,
                       const std::string& model = "llama-1b") {
  auto config = MakeConfig(model, overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  auto hw = FindHardware(hardware);
  EXPECT_TRUE(hw.ok()) << hw.status().message();
  auto cluster = MakeCluster(world, std::min(world, 8));
  EXPECT_TRUE(cluster.ok()) << cluster.status().message();
  PlanRequest request;
  request.program = *program;
  request.world_size = world;
  request.backend = "cuda";
  request.device = hardware;
  request.costs = EstimateCostModel(*program, *hw, *cluster);
  return request;
}

// A Llama shape as the never-worse test's cases print it (--layers ... --gas).
ModelOverrides LlamaShape(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads,
                          int64_t ffn, int64_t seq, int64_t micro_batch, int64_t gas) {
  ModelOverrides o;
  o.layers = layers;
  o.hidden = hidden;
  o.heads = heads;
  o.kv_heads = kv_heads;
  o.ffn = ffn;
  o.vocab = 128256;
  o.seq = seq;
  o.micro_batch = micro_batch;
  o.gas = gas;
  return o;
}

// A preset's own shape at `seq`, `micro_batch` and `gas`.
ModelOverrides PresetAt(int64_t seq, int64_t micro_batch, int64_t gas) {
  ModelOverrides o;
  o.seq = seq;
  o.micro_batch = micro_batch;
  o.gas = gas;
  return o;
}

// The profile's device memory: plan_bench's and paper_bench's budget.
int64_t DeviceMemoryBytes(const std::string& hardware) {
  auto hw = FindHardware(hardware);
  EXPECT_TRUE(hw.ok()) << hw.status().message();
  return hw.ok() ? hw->device_memory_bytes : 0;
}

// plan_bench's tight budget for `request`'s model: 80% of the baseline's peak (0 where the
// baseline does not plan).
int64_t TightBudgetBytes(PlanRequest request) {
  request.policy = "baseline";
  request.budget_bytes = 0;
  auto baseline = MakePlan(request);
  EXPECT_TRUE(baseline.ok()) << baseline.status().message();
  if (!baseline.ok()) return 0;
  return static_cast<int64_t>(static_cast<double>(baseline->prediction().peak_device_bytes()) *
                              0.8);
}

// A policy's candidates (splits, fallbacks, rivals) may fail only for the budget: any other
// failure is a pass's defect, which the planner notes in the plan (or says in its error).
void ExpectNoCandidateDefect(const StatusOr<proto::Schedule>& plan, const std::string& policy) {
  if (!plan.ok()) {
    EXPECT_TRUE(plan.status().over_budget()) << policy << ": " << plan.status().message();
    return;
  }
  for (const std::string& note : plan->notes()) {
    EXPECT_EQ(note.find("dc defect"), std::string::npos) << policy << ": " << note;
  }
}

// Where dc keeps a rival's plan (the case of Synthetic.DcKeepsARulesPlanWhereItIsFaster), its own
// pipeline's plan is the runner-up, complete and predicted slower; the rivals that lost follow it,
// fastest predicted first.
TEST(NeverWorseTest, APlanKeptFromARivalHasTheOwnPlanAsRunnerUp) {
  PlanRequest request = RequestFor(LlamaShape(3, 1024, 32, 2, 4096, 512, 3, 1), 32, "a100-80gb");
  request.budget_bytes = 1268853715;
  std::vector<RunnerUp> runners_up;
  request.runners_up = &runners_up;
  auto plan = MakePlan(request);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  ASSERT_FALSE(runners_up.empty());
  EXPECT_EQ(runners_up.front().source, "dc's own pipeline");
  // The plan names the rival whose plan it is, and the own pipeline's step it beat.
  EXPECT_FALSE(plan->kept_rival().empty());
  EXPECT_EQ(plan->policy(), "dc");
  EXPECT_DOUBLE_EQ(plan->own_step_seconds(), runners_up.front().plan.prediction().step_seconds());
  double previous = plan->prediction().step_seconds();
  for (const RunnerUp& r : runners_up) {
    EXPECT_GE(r.plan.prediction().step_seconds(), previous) << r.source;
    EXPECT_GT(r.plan.memory_plan().arena_bytes(), 0) << r.source;
    previous = r.plan.prediction().step_seconds();
  }
}

// Plans every rule and dc under `request`'s budget and checks dc against each; returns the rule
// whose plan dc kept, if any ("" otherwise).
std::string CheckNeverWorse(PlanRequest request) {
  const StepBound bound = StepLowerBound(request.program, request.world_size, request.costs);
  std::map<std::string, StatusOr<proto::Schedule>> plans;
  for (const char* policy : {"baseline", "zero3-offload", "deepcompile", "dc"}) {
    request.policy = policy;
    plans.emplace(policy, MakePlan(request));
    const auto& plan = plans.at(policy);
    ExpectNoCandidateDefect(plan, policy);
    if (plan.ok()) {
      EXPECT_LE(bound.seconds, plan->prediction().step_seconds() * (1 + kStepSlack))
          << policy << ": the lower bound (" << bound.binding << ") is above the plan's step";
    }
  }
  const auto& dc = plans.at("dc");
  for (const char* rule : kRules) {
    const auto& plan = plans.at(rule);
    if (!plan.ok()) continue;
    if (!dc.ok()) {
      ADD_FAILURE() << "dc refuses a budget " << rule << " meets: " << dc.status().message();
      continue;
    }
    EXPECT_LE(dc->prediction().step_seconds(), plan->prediction().step_seconds() * (1 + kStepSlack))
        << "dc (" << dc->prediction().step_seconds() << " s) is slower than " << rule << " ("
        << plan->prediction().step_seconds() << " s)";
  }
  if (!dc.ok()) return "";
  // The plan says which rival's it is (and the note says so in words), and the step of dc's own
  // that it beat.
  const std::string& kept = dc->kept_rival();
  bool noted = false;
  for (const std::string& note : dc->notes()) {
    noted = noted || note.rfind("kept " + kept + "'s plan", 0) == 0;
  }
  EXPECT_EQ(noted, !kept.empty()) << kept;
  if (kept.empty()) {
    EXPECT_EQ(dc->own_step_seconds(), 0);
  } else if (dc->own_step_seconds() > 0) {
    EXPECT_LT(dc->prediction().step_seconds(), dc->own_step_seconds());
  }
  return kept;
}

// Issue 14's case: dc's own pipelines predicted 0.1781 s where deepcompile's rules predict
// 0.1672 s, and dc kept deepcompile's plan. Since the offload pass lowers its planning budget
// twice as far each arena round and its arena check tries three packing orders, dc's own
// pipeline plans 0.1552 s: never worse, and now by its own plan; since breadth-descending
// packing stacks the longest-lived buffers first on its ties, offload gives back less and the
// plan steps in 0.1429 s; since a relaxed split whose offload slowed it is planned again a few
// percent lower, 0.1421 s.
TEST(NeverWorseTest, IssueCasePlansNoSlowerThanDeepCompile) {
  PlanRequest request = RequestFor(LlamaShape(4, 4096, 32, 2, 8192, 512, 3, 4), 8, "h100-sxm");
  request.budget_bytes = 4954009965;
  EXPECT_EQ(CheckNeverWorse(request), "");
  request.policy = "deepcompile";
  auto rule = MakePlan(request);
  ASSERT_TRUE(rule.ok()) << rule.status().message();
  EXPECT_NEAR(rule->prediction().step_seconds(), 0.1672, 5e-5);
  request.policy = "dc";
  auto dc = MakePlan(request);
  ASSERT_TRUE(dc.ok()) << dc.status().message();
  EXPECT_NEAR(dc->prediction().step_seconds(), 0.1421, 5e-5);
  EXPECT_EQ(dc->kept_rival(), "");
  EXPECT_EQ(dc->policy(), "dc");
}

// A full pipeline that only ties the baseline has gained nothing from its passes, and the
// fallbacks are planned as where it is slower: tiny on 2 cpu ranks at 75% of the baseline's
// peak, where the full pipeline offloads room for its arena and steps as the baseline does, and
// Adam on the host with bucketing and prefetching is a third faster.
TEST(NeverWorseTest, APlanThatOnlyTiesTheBaselineTriesTheFallbacks) {
  auto config = MakeConfig("tiny", ModelOverrides{});
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok()) << program.status().message();
  PlanRequest request;
  request.program = *program;
  request.world_size = 2;
  request.costs = EstimateCostModel(*program, *FindHardware("cpu"), ClusterShape{1, 2});
  request.policy = "baseline";
  auto baseline = MakePlan(request);
  ASSERT_TRUE(baseline.ok()) << baseline.status().message();
  request.policy = "dc";
  request.budget_bytes =
      static_cast<int64_t>(static_cast<double>(baseline->prediction().peak_device_bytes()) * 0.75);
  auto plan = MakePlan(request);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_LT(plan->prediction().step_seconds(), 0.9 * baseline->prediction().step_seconds());
  bool noted = false;
  for (const std::string& note : plan->notes()) {
    noted = noted || note.find("no faster than the baseline's") != std::string::npos;
  }
  EXPECT_TRUE(noted);
}

// Mixtral 8x7B at the paper's scale (32 H100s, seq 2048, micro-batch 4): dc's plan prefetches
// and keeps experts gathered under the 79.65 GiB budget. One of its candidates used to make a
// schedule the happens-before check refused (a compute lost its wait for a gather when unshard
// removed the gather after it), which the planner passed over in silence: the plan fell back to
// the baseline's 1.650 s.
TEST(NeverWorseTest, Mixtral8x7bPlansFasterThanTheBaselineWithNoCandidateDefect) {
  PlanRequest request = RequestFor(PresetAt(2048, 4, 1), 32, "h100-sxm", "mixtral-8x7b");
  request.budget_bytes = DeviceMemoryBytes("h100-sxm");  // 79.65 GiB
  request.policy = "dc";
  auto dc = MakePlan(request);
  ExpectNoCandidateDefect(dc, "dc");
  ASSERT_TRUE(dc.ok()) << dc.status().message();
  // 1.131 s against the baseline's 1.650 s on this profile; a plan that lost its prefetch and
  // unsharding gains nothing.
  EXPECT_LT(dc->prediction().step_seconds(), dc->baseline().step_seconds() / 1.3);
}

// Llama-3 70B on 32 H100s at GAS 1 (plan_bench's loose row, seq 1024): at the H100's exact
// memory the split that relaxes by all the optimizer-state bytes unshards to 96.06 GiB, and
// offloading all it may leaves it 2.7 MB over, so offload's reloads slowed that split from
// 1.106 s to 1.289 s and dc planned 1.1256 s, where 9 MB more budget planned 1.1063 s. Planned
// again at a slightly lower relaxed budget, the split gives up a few megabytes of unsharding
// instead of adding reloads: a few megabytes less budget cost no more than a fraction of a
// percent of the step.
TEST(NeverWorseTest, AFewMegabytesLessBudgetCostAFewMegabytesOfUnsharding) {
  PlanRequest request = RequestFor(PresetAt(1024, 1, 1), 32, "h100-sxm", "llama3-70b");
  request.policy = "dc";
  const int64_t h100_bytes = DeviceMemoryBytes("h100-sxm");
  request.budget_bytes = h100_bytes + 9'000'000;
  auto roomier = MakePlan(request);
  ASSERT_TRUE(roomier.ok()) << roomier.status().message();
  request.budget_bytes = h100_bytes;
  auto exact = MakePlan(request);
  ExpectNoCandidateDefect(exact, "dc");
  ASSERT_TRUE(exact.ok()) << exact.status().message();
  EXPECT_LT(exact->prediction().step_seconds(), roomier->prediction().step_seconds() * 1.005);
  EXPECT_LT(exact->prediction().step_seconds(), 1.115);
  // The plan says which split it came from, and that it was planned again.
  bool noted = false;
  for (const std::string& note : exact->notes()) {
    noted = noted || (note.find("dc's own pipeline, planned with a relaxed budget of") == 0 &&
                      note.find("under the split at") != std::string::npos);
  }
  EXPECT_TRUE(noted);
}

// Llama-3 8B on 8 H100s at GAS 16 and 80% of the baseline's peak (plan_bench's tight row, 51k
// instructions): the budget relaxed by half the optimizer-state bytes is still under the
// baseline's own peak, so the passes before offload had no room, and dc planned 2.6895 s, 3%
// under deepcompile's rules (2.7812 s). The split that may spend all of them, once planned only
// up to 50k instructions, prefetches and unshards, and offload gives the bytes back.
TEST(NeverWorseTest, ATightBudgetAtGas16ExploresTheSplitWithAllTheStateBytes) {
  PlanRequest request = RequestFor(PresetAt(1024, 1, 16), 8, "h100-sxm", "llama3-8b");
  request.budget_bytes = TightBudgetBytes(request);
  ASSERT_GT(request.budget_bytes, 0);
  request.policy = "deepcompile";
  auto rule = MakePlan(request);
  ASSERT_TRUE(rule.ok()) << rule.status().message();
  request.policy = "dc";
  auto dc = MakePlan(request);
  ExpectNoCandidateDefect(dc, "dc");
  ASSERT_TRUE(dc.ok()) << dc.status().message();
  EXPECT_LT(dc->prediction().step_seconds(), 0.75 * rule->prediction().step_seconds());
  EXPECT_EQ(dc->kept_rival(), "");
}

// At 80% of the baseline's peak (plan_bench's tight rows) offload must make room for the arena,
// not only the peak, so every percent the arena packs over the live peak is offloaded too.
// Llama-3 70B on 32 H100s at GAS 1: with the best packing compacted (MemoryPlanOptions::
// compaction_rounds) the arena packs 2.56% over the live peak, not 3.06%, and the step is
// 1.2085 s, not 1.2552 s. Llama-3 8B on 8 H100s at GAS 1: offload's arena rounds overshot to a
// plan that fit with room to spare; planned again halfway back up
// (OffloadOptions::arena_refine_rounds), 0.1989 s instead of 0.2003 s.
TEST(NeverWorseTest, ATightBudgetOffloadsOnlyWhatTheArenaNeeds) {
  struct Row {
    const char* preset;
    int world;
    double step_under_seconds;
  };
  for (const Row& row : {Row{"llama3-8b", 8, 0.2000}, Row{"llama3-70b", 32, 1.23}}) {
    SCOPED_TRACE(row.preset);
    PlanRequest request = RequestFor(PresetAt(1024, 1, 1), row.world, "h100-sxm", row.preset);
    request.budget_bytes = TightBudgetBytes(request);
    ASSERT_GT(request.budget_bytes, 0);
    request.policy = "dc";
    auto dc = MakePlan(request);
    ExpectNoCandidateDefect(dc, "dc");
    ASSERT_TRUE(dc.ok()) << dc.status().message();
    EXPECT_LT(dc->prediction().step_seconds(), row.step_under_seconds);
    EXPECT_LE(dc->memory_plan().arena_bytes(), request.budget_bytes);
  }
}

class NeverWorse : public ::testing::TestWithParam<int> {
 public:
  static std::map<std::string, int>& Kept() {
    static std::map<std::string, int> kept;
    return kept;
  }
  static void TearDownTestSuite() {
    std::string line = "dc never worse than a rule: rule plans kept:";
    for (const auto& [rule, count] : Kept()) line += " " + rule + " " + std::to_string(count);
    std::printf("%s\n", line.c_str());
  }
};

TEST_P(NeverWorse, Holds) {
  const RandomCase c = MakeCase(GetParam());
  PlanRequest request = RequestFor(c.overrides, c.world, c.hardware);
  request.policy = "baseline";
  auto unbounded = MakePlan(request);
  ASSERT_TRUE(unbounded.ok()) << Describe(c, 0) << ": " << unbounded.status().message();
  request.budget_bytes = static_cast<int64_t>(
      static_cast<double>(unbounded->prediction().peak_device_bytes()) * c.budget_share);
  SCOPED_TRACE(Describe(c, request.budget_bytes));
  const std::string kept = CheckNeverWorse(request);
  if (!kept.empty()) {
    ++Kept()[kept];
    std::printf("kept %s's plan: %s\n", kept.c_str(), Describe(c, request.budget_bytes).c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Random, NeverWorse,
                         ::testing::Range(0,
                                          static_cast<int>(EnvOr("DC_NEVER_WORSE_CASES", kCases))));

}  // namespace
}  // namespace dc
