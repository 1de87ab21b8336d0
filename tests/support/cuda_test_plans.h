// Plans of the tiny model for the tests of the cuda backend, made as dc-plan --synthetic
// --hardware h100-sxm makes them (the roofline cost model of an H100), so the plans that run on
// a GPU are the ones users get.
#pragma once

#include <string>
#include <vector>

#include "machine/estimate.h"
#include "machine/hardware.h"
#include "models/model.h"
#include "rewriter/planner.h"

namespace dc::testing {

struct TinyPlanOptions {
  std::string preset = "tiny";  // or mixtral-tiny
  std::string backend = "cuda";
  std::string policy = "baseline";
  std::vector<std::string> passes;  // non-empty: these instead of the policy's (--passes)
  int world_size = 1;
  proto::DType compute_dtype = proto::DTYPE_F32;  // the tiny preset's own
  int64_t gas = 2;
  bool recompute = false;    // --recompute: every layer's forward again in its backward
  int64_t budget_bytes = 0;  // 0 = unlimited
};

inline StatusOr<proto::Schedule> TinyPlan(const TinyPlanOptions& options) {
  ModelOverrides overrides;
  overrides.gas = options.gas;
  overrides.recompute_layers = options.recompute;
  DC_ASSIGN_OR_RETURN(proto::ModelConfig config, MakeConfig(options.preset, overrides));
  config.set_compute_dtype(options.compute_dtype);
  DC_ASSIGN_OR_RETURN(proto::Program program, BuildProgram(config));
  constexpr int kGpusPerNode = 8;
  DC_ASSIGN_OR_RETURN(HardwareProfile hw, FindHardware("h100-sxm"));
  DC_ASSIGN_OR_RETURN(ClusterShape cluster, MakeCluster(options.world_size, kGpusPerNode));
  PlanRequest request;
  request.costs = EstimateCostModel(program, hw, cluster);
  request.program = std::move(program);
  request.world_size = options.world_size;
  request.backend = options.backend;
  request.device = hw.name;
  request.policy = options.policy;
  request.passes = options.passes;
  request.budget_bytes = options.budget_bytes;
  return MakePlan(request);
}

}  // namespace dc::testing
