// plan_digests: one line per planning case, "case policy digest", where the digest is the SHA-256
// of the plan's canonical bytes with planning times (PassRecord::seconds) zeroed. Two builds that
// print the same lines make byte-identical plans (the refactoring guard of ARCHITECTURE.md):
//
//   build/bench/plan_digests > before.txt     (on the old build)
//   build/bench/plan_digests > after.txt      (on the new one)
//   diff before.txt after.txt
//
//   plan_digests --quick           the small models only (a few seconds)
//   plan_digests --threads N       plan on N threads (PlanRequest::threads): the same lines as on
//                                  one
//   plan_digests --schedule-only   the digest of what was planned, without the program: the
//                                  plan less its program, program digest, cache key (which
//                                  digests the program) and format version. For a change to the
//                                  program format that must not move a schedule: instructions,
//                                  memory plan, predictions, peaks and pass records equal.
//
// The cases cover every policy at an unlimited, a loose and a tight budget over dense and MoE
// models, f32 and bf16, with and without recompute, on the cpu and h100-sxm profiles.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "machine/estimate.h"
#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/planner.h"
#include "schemas/digest.h"

namespace {

struct Case {
  std::string preset;
  int world = 2;
  int gas = 1;
  int64_t seq = 0;  // 0: the preset's
  std::string hardware = "h100-sxm";
  std::string dtype;  // "": the preset's
  bool recompute = false;
  bool quick = true;  // also in --quick
};

std::vector<Case> Cases() {
  // preset, world, GAS, seq (0: the preset's), hardware, dtype ("": the preset's), recompute,
  // in --quick
  return {
      {"tiny", 2, 1, 0, "cpu", "", false, true},
      {"tiny", 2, 4, 0, "cpu", "", true, true},
      {"tiny", 4, 2, 0, "cpu", "bf16", false, true},
      {"mixtral-tiny", 2, 2, 0, "cpu", "", false, true},
      {"mixtral-tiny", 2, 2, 0, "cpu", "", true, true},
      {"small", 2, 4, 0, "cpu", "", false, true},
      {"llama-1b", 8, 1, 512, "h100-sxm", "bf16", false, true},
      {"llama-1b", 8, 4, 512, "h100-sxm", "bf16", true, true},
      {"llama3-8b", 8, 1, 1024, "h100-sxm", "", false, false},
      {"llama3-8b", 32, 4, 1024, "h100-sxm", "", false, false},
      {"llama3-70b", 32, 1, 1024, "h100-sxm", "", false, false},
      {"llama3-70b", 16, 1, 1024, "h100-sxm", "", false, false},
      {"llama3-70b", 32, 1, 2048, "h100-sxm", "", true, false},
      {"mixtral-8x7b", 32, 1, 1024, "h100-sxm", "", false, false},
  };
}

std::string Name(const Case& c) {
  std::string name = c.preset + "/w" + std::to_string(c.world) + "/gas" + std::to_string(c.gas);
  if (c.seq) name += "/seq" + std::to_string(c.seq);
  name += "/" + c.hardware;
  if (!c.dtype.empty()) name += "/" + c.dtype;
  if (c.recompute) name += "/recompute";
  return name;
}

int Fail(const std::string& what, const dc::Status& status) {
  std::fprintf(stderr, "plan_digests: %s: %s\n", what.c_str(), status.message().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, schedule_only = false;
  int threads = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--schedule-only") == 0) {
      schedule_only = true;
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc &&
               std::atoi(argv[i + 1]) >= 1 && std::atoi(argv[i + 1]) <= 64) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: plan_digests [--quick] [--schedule-only] [--threads 1-64]\n");
      return 2;
    }
  }
  for (const Case& c : Cases()) {
    if (quick && !c.quick) continue;
    const std::string name = Name(c);
    dc::ModelOverrides overrides;
    overrides.gas = c.gas;
    if (c.seq) overrides.seq = c.seq;
    if (!c.dtype.empty()) overrides.compute_dtype = c.dtype;
    overrides.recompute_layers = c.recompute;
    auto config = dc::MakeConfig(c.preset, overrides);
    if (!config.ok()) return Fail(name, config.status());
    auto program = dc::BuildProgram(*config);
    if (!program.ok()) return Fail(name, program.status());
    auto hw = dc::FindHardware(c.hardware);
    if (!hw.ok()) return Fail(name, hw.status());
    const int per_node = std::min(c.world, 8);
    auto cluster = dc::MakeCluster(c.world, per_node);
    if (!cluster.ok()) return Fail(name, cluster.status());
    const dc::CostModel costs = dc::EstimateCostModel(*program, *hw, *cluster);
    // The baseline's unbounded peak sets the loose (1.3x) and tight (0.8x) budgets.
    dc::PlanRequest base;
    base.program = *program;
    base.world_size = c.world;
    base.backend = c.hardware == "cpu" ? "cpu" : "cuda";
    base.device = c.hardware;
    base.costs = costs;
    base.policy = "baseline";
    auto baseline = dc::MakePlan(base);
    if (!baseline.ok()) return Fail(name, baseline.status());
    const int64_t peak = baseline->prediction().peak_device_bytes();
    const std::vector<std::pair<std::string, int64_t>> budgets = {
        {"unlimited", 0}, {"loose", peak * 13 / 10}, {"tight", peak * 8 / 10}};
    for (const std::string& policy : dc::PolicyNames()) {
      for (const auto& [budget_name, budget_bytes] : budgets) {
        dc::PlanRequest request = base;
        request.policy = policy;
        request.budget_bytes = budget_bytes;
        request.threads = threads;
        auto plan = dc::MakePlan(request);
        std::string digest;
        if (plan.ok()) {
          for (auto& record : *plan->mutable_passes()) record.set_seconds(0);
          if (schedule_only) {
            plan->clear_program();
            plan->clear_program_digest();
            plan->clear_cache_key();
            plan->clear_format_version();
          }
          digest = dc::DigestOf(*plan);
        } else {
          digest = "error: " + plan.status().message();
        }
        std::printf("%s %s %s %s\n", name.c_str(), policy.c_str(), budget_name.c_str(),
                    digest.c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
