// Policies as data: every pass by name, and each policy as its pipeline, the fallback pipelines
// it tries where that one fails or loses to the baseline, and how far it searches. MakePlan
// (rewriter/planner.h) runs what a policy lists and keeps the best plan; no other code knows a
// policy by name.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rewriter/pass.h"
#include "schemas/status.h"

namespace dc {

// Every pass a pipeline can be built from, by name, in the order `--passes` lists them.
std::vector<std::string> PassNames();
// A pipeline of the named passes in order, each with its default options (--passes
// zero3,prefetch,...). An unknown name is an error that lists the known ones.
StatusOr<std::unique_ptr<Pipeline>> MakePipelineFromNames(const std::vector<std::string>& names);
// Whether the named pass never speeds the step up (Pass::NeverSpeedsUp); false for an unknown
// name.
bool NeverSpeedsUp(const std::string& pass_name);

// The constants of dc's search, each with its reason.
struct SearchOptions {
  // Passes before offloading may spend 1 / relaxed_state_share_divisor of the optimizer-state
  // bytes that offloading can give back; offload then frees what must go.
  int64_t relaxed_state_share_divisor = 2;
  // The alternative split that lets those passes spend all of the state bytes is planned only
  // where the zero3 stream has at most this many instructions: GAS 16 of Llama-3 8B and 70B
  // (51k-127k), where a tight budget relaxed by half the state bytes is still under the
  // baseline's own peak and leaves prefetch and unsharding no room (llama3-70b on 32 H100s at
  // GAS 16 and 80% of the baseline's peak: 25.86 s, the baseline's step, with half; 18.61 s
  // with all), but not Llama-3 405B's 235k, which must plan in a few seconds.
  int64_t max_instructions_to_explore = 150000;
  // A relaxed split whose offload slowed its step is planned again with its relaxed budget
  // lowered by these shares of it, in turn, while offload still slows it (PlanSplits): the
  // passes before offload may have overspent by a few megabytes. Only where the zero3 stream has
  // at most max_instructions_to_retry instructions (at GAS 16 the retries took llama3-70b on 32
  // H100s, tight, from 18.61 to 18.09 s for twice the planning time).
  std::vector<double> retry_relaxed_budget_shares = {0.01, 0.03};
  int64_t max_instructions_to_retry = 50000;
  // A plan is faster or slower than the baseline when its step differs by more than this
  // relative margin (float noise of the simulator's sums, not a real difference).
  double slower_than_baseline_tolerance = 1e-9;
};

// A pipeline a policy falls back to: its passes, whether the passes before offload may spend
// the relaxed budget, and whether it runs the optimizer step on the host (then it can plan where
// the persistent shards alone exceed the budget, and only then is it the only kind tried).
struct FallbackPipeline {
  std::vector<std::string> passes;
  bool relaxed = false;
  bool optimizer_on_host = false;
};

struct Policy {
  std::string name;
  std::string summary;  // what it is, a few words for --help
  std::vector<std::string> passes;
  // The passes before offload plan against a budget relaxed by the optimizer-state bytes
  // offloading can give back (SearchOptions::relaxed_state_share_divisor).
  bool relaxes_budget = false;
  // Also plans the other splits of memory between the passes (with and without kept
  // activations; half or all of the offloadable state bytes before offload) and keeps the
  // fastest.
  bool explores_splits = false;
  // Tried, in order, where the pipeline fails at the budget or predicts a step no faster than the
  // baseline; the fastest plan wins (ties: the first). Where the persistent shards alone exceed
  // the budget, only those with the optimizer step on the host are tried.
  std::vector<FallbackPipeline> fallbacks;
  // Other policies (by name) whose plans this one also makes under the same budget: the fastest
  // of its own plan and theirs wins (ties: its own), so it is never slower than any of them and
  // never refuses a budget one of them meets. The plan keeps this policy's name and notes which
  // rival's plan it kept.
  std::vector<std::string> rivals;
  // Every optimizer step runs on the host (ZeRO-3 offload): its step is at least the host's
  // optimizer time, so a rival's plan already faster needs no planning of it.
  bool optimizer_on_host = false;
  SearchOptions search;
};

// Every policy, in the order --policy lists them: baseline, zero3-offload, deepcompile, dc.
const std::vector<Policy>& Policies();
std::vector<std::string> PolicyNames();
// The policy of this name; an error that lists the known ones.
StatusOr<const Policy*> FindPolicy(const std::string& name);
// The pipeline of `policy` (error for an unknown one).
StatusOr<std::unique_ptr<Pipeline>> MakePipeline(const std::string& policy);

}  // namespace dc
