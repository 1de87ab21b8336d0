// paper_bench: DeepCompile's own evaluation, reproduced at paper scale on the simulator. For each
// configuration the paper measured (Llama-3 70B and Mixtral 8x7B on 32 H100s, 4 nodes of 8;
// Llama-3 70B on 16 H100s with the optimizer states offloaded), the predicted step time, tokens/s
// and MFU, and the peak device memory per GPU of `baseline` (ZeRO-3), `deepcompile` (the paper's
// rules inside our pipeline) and `dc`, the speed-ups over the baseline beside the paper's, and
// the time each plan took. Costs are the roofline and NCCL-ring estimates of machine/estimate.h
// on the h100-sxm profile (constants and sources: bench/CALIBRATION.md, machine/HARDWARE.md).
//
//   paper_bench           the table (markdown on stdout; progress on stderr), then how dc's
//                         speed-up moves when the least certain constants of the profile move
//                         (matmul efficiency, overlap slowdown, network and host-link bandwidth)
//
// Planning seconds are wall-clock seconds of MakePlan: the median of three for dc, one run for
// the others. Planning is single-threaded: run pinned to one core (taskset -c 0).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "machine/estimate.h"
#include "machine/hardware.h"
#include "machine/lower_bound.h"
#include "models/model.h"
#include "rewriter/planner.h"
#include "tools/allocator.h"

namespace {

using dc::StatusOr;

constexpr int kGpusPerNode = 8;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kTimingRepeats = 3;

struct Config {
  std::string label;   // as the paper names the setting
  std::string preset;  // llama3-70b or mixtral-8x7b
  int64_t seq = 1024, micro_batch = 1;
  int gas = 1;
  int ranks = 32;
  // The policy ZeRO-3 is compared as: "baseline", or "zero3-offload" where the states must
  // leave the GPU (ZeRO-3 offload keeps all of them on the host and runs Adam there).
  std::string baseline = "baseline";
  double paper_speedup = 0;  // DeepCompile over ZeRO-3 in the paper (0: not published per row)
  // Activation checkpointing per decoder layer, for every policy alike (what a user turns on
  // when the activations alone are over the GPU).
  bool recompute = false;
};

struct PolicyRun {
  bool ok = false;
  std::string error;
  double step_seconds = 0, plan_seconds = 0;
  int64_t peak_bytes = 0;
  std::string
      kept;  // the rule whose plan dc kept (its note "kept deepcompile's plan: ..."), if any
};

struct Row {
  Config config;
  // What the speed-ups divide: the config's baseline, or ZeRO-3 with every optimizer state
  // offloaded where plain ZeRO-3 does not fit (what a ZeRO-3 user would turn on).
  std::string base_policy;
  double flops_per_rank_step = 0;  // forward and backward of every micro-step, one rank
  int64_t tokens_per_rank_step = 0;
  double bound_seconds = 0;  // no schedule's step is shorter (machine/lower_bound.h)
  std::map<std::string, PolicyRun> runs;
};

int Fail(const dc::Status& status) {
  std::fprintf(stderr, "paper_bench: %s\n", status.message().c_str());
  return 1;
}

// The paper's settings (DeepCompile, arXiv 2504.09983, §5, and the DeepSpeed blog post): 32
// H100s as 4 x 8, sequence 1024 micro-batch 1 and sequence 2048 with the largest micro-batch that
// fits, GAS 1 and 16; Llama-3 70B on 16 H100s with optimizer-state offloading. The paper quotes
// up to 1.28x (Llama) and 1.54x (Mixtral) over ZeRO-3 at the best setting and up to 7.01x with
// offloading; those maxima stand beside every row of their model.
std::vector<Config> PaperConfigs() {
  return {
      {"Llama-3 70B, seq 1024, mb 1, GAS 1", "llama3-70b", 1024, 1, 1, 32, "baseline", 1.28},
      {"Llama-3 70B, seq 2048, mb 2, GAS 1, layers recomputed", "llama3-70b", 2048, 2, 1, 32,
       "baseline", 1.28, true},
      {"Mixtral 8x7B, seq 1024, mb 1, GAS 1", "mixtral-8x7b", 1024, 1, 1, 32, "baseline", 1.54},
      {"Mixtral 8x7B, seq 2048, mb 4, GAS 1", "mixtral-8x7b", 2048, 4, 1, 32, "baseline", 1.54},
      {"Mixtral 8x7B, seq 1024, mb 1, GAS 16", "mixtral-8x7b", 1024, 1, 16, 32, "baseline", 1.54},
      {"Llama-3 70B on 16 GPUs, offloaded states, seq 1024, mb 1, GAS 1", "llama3-70b", 1024, 1, 1,
       16, "zero3-offload", 7.01},
  };
}

PolicyRun Plan(const dc::proto::Program& program, const dc::CostModel& costs, int world,
               const std::string& policy, int64_t budget_bytes) {
  dc::PlanRequest request;
  request.program = program;
  request.world_size = world;
  request.backend = "cuda";
  request.device = "h100-sxm";
  request.budget_bytes = budget_bytes;
  request.policy = policy;
  request.costs = costs;
  const auto start = std::chrono::steady_clock::now();
  StatusOr<dc::proto::Schedule> plan = dc::MakePlan(request);
  PolicyRun run;
  run.plan_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!plan.ok()) {
    run.error = plan.status().message();
    return run;
  }
  run.ok = true;
  run.step_seconds = plan->prediction().step_seconds();
  run.peak_bytes = plan->prediction().peak_device_bytes();
  run.kept = plan->kept_rival();
  return run;
}

// `policies` empty: the row's baseline(s), deepcompile and dc, dc's planning time the median of
// kTimingRepeats.
StatusOr<Row> Measure(const Config& config, const dc::HardwareProfile& hw,
                      std::vector<std::string> policies = {}) {
  dc::ModelOverrides overrides;
  overrides.seq = config.seq;
  overrides.micro_batch = config.micro_batch;
  overrides.gas = config.gas;
  overrides.recompute_layers = config.recompute;
  DC_ASSIGN_OR_RETURN(dc::proto::ModelConfig model, dc::MakeConfig(config.preset, overrides));
  DC_ASSIGN_OR_RETURN(dc::proto::Program program, dc::BuildProgram(model));
  DC_ASSIGN_OR_RETURN(dc::ClusterShape cluster,
                      dc::MakeCluster(config.ranks, std::min(config.ranks, kGpusPerNode)));
  DC_RETURN_IF_ERROR(dc::ValidateCluster(hw, cluster));
  const dc::CostModel costs = dc::EstimateCostModel(program, hw, cluster);
  Row row;
  row.config = config;
  row.bound_seconds = dc::StepLowerBound(program, cluster.world_size(), costs).seconds;
  // The model's flops (MFU): recomputed ops are work the step does twice, not model flops.
  for (const auto& op : program.ops()) {
    if (op.phase() == dc::proto::PHASE_OPTIMIZER) continue;
    if (op.has_recompute_of()) continue;
    row.flops_per_rank_step += op.flops();
  }
  row.flops_per_rank_step *= config.gas;
  row.tokens_per_rank_step = config.seq * config.micro_batch * config.gas;
  const bool table = policies.empty();
  if (table) {
    policies = {config.baseline, "deepcompile", "dc"};
    if (config.baseline != "baseline") policies.insert(policies.begin(), "baseline");
  }
  for (const std::string& policy : policies) {
    std::fprintf(stderr, "paper_bench: %s: %s\n", config.label.c_str(), policy.c_str());
    PolicyRun run = Plan(program, costs, cluster.world_size(), policy, hw.device_memory_bytes);
    if (table && policy == "dc" && run.ok) {
      std::vector<double> seconds = {run.plan_seconds};
      for (int i = 1; i < kTimingRepeats; ++i) {
        seconds.push_back(Plan(program, costs, cluster.world_size(), policy, hw.device_memory_bytes)
                              .plan_seconds);
      }
      std::sort(seconds.begin(), seconds.end());
      run.plan_seconds = seconds[seconds.size() / 2];
    }
    row.runs[policy] = run;
  }
  row.base_policy = config.baseline;
  if (table && !row.runs.at(config.baseline).ok && config.baseline == "baseline") {
    row.base_policy = "zero3-offload";
    std::fprintf(stderr, "paper_bench: %s: zero3-offload\n", config.label.c_str());
    row.runs[row.base_policy] =
        Plan(program, costs, cluster.world_size(), row.base_policy, hw.device_memory_bytes);
  }
  return row;
}

std::string Format(const char* format, double value) {
  char text[32];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

class Footnotes {
 public:
  std::string Cite(const std::string& note) {
    auto it = std::find(notes_.begin(), notes_.end(), note);
    if (it == notes_.end()) it = notes_.insert(notes_.end(), note);
    return "[" + std::to_string(it - notes_.begin() + 1) + "]";
  }
  void Print() const {
    for (size_t i = 0; i < notes_.size(); ++i)
      std::printf("[%zu] %s\n\n", i + 1, notes_[i].c_str());
  }

 private:
  std::vector<std::string> notes_;
};

void Print(const std::vector<Row>& rows, const dc::HardwareProfile& hw) {
  std::printf("## DeepCompile's evaluation settings, predicted\n\n");
  std::printf(
      "H100 SXM (%s), %d GPUs per node, budget = the GPU's memory (%.2f GiB) for every policy. "
      "Step and planning in seconds, peak in GiB per GPU, MFU against %.0f TFLOP/s dense bf16. "
      "\"x base\" is the step speed-up over the row's ZeRO-3 (for the offload row: ZeRO-3 "
      "offload); \"paper\" is DeepCompile's published best speed-up for that model and setting. "
      "Where plain ZeRO-3 does not fit, the speed-ups are over ZeRO-3 offload (zero3-offload: "
      "masters and Adam states in host memory, Adam on the host as DeepSpeed's CPU Adam runs "
      "it), as its users would run it. \"bound s\" is a step no schedule of the row's program "
      "beats on this profile at any budget (machine/lower_bound.h); \"gap\" is the policy's "
      "step over it, less 1.\n\n",
      hw.name.c_str(), kGpusPerNode, static_cast<double>(hw.device_memory_bytes) / kGiB,
      hw.peak_bf16_flops_per_s / 1e12);
  std::printf(
      "| setting | policy | step s | bound s | gap | tokens/s/GPU | MFU | peak GiB | x base | "
      "paper "
      "| plan s |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  Footnotes notes;
  for (const Row& row : rows) {
    const PolicyRun& base = row.runs.at(row.base_policy);
    std::vector<std::string> order = {"baseline"};
    if (row.base_policy != "baseline") order.push_back(row.base_policy);
    order.push_back("deepcompile");
    order.push_back("dc");
    for (const std::string& policy : order) {
      const PolicyRun& run = row.runs.at(policy);
      const std::string label = policy == order.front() ? row.config.label : "";
      if (!run.ok) {
        std::printf("| %s | %s | refused %s | | | | | | | | %s |\n", label.c_str(), policy.c_str(),
                    notes.Cite(policy + ": " + run.error).c_str(),
                    Format("%.2f", run.plan_seconds).c_str());
        continue;
      }
      const double tokens = static_cast<double>(row.tokens_per_rank_step) / run.step_seconds;
      const double mfu = row.flops_per_rank_step / run.step_seconds / hw.peak_bf16_flops_per_s;
      const bool compared = base.ok && policy != row.base_policy && policy != "baseline";
      const std::string speedup =
          compared ? Format("%.2fx", base.step_seconds / run.step_seconds) : "";
      const std::string paper =
          compared && policy == "dc" ? Format("%.2fx", row.config.paper_speedup) : "";
      std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", label.c_str(),
                  policy.c_str(),
                  (Format("%.3f", run.step_seconds) +
                   (run.kept.empty() ? "" : " (" + run.kept + "'s plan)"))
                      .c_str(),
                  Format("%.3f", row.bound_seconds).c_str(),
                  Format("%.0f%%", 100 * dc::BoundGap(run.step_seconds, row.bound_seconds)).c_str(),
                  Format("%.0f", tokens).c_str(), Format("%.1f%%", 100 * mfu).c_str(),
                  Format("%.2f", static_cast<double>(run.peak_bytes) / kGiB).c_str(),
                  speedup.c_str(), paper.c_str(), Format("%.2f", run.plan_seconds).c_str());
    }
  }
  std::printf("\n");
  notes.Print();
}

// dc's speed-up over the row's baseline (and deepcompile's) when one constant moves: the
// constants the HARDWARE.md calibration note marks as assumptions or as the least certain.
int Sensitivity(const std::vector<Row>& rows, const dc::HardwareProfile& nominal) {
  struct Variant {
    std::string name;
    std::function<void(dc::HardwareProfile*)> apply;
  };
  const std::vector<Variant> variants = {
      {"nominal", [](dc::HardwareProfile*) {}},
      {"matmul eff 0.55", [](dc::HardwareProfile* hw) { hw->matmul_efficiency = 0.55; }},
      {"matmul eff 0.80", [](dc::HardwareProfile* hw) { hw->matmul_efficiency = 0.80; }},
      {"overlap 1.00", [](dc::HardwareProfile* hw) { hw->overlap_compute_slowdown = 1.0; }},
      {"overlap 1.25", [](dc::HardwareProfile* hw) { hw->overlap_compute_slowdown = 1.25; }},
      {"network x0.5",
       [](dc::HardwareProfile* hw) { hw->inter_node_bandwidth_per_gpu_bytes_per_s *= 0.5; }},
      {"host link x0.5",
       [](dc::HardwareProfile* hw) { hw->host_link_bandwidth_bytes_per_s *= 0.5; }},
      {"host Adam x3", [](dc::HardwareProfile* hw) { hw->host_optimizer_elements_per_s *= 3; }},
  };
  std::printf("## Sensitivity: dc's speed-up over the baseline (deepcompile's in brackets)\n\n");
  std::printf(
      "Each column moves one constant of h100-sxm and re-plans the row. \"-\": the baseline "
      "or dc refuses the row at that setting.\n\n| setting |");
  for (const Variant& v : variants) std::printf(" %s |", v.name.c_str());
  std::printf("\n| --- |");
  for (size_t i = 0; i < variants.size(); ++i) std::printf(" ---: |");
  std::printf("\n");
  for (const Row& row : rows) {
    if (!row.runs.at(row.base_policy).ok) continue;
    std::printf("| %s |", row.config.label.c_str());
    for (const Variant& v : variants) {
      dc::HardwareProfile hw = nominal;
      v.apply(&hw);
      auto measured = Measure(row.config, hw, {row.base_policy, "deepcompile", "dc"});
      if (!measured.ok()) return Fail(measured.status());
      const PolicyRun& base = measured->runs.at(row.base_policy);
      const PolicyRun& ours = measured->runs.at("dc");
      const PolicyRun& theirs = measured->runs.at("deepcompile");
      if (!base.ok || !ours.ok) {
        std::printf(" - |");
        continue;
      }
      const std::string bracket =
          theirs.ok ? " (" + Format("%.2f", base.step_seconds / theirs.step_seconds) + ")" : " (-)";
      std::printf(" %s%s |", Format("%.2fx", base.step_seconds / ours.step_seconds).c_str(),
                  bracket.c_str());
    }
    std::printf("\n");
  }
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char**) {
  dc::cli::KeepFreedPagesWhilePlanning();
  if (argc > 1) {
    std::fprintf(stderr, "usage: paper_bench (no arguments; see bench/README.md)\n");
    return 2;
  }
  auto hw = dc::FindHardware("h100-sxm");
  if (!hw.ok()) return Fail(hw.status());
  std::vector<Row> rows;
  for (const Config& config : PaperConfigs()) {
    auto row = Measure(config, *hw);
    if (!row.ok()) return Fail(row.status());
    rows.push_back(std::move(*row));
  }
  Print(rows, *hw);
  return Sensitivity(rows, *hw);
}
