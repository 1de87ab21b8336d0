// plan_bench: what the baseline, zero3-offload, deepcompile and dc policies predict (step time,
// peak device bytes) for Llama 3 models on simulated H100 clusters (machine/estimate.h costs),
// and how long dc takes to plan, pass by pass. Sequence 1024, micro-batch 1, 8 GPUs per node.
//
//   plan_bench            the standard table: llama3-8b and llama3-70b at 8, 32 and 64 ranks,
//                         GAS 1, 4 and 16, a loose budget (the GPU's memory) and a tight one
//                         (0.8 x the baseline's peak: offloading must act); then the planning
//                         time of dc for llama3-70b at 32 ranks, GAS 1 and 16, pass by pass;
//                         then the pass records of the rows where dc does not beat deepcompile
//                         then Llama-3 405B shapes on 1,024 ranks (seq 8192, GAS 16,
//                         recompute): dc's planning time, arena and live peak
//   plan_bench --quick    the same sections for a small subset (a smoke test)
//   plan_bench --scale    the Llama-3 405B section alone
//   plan_bench PRESET GAS NODES GPUS_PER_NODE [BUDGET_GB [PASSES]]
//                         one case; PASSES a comma-separated pass list (then only it)
//
// Planning seconds are wall-clock seconds of MakePlan (the pipeline with the verifier after every
// pass, the baseline's simulation and the final one); pass seconds are Pass::Run as the pipeline
// records them (PassRecord::seconds). Planning is on one thread (PlanRequest::threads 1) except
// in the 405B section, which plans on one thread and on every core: run the rest pinned to one
// core (taskset -c 0) for planning times that mean something.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "machine/estimate.h"
#include "machine/lower_bound.h"
#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/memory_lifetimes.h"
#include "rewriter/planner.h"
#include "schemas/files.h"
#include "tools/allocator.h"
#include "tools/cli.h"

namespace {

using dc::StatusOr;

constexpr int64_t kSeq = 1024;
constexpr int kGpusPerNode = 8;
constexpr double kGB = 1e9;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// The tight budget: this fraction of the baseline's unbounded peak.
constexpr double kTightShareOfBaselinePeak = 0.8;
// Each planning-time measurement is the median of this many MakePlan calls.
constexpr int kTimingRepeats = 3;
// dc "beats" deepcompile when its step is shorter by more than this relative margin (less is
// within what the cost model's assumptions can tell apart).
constexpr double kBeatMargin = 0.01;

struct Case {
  std::string preset;
  int gas = 1;
  dc::ClusterShape cluster;
  int64_t budget_bytes = 0;
};

// ----- the one-case mode (a pass list of one's own) -----

struct Outcome {
  double plan_seconds = 0;
  double step_seconds = 0;
  int64_t peak_bytes = 0;
  int instructions = 0;
  std::string passes;  // "name seconds" per pass
};

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

StatusOr<dc::proto::Program> ProgramOf(const std::string& preset, int gas) {
  dc::ModelOverrides overrides;
  overrides.gas = gas;
  overrides.seq = kSeq;
  overrides.micro_batch = 1;
  DC_ASSIGN_OR_RETURN(dc::proto::ModelConfig config, dc::MakeConfig(preset, overrides));
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

int OneCase(int argc, char** argv, const dc::HardwareProfile& hw) {
  const int64_t budget = static_cast<int64_t>((argc > 5 ? std::atof(argv[5]) : 80) * kGB);
  const Case c{argv[1], std::atoi(argv[2]), {std::atoi(argv[3]), std::atoi(argv[4])}, budget};
  auto program = ProgramOf(c.preset, c.gas);
  if (!program.ok()) return Fail(program.status());
  const dc::CostModel costs = dc::EstimateCostModel(*program, hw, c.cluster);
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
        "  %-12s step %8.4f s (x%.3f)  peak %6.2f GB  instructions %6d  plan %.3f s  [%s ]\n",
        name.c_str(), outcome->step_seconds, baseline_seconds / outcome->step_seconds,
        static_cast<double>(outcome->peak_bytes) / kGB, outcome->instructions,
        outcome->plan_seconds, outcome->passes.c_str());
  }
  return 0;
}

// ----- the standard table -----

struct Config {
  std::string preset;
  int ranks = 8;
  int gas = 1;
};

// One policy's plan at one budget.
struct PolicyRun {
  bool ok = false;
  std::string error;
  double step_seconds = 0;
  int64_t peak_bytes = 0;
  double plan_seconds = 0;
  int64_t arena_bytes = 0;      // the memory plan's arena (0: the plan has none)
  int64_t live_peak_bytes = 0;  // most bytes its buffers hold at once, in simulated time
  int instructions = 0;
  double compute_seconds = 0;                // the plan's compute, as the simulator unions it
  double exposed_communication_seconds = 0;  // its communication not hidden by compute
  std::vector<dc::proto::PassRecord> passes;
  std::string
      kept;  // the rule whose plan dc kept (its note "kept deepcompile's plan: ..."), if any
};

struct Row {
  Config config;
  std::string budget_name;  // "loose" or "tight"
  int64_t budget_bytes = 0;
  int64_t baseline_unbounded_peak_bytes = 0;
  double baseline_unbounded_step_seconds = 0;
  double bound_seconds = 0;               // no schedule's step is shorter (machine/lower_bound.h)
  std::map<std::string, PolicyRun> runs;  // by policy
};

struct Model {
  dc::proto::Program program;
  dc::CostModel costs;
  int world = 1;
};

StatusOr<Model> ModelOf(const Config& config, const dc::HardwareProfile& hw) {
  Model model;
  DC_ASSIGN_OR_RETURN(model.program, ProgramOf(config.preset, config.gas));
  DC_ASSIGN_OR_RETURN(dc::ClusterShape cluster,
                      dc::MakeCluster(config.ranks, std::min(config.ranks, kGpusPerNode)));
  DC_RETURN_IF_ERROR(dc::ValidateCluster(hw, cluster));
  model.costs = dc::EstimateCostModel(model.program, hw, cluster);
  model.world = cluster.world_size();
  return model;
}

// Most bytes the plan's device buffers hold at once over the memory plan's lifetimes (simulated
// time): what no arena can undercut.
int64_t LivePeakBytes(const dc::proto::Schedule& plan, const dc::CostModel& costs) {
  auto buffers = dc::BufferLifetimes(plan);
  if (!buffers.ok()) return 0;
  dc::SimOptions options;
  options.memory_timeline = false;
  auto sim = dc::Simulate(plan, costs, options);
  if (!sim.ok()) return 0;
  int length = 0;
  std::vector<int> instruction_at;
  if (!dc::ToSimulatedTimeAxis(plan, *sim, &*buffers, &length, &instruction_at).ok()) return 0;
  return dc::LivePeak(*buffers, length).first;
}

PolicyRun Plan(const Model& model, const std::string& policy, int64_t budget_bytes,
               int threads = 1) {
  dc::PlanRequest request;
  request.threads = threads;
  request.program = model.program;
  request.world_size = model.world;
  request.backend = "cuda";
  request.device = "h100-sxm";
  request.budget_bytes = budget_bytes;
  request.policy = policy;
  request.costs = model.costs;
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
  run.instructions = plan->instructions_size();
  if (plan->has_memory_plan() && plan->memory_plan().arena_bytes() > 0) {
    run.arena_bytes = plan->memory_plan().arena_bytes();
    run.live_peak_bytes = LivePeakBytes(*plan, model.costs);
  }
  run.compute_seconds = plan->prediction().compute_seconds();
  run.exposed_communication_seconds = plan->prediction().exposed_communication_seconds();
  run.passes.assign(plan->passes().begin(), plan->passes().end());
  return run;
}

std::string GiB(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", static_cast<double>(bytes) / kGiB);
  return text;
}

std::string Fixed(double value, int digits) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

// Errors, numbered as the table's footnotes cite them; the same error is one footnote.
class Footnotes {
 public:
  std::string Cite(const std::string& policy, const std::string& error) {
    const std::string note = policy + ": " + error;
    auto it = std::find(notes_.begin(), notes_.end(), note);
    if (it == notes_.end()) it = notes_.insert(notes_.end(), note);
    return "[" + std::to_string(it - notes_.begin() + 1) + "]";
  }
  void Print() const {
    for (size_t i = 0; i < notes_.size(); ++i) {
      std::printf("[%zu] %s\n\n", i + 1, notes_[i].c_str());
    }
  }

 private:
  std::vector<std::string> notes_;
};

std::string ArenaText(const PolicyRun& run) {
  return run.ok && run.arena_bytes > 0 ? GiB(run.arena_bytes) : "—";
}

std::string OverLivePeak(const PolicyRun& run) {
  if (!run.ok || run.arena_bytes <= 0 || run.live_peak_bytes <= 0) return "—";
  return Fixed(100.0 * static_cast<double>(run.arena_bytes - run.live_peak_bytes) /
                   static_cast<double>(run.live_peak_bytes),
               2) +
         "%";
}

std::string ConfigLabel(const Row& row) {
  return row.config.preset + ", " + std::to_string(row.config.ranks) + " ranks, GAS " +
         std::to_string(row.config.gas) + ", " + row.budget_name + " budget";
}

void PrintTable(const std::vector<Row>& rows, const dc::HardwareProfile& hw) {
  std::printf("## Predicted step time and peak per rank\n\n");
  std::printf(
      "H100 SXM (%s), %d GPUs per node, sequence %lld, micro-batch 1. Budgets: loose = the GPU's "
      "memory (%s GiB); tight = %.1f x the baseline's unbounded peak (the baseline does not fit, "
      "so offloading must act; where even all of the optimizer state on the host is not enough, "
      "every policy refuses and the footnotes say why). Steps in seconds, peaks in GiB per rank. "
      "Speed-ups are the other policy's step over dc's; where the baseline does not fit, dc's is "
      "taken over zero3-offload (ZeRO-3's own answer to the budget) and marked *. bound: a step "
      "no schedule of the program beats on this profile at any budget (machine/lower_bound.h); dc "
      "gap: dc's step over it, less 1. \"(deepcompile's plan)\" after dc's step: a rule's plan was "
      "faster than dc's own and dc kept it. dc arena: the memory plan's arena, and over the live "
      "peak of its buffers (simulated time) in percent; — where the plan has no memory plan. dc "
      "plan s: wall-clock seconds of MakePlan for dc.\n\n",
      hw.name.c_str(), kGpusPerNode, static_cast<long long>(kSeq),
      GiB(hw.device_memory_bytes).c_str(), kTightShareOfBaselinePeak);
  std::printf(
      "| model | ranks | GAS | budget GiB | baseline step | baseline peak | zero3-offload step | "
      "deepcompile step | deepcompile peak | dc step | dc peak | bound | dc gap | dc / baseline | "
      "dc / deepcompile | dc arena | arena over live peak | dc plan s |\n");
  std::printf(
      "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
      "\n");
  Footnotes notes;
  for (const Row& row : rows) {
    const PolicyRun& base = row.runs.at("baseline");
    const PolicyRun& offload = row.runs.at("zero3-offload");
    const PolicyRun& deep = row.runs.at("deepcompile");
    const PolicyRun& dc = row.runs.at("dc");
    auto step = [&](const std::string& policy, const PolicyRun& run) {
      return run.ok ? Fixed(run.step_seconds, 4) : "fails " + notes.Cite(policy, run.error);
    };
    std::string base_step, base_peak;
    if (base.ok) {
      base_step = Fixed(base.step_seconds, 4);
      base_peak = GiB(base.peak_bytes);
    } else {
      base_step = "does not fit";
      base_peak = "needs " + GiB(row.baseline_unbounded_peak_bytes);
    }
    std::string over_base = "—", over_deep = "—";
    if (dc.ok && base.ok) {
      over_base = Fixed(base.step_seconds / dc.step_seconds, 3) + "x";
    } else if (dc.ok && offload.ok) {
      over_base = Fixed(offload.step_seconds / dc.step_seconds, 3) + "x*";
    }
    if (dc.ok && deep.ok) over_deep = Fixed(deep.step_seconds / dc.step_seconds, 3) + "x";
    const std::string offload_step = step("zero3-offload", offload);
    const std::string deep_step = step("deepcompile", deep);
    std::string dc_step = step("dc", dc);
    if (dc.ok && !dc.kept.empty()) dc_step += " (" + dc.kept + "'s plan)";
    const std::string gap =
        dc.ok ? Fixed(100 * dc::BoundGap(dc.step_seconds, row.bound_seconds), 0) + "%" : "—";
    std::printf(
        "| %s | %d | %d | %s %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s "
        "| %s |\n",
        row.config.preset.c_str(), row.config.ranks, row.config.gas, row.budget_name.c_str(),
        GiB(row.budget_bytes).c_str(), base_step.c_str(), base_peak.c_str(), offload_step.c_str(),
        deep_step.c_str(), deep.ok ? GiB(deep.peak_bytes).c_str() : "—", dc_step.c_str(),
        dc.ok ? GiB(dc.peak_bytes).c_str() : "—", Fixed(row.bound_seconds, 4).c_str(), gap.c_str(),
        over_base.c_str(), over_deep.c_str(), ArenaText(dc).c_str(), OverLivePeak(dc).c_str(),
        Fixed(dc.plan_seconds, 3).c_str());
  }
  std::printf("\n");
  notes.Print();
}

// Where dc does not beat deepcompile by more than kBeatMargin: both policies' compute, exposed
// communication and pass records, as --explain shows them.
void PrintNonWins(const std::vector<Row>& rows) {
  std::printf("## Where dc does not beat deepcompile by more than %.0f%%\n\n", kBeatMargin * 100);
  std::printf(
      "Compute is the union of compute intervals; exposed is communication (gathers, "
      "reduce-scatters) that no compute hides. A step cannot be shorter than its compute.\n\n");
  int shown = 0;
  for (const Row& row : rows) {
    const PolicyRun& deep = row.runs.at("deepcompile");
    const PolicyRun& dc = row.runs.at("dc");
    if (!dc.ok || !deep.ok || dc.step_seconds < deep.step_seconds * (1 - kBeatMargin)) continue;
    ++shown;
    std::printf("### %s: dc %.4f s, deepcompile %.4f s (x%.3f)\n\n", ConfigLabel(row).c_str(),
                dc.step_seconds, deep.step_seconds, deep.step_seconds / dc.step_seconds);
    for (const char* policy : {"deepcompile", "dc"}) {
      const PolicyRun& run = row.runs.at(policy);
      std::printf("%s: step %.4f s, compute %.4f s, exposed communication %.4f s, peak %s GiB\n\n",
                  policy, run.step_seconds, run.compute_seconds, run.exposed_communication_seconds,
                  GiB(run.peak_bytes).c_str());
      for (const auto& record : run.passes) {
        std::printf("- %s: step %.4f s, peak %s GiB, %d instructions: %s\n", record.name().c_str(),
                    record.predicted_step_seconds(), GiB(record.predicted_peak_bytes()).c_str(),
                    record.instructions(), record.summary().c_str());
      }
      std::printf("\n");
    }
  }
  if (shown == 0) {
    std::printf("None: dc's step is shorter by more than %.0f%% in every row both plan.\n\n",
                kBeatMargin * 100);
  }
}

// The median of kTimingRepeats plans of dc, and its pass records.
PolicyRun MedianDcPlan(const Model& model, int64_t budget_bytes, int threads = 1) {
  std::vector<PolicyRun> runs;
  for (int i = 0; i < kTimingRepeats; ++i) runs.push_back(Plan(model, "dc", budget_bytes, threads));
  std::sort(runs.begin(), runs.end(),
            [](const PolicyRun& a, const PolicyRun& b) { return a.plan_seconds < b.plan_seconds; });
  return runs[runs.size() / 2];
}

int PlanningTime(const std::vector<Config>& configs, const dc::HardwareProfile& hw) {
  std::printf("## Planning time on one core\n\n");
  std::printf(
      "dc's MakePlan, median of %d, wall-clock seconds. Each pass's seconds are its Run "
      "(PassRecord::seconds); \"verifier and simulations\" is the rest of MakePlan: the verifier "
      "after every pass, the simulation each pass record carries, the baseline's plan and the "
      "final simulation.\n\n",
      kTimingRepeats);
  struct Column {
    std::string label;
    PolicyRun run;
    int instructions = 0;
  };
  std::vector<Column> columns;
  for (const Config& config : configs) {
    auto model = ModelOf(config, hw);
    if (!model.ok()) return Fail(model.status());
    const PolicyRun unbounded = Plan(*model, "baseline", 0);
    if (!unbounded.ok) return Fail(dc::Status::Error(unbounded.error));
    const int64_t tight =
        static_cast<int64_t>(static_cast<double>(unbounded.peak_bytes) * kTightShareOfBaselinePeak);
    for (const auto& [name, budget] : std::vector<std::pair<std::string, int64_t>>{
             {"loose", hw.device_memory_bytes}, {"tight", tight}}) {
      Column column;
      column.label = config.preset + " " + std::to_string(config.ranks) + " ranks GAS " +
                     std::to_string(config.gas) + " " + name;
      column.run = MedianDcPlan(*model, budget);
      if (!column.run.ok) {
        return Fail(dc::Status::Error(column.label + ": dc: " + column.run.error));
      }
      if (!column.run.passes.empty()) column.instructions = column.run.passes.back().instructions();
      columns.push_back(std::move(column));
    }
  }
  std::printf("| pass |");
  for (const Column& column : columns) std::printf(" %s |", column.label.c_str());
  std::printf("\n|---|");
  for (size_t i = 0; i < columns.size(); ++i) std::printf("---:|");
  std::printf("\n");
  const size_t passes = columns.empty() ? 0 : columns.front().run.passes.size();
  for (size_t p = 0; p < passes; ++p) {
    std::printf("| %s |", columns.front().run.passes[p].name().c_str());
    for (const Column& column : columns) std::printf(" %.3f |", column.run.passes[p].seconds());
    std::printf("\n");
  }
  std::printf("| verifier and simulations |");
  for (const Column& column : columns) {
    double pass_seconds = 0;
    for (const auto& record : column.run.passes) pass_seconds += record.seconds();
    std::printf(" %.3f |", column.run.plan_seconds - pass_seconds);
  }
  std::printf("\n| **MakePlan total** |");
  for (const Column& column : columns) std::printf(" **%.3f** |", column.run.plan_seconds);
  std::printf("\n| instructions in the plan |");
  for (const Column& column : columns) std::printf(" %d |", column.instructions);
  std::printf("\n\nWhat each pass did:\n\n");
  for (const Column& column : columns) {
    std::printf("%s:\n\n", column.label.c_str());
    for (const auto& record : column.run.passes) {
      std::printf("- %s (%.3f s; then step %.4f s, peak %s GiB): %s\n", record.name().c_str(),
                  record.seconds(), record.predicted_step_seconds(),
                  GiB(record.predicted_peak_bytes()).c_str(), record.summary().c_str());
    }
    std::printf("\n");
  }
  return 0;
}

// Llama-3 405B's shapes (issue 14): planned by dc on 1,024 ranks at the GPU's memory.
int Scale(const dc::HardwareProfile& hw) {
  std::printf("## Llama-3 405B on 1,024 ranks\n\n");
  dc::ModelOverrides overrides;
  overrides.layers = 126;
  overrides.hidden = 16384;
  overrides.heads = 128;
  overrides.kv_heads = 8;
  overrides.ffn = 53248;
  overrides.seq = 8192;
  overrides.micro_batch = 1;
  overrides.gas = 16;
  overrides.recompute_layers = true;
  auto config = dc::MakeConfig("llama3-70b", overrides);
  if (!config.ok()) return Fail(config.status());
  Model model;
  auto program = dc::BuildProgram(*config);
  if (!program.ok()) return Fail(program.status());
  model.program = std::move(*program);
  auto cluster = dc::MakeCluster(1024, kGpusPerNode);
  if (!cluster.ok()) return Fail(cluster.status());
  model.costs = dc::EstimateCostModel(model.program, hw, *cluster);
  model.world = cluster->world_size();
  std::fprintf(stderr, "plan_bench: llama3-405b shapes, 1024 ranks, GAS 16\n");
  // One thread, then the cores this process may use (the candidates planned at once).
  const int cores = dc::AvailableCores();  // as dc-plan's default: taskset counts
  std::vector<int> thread_counts = {1};
  if (cores > 1) thread_counts.push_back(cores);
  std::vector<PolicyRun> runs;
  for (int threads : thread_counts)
    runs.push_back(MedianDcPlan(model, hw.device_memory_bytes, threads));
  std::printf(
      "126 layers, hidden 16384, 128 heads, 8 KV heads, FFN 53248, seq 8192, micro-batch 1, GAS "
      "16, recompute; %d x %d H100 (%s); budget the GPU's memory. dc's MakePlan, median of %d, "
      "wall-clock seconds, on one thread and on as many as the machine has cores "
      "(PlanRequest::threads: the same plan).\n\n",
      cluster->nodes, cluster->gpus_per_node, hw.name.c_str(), kTimingRepeats);
  std::printf(
      "| threads | dc step | dc peak | instructions | arena | live peak | arena over live peak | "
      "budget | dc plan s |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (size_t i = 0; i < runs.size(); ++i) {
    const PolicyRun& run = runs[i];
    if (!run.ok) {
      std::printf("| %d | fails | — | — | — | — | — | %s | %s |\n\n%s\n\n", thread_counts[i],
                  GiB(hw.device_memory_bytes).c_str(), Fixed(run.plan_seconds, 3).c_str(),
                  run.error.c_str());
      return 0;
    }
    std::printf("| %d | %s | %s | %d | %s | %s | %s | %s | %s |\n", thread_counts[i],
                Fixed(run.step_seconds, 4).c_str(), GiB(run.peak_bytes).c_str(), run.instructions,
                ArenaText(run).c_str(),
                run.live_peak_bytes > 0 ? GiB(run.live_peak_bytes).c_str() : "—",
                OverLivePeak(run).c_str(), GiB(hw.device_memory_bytes).c_str(),
                Fixed(run.plan_seconds, 3).c_str());
  }
  std::printf("\n");
  const PolicyRun& run = runs.front();
  for (const auto& record : run.passes) {
    std::printf("- %s (%.3f s; then step %.4f s, peak %s GiB): %s\n", record.name().c_str(),
                record.seconds(), record.predicted_step_seconds(),
                GiB(record.predicted_peak_bytes()).c_str(), record.summary().c_str());
  }
  std::printf("\n");
  return 0;
}

int Standard(bool quick, const dc::HardwareProfile& hw) {
  std::vector<Config> configs;
  std::vector<Config> timing;
  if (quick) {
    configs = {{"llama3-8b", 8, 1}};
    timing = {{"llama3-8b", 8, 1}};
  } else {
    for (const char* preset : {"llama3-8b", "llama3-70b"}) {
      for (int ranks : {8, 32, 64}) {
        for (int gas : {1, 4, 16}) configs.push_back({preset, ranks, gas});
      }
    }
    timing = {{"llama3-70b", 32, 1}, {"llama3-70b", 32, 16}};
  }
  std::vector<Row> rows;
  for (const Config& config : configs) {
    std::fprintf(stderr, "plan_bench: %s %d ranks GAS %d\n", config.preset.c_str(), config.ranks,
                 config.gas);
    auto model = ModelOf(config, hw);
    if (!model.ok()) return Fail(model.status());
    const PolicyRun unbounded = Plan(*model, "baseline", 0);
    if (!unbounded.ok) return Fail(dc::Status::Error(unbounded.error));
    const int64_t tight =
        static_cast<int64_t>(static_cast<double>(unbounded.peak_bytes) * kTightShareOfBaselinePeak);
    for (const auto& [name, budget] : std::vector<std::pair<std::string, int64_t>>{
             {"loose", hw.device_memory_bytes}, {"tight", tight}}) {
      Row row;
      row.config = config;
      row.budget_name = name;
      row.budget_bytes = budget;
      row.baseline_unbounded_peak_bytes = unbounded.peak_bytes;
      row.baseline_unbounded_step_seconds = unbounded.step_seconds;
      row.bound_seconds = dc::StepLowerBound(model->program, model->world, model->costs).seconds;
      for (const std::string& policy : dc::PolicyNames()) {
        row.runs[policy] = Plan(*model, policy, budget);
      }
      rows.push_back(std::move(row));
    }
  }
  PrintTable(rows, hw);
  if (int failed = PlanningTime(timing, hw); failed != 0) return failed;
  PrintNonWins(rows);
  if (!quick) return Scale(hw);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  dc::cli::KeepFreedPagesWhilePlanning();
  auto hw = dc::FindHardware("h100-sxm");
  if (!hw.ok()) return Fail(hw.status());
  if (argc > 4) return OneCase(argc, argv, *hw);
  const bool quick = argc == 2 && std::strcmp(argv[1], "--quick") == 0;
  if (argc == 2 && std::strcmp(argv[1], "--scale") == 0) return Scale(*hw);
  if (argc > 1 && !quick) {
    std::fprintf(
        stderr,
        "usage: plan_bench [--quick | --scale] | plan_bench PRESET GAS NODES GPUS_PER_NODE "
        "[BUDGET_GB [PASSES]]\n");
    return 2;
  }
  return Standard(quick, *hw);
}
