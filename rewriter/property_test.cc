// Property tests of the planner: random small programs (the tiny preset with random shapes), world
// sizes, hardware and budgets, every policy. Whatever the input, a policy either returns a plan
// that re-verifies, fits its budget, is no faster than the lower bound and (for dc) is no slower
// than any rule's, or says that the budget is too small, and only where it is. The same request
// gives the same plan twice.
//
// The cases come from one fixed seed (std::mt19937_64 is specified bit for bit by the standard;
// draws use it directly, not the implementation-defined distributions), so a failure names a
// case seed that reproduces it: rerun with --gtest_filter=Random/PlanProperties.Holds/<case>.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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
#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/planner.h"
#include "rewriter/verifier.h"
#include "schemas/happens_before.h"

namespace dc {
namespace {

constexpr uint64_t kSeed = 20261121;
// Cases per run; the environment variable DC_PROPERTY_CASES sets another count (a longer soak).
constexpr int kCases = 40;
// dc's predicted step may exceed the baseline's by this relative rounding slack at most.
constexpr double kStepSlack = 1e-9;
// A budget of 0 (unlimited) for one case in this many.
constexpr uint64_t kUnlimitedOneIn = 4;
// Budgets reach up to this multiple of the baseline's simulated peak.
constexpr double kMaxBudgetOverPeak = 1.5;
// Gradient clipping (--clip-grad-norm 1) for one case in this many.
constexpr uint64_t kClipOneIn = 2;

// Uniform in [lo, hi] from the engine's raw output (bias of at most 2^-40 here).
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
  bool unlimited = false;
  uint64_t budget_draw = 0;  // picks the budget once the baseline's peak is known
};

RandomCase MakeCase(int index) {
  RandomCase c;
  c.seed = kSeed + static_cast<uint64_t>(index);
  std::mt19937_64 rng(c.seed);
  ModelOverrides& o = c.overrides;
  o.layers = Draw(rng, 1, 3);
  o.hidden = Pick<int64_t>(rng, {32, 64, 96});
  std::vector<int64_t> heads;  // divide hidden with an even head dim (RoPE)
  for (int64_t h : {1, 2, 3, 4, 6, 8}) {
    if (*o.hidden % h == 0 && (*o.hidden / h) % 2 == 0) heads.push_back(h);
  }
  o.heads = Pick(rng, heads);
  std::vector<int64_t> kv_heads;
  for (int64_t k = 1; k <= *o.heads; ++k) {
    if (*o.heads % k == 0) kv_heads.push_back(k);
  }
  o.kv_heads = Pick(rng, kv_heads);
  o.ffn = Pick<int64_t>(rng, {64, 128, 160});
  o.vocab = Pick<int64_t>(rng, {64, 256});
  o.seq = Pick<int64_t>(rng, {8, 16, 32});
  o.micro_batch = Draw(rng, 1, 2);
  o.gas = Draw(rng, 1, 4);
  c.world = static_cast<int>(Draw(rng, 1, 8));
  c.hardware = Pick<std::string>(rng, {"h100-sxm", "a100-80gb", "cpu"});
  c.unlimited = rng() % kUnlimitedOneIn == 0;
  c.budget_draw = rng();
  if (rng() % kClipOneIn == 0) o.clip_grad_norm = 1.0;
  return c;
}

std::string Describe(const RandomCase& c, int64_t budget_bytes) {
  const ModelOverrides& o = c.overrides;
  char text[320];
  std::snprintf(text, sizeof(text),
                "case seed %llu: tiny --layers %lld --hidden %lld --heads %lld --kv-heads %lld "
                "--ffn %lld --vocab %lld --seq %lld --micro-batch %lld --gas %lld%s, world %d, "
                "%s, budget %lld bytes",
                static_cast<unsigned long long>(c.seed), static_cast<long long>(*o.layers),
                static_cast<long long>(*o.hidden), static_cast<long long>(*o.heads),
                static_cast<long long>(*o.kv_heads), static_cast<long long>(*o.ffn),
                static_cast<long long>(*o.vocab), static_cast<long long>(*o.seq),
                static_cast<long long>(*o.micro_batch), static_cast<long long>(*o.gas),
                o.clip_grad_norm ? " --clip-grad-norm 1" : "", c.world, c.hardware.c_str(),
                static_cast<long long>(budget_bytes));
  return text;
}

int CaseCount() {
  const char* text = std::getenv("DC_PROPERTY_CASES");
  const int count = text ? std::atoi(text) : 0;
  return count > 0 ? count : kCases;
}

// Cases run (and of them clipped), and plans per policy and those refused for the budget (for
// the summary line).
int& CasesRun() {
  static int cases = 0;
  return cases;
}
int& ClippedCasesRun() {
  static int cases = 0;
  return cases;
}
struct Counts {
  int planned = 0;
  int over_budget = 0;
  int known = 0;  // refusals that break a property, listed in kKnownFailures
};
std::map<std::string, Counts>& CountsByPolicy() {
  static std::map<std::string, Counts> counts;
  return counts;
}

// Cases where a policy breaks a property today. The case still runs every other check, then
// reports itself skipped; a listed failure that no longer happens fails the case (delete its
// entry). Each entry says what goes wrong; the case seed is kSeed + case.
struct KnownFailure {
  int case_index;
  const char* policy;
  const char* why;
};
// None today: dc falls back to simpler pipelines of its own passes when its full pipeline
// does not fit or is slower than the baseline, and only dc plans against the relaxed budget.
constexpr std::array<KnownFailure, 0> kKnownFailures{};

const KnownFailure* FindKnownFailure(int case_index, const std::string& policy) {
  for (const KnownFailure& known : kKnownFailures) {
    if (known.case_index == case_index && policy == known.policy) return &known;
  }
  return nullptr;
}

class PlanProperties : public ::testing::TestWithParam<int> {
 public:
  static void TearDownTestSuite() {
    std::string line = "plan properties over " + std::to_string(CasesRun()) + " cases (" +
                       std::to_string(ClippedCasesRun()) + " with --clip-grad-norm):";
    for (const auto& [policy, counts] : CountsByPolicy()) {
      line += " " + policy + " " + std::to_string(counts.planned) + " planned, " +
              std::to_string(counts.over_budget) + " refused (" + std::to_string(counts.known) +
              " known bugs);";
    }
    std::printf("%s\n", line.c_str());
  }
};

// Whether instruction `to` happens after `from` finishes: through deps, or issue order on one
// stream (every stream runs its instructions in order).
bool HappensAfter(const proto::Schedule& plan, const std::vector<int>& previous_on_stream, int from,
                  int to) {
  std::vector<char> seen(plan.instructions_size(), 0);
  std::vector<int> stack = {to};
  while (!stack.empty()) {
    const int i = stack.back();
    stack.pop_back();
    if (i == from) return i != to;
    if (seen[i]) continue;
    seen[i] = 1;
    const proto::Instruction& instr = plan.instructions(i);
    for (int d : instr.deps()) stack.push_back(d);
    if (previous_on_stream[i] >= 0) stack.push_back(previous_on_stream[i]);
  }
  return false;
}

// With clipping: one all-reduce of the grads' squared norm, after its compute, which follows
// every reduce-scatter; every optimizer step (on the device or the host) after the all-reduce.
void ExpectStepsWaitForTheNorm(const proto::Schedule& plan, const std::string& policy) {
  const proto::Program& program = plan.program();
  std::vector<int> reductions, norms, all_reduces, steps;
  std::vector<int> previous_on_stream(plan.instructions_size(), -1);
  std::map<int, int> last_on_stream;
  for (int i = 0; i < plan.instructions_size(); ++i) {
    const proto::Instruction& instr = plan.instructions(i);
    auto last = last_on_stream.find(instr.stream());
    if (last != last_on_stream.end()) previous_on_stream[i] = last->second;
    last_on_stream[instr.stream()] = i;
    if (instr.kind() == proto::INSTR_REDUCE_SCATTER) reductions.push_back(i);
    if (instr.kind() == proto::INSTR_ALL_REDUCE) all_reduces.push_back(i);
    if (instr.kind() != proto::INSTR_COMPUTE) continue;
    const proto::Op& op = program.ops(instr.op());
    if (IsShardReduction(program, op)) norms.push_back(i);
    if (IsOptimizerStep(program, op)) steps.push_back(i);
  }
  ASSERT_EQ(norms.size(), 1u) << policy;
  ASSERT_EQ(all_reduces.size(), 1u) << policy;
  EXPECT_EQ(plan.instructions(all_reduces[0]).stream(), proto::STREAM_REDUCE) << policy;
  EXPECT_TRUE(HappensAfter(plan, previous_on_stream, norms[0], all_reduces[0])) << policy;
  for (int r : reductions) {
    EXPECT_TRUE(HappensAfter(plan, previous_on_stream, r, norms[0]))
        << policy << ": reduce-scatter " << r;
  }
  EXPECT_FALSE(steps.empty()) << policy;
  for (int s : steps) {
    EXPECT_TRUE(HappensAfter(plan, previous_on_stream, all_reduces[0], s))
        << policy << ": optimizer step " << s;
  }
}

proto::Schedule WithoutTimes(proto::Schedule plan) {
  for (auto& record : *plan.mutable_passes()) record.clear_seconds();
  return plan;
}

TEST_P(PlanProperties, Holds) {
  const RandomCase c = MakeCase(GetParam());
  ++CasesRun();
  if (c.overrides.clip_grad_norm) ++ClippedCasesRun();
  auto config = MakeConfig("tiny", c.overrides);
  ASSERT_TRUE(config.ok()) << Describe(c, 0) << ": " << config.status().message();
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok()) << program.status().message();
  auto hw = FindHardware(c.hardware);
  ASSERT_TRUE(hw.ok()) << hw.status().message();
  const int gpus_per_node = c.hardware == "cpu" ? c.world : std::min(c.world, 8);
  auto cluster = MakeCluster(c.world, gpus_per_node);
  ASSERT_TRUE(cluster.ok()) << cluster.status().message();

  PlanRequest request;
  request.program = *program;
  request.world_size = c.world;
  request.backend = c.hardware == "cpu" ? "cpu" : "cuda";
  request.device = c.hardware;
  request.costs = EstimateCostModel(*program, *hw, *cluster);

  // The baseline without a budget: its peak bounds the budgets drawn.
  request.policy = "baseline";
  auto unlimited = MakePlan(request);
  ASSERT_TRUE(unlimited.ok()) << Describe(c, 0) << ": " << unlimited.status().message();
  const int64_t baseline_peak = unlimited->prediction().peak_device_bytes();
  const std::vector<int64_t> persistent = PersistentBytesByKind(*program, c.world);
  int64_t persistent_bytes = 0;
  for (int64_t bytes : persistent) persistent_bytes += bytes;
  const int64_t states_bytes = persistent[static_cast<int>(BufferKind::kOptimizerState)];
  int64_t largest_transient = 0;
  for (const auto& tensor : program->tensors()) {
    if (tensor.role() == proto::ROLE_OPTIMIZER_STATE) continue;
    largest_transient = std::max(largest_transient, TransientBytes(*program, tensor));
  }
  // No plan of any policy fits below the floor: the persistent shards other than the optimizer
  // state and one transient must be on the device at once.
  const int64_t floor_bytes = persistent_bytes - states_bytes + largest_transient;
  const int64_t top_bytes = std::max(
      floor_bytes, static_cast<int64_t>(static_cast<double>(baseline_peak) * kMaxBudgetOverPeak));
  int64_t budget = 0;
  if (!c.unlimited) {
    budget = floor_bytes + static_cast<int64_t>(c.budget_draw %
                                                static_cast<uint64_t>(top_bytes - floor_bytes + 1));
  }
  // The offloading policies must plan at any budget from here on: the baseline stream with every
  // optimizer-state fragment on the host during forward and backward and all of them back for
  // the optimizer step (which runs on the device with every persistent shard) peaks at no more.
  const int64_t offload_bound = std::max(persistent_bytes, baseline_peak - states_bytes);
  request.budget_bytes = budget;
  SCOPED_TRACE(Describe(c, budget) + " (baseline peak " + std::to_string(baseline_peak) +
               ", floor " + std::to_string(floor_bytes) + ", offload bound " +
               std::to_string(offload_bound) + ")");

  const KnownFailure* known_seen = nullptr;
  std::map<std::string, StatusOr<proto::Schedule>> plans;
  for (const std::string& policy : PolicyNames()) {
    request.policy = policy;
    auto plan = MakePlan(request);
    Counts& counts = CountsByPolicy()[policy];
    const KnownFailure* known = FindKnownFailure(GetParam(), policy);
    if (!plan.ok()) {
      ++counts.over_budget;
      const std::string message = plan.status().message();
      EXPECT_NE(message.find("budget"), std::string::npos) << policy << ": " << message;
      EXPECT_TRUE(plan.status().over_budget()) << policy << ": " << message;
      EXPECT_GT(budget, 0) << policy << ": " << message;
      // The baseline refuses exactly the budgets below its peak. DeepCompile's offload rule
      // looks at the forward only (rewriter/offload.h), so it may miss any budget the baseline
      // does not fit; ours and ZeRO-3's offload must meet every budget from the offload bound.
      const int64_t refusable_below =
          policy == "baseline" || policy == "deepcompile" ? baseline_peak : offload_bound;
      if (budget >= refusable_below && known) {
        known_seen = known;
        ++counts.known;
      } else {
        EXPECT_LT(budget, refusable_below) << policy << " refuses: " << message;
      }
      plans.emplace(policy, std::move(plan));
      continue;
    }
    ++counts.planned;
    // Every candidate the policy planned failed only for the budget, if at all.
    for (const std::string& note : plan->notes()) {
      EXPECT_EQ(note.find("dc defect"), std::string::npos) << policy << ": " << note;
    }
    // No plan beats the lower bound (machine/lower_bound.h).
    const StepBound bound = StepLowerBound(*program, c.world, request.costs);
    EXPECT_LE(bound.seconds, plan->prediction().step_seconds() * (1 + kStepSlack))
        << policy << ": the lower bound (" << bound.binding << ") is above the plan's step";
    const PassContext context{&request.costs, budget};
    const Status verified = VerifySchedule(*plan, context);
    EXPECT_TRUE(verified.ok()) << policy << ": " << verified.message();
    // The streams run concurrently: the plan's deps order every pair of effects on a buffer.
    const Status ordered = CheckHappensBefore(*plan);
    EXPECT_TRUE(ordered.ok()) << policy << ": " << ordered.message();
    auto sim = Simulate(*plan, request.costs);
    ASSERT_TRUE(sim.ok()) << policy << ": " << sim.status().message();
    EXPECT_EQ(sim->peak_device_bytes, plan->prediction().peak_device_bytes()) << policy;
    if (budget > 0) {
      EXPECT_LE(sim->peak_device_bytes, budget) << policy;
      if (plan->has_memory_plan()) {
        EXPECT_LE(plan->memory_plan().arena_bytes(), budget) << policy;
      }
    }

    if (c.overrides.clip_grad_norm) ExpectStepsWaitForTheNorm(*plan, policy);

    // A pass that never speeds the step up (Pass::NeverSpeedsUp: offload, the memory plan) does
    // not: the planner stops a candidate before them where the candidate's step cannot win there.
    for (int i = 1; i < plan->passes_size(); ++i) {
      if (!NeverSpeedsUp(plan->passes(i).name())) continue;
      EXPECT_GE(plan->passes(i).predicted_step_seconds(),
                plan->passes(i - 1).predicted_step_seconds())
          << policy << ": " << plan->passes(i).name() << " made the step faster";
    }

    // The same request planned again, its candidates made at once on three threads: the same
    // plan (the one-by-one planning stops candidates early that could not have been chosen).
    PlanRequest at_once = request;
    at_once.threads = 3;
    auto again = MakePlan(at_once);
    ASSERT_TRUE(again.ok()) << policy << ": " << again.status().message();
    EXPECT_EQ(WithoutTimes(*again).SerializeAsString(), WithoutTimes(*plan).SerializeAsString())
        << policy << ": the same request gave another plan on three threads";
    plans.emplace(policy, std::move(plan));
  }

  const auto& baseline = plans.at("baseline");
  const auto& dc = plans.at("dc");
  if (baseline.ok() && dc.ok()) {
    EXPECT_LE(dc->prediction().step_seconds(),
              baseline->prediction().step_seconds() * (1 + kStepSlack))
        << "dc is slower than the baseline";
  } else if (baseline.ok() && !(known_seen && std::string(known_seen->policy) == "dc")) {
    ADD_FAILURE() << "dc fails where the baseline plans: " << dc.status().message();
  }

  // dc keeps the fastest of its own plans and every rule's (rewriter/policy.h's rivals).
  for (const char* rule : {"zero3-offload", "deepcompile"}) {
    const auto& plan = plans.at(rule);
    if (!plan.ok()) continue;
    if (!dc.ok()) {
      ADD_FAILURE() << "dc fails where " << rule << " plans: " << dc.status().message();
      continue;
    }
    EXPECT_LE(dc->prediction().step_seconds(), plan->prediction().step_seconds() * (1 + kStepSlack))
        << "dc is slower than " << rule;
  }

  for (const KnownFailure& known : kKnownFailures) {
    if (known.case_index != GetParam()) continue;
    if (&known == known_seen) GTEST_SKIP() << "KNOWN: " << known.policy << ": " << known.why;
    ADD_FAILURE() << "the known failure of " << known.policy << " (" << known.why
                  << ") no longer happens: delete its kKnownFailures entry";
  }
}

INSTANTIATE_TEST_SUITE_P(Random, PlanProperties, ::testing::Range(0, CaseCount()));
// Cases a longer run found (DC_PROPERTY_CASES=300), kept in every run: 62, deepcompile refused a
// budget above the baseline's peak, its memory plan's arena 2% over the budget with the live
// peak under it (it now falls back to allocating as it runs); 287, zero3-offload the same, and dc
// then lost to that fallback's plan until its rivals were planned with their fallbacks.
INSTANTIATE_TEST_SUITE_P(Found, PlanProperties, ::testing::Values(62, 287));

}  // namespace
}  // namespace dc
