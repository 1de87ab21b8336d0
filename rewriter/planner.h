// Planning in one call: run what a policy (rewriter/policy.h) lists over a program, keep the
// best plan, simulate it and the zero3 baseline on the same cost model, and fill the plan's
// prediction, pass log and cache key.
#pragma once

#include <string>
#include <vector>

#include "machine/cost_model.h"
#include "rewriter/pass.h"
#include "rewriter/policy.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// A complete plan the planner weighed under the request's budget and did not keep: the policy's
// own where a rival's was faster, or a rival's that was not. `source` names it ("dc's own
// pipeline", "deepcompile's plan").
struct RunnerUp {
  std::string source;
  proto::Schedule plan;
};

struct PlanRequest {
  proto::Program program;
  int world_size = 1;
  std::string backend = "cpu";
  std::string device = "cpu";
  int64_t budget_bytes = 0;   // 0 = unlimited
  std::string policy = "dc";  // one of PolicyNames()
  // Non-empty: run these passes (PassNames()) in this order instead of the policy's (--passes).
  std::vector<std::string> passes;
  std::vector<std::string> disabled_passes;
  CostModel costs;
  std::string profile_digest;
  std::string dump_after;  // pass name; the dump goes to `dump`
  Pipeline::DumpFn dump;
  Pipeline::ProgressFn on_pass;  // after every pass of the plan (not of the baseline)
  // Threads the plan may use at once: candidate plans (a policy's splits, its fallbacks) made at
  // once, each stopping where it would have stopped planned after the ones before it (waiting
  // there for their step), and their packings made several at a time on the threads idle then
  // (rewriter/tasks.h's ThreadShare). The plan is the same for any number: only the planning
  // time changes.
  int threads = 1;
  // Optional: gets the runners-up, fastest predicted first (profile-guided rounds measure one
  // where the simulator's measured error is larger than the margin it was beaten by).
  std::vector<RunnerUp>* runners_up = nullptr;
};

// The cache key of the plan `request` would produce.
StatusOr<std::string> PlanKey(const PlanRequest& request);

StatusOr<proto::Schedule> MakePlan(const PlanRequest& request);

}  // namespace dc
