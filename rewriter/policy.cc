#include "rewriter/policy.h"

#include <utility>

#include "rewriter/bucket.h"
#include "rewriter/dc_offload.h"
#include "rewriter/dc_prefetch.h"
#include "rewriter/dc_selective_gather.h"
#include "rewriter/host_optimizer.h"
#include "rewriter/keep_activations.h"
#include "rewriter/memory_plan.h"
#include "rewriter/offload.h"
#include "rewriter/offload_all.h"
#include "rewriter/optimizer_order.h"
#include "rewriter/prefetch.h"
#include "rewriter/ramp.h"
#include "rewriter/unshard.h"
#include "rewriter/verifier.h"
#include "rewriter/zero3.h"
#include "schemas/units.h"

namespace dc {
namespace {

// host-optimizer-part: Adam on the host for the largest params, until the device's shards fit
// this share of the budget (the rest: activations, gathers, the arena's fragmentation).
constexpr double kPartialHostDeviceShareOfBudget = 0.9;

struct PassFactory {
  const char* name;
  std::unique_ptr<Pass> (*make)();
};

template <typename P>
std::unique_ptr<Pass> Make() {
  return std::make_unique<P>();
}

std::unique_ptr<Pass> MakePartialHostOptimizer() {
  return std::make_unique<HostOptimizerPass>(HostOptimizerOptions{kPartialHostDeviceShareOfBudget});
}

constexpr PassFactory kPasses[] = {
    {"zero3", Make<Zero3Pass>},
    {"bucket", Make<BucketPass>},
    {"prefetch", Make<PrefetchPass>},
    {"unshard", Make<UnshardPass>},
    {"ramp", Make<RampPass>},
    {"optimizer-order", Make<OptimizerOrderPass>},
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

// dc: bucket first, on the zero3 stream whose gathers run as early as the gather stream allows,
// so fusion is judged where communication is hidden as well as it can be; prefetch then bounds
// how far ahead each gather (or bucket) runs, which leaves the memory unshard fills; a last
// prefetch re-times the gathers that remain, as the removed ones free both the gather stream and
// memory; ramp then splits the step's first gather, which nothing can hide, where the step
// gains by it once the others are timed, and optimizer-order steps each param as soon as its
// grad is reduced. Its fallbacks are simpler pipelines of its own passes,
// then, where the device cannot hold the optimizer step's shards, Adam on the host: for the largest
// params only, until the device's shards fit (offload moves the other params' state as it must),
// else for all, as ZeRO-3 offload runs it; the memory that frees goes to communication.
Policy Dc() {
  Policy p;
  p.name = "dc";
  p.summary = "ours: planned against the memory timeline, with fallbacks";
  p.passes = {"zero3", "keep-activations", "bucket",  "prefetch",   "unshard", "prefetch",
              "ramp",  "optimizer-order",  "offload", "memory-plan"};
  p.relaxes_budget = true;
  p.explores_splits = true;
  p.fallbacks = {
      {{"zero3", "bucket", "prefetch", "unshard", "prefetch", "ramp", "optimizer-order", "offload",
        "memory-plan"}},
      {{"zero3", "bucket", "prefetch", "offload", "memory-plan"}},
      {{"zero3", "prefetch", "offload", "memory-plan"}},
      {{"zero3", "offload", "memory-plan"}},
      {{"zero3", "bucket", "prefetch", "unshard", "prefetch", "ramp", "optimizer-order",
        "offload"}},
      {{"zero3", "offload"}},
      {{"zero3"}},
      {{"zero3", "host-optimizer-part", "bucket", "prefetch", "unshard", "prefetch", "ramp",
        "optimizer-order", "offload", "memory-plan"},
       /*relaxed=*/false,
       /*optimizer_on_host=*/true},
      {{"zero3", "host-optimizer", "bucket", "prefetch", "unshard", "prefetch", "ramp",
        "optimizer-order", "memory-plan"},
       /*relaxed=*/false,
       /*optimizer_on_host=*/true},
      {{"zero3", "host-optimizer", "memory-plan"}, /*relaxed=*/false, /*optimizer_on_host=*/true},
  };
  // The rules dc must never lose to: its passes are greedy, and on a few shapes a rule's simpler
  // plan is faster (issue 14: 4 of 124 random cases lost to deepcompile, by up to 6.5%).
  p.rivals = {"baseline", "zero3-offload", "deepcompile"};
  return p;
}

// A policy that runs its pipeline and nothing else.
Policy Plain(std::string name, std::string summary, std::vector<std::string> passes) {
  Policy p;
  p.name = std::move(name);
  p.summary = std::move(summary);
  p.passes = std::move(passes);
  return p;
}

Policy OnHost(Policy p) {
  p.optimizer_on_host = true;
  return p;
}

// A rule's pipeline ends with dc's static memory plan; where its arena does not fit the budget
// (the buffers' alignment and lifetimes fragment it past a live peak that fits), the rule plans
// without it and the executor allocates as it runs, as the framework the rule stands for does.
Policy WithoutTheMemoryPlanToFallBackOn(Policy p) {
  FallbackPipeline fallback;
  for (const std::string& pass : p.passes) {
    if (pass != "memory-plan") fallback.passes.push_back(pass);
  }
  fallback.optimizer_on_host = p.optimizer_on_host;
  p.fallbacks.push_back(std::move(fallback));
  return p;
}

}  // namespace

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
      return Status::Error("unknown pass '" + name + "'; known passes: " + Join(PassNames(), ", "));
    }
    pipeline->Add(found->make());
  }
  return pipeline;
}

bool NeverSpeedsUp(const std::string& pass_name) {
  for (const PassFactory& factory : kPasses) {
    if (pass_name == factory.name) return factory.make()->NeverSpeedsUp();
  }
  return false;
}

const std::vector<Policy>& Policies() {
  static const auto* policies = new std::vector<Policy>{
      Plain("baseline", "ZeRO-3", {"zero3"}),
      WithoutTheMemoryPlanToFallBackOn(OnHost(Plain(
          "zero3-offload", "ZeRO-3 offload: masters and Adam's state on the host, Adam run there",
          {"zero3", "host-optimizer", "memory-plan"}))),
      WithoutTheMemoryPlanToFallBackOn(
          Plain("deepcompile", "the paper's rules",
                {"zero3", "dc-prefetch", "dc-selective-gather", "dc-offload", "memory-plan"})),
      Dc(),
  };
  return *policies;
}

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names;
  for (const Policy& policy : Policies()) names.push_back(policy.name);
  return names;
}

StatusOr<const Policy*> FindPolicy(const std::string& name) {
  for (const Policy& policy : Policies()) {
    if (policy.name == name) return &policy;
  }
  return Status::Error("unknown policy '" + name + "'; choose one of " + Join(PolicyNames(), ", "));
}

StatusOr<std::unique_ptr<Pipeline>> MakePipeline(const std::string& policy) {
  DC_ASSIGN_OR_RETURN(const Policy* found, FindPolicy(policy));
  return MakePipelineFromNames(found->passes);
}

}  // namespace dc
