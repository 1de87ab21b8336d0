#include "rewriter/planner.h"

#include <algorithm>
#include <optional>

#include "analyzer/simulator.h"
#include "models/op_kinds.h"
#include "rewriter/bucket.h"
#include "rewriter/deepcompile.h"
#include "rewriter/host_optimizer.h"
#include "rewriter/keep_activations.h"
#include "rewriter/memory_plan.h"
#include "rewriter/offload.h"
#include "rewriter/plan_cache.h"
#include "rewriter/prefetch.h"
#include "rewriter/unshard.h"
#include "rewriter/verifier.h"
#include "rewriter/zero3.h"
#include "schemas/digest.h"

namespace dc {

namespace {

// Every pass by name, with its default options.
struct PassFactory {
  const char* name;
  std::unique_ptr<Pass> (*make)();
};

template <typename P>
std::unique_ptr<Pass> Make() {
  return std::make_unique<P>();
}

// Adam on the host for the largest params, until the device's shards fit nine tenths of the
// budget (the rest: activations, gathers, the arena's fragmentation).
std::unique_ptr<Pass> MakePartialHostOptimizer() {
  return std::make_unique<HostOptimizerPass>(HostOptimizerOptions{0.9});
}

constexpr PassFactory kPasses[] = {
    {"zero3", Make<Zero3Pass>},
    {"bucket", Make<BucketPass>},
    {"prefetch", Make<PrefetchPass>},
    {"unshard", Make<UnshardPass>},
    {"dc-prefetch", Make<DcPrefetchPass>},
    {"dc-selective-gather", Make<DcSelectiveGatherPass>},
    {"offload", Make<OffloadPass>},
    {"offload-all", Make<ZeroOffloadPass>},
    {"dc-offload", Make<DcOffloadPass>},
    {"host-optimizer", Make<HostOptimizerPass>},
    {"host-optimizer-part", MakePartialHostOptimizer},
    {"keep-activations", Make<KeepActivationsPass>},
    {"memory-plan", Make<MemoryPlanPass>},
};

// The optimization sequence of each policy. dc: bucket first, on the zero3 stream whose
// gathers run as early as the gather stream allows, so fusion is judged where communication
// is hidden as well as it can be; prefetch then bounds how far ahead each gather (or bucket)
// runs, which leaves the memory unshard fills; a last prefetch re-times the gathers that
// remain, as the removed ones free both the gather stream and memory.
struct Policy {
  const char* name;
  std::vector<std::string> passes;
};

const std::vector<Policy>& Policies() {
  static const std::vector<Policy> policies = {
      {"baseline", {"zero3"}},
      {"zero3-offload", {"zero3", "host-optimizer", "memory-plan"}},
      {"deepcompile", {"zero3", "dc-prefetch", "dc-selective-gather", "dc-offload", "memory-plan"}},
      {"dc",
       {"zero3", "keep-activations", "bucket", "prefetch", "unshard", "prefetch", "offload",
        "memory-plan"}},
  };
  return policies;
}

std::string JoinNames(const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < names.size(); ++i) text += (i ? ", " : "") + names[i];
  return text;
}

}  // namespace

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names;
  for (const Policy& policy : Policies()) names.push_back(policy.name);
  return names;
}

std::vector<std::string> PassNames() {
  std::vector<std::string> names;
  for (const PassFactory& factory : kPasses) names.push_back(factory.name);
  return names;
}

StatusOr<std::unique_ptr<Pipeline>> MakePipelineFromNames(const std::vector<std::string>& names) {
  auto pipeline = std::make_unique<Pipeline>(VerifySchedule);
  for (const std::string& name : names) {
    const PassFactory* found = nullptr;
    for (const PassFactory& factory : kPasses) {
      if (name == factory.name) found = &factory;
    }
    if (!found) {
      return Status::Error("unknown pass '" + name + "'; known passes: " + JoinNames(PassNames()));
    }
    pipeline->Add(found->make());
  }
  return pipeline;
}

StatusOr<std::unique_ptr<Pipeline>> MakePipeline(const std::string& policy) {
  for (const Policy& p : Policies()) {
    if (policy == p.name) return MakePipelineFromNames(p.passes);
  }
  return Status::Error("unknown policy '" + policy + "'; choose one of " +
                       JoinNames(PolicyNames()));
}

namespace {

StatusOr<std::unique_ptr<Pipeline>> PipelineFor(const PlanRequest& request) {
  DC_ASSIGN_OR_RETURN(auto pipeline, request.passes.empty()
                                         ? MakePipeline(request.policy)
                                         : MakePipelineFromNames(request.passes));
  for (const auto& name : request.disabled_passes) {
    DC_RETURN_IF_ERROR(pipeline->Disable(name).Prefixed("--disable: "));
  }
  if (!request.dump_after.empty()) {
    DC_RETURN_IF_ERROR(
        pipeline->DumpAfter(request.dump_after, request.dump).Prefixed("--dump-after: "));
  }
  if (request.on_pass) pipeline->OnPass(request.on_pass);
  return pipeline;
}

// The digest of `program` as a plan carries it: at this dc's program format version.
std::string ProgramDigest(const proto::Program& program) {
  if (program.format_version() == kProgramFormatVersion) return DigestOf(program);
  proto::Program versioned = program;
  versioned.set_format_version(kProgramFormatVersion);
  return DigestOf(versioned);
}

// `program_digest`: ProgramDigest(request.program), computed once per plan.
proto::Schedule EmptySchedule(const PlanRequest& request, const std::string& program_digest) {
  proto::Schedule schedule;
  schedule.set_world_size(request.world_size);
  schedule.set_budget_bytes(request.budget_bytes);
  schedule.set_backend(request.backend);
  schedule.set_device(request.device);
  schedule.set_policy(request.policy);
  *schedule.mutable_program() = request.program;
  schedule.mutable_program()->set_format_version(kProgramFormatVersion);
  schedule.set_program_digest(program_digest);
  schedule.set_profile_digest(request.profile_digest);
  return schedule;
}

StatusOr<std::string> KeyOf(const PlanRequest& request, const std::string& program_digest) {
  DC_ASSIGN_OR_RETURN(auto pipeline, PipelineFor(request));
  PlanKeyInputs inputs;
  inputs.program_digest = program_digest;
  inputs.world_size = request.world_size;
  inputs.backend = request.backend;
  inputs.device = request.device;
  inputs.budget_bytes = request.budget_bytes;
  inputs.policy = request.policy;
  inputs.pass_options = pipeline->OptionsText();
  inputs.profile_digest = request.profile_digest;
  return PlanCacheKey(inputs);
}

}  // namespace

StatusOr<std::string> PlanKey(const PlanRequest& request) {
  return KeyOf(request, ProgramDigest(request.program));
}

namespace {

// Runs `pipeline` over a fresh schedule and fills its prediction.
StatusOr<proto::Schedule> RunPipeline(const PlanRequest& request, const std::string& program_digest,
                                      const Pipeline& pipeline, const PassContext& context) {
  proto::Schedule schedule = EmptySchedule(request, program_digest);
  // The verifier's simulation of the final schedule is the prediction's (it has the same costs;
  // the prediction needs no memory timeline).
  std::optional<SimResult> sim;
  DC_RETURN_IF_ERROR(pipeline.Run(&schedule, context, &sim));
  if (!sim || context.costs != &request.costs) {
    DC_ASSIGN_OR_RETURN(sim, Simulate(schedule, request.costs));
  }
  *schedule.mutable_prediction() = ToPrediction(*sim);
  return schedule;
}

// Simpler pipelines of dc's own passes, tried when the full one fails at the budget (the
// passes spent memory the arena then lacks) or predicts a slower step than the baseline. Each
// entry: passes, and whether the passes before offload may spend the relaxed budget.
struct Fallback {
  std::vector<std::string> passes;
  bool relaxed;
};
const std::vector<Fallback>& DcFallbacks() {
  static const auto* fallbacks = new std::vector<Fallback>{
      {{"zero3", "bucket", "prefetch", "unshard", "prefetch", "offload", "memory-plan"}, false},
      {{"zero3", "bucket", "prefetch", "offload", "memory-plan"}, false},
      {{"zero3", "prefetch", "offload", "memory-plan"}, false},
      {{"zero3", "offload", "memory-plan"}, false},
      {{"zero3", "bucket", "prefetch", "unshard", "prefetch", "offload"}, false},
      {{"zero3", "offload"}, false},
      {{"zero3"}, false},
      // Where the device cannot hold the optimizer step's shards, Adam on the host: for the
      // largest params only, until the device's shards fit (offload moves the other params'
      // state as it must), else for all, as ZeRO-3 offload runs it. The memory that frees goes
      // to communication.
      {{"zero3", "host-optimizer-part", "bucket", "prefetch", "unshard", "prefetch", "offload",
        "memory-plan"},
       false},
      {{"zero3", "host-optimizer", "bucket", "prefetch", "unshard", "prefetch", "memory-plan"},
       false},
      {{"zero3", "host-optimizer", "memory-plan"}, false},
  };
  return *fallbacks;
}

std::string Join(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& n : names) text += (text.empty() ? "" : ",") + n;
  return text;
}

}  // namespace

StatusOr<proto::Schedule> MakePlan(const PlanRequest& request) {
  if (request.world_size < 1) return Status::Error("world size must be at least 1");
  DC_ASSIGN_OR_RETURN(auto pipeline, PipelineFor(request));
  const std::string program_digest = ProgramDigest(request.program);
  DC_ASSIGN_OR_RETURN(std::string key, KeyOf(request, program_digest));
  PackingMemo packings;
  PassContext context{&request.costs, request.budget_bytes};
  context.packings = &packings;
  // dc's passes before offloading may spend up to half the optimizer-state bytes that
  // offloading can give back; offload then frees what must go. Other policies plan against the
  // budget as it is (DeepCompile's rules have no such give-back).
  constexpr int64_t kRelaxedShareOfStates = 2;
  const bool dc_policy = request.passes.empty() && request.policy == "dc";
  const bool offloads =
      dc_policy || std::count(request.passes.begin(), request.passes.end(), "offload") > 0;
  if (request.budget_bytes > 0 && offloads) {
    const int64_t states = PersistentBytesByKind(
        request.program, request.world_size)[static_cast<int>(BufferKind::kOptimizerState)];
    context.relaxed_budget_bytes = request.budget_bytes + states / kRelaxedShareOfStates;
  }

  // The baseline on the same simulator, for comparison: the zero3 schedule. zero3 depends on the
  // program and world size alone, so where the pipeline starts with it, the verifier's
  // simulation after it is the baseline's; otherwise the baseline is planned on its own.
  std::optional<SimResult> baseline_sim;
  pipeline->OnVerified(
      [&baseline_sim, first = true](const proto::PassRecord& record, const SimResult& sim) mutable {
        if (first && record.name() == "zero3") baseline_sim = sim;
        first = false;
      });
  StatusOr<proto::Schedule> planned = RunPipeline(request, program_digest, *pipeline, context);
  if (!baseline_sim) {
    proto::Schedule baseline = EmptySchedule(request, program_digest);
    Zero3Pass zero3;
    DC_RETURN_IF_ERROR(zero3.Run(&baseline, context).status());
    DC_ASSIGN_OR_RETURN(baseline_sim, Simulate(baseline, request.costs));
  }
  // dc's passes are greedy and decide in order: what an earlier one spends is not offered to a
  // later one. Where another split may do better, dc plans that way too and keeps the fastest
  // plan (ties: the first):
  // - kept activations take memory before prefetch and unsharding: on a compute-bound step that
  //   pays most, on a communication-bound one the memory may buy more as communication. Planned
  //   without keep-activations too where the program recomputes.
  // - before offload, passes may spend half the bytes of Adam's m and v that offload can give
  //   back, or all of them: more unsharding and kept activations against more reloads. Planned
  //   with all of them too where the zero3 stream has at most kMaxInstructionsToExplore
  //   instructions, so planning stays under a second (Mixtral 8x7B at GAS 16: 105k, planned
  //   once).
  if (dc_policy) {
    constexpr size_t kMaxInstructionsToExplore = 50000;
    const bool recomputes = std::any_of(
        request.program.ops().begin(), request.program.ops().end(),
        [](const proto::Op& op) { return op.name().ends_with(op_kind::kRecomputeSuffix); });
    const bool keeps =
        recomputes && std::count(request.disabled_passes.begin(), request.disabled_passes.end(),
                                 "keep-activations") == 0;
    struct Alternative {
      bool keep_activations;
      int64_t relaxed_budget_bytes;
    };
    std::vector<Alternative> alternatives;
    if (keeps) alternatives.push_back({false, context.relaxed_budget_bytes});
    if (context.relaxed_budget_bytes > 0 &&
        baseline_sim->start_seconds.size() <= kMaxInstructionsToExplore) {
      const int64_t states = PersistentBytesByKind(
          request.program, request.world_size)[static_cast<int>(BufferKind::kOptimizerState)];
      alternatives.push_back({true, request.budget_bytes + states});
      if (keeps) alternatives.push_back({false, request.budget_bytes + states});
    }
    for (const Alternative& alternative : alternatives) {
      DC_ASSIGN_OR_RETURN(auto other_pipeline, PipelineFor(request));
      if (!alternative.keep_activations) {
        DC_RETURN_IF_ERROR(other_pipeline->Disable("keep-activations"));
      }
      PassContext other_context = context;
      other_context.relaxed_budget_bytes = alternative.relaxed_budget_bytes;
      StatusOr<proto::Schedule> other =
          RunPipeline(request, program_digest, *other_pipeline, other_context);
      if (other.ok() && (!planned.ok() || other->prediction().step_seconds() <
                                              planned->prediction().step_seconds())) {
        planned = std::move(other);
      }
    }
  }
  constexpr double kSlowerTolerance = 1e-9;
  auto slower_than_baseline = [&](const proto::Schedule& s) {
    return s.prediction().step_seconds() > baseline_sim->step_seconds * (1 + kSlowerTolerance);
  };
  if (dc_policy && (!planned.ok() || slower_than_baseline(*planned))) {
    // dc never settles for less than a simpler pipeline of its own passes achieves.
    std::optional<proto::Schedule> best;
    std::string chosen;
    if (planned.ok()) best = *planned;
    // Where the persistent shards alone exceed the budget, no optimizer step on the device fits:
    // only the fallbacks that run it on the host can plan.
    int64_t persistent = 0;
    for (int64_t b : PersistentBytesByKind(request.program, request.world_size)) persistent += b;
    const bool device_step_cannot_fit =
        request.budget_bytes > 0 && persistent > request.budget_bytes;
    for (const Fallback& fallback : DcFallbacks()) {
      const bool on_host = std::any_of(fallback.passes.begin(), fallback.passes.end(),
                                       [](const std::string& p) { return p.starts_with("host-"); });
      if (device_step_cannot_fit && !on_host) continue;
      DC_ASSIGN_OR_RETURN(auto simpler, MakePipelineFromNames(fallback.passes));
      for (const auto& name : request.disabled_passes) {
        if (simpler->Has(name)) DC_RETURN_IF_ERROR(simpler->Disable(name));
      }
      PassContext fallback_context = context;
      if (!fallback.relaxed) fallback_context.relaxed_budget_bytes = 0;
      StatusOr<proto::Schedule> candidate =
          RunPipeline(request, program_digest, *simpler, fallback_context);
      if (!candidate.ok()) continue;
      if (!best || candidate->prediction().step_seconds() < best->prediction().step_seconds()) {
        best = *candidate;
        chosen = Join(fallback.passes);
      }
    }
    if (best) {
      if (!chosen.empty()) {
        best->add_notes(std::string("dc's full pipeline ") +
                        (planned.ok()
                             ? "predicted a slower step than the baseline"
                             : "did not fit the budget (" + planned.status().message() + ")") +
                        "; planned with " + chosen);
      }
      planned = std::move(*best);
    }
  }
  if (!planned.ok()) return planned.status();
  proto::Schedule schedule = std::move(planned).value();
  *schedule.mutable_baseline() = ToPrediction(*baseline_sim);
  schedule.set_cache_key(key);
  return schedule;
}

}  // namespace dc
