// plan_bench: how long planning takes, pass by pass, and what the baseline, deepcompile and dc
// policies predict (step time, peak device bytes) for Llama 3 models on simulated H100
// clusters (analyzer/estimate.h costs). Sequence 1024, micro-batch 1, an 80 GB budget.
//
//   plan_bench                      the standard cases
//   plan_bench PRESET GAS NODES GPUS_PER_NODE [BUDGET_GB [PASSES]]
//                                   one case; PASSES a comma-separated pass list (then only it)
//
// Pass times are wall-clock seconds of Pass::Run as the pipeline records them (the verifier's
// simulation after each pass is not included); "plan" is the whole pipeline with verifiers.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "analyzer/estimate.h"
#include "analyzer/simulator.h"
#include "models/model.h"
#include "rewriter/planner.h"

namespace {

using dc::StatusOr;

struct Case {
  std::string preset;
  int gas = 1;
  dc::ClusterShape cluster;
  int64_t budget_bytes = 0;
};

struct Outcome {
  double plan_seconds = 0;
  double step_seconds = 0;
  int64_t peak_bytes = 0;
  int instructions = 0;
  std::string passes;  // "name seconds" per pass
};

constexpr int64_t kSeq = 1024;
constexpr double kGB = 1e9;

StatusOr<Outcome> Run(const Case& c, const dc::proto::Program& program, const dc::CostModel& costs,
                      std::unique_ptr<dc::Pipeline> pipeline) {
  dc::proto::Schedule schedule;
  schedule.set_world_size(c.cluster.world_size());
  schedule.set_budget_bytes(c.budget_bytes);
  *schedule.mutable_program() = program;
  const dc::PassContext context{&costs, c.budget_bytes};
  const auto start = std::chrono::steady_clock::now();
  DC_RETURN_IF_ERROR(pipeline->Run(&schedule, context));
  Outcome outcome;
  outcome.plan_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  dc::SimOptions options;
  options.memory_timeline = false;
  DC_ASSIGN_OR_RETURN(dc::SimResult sim, dc::Simulate(schedule, costs, options));
  outcome.step_seconds = sim.step_seconds;
  outcome.peak_bytes = sim.peak_device_bytes;
  outcome.instructions = schedule.instructions_size();
  char text[96];
  for (const auto& record : schedule.passes()) {
    std::snprintf(text, sizeof(text), " %s %.3f", record.name().c_str(), record.seconds());
    outcome.passes += text;
  }
  return outcome;
}

StatusOr<dc::proto::Program> ProgramOf(const Case& c) {
  dc::ModelOverrides overrides;
  overrides.gas = c.gas;
  overrides.seq = kSeq;
  overrides.micro_batch = 1;
  DC_ASSIGN_OR_RETURN(dc::proto::ModelConfig config, dc::MakeConfig(c.preset, overrides));
  return dc::BuildProgram(config);
}

std::vector<std::string> Split(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) parts.push_back(part);
  return parts;
}

int Fail(const dc::Status& status) {
  std::fprintf(stderr, "plan_bench: %s\n", status.message().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t budget = static_cast<int64_t>((argc > 5 ? std::atof(argv[5]) : 80) * kGB);
  std::vector<Case> cases;
  if (argc > 4) {
    cases.push_back(
        {argv[1], std::atoi(argv[2]), {std::atoi(argv[3]), std::atoi(argv[4])}, budget});
  } else {
    cases = {{"llama3-70b", 1, {4, 8}, budget},
             {"llama3-70b", 16, {4, 8}, budget},
             {"llama3-8b", 1, {1, 8}, budget}};
  }
  auto hw = dc::FindHardware("h100-sxm");
  if (!hw.ok()) return Fail(hw.status());

  for (const Case& c : cases) {
    auto program = ProgramOf(c);
    if (!program.ok()) return Fail(program.status());
    const dc::CostModel costs = dc::EstimateCostModel(*program, *hw, c.cluster);
    std::printf("%s, %d x %d H100, GAS %d, seq %lld, micro-batch 1, budget %.0f GB\n",
                c.preset.c_str(), c.cluster.nodes, c.cluster.gpus_per_node, c.gas,
                static_cast<long long>(kSeq), static_cast<double>(c.budget_bytes) / kGB);
    std::vector<std::pair<std::string, StatusOr<std::unique_ptr<dc::Pipeline>>>> pipelines;
    if (argc > 6) {
      pipelines.emplace_back(argv[6], dc::MakePipelineFromNames(Split(argv[6])));
    } else {
      for (const std::string& policy : dc::PolicyNames()) {
        pipelines.emplace_back(policy, dc::MakePipeline(policy));
      }
    }
    double baseline_seconds = 0;
    for (auto& [name, pipeline] : pipelines) {
      if (!pipeline.ok()) return Fail(pipeline.status());
      auto outcome = Run(c, *program, costs, std::move(*pipeline));
      if (!outcome.ok()) return Fail(outcome.status().Prefixed(name + ": "));
      if (baseline_seconds == 0) baseline_seconds = outcome->step_seconds;
      std::printf(
          "  %-12s step %8.4f s (x%.3f)  peak %6.2f GB  instructions %6d  plan %.3f s  "
          "[%s ]\n",
          name.c_str(), outcome->step_seconds, baseline_seconds / outcome->step_seconds,
          static_cast<double>(outcome->peak_bytes) / kGB, outcome->instructions,
          outcome->plan_seconds, outcome->passes.c_str());
    }
  }
  return 0;
}
