// Planning in one call: build the pipeline for a policy, run it over a program, simulate the
// result and the zero3 baseline on the same cost model, and fill the plan's prediction, pass
// log and cache key. The one place that lists the optimization sequence.
#pragma once

#include <string>
#include <vector>

#include "analyzer/cost_model.h"
#include "rewriter/pass.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

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
};

// The policies: baseline (zero3), deepcompile (zero3, then DeepCompile's prefetch and selective
// unsharding rules) and dc (zero3, bucket, prefetch, unshard, prefetch).
std::vector<std::string> PolicyNames();
// Every pass a pipeline can be built from, by name.
std::vector<std::string> PassNames();

// The pipeline of `policy` (error for an unknown one).
StatusOr<std::unique_ptr<Pipeline>> MakePipeline(const std::string& policy);
// A pipeline of the named passes in order, each with its default options (--passes
// zero3,prefetch,...). An unknown name is an error that lists the known ones.
StatusOr<std::unique_ptr<Pipeline>> MakePipelineFromNames(const std::vector<std::string>& names);

// The cache key of the plan `request` would produce.
StatusOr<std::string> PlanKey(const PlanRequest& request);

StatusOr<proto::Schedule> MakePlan(const PlanRequest& request);

}  // namespace dc
