#include "rewriter/planner.h"

#include "analyzer/simulator.h"
#include "rewriter/plan_cache.h"
#include "rewriter/verifier.h"
#include "rewriter/zero3.h"
#include "schemas/digest.h"

namespace dc {

std::vector<std::string> PolicyNames() { return {"baseline", "dc"}; }

StatusOr<std::unique_ptr<Pipeline>> MakePipeline(const std::string& policy) {
  auto pipeline = std::make_unique<Pipeline>(VerifySchedule);
  if (policy == "baseline") {
    pipeline->Add(std::make_unique<Zero3Pass>());
  } else if (policy == "dc") {
    pipeline->Add(std::make_unique<Zero3Pass>());
  } else {
    return Status::Error("unknown policy '" + policy + "'; choose baseline or dc");
  }
  return pipeline;
}

namespace {

StatusOr<std::unique_ptr<Pipeline>> PipelineFor(const PlanRequest& request) {
  DC_ASSIGN_OR_RETURN(auto pipeline, MakePipeline(request.policy));
  for (const auto& name : request.disabled_passes) pipeline->Disable(name);
  if (!request.dump_after.empty()) pipeline->DumpAfter(request.dump_after, request.dump);
  return pipeline;
}

proto::Schedule EmptySchedule(const PlanRequest& request) {
  proto::Schedule schedule;
  schedule.set_world_size(request.world_size);
  schedule.set_budget_bytes(request.budget_bytes);
  schedule.set_backend(request.backend);
  schedule.set_device(request.device);
  schedule.set_policy(request.policy);
  *schedule.mutable_program() = request.program;
  schedule.mutable_program()->set_format_version(kProgramFormatVersion);
  schedule.set_program_digest(DigestOf(schedule.program()));
  schedule.set_profile_digest(request.profile_digest);
  return schedule;
}

}  // namespace

StatusOr<std::string> PlanKey(const PlanRequest& request) {
  DC_ASSIGN_OR_RETURN(auto pipeline, PipelineFor(request));
  proto::Program program = request.program;
  program.set_format_version(kProgramFormatVersion);
  PlanKeyInputs inputs;
  inputs.program_digest = DigestOf(program);
  inputs.world_size = request.world_size;
  inputs.backend = request.backend;
  inputs.device = request.device;
  inputs.budget_bytes = request.budget_bytes;
  inputs.policy = request.policy;
  inputs.pass_options = pipeline->OptionsText();
  inputs.profile_digest = request.profile_digest;
  return PlanCacheKey(inputs);
}

StatusOr<proto::Schedule> MakePlan(const PlanRequest& request) {
  if (request.world_size < 1) return Status::Error("world size must be at least 1");
  DC_ASSIGN_OR_RETURN(auto pipeline, PipelineFor(request));
  DC_ASSIGN_OR_RETURN(std::string key, PlanKey(request));
  const PassContext context{&request.costs, request.budget_bytes};

  // The baseline on the same simulator, for comparison; it alone must fit the budget for the
  // budget error to name what the baseline needs.
  proto::Schedule baseline = EmptySchedule(request);
  Zero3Pass zero3;
  DC_RETURN_IF_ERROR(zero3.Run(&baseline, context).status());
  DC_ASSIGN_OR_RETURN(SimResult baseline_sim, Simulate(baseline, request.costs));

  proto::Schedule schedule = EmptySchedule(request);
  DC_RETURN_IF_ERROR(pipeline->Run(&schedule, context));
  DC_ASSIGN_OR_RETURN(SimResult sim, Simulate(schedule, request.costs));
  *schedule.mutable_prediction() = ToPrediction(sim);
  *schedule.mutable_baseline() = ToPrediction(baseline_sim);
  schedule.set_cache_key(key);
  return schedule;
}

}  // namespace dc
