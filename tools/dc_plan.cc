// dc-plan: read a trace, derive the profile, plan an optimized schedule (cached).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>

#include "analyzer/profile.h"
#include "analyzer/trace.h"
#include "executor/data.h"
#include "machine/estimate.h"
#include "machine/hardware.h"
#include "machine/lower_bound.h"
#include "machine/simulator.h"
#include "machine/uncertainty.h"
#include "rewriter/plan_cache.h"
#include "rewriter/planner.h"
#include "rewriter/schedule_text.h"
#include "rewriter/search.h"
#include "rewriter/zero3.h"
#include "schemas/digest.h"
#include "schemas/files.h"
#include "schemas/plan_file.h"
#include "schemas/units.h"
#include "tools/allocator.h"
#include "tools/cli.h"
#include "tracetools/perfetto.h"
#include "tracetools/report.h"

namespace {

using namespace dc;

nlohmann::json PredictionJson(const proto::Prediction& p) {
  nlohmann::json j;
  j["step_seconds"] = p.step_seconds();
  j["peak_device_bytes"] = p.peak_device_bytes();
  j["exposed_communication_seconds"] = p.exposed_communication_seconds();
  j["compute_seconds"] = p.compute_seconds();
  j["communication_seconds"] = p.communication_seconds();
  nlohmann::json by_kind = nlohmann::json::object();
  for (const auto& k : p.peak_by_kind()) by_kind[k.kind()] = k.bytes();
  j["peak_by_kind"] = by_kind;
  return j;
}

// The lower bound beside a predicted step: its seconds, the gap, the term that binds and each
// term (machine/lower_bound.h).
nlohmann::json BoundJson(const StepBound& bound, double step_seconds) {
  return {{"step_seconds", bound.seconds},
          {"gap", BoundGap(step_seconds, bound.seconds)},
          {"binding", bound.binding},
          {"terms",
           {{"compute_seconds", bound.compute_seconds},
            {"compute_and_host_optimizer_seconds", bound.compute_host_seconds},
            {"communication_seconds", bound.communication_seconds},
            {"overlap_seconds", bound.overlap_seconds},
            {"serial_seconds", bound.serial_seconds}}}};
}

// "bound 0.94 s, gap 20%"
std::string BoundText(const StepBound& bound, double step_seconds) {
  char text[96];
  std::snprintf(text, sizeof(text), "bound %.4f s, gap %.0f%%", bound.seconds,
                100 * BoundGap(step_seconds, bound.seconds));
  return text;
}

// A synthetic plan's machine: the profile and the cluster its costs were estimated for.
struct Machine {
  HardwareProfile hw;
  ClusterShape cluster;
};

// The range of a prediction over the profile's assumed constants (machine/uncertainty.h): the
// plan and the zero3 baseline re-simulated on every variant of the profile; then the step's range
// widened by the profile's measured step error.
struct PredictionRange {
  std::vector<std::string> assumed;  // the constants' keys
  // The profile's HardwareProfile::step_error_fraction: the step's range widened by it both ways.
  double step_error_fraction = 0;
  double min_step_seconds = 0, max_step_seconds = 0;
  double min_speedup = 0, max_speedup = 0;  // baseline step over the plan's, per variant
};

StatusOr<std::optional<PredictionRange>> RangeOf(const proto::Schedule& plan,
                                                 const Machine& machine) {
  const std::vector<ProfileVariant> variants = AssumptionVariants(machine.hw);
  const double error = machine.hw.step_error_fraction;
  if (variants.empty() && error == 0) return std::optional<PredictionRange>();
  proto::Schedule baseline;
  if (!variants.empty()) {
    baseline.set_world_size(plan.world_size());
    *baseline.mutable_program() = plan.program();
    Zero3Pass zero3;
    DC_RETURN_IF_ERROR(zero3.Run(&baseline, PassContext{nullptr, 0}).status());
  }
  PredictionRange range;
  for (const AssumedRange& r : AssumedRanges(machine.hw)) range.assumed.push_back(r.key);
  SimOptions options;
  options.memory_timeline = false;
  // The range holds the prediction itself (every constant at its value).
  range.min_step_seconds = range.max_step_seconds = plan.prediction().step_seconds();
  range.min_speedup = range.max_speedup =
      plan.baseline().step_seconds() / plan.prediction().step_seconds();
  for (const ProfileVariant& variant : variants) {
    const CostModel costs = EstimateCostModel(plan.program(), variant.profile, machine.cluster);
    DC_ASSIGN_OR_RETURN(SimResult ours, Simulate(plan, costs, options));
    DC_ASSIGN_OR_RETURN(SimResult base, Simulate(baseline, costs, options));
    const double speedup = base.step_seconds / ours.step_seconds;
    range.min_step_seconds = std::min(range.min_step_seconds, ours.step_seconds);
    range.max_step_seconds = std::max(range.max_step_seconds, ours.step_seconds);
    range.min_speedup = std::min(range.min_speedup, speedup);
    range.max_speedup = std::max(range.max_speedup, speedup);
  }
  // The model's own miss on the user's measured steps, beyond what the constants span. The
  // speed-up keeps the constants' range: the baseline is the same model's, missed alike.
  range.step_error_fraction = error;
  const StepRange widened =
      WidenedByStepError(machine.hw, {range.min_step_seconds, range.max_step_seconds});
  range.min_step_seconds = widened.min_seconds;
  range.max_step_seconds = widened.max_seconds;
  return std::optional<PredictionRange>(range);
}

Status SyntheticRequest(const cli::ModelFlags& model, const std::string& hardware, int world,
                        int gpus_per_node, int64_t budget, PlanRequest* request,
                        std::optional<Machine>* machine) {
  DC_ASSIGN_OR_RETURN(proto::ModelConfig config, MakeConfig(model.preset, model.overrides));
  DC_RETURN_IF_ERROR(RecordDataFile(&config));
  DC_ASSIGN_OR_RETURN(proto::Program program, BuildProgram(config));
  DC_ASSIGN_OR_RETURN(HardwareProfile hw, ResolveHardware(hardware));
  DC_ASSIGN_OR_RETURN(ClusterShape cluster, MakeCluster(world, gpus_per_node));
  DC_RETURN_IF_ERROR(ValidateCluster(hw, cluster));
  request->world_size = world;
  request->backend = BackendOf(hw);
  request->device = hw.name + " x" + std::to_string(world) + " (" + std::to_string(cluster.nodes) +
                    " x " + std::to_string(cluster.gpus_per_node) + ")";
  request->costs = EstimateCostModel(program, hw, cluster);
  request->profile_digest = Sha256Hex(CostModelText(request->costs));
  request->budget_bytes = budget > 0 ? budget : hw.device_memory_bytes;
  request->program = std::move(program);
  *machine = Machine{std::move(hw), cluster};
  return Status::Ok();
}

// The BLAS threads per rank a trace's run recorded (0: not recorded).
int TracedThreadsPerRank(const Trace& trace) {
  return trace.ranks().empty() ? 0 : trace.ranks().front().threads_per_rank;
}

Status TraceRequest(const std::string& trace_path, const std::string& from_plan, int64_t budget,
                    PlanRequest* request, std::optional<Profile>* measured,
                    std::vector<std::string>* notes, int* threads_per_rank) {
  DC_ASSIGN_OR_RETURN(auto trace, Trace::Open(trace_path));
  if (!trace->program()) {
    return Status::Error(
        trace_path + ": a foreign (" +
        std::string(trace->source() == TraceSource::kNsys ? "nsys" : "unknown") +
        ") trace has no program to plan; its analysis is report-only (dc-trace summary)");
  }
  DC_ASSIGN_OR_RETURN(Profile profile, BuildProfile(*trace));
  request->program = *trace->program();
  request->world_size = static_cast<int>(trace->ranks().size());
  request->backend = trace->ranks().empty() ? "cpu" : trace->ranks().front().backend;
  request->device = trace->ranks().empty() ? "cpu" : trace->ranks().front().device;
  *threads_per_rank = TracedThreadsPerRank(*trace);
  request->budget_bytes = budget;
  request->costs = profile.costs;
  request->profile_digest = profile.digest;
  if (!from_plan.empty()) {
    DC_ASSIGN_OR_RETURN(proto::Schedule base, LoadPlan(from_plan));
    if (base.program_digest() != trace->program_digest()) {
      return Status::Error(trace_path + ": recorded under another program than " + from_plan +
                           " (digest " + trace->program_digest().substr(0, 12) + " vs " +
                           base.program_digest().substr(0, 12) +
                           "); record a trace of that plan with dc-run --trace");
    }
    request->world_size = base.world_size();
    if (budget == 0) request->budget_bytes = base.budget_bytes();
  }
  *notes = trace->notes();
  const int traced_world = std::max<int>(1, static_cast<int>(trace->ranks().size()));
  if (!from_plan.empty() && request->world_size != traced_world) {
    notes->push_back(trace_path + " measured " + std::to_string(traced_world) + " rank(s) and " +
                     from_plan + " is for " + std::to_string(request->world_size) +
                     ": its collectives' costs are those of " + std::to_string(traced_world) +
                     " rank(s) (and none where it had one); a trace of " +
                     std::to_string(request->world_size) +
                     " ranks (dc-run --trace on that plan) predicts them");
  }
  *measured = std::move(profile);
  return Status::Ok();
}

std::string ShellQuote(const std::string& s) {
  std::string quoted = "'";
  for (char c : s) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// dc-run beside this binary, else on PATH.
std::string DcRunPath() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto sibling = self.parent_path() / "dc-run";
    if (std::filesystem::exists(sibling, ec)) return sibling.string();
  }
  return "dc-run";
}

struct RoundOptions {
  int rounds = 0;
  int steps = 3;   // measured steps per round
  int warmup = 1;  // warm-up steps per round, left out of the profile
  // The BLAS threads per rank the trace ran with (0: not recorded, dc-run's default): each
  // round runs as the trace did, so its measurement compares with the trace's.
  int threads_per_rank = 0;
};

// One round's measurement for PlanInRounds: run the plan with collection on its backend (dc-run
// --backend cpu or cuda: a cuda plan needs a GPU here) and profile the trace.
MeasureFn MeasureByRunning(const RoundOptions& options, const std::string& backend,
                           const std::string& out) {
  return [options, backend, out](int round,
                                 const proto::Schedule& plan) -> StatusOr<RoundMeasurement> {
    const std::string base = out + ".round" + std::to_string(round);
    DC_RETURN_IF_ERROR(SavePlan(base + ".dcplan", plan));
    const std::string command =
        ShellQuote(DcRunPath()) + " " + ShellQuote(base + ".dcplan") + " --steps " +
        std::to_string(options.steps) + " --warmup " + std::to_string(options.warmup) +
        " --backend " + ShellQuote(backend) + " --trace " + ShellQuote(base + ".db") +
        (options.threads_per_rank > 0
             ? " --threads-per-rank " + std::to_string(options.threads_per_rank)
             : std::string()) +
        " --quiet >/dev/null";
    const int rc = std::system(command.c_str());
    std::error_code ec;
    std::filesystem::remove(base + ".dcplan", ec);
    if (rc != 0) {
      return Status::Error("round " + std::to_string(round) +
                           ": dc-run failed (see its message above)");
    }
    DC_ASSIGN_OR_RETURN(auto trace, Trace::Open(base + ".db"));
    DC_ASSIGN_OR_RETURN(Profile profile, BuildProfile(*trace));
    std::filesystem::remove(base + ".db", ec);
    return RoundMeasurement{profile.step_seconds_median, profile.costs, profile.digest,
                            TracedThreadsPerRank(*trace)};
  };
}

// Each round into the --json report, and a line on stderr with `progress`.
std::function<void(const RoundRecord&)> ReportRounds(nlohmann::json* report, bool progress) {
  return [report, progress](const RoundRecord& r) {
    report->push_back({{"round", r.round},
                       {"source", r.source},
                       {"predicted_step_seconds", r.predicted_step_seconds},
                       {"measured_step_seconds", r.measured_step_seconds},
                       {"instructions", r.instructions},
                       {"threads_per_rank", r.threads_per_rank}});
    if (progress) {
      std::fprintf(stderr, "dc-plan: round %d (%s): predicted %.6f s, measured %.6f s per step\n",
                   r.round, r.source.c_str(), r.predicted_step_seconds, r.measured_step_seconds);
    }
  };
}

// The plan as stored: planning times vary run to run, so they stay out of the file and the same
// inputs give a byte-identical plan. They are reported on stdout.
proto::Schedule WithoutTimings(proto::Schedule plan) {
  for (auto& pass : *plan.mutable_passes()) pass.clear_seconds();
  return plan;
}

void PrintReport(const Profile& profile, const proto::Schedule& plan) {
  std::printf("profile of %s: %d rank(s), %d measured step(s), median step %.4f s\n",
              profile.trace_path.c_str(), profile.world_size, profile.steps_measured,
              profile.step_seconds_median);
  double compute = 0, comm = 0, overlap = 0, exposed = 0;
  for (const auto& o : profile.overlap) {
    compute += o.compute_seconds;
    comm += o.communication_seconds;
    overlap += o.overlap_seconds;
    exposed += o.exposed_communication_seconds;
  }
  const double n = profile.overlap.empty() ? 1.0 : static_cast<double>(profile.overlap.size());
  std::printf(
      "per step and rank: compute %.4f s, communication %.4f s, overlapped %.4f s, exposed "
      "communication %.4f s\n",
      compute / n, comm / n, overlap / n, exposed / n);
  std::printf(
      "all-gather cost: %.1f us + bytes / %.2f GB/s; reduce-scatter: %.1f us + bytes / %.2f GB/s\n",
      profile.costs.all_gather.latency_seconds * 1e6,
      profile.costs.all_gather.bandwidth_bytes_per_second / 1e9,
      profile.costs.reduce_scatter.latency_seconds * 1e6,
      profile.costs.reduce_scatter.bandwidth_bytes_per_second / 1e9);
  if (profile.costs.collective_compute_seconds > 0) {
    std::printf(
        "compute-stream time per collective: %.1f us (the communication threads' share of the "
        "compute thread's core, fitted so the trace's own schedule takes its measured step)\n",
        profile.costs.collective_compute_seconds * 1e6);
  }
  const auto& mem = profile.memory;
  std::printf("measured memory timeline (rank 0): peak %s at %.4f s\n",
              FormatBytes(mem.peak_bytes).c_str(), mem.peak_ts_ns / 1e9);
  for (size_t k = 0; k < mem.kinds.size() && k < mem.peak_by_kind.size(); ++k) {
    if (mem.peak_by_kind[k] > 0)
      std::printf("  %-16s %s\n", mem.kinds[k].c_str(), FormatBytes(mem.peak_by_kind[k]).c_str());
  }
  // A coarse picture of live bytes over the step: 16 samples of the measured timeline.
  if (!mem.points.empty() && mem.peak_bytes > 0) {
    const int64_t t0 = mem.points.front().ts_ns, t1 = mem.points.back().ts_ns;
    constexpr int kSamples = 16, kBarWidth = 40;
    size_t i = 0;
    for (int s = 0; s < kSamples; ++s) {
      // In doubles: a span of 2^62 ns times the sample index, or live bytes times the bar
      // width, leaves 64 bits (the reader's range rules allow both).
      const int64_t t =
          t0 + static_cast<int64_t>(static_cast<double>(t1 - t0) * s / (kSamples - 1));
      while (i + 1 < mem.points.size() && mem.points[i + 1].ts_ns <= t) ++i;
      const int64_t live = mem.points[i].total_bytes;
      const int bar = std::clamp(static_cast<int>(kBarWidth * static_cast<double>(live) /
                                                  static_cast<double>(mem.peak_bytes)),
                                 0, kBarWidth);
      std::printf("  %8.4f s |%-*s| %s\n", (t - t0) / 1e9, kBarWidth, std::string(bar, '#').c_str(),
                  FormatBytes(live).c_str());
    }
  }
  std::printf("plan (%s): predicted step %.4f s, peak %s; baseline %.4f s, peak %s\n",
              plan.policy().c_str(), plan.prediction().step_seconds(),
              FormatBytes(plan.prediction().peak_device_bytes()).c_str(),
              plan.baseline().step_seconds(),
              FormatBytes(plan.baseline().peak_device_bytes()).c_str());
}

void PrintExplain(const proto::Schedule& plan, const StepBound& bound) {
  std::printf("passes (%s):\n", plan.policy().c_str());
  double previous_seconds = plan.baseline().step_seconds();
  int64_t previous_peak = plan.baseline().peak_device_bytes();
  for (const auto& p : plan.passes()) {
    const double step = p.predicted_step_seconds();
    const int64_t peak = p.predicted_peak_bytes();
    std::printf("  %-20s %-9s %8.3f ms  step %.6f s (%+.6f)  peak %s (%+lld B)  %d instructions\n",
                p.name().c_str(), p.changed() ? "changed" : "unchanged", p.seconds() * 1e3, step,
                step - previous_seconds, FormatBytes(peak).c_str(),
                static_cast<long long>(peak - previous_peak), p.instructions());
    if (!p.summary().empty()) std::printf("  %-20s %s\n", "", p.summary().c_str());
    previous_seconds = step;
    previous_peak = peak;
  }
  const double base = plan.baseline().step_seconds(), now = plan.prediction().step_seconds();
  if (now > 0) std::printf("  speed-up over the zero3 baseline: %.3fx\n", base / now);
  // Which candidate won: a rival policy's plan or a fallback says so in a note.
  bool noted = false;
  for (const auto& note : plan.notes()) {
    if (note.rfind("kept ", 0) == 0 || note.find("planned with") != std::string::npos) {
      std::printf("  chosen: %s\n", note.c_str());
      noted = true;
    }
  }
  if (!noted) std::printf("  chosen: %s's own pipeline\n", plan.policy().c_str());
  std::printf(
      "  predicted step %.4f s, %s (%s binds; no schedule of this program on this profile is "
      "faster)\n",
      now, BoundText(bound, now).c_str(), bound.binding.c_str());
  std::printf(
      "  bound terms: compute %.4f s, compute and host optimizer %.4f s, communication %.4f s, "
      "under the overlap slowdown %.4f s",
      bound.compute_seconds, bound.compute_host_seconds, bound.communication_seconds,
      bound.overlap_seconds);
  if (bound.serial_seconds > 0) std::printf(", serial streams %.4f s", bound.serial_seconds);
  std::printf("\n");
}

// What the command line asks for.
struct Flags {
  std::string trace_path, out = "plan.dcplan", cache_dir, policy = "dc", from_plan;
  int64_t budget = 0;
  bool no_cache = false, report = false, json = false, synthetic = false, explain = false;
  bool quiet = false, print_hardware = false;
  std::string hardware = "h100-sxm", dump_after, perfetto;
  int world = 8, gpus_per_node = 8;
  int threads = AvailableCores();
  cli::ModelFlags model;
  RoundOptions rounds;
  std::vector<std::string> passes, disable;
};

void AddFlags(CLI::App& app, Flags* f) {
  app.add_option("trace", f->trace_path,
                 "trace written by dc-collect or dc-run --trace (omit with --synthetic)");
  app.add_flag(
      "--synthetic", f->synthetic,
      "plan a model on a hardware profile without a trace (roofline and NCCL-ring cost estimates), "
      "e.g. --synthetic --model llama3-70b --world 32 --hardware h100-sxm --gpus-per-node 8");
  f->model.Add(app);
  app.add_option("--world", f->world, "ranks (--synthetic)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--hardware", f->hardware,
                 "hardware profile (--synthetic): " + Join(HardwareNames(), ", ") +
                     ", or a profile file (FILE.json, as --print-hardware writes)")
      ->capture_default_str();
  app.add_option("--gpus-per-node", f->gpus_per_node, "GPUs per node (--synthetic)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_flag("--print-hardware", f->print_hardware,
               "print the --hardware profile as a file (each constant's value, unit and source) "
               "to edit and pass back as --hardware FILE.json, and exit");
  app.add_flag("--explain", f->explain,
               "say per pass what it changed and what it bought (predicted seconds and bytes)");
  app.add_option("--rounds", f->rounds.rounds,
                 "profile-guided rounds: run the plan with collection (as many BLAS threads per "
                 "rank as the trace recorded), re-plan from the new trace, keep the best measured "
                 "plan (plans measured within 3% of it are measured again, alternately, and the "
                 "means decide)")
      ->check(CLI::Range(0, 100));
  app.add_option("--round-steps", f->rounds.steps, "measured steps per round")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--perfetto", f->perfetto,
                 "write the plan's simulated timeline as Chrome trace-event JSON "
                 "(ui.perfetto.dev), to open "
                 "beside `dc-trace perfetto` of a measured trace")
      ->check(cli::NonEmptyPath());
  app.add_option("--dump-after", f->dump_after,
                 "write the schedule after this pass as text to <plan>.<pass>.txt");
  cli::AddBytesOption(app, "--budget", &f->budget,
                      "device memory budget per rank, e.g. 1GiB (default: unlimited)");
  app.add_option("--passes", f->passes,
                 "run exactly these passes in order instead of the policy's, e.g. --passes "
                 "zero3,prefetch,bucket")
      ->delimiter(',');
  app.add_option("--disable", f->disable,
                 "switch these passes of the policy off by name, e.g. --disable bucket")
      ->delimiter(',');
  std::string policies_help = "pass pipeline:";
  for (const Policy& p : Policies()) policies_help += " " + p.name + " (" + p.summary + "),";
  policies_help.back() = '.';
  app.add_option("--policy", f->policy, policies_help)
      ->check(CLI::IsMember(PolicyNames()))
      ->capture_default_str();
  app.add_option("--from-plan", f->from_plan,
                 "re-plan this plan's program, for its world size, with the trace's profile (the "
                 "trace must be of the same program; one of another world size is used and noted), "
                 "e.g. dc-plan t.db --from-plan four-ranks.dcplan");
  app.add_option("--cache-dir", f->cache_dir,
                 "plan cache directory (default: $XDG_CACHE_HOME/dc or ~/.cache/dc)");
  app.add_flag("--no-cache", f->no_cache, "neither read nor write the plan cache");
  app.add_option("--threads", f->threads,
                 "candidate plans (the policy's splits and fallbacks), and the memory plan's "
                 "packings, made at once; the plan is the same for any number, "
                 "only planning time changes (default: the cores "
                 "available to dc-plan), e.g. --threads 1 to leave the other cores to training")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("-o,--output", f->out, "plan file to write")
      ->check(cli::NonEmptyPath())
      ->capture_default_str();
  app.add_flag("--report", f->report,
               "print the measured memory timeline and overlap summary, the fitted collective "
               "costs and, on a cpu trace of two or more ranks, the compute-stream time each "
               "collective takes (with --synthetic: the simulated step's)");
  app.add_flag("--json", f->json, "print one JSON object");
  app.add_flag("--quiet", f->quiet,
               "no progress on stderr (progress shows only on a terminal anyway)");
}

// What planning made, for printing.
struct Outcome {
  proto::Schedule plan;
  std::string cache_key;
  bool cache_hit = false;
  std::optional<Profile> measured;
  std::vector<std::string> notes;
  std::vector<std::string> warnings;
  StepBound bound;                 // of the plan's program, world and costs
  std::optional<Machine> machine;  // --synthetic: the profile the costs came from
  // --synthetic: the prediction's range over the profile's assumed constants (none where the
  // profile assumes nothing).
  std::optional<PredictionRange> range;
  nlohmann::json rounds = nlohmann::json::array();
  int kept_round = 0;               // with --rounds: the round whose plan was written
  int traced_threads_per_rank = 0;  // the trace's BLAS threads per rank (0: not recorded)
  double kept_step_seconds = 0;
  CostModel costs;  // what the plan was predicted with
};

// The request the flags describe: the trace's (or the synthetic model's) program and costs, the
// policy or passes, progress and dumps.
StatusOr<PlanRequest> RequestOf(const Flags& f, Outcome* outcome) {
  PlanRequest request;
  DC_RETURN_IF_ERROR(f.synthetic ? SyntheticRequest(f.model, f.hardware, f.world, f.gpus_per_node,
                                                    f.budget, &request, &outcome->machine)
                                 : TraceRequest(f.trace_path, f.from_plan, f.budget, &request,
                                                &outcome->measured, &outcome->notes,
                                                &outcome->traced_threads_per_rank));
  request.policy = f.passes.empty() ? f.policy : "custom";
  request.passes = f.passes;
  request.disabled_passes = f.disable;
  request.threads = f.threads;
  // Progress for plans that take a while: each pass once planning has run past a second.
  if (!f.quiet && ::isatty(STDERR_FILENO)) {
    const auto planning_start = std::chrono::steady_clock::now();
    request.on_pass = [planning_start](const proto::PassRecord& record) {
      constexpr double kQuietSeconds = 1.0;
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - planning_start).count();
      if (elapsed > kQuietSeconds) {
        std::fprintf(stderr, "dc-plan: %.1f s: %s done (%d instructions)\n", elapsed,
                     record.name().c_str(), record.instructions());
      }
    };
  }
  if (!f.dump_after.empty()) {
    request.dump_after = f.dump_after;
    request.dump = [out = f.out](std::string_view pass, const proto::Schedule& schedule) {
      const std::string path = out + "." + std::string(pass) + ".txt";
      if (Status written = WriteFileAtomic(path, ScheduleToText(schedule)); written.ok()) {
        std::fprintf(stderr, "dc-plan: wrote the schedule after %s to %s\n",
                     std::string(pass).c_str(), path.c_str());
      } else {
        std::fprintf(stderr, "dc-plan: %s\n", written.message().c_str());
      }
    };
  }
  return request;
}

// Plans (or finds the plan in the cache), runs the profile-guided rounds, and writes the plan
// and its simulated timeline.
StatusOr<Outcome> Plan(const Flags& f) {
  Outcome outcome;
  DC_ASSIGN_OR_RETURN(PlanRequest request, RequestOf(f, &outcome));
  DC_ASSIGN_OR_RETURN(outcome.cache_key, PlanKey(request));
  PlanCache cache(f.cache_dir.empty() ? DefaultCacheDir() : f.cache_dir);
  std::optional<proto::Schedule> plan;
  // A dump is a side effect of planning: skip the cache so it is written. Rounds measure the
  // runners-up a planning gives, which the cache does not keep.
  if (!f.no_cache && f.dump_after.empty() && f.rounds.rounds == 0) {
    plan = cache.Lookup(outcome.cache_key);
  }
  outcome.cache_hit = plan.has_value();
  std::vector<RunnerUp> runners_up;
  if (f.rounds.rounds > 0) request.runners_up = &runners_up;
  if (!outcome.cache_hit) {
    auto made = MakePlan(request);
    if (!made.ok()) {
      Status failed = made.status().Prefixed(f.synthetic ? "" : f.trace_path + ": ");
      if (auto smallest = SmallestBudget(request, made.status().shortfall_bytes());
          smallest.has_value()) {
        failed = Status::Error(failed.message() + "; the smallest budget the " + request.policy +
                               " policy meets is " + FormatBytes(*smallest) + " (--budget " +
                               std::to_string(*smallest) + ")");
      }
      return failed;
    }
    plan = std::move(made).value();
    if (!f.no_cache) {
      // The cache only saves time: a cache that cannot be written costs the next run a re-plan,
      // never this run its plan.
      if (Status stored = cache.Store(outcome.cache_key, WithoutTimings(*plan)); !stored.ok()) {
        outcome.warnings.push_back("the plan is written but not cached: " + stored.message());
      }
    }
  }
  if (f.rounds.rounds > 0) {
    if (f.synthetic) return Status::Error("--rounds needs a trace to start from, not --synthetic");
    const bool progress = !f.quiet && ::isatty(STDERR_FILENO);
    RoundOptions rounds = f.rounds;
    rounds.threads_per_rank = outcome.traced_threads_per_rank;
    DC_ASSIGN_OR_RETURN(
        RoundsResult kept,
        PlanInRounds(request, *plan, f.rounds.rounds,
                     MeasureByRunning(rounds, request.backend, f.out),
                     ReportRounds(&outcome.rounds, progress), std::move(runners_up)));
    plan = std::move(kept.plan);
    // Its prediction, bound and timeline are its own costs' (a later round's plan: that round's
    // trace).
    request.costs = std::move(kept.costs);
    outcome.kept_round = kept.kept_round;
    outcome.kept_step_seconds = kept.kept_step_seconds;
  }
  DC_RETURN_IF_ERROR(SavePlan(f.out, WithoutTimings(*plan)));
  if (!f.perfetto.empty()) {
    DC_ASSIGN_OR_RETURN(SimResult sim, Simulate(*plan, request.costs));
    DC_RETURN_IF_ERROR(WritePlanPerfettoFile(*plan, sim, f.perfetto).status());
  }
  outcome.costs = request.costs;
  outcome.bound = StepLowerBound(plan->program(), plan->world_size(), request.costs);
  if (outcome.machine && f.rounds.rounds == 0 && (f.json || f.explain)) {
    DC_ASSIGN_OR_RETURN(outcome.range, RangeOf(*plan, *outcome.machine));
  }
  // A rule's plan kept over dc's own by a trace's prediction: a margin the measurement may not
  // hold (bench/CALIBRATION.md); rounds measure both.
  if (!f.synthetic && f.rounds.rounds == 0) {
    if (!plan->kept_rival().empty() && plan->own_step_seconds() > 0) {
      outcome.notes.push_back(
          "predictions from a trace can miss by more than that margin; dc-plan " + f.trace_path +
          " --rounds 2 measures this plan and, where it misses its prediction by more, the "
          "runner-up, and keeps the faster");
    }
  }
  outcome.plan = std::move(*plan);
  return outcome;
}

// --report without a trace (--synthetic): the simulated step, as dc-trace summary shows a plan.
void PrintPredictedReport(const Outcome& o) {
  auto sim = Simulate(o.plan, o.costs);
  if (!sim.ok()) {
    std::fprintf(stderr, "dc-plan: --report: %s\n", sim.status().message().c_str());
    return;
  }
  const std::unique_ptr<Timeline> timeline = PlanTimeline("predicted step", o.plan, *sim);
  auto summary = Summarize(*timeline, SummaryOptions{});
  if (!summary.ok()) {
    std::fprintf(stderr, "dc-plan: --report: %s\n", summary.status().message().c_str());
    return;
  }
  std::printf("no trace (--synthetic): the report is the simulator's prediction\n%s",
              SummaryText(*summary).c_str());
}

void PrintJson(const Flags& f, const Outcome& o) {
  const proto::Schedule& plan = o.plan;
  nlohmann::json j;
  j["plan"] = f.out;
  j["cache"] = o.cache_hit ? "hit" : "miss";
  j["cache_key"] = o.cache_key;
  j["policy"] = plan.policy();
  // Where the policy kept another policy's plan: which, and its own step that lost (0: its own
  // pipelines did not fit the budget).
  if (!plan.kept_rival().empty()) {
    j["kept_rival"] = plan.kept_rival();
    j["own_step_seconds"] = plan.own_step_seconds();
  }
  j["world_size"] = plan.world_size();
  j["budget_bytes"] = plan.budget_bytes();
  j["instructions"] = plan.instructions_size();
  j["arena_bytes"] = plan.memory_plan().arena_bytes();
  // The plan's notes, then the run's (the trace's, and what dc-plan adds about them), as the text
  // output prints them.
  std::vector<std::string> notes(plan.notes().begin(), plan.notes().end());
  notes.insert(notes.end(), o.notes.begin(), o.notes.end());
  j["notes"] = notes;
  j["predicted"] = PredictionJson(plan.prediction());
  j["baseline"] = PredictionJson(plan.baseline());
  j["bound"] = BoundJson(o.bound, plan.prediction().step_seconds());
  if (o.range) {
    j["range"] = {
        {"assumed", o.range->assumed},
        {"step_error_fraction", o.range->step_error_fraction},
        {"step_seconds", {{"min", o.range->min_step_seconds}, {"max", o.range->max_step_seconds}}},
        {"speedup_over_baseline", {{"min", o.range->min_speedup}, {"max", o.range->max_speedup}}}};
  }
  j["passes"] = nlohmann::json::array();
  for (const auto& p : plan.passes()) {
    j["passes"].push_back({{"name", p.name()},
                           {"changed", p.changed()},
                           {"seconds", p.seconds()},
                           {"summary", p.summary()},
                           {"predicted_step_seconds", p.predicted_step_seconds()},
                           {"predicted_peak_bytes", p.predicted_peak_bytes()},
                           {"instructions", p.instructions()}});
  }
  if (o.measured) {
    j["measured_step_seconds"] = o.measured->step_seconds_median;
    int64_t skipped_records = 0;
    nlohmann::json skipped = nlohmann::json::array();
    for (const SkippedRecords& r : o.measured->skipped) {
      skipped_records += r.count;
      skipped.push_back({{"source", r.source}, {"problem", r.problem}, {"count", r.count}});
    }
    j["skipped_records"] = skipped_records;
    j["skipped"] = skipped;
  }
  if (f.rounds.rounds > 0) {
    j["rounds"] = o.rounds;
    j["kept_round"] = o.kept_round;
    j["kept_step_seconds"] = o.kept_step_seconds;
  }
  j["warnings"] = o.warnings;
  j["device"] = plan.device();
  std::cout << j.dump() << "\n";
}

void PrintText(const Flags& f, const Outcome& o) {
  const proto::Schedule& plan = o.plan;
  std::printf(
      "plan %s: cache %s, %d instructions for %d rank(s), predicted step %.4f s (%s), peak %s "
      "(budget %s)\n",
      f.out.c_str(), o.cache_hit ? "hit" : "miss", plan.instructions_size(), plan.world_size(),
      plan.prediction().step_seconds(),
      BoundText(o.bound, plan.prediction().step_seconds()).c_str(),
      FormatBytes(plan.prediction().peak_device_bytes()).c_str(),
      plan.budget_bytes() ? FormatBytes(plan.budget_bytes()).c_str() : "unlimited");
  for (const auto& round : o.rounds) {
    std::printf("round %d (%s): predicted %.6f s, measured %.6f s per step\n",
                round["round"].get<int>(), round["source"].get<std::string>().c_str(),
                round["predicted_step_seconds"].get<double>(),
                round["measured_step_seconds"].get<double>());
  }
  if (o.kept_round > 0) {
    std::printf(
        "kept round %d's plan: measured %.6f s per step (the mean of its measurements), the "
        "fastest of %zu measurement(s)\n",
        o.kept_round, o.kept_step_seconds, o.rounds.size());
  }
  if (f.explain) {
    PrintExplain(plan, o.bound);
    if (o.range) {
      std::string over;
      if (!o.range->assumed.empty()) {
        over = "the profile's " + std::to_string(o.range->assumed.size()) + " assumed constants (" +
               Join(o.range->assumed, ", ") + "; machine/HARDWARE.md)";
      }
      if (o.range->step_error_fraction > 0) {
        char error[160];
        std::snprintf(error, sizeof(error),
                      "%sits measured steps' median error (+-%.0f%%, step_error_fraction)",
                      over.empty() ? "" : " and ", 100 * o.range->step_error_fraction);
        over += error;
      }
      std::printf(
          "  range over %s: step %.4f-%.4f s, speed-up over the zero3 baseline %.3f-%.3fx\n",
          over.c_str(), o.range->min_step_seconds, o.range->max_step_seconds, o.range->min_speedup,
          o.range->max_speedup);
    } else if (o.machine) {
      std::printf("  no range: the profile assumes none of its constants\n");
    }
  }
  if (f.report) {
    if (o.measured) {
      PrintReport(*o.measured, plan);
    } else {
      PrintPredictedReport(o);
    }
  }
  for (const auto& note : plan.notes()) std::fprintf(stderr, "dc-plan: note: %s\n", note.c_str());
  for (const auto& note : o.notes) std::fprintf(stderr, "dc-plan: note: %s\n", note.c_str());
  if (o.measured) {
    for (const SkippedRecords& r : o.measured->skipped) {
      std::fprintf(stderr, "dc-plan: warning: %s: %s\n", o.measured->trace_path.c_str(),
                   r.Text().c_str());
    }
  }
}

}  // namespace

// Flags, then the request planned, then what it made printed.
int main(int argc, char** argv) {
  dc::cli::KeepFreedPagesWhilePlanning();
  CLI::App app{
      "dc-plan: read a trace, derive the memory timeline and costs, and plan an optimized "
      "schedule into a plan file (cached across runs).\n"
      "Example: dc-plan trace.db --budget 1GiB -o plan.dcplan --report",
      "dc-plan"};
  Flags flags;
  AddFlags(app, &flags);
  if (std::optional<int> exit_code = cli::Parse(app, argc, argv)) return *exit_code;
  if (flags.print_hardware) {
    StatusOr<HardwareProfile> hw = ResolveHardware(flags.hardware);
    if (!hw.ok()) return cli::Fail("dc-plan", hw.status());
    std::cout << HardwareProfileJson(*hw);
    return 0;
  }
  // Neither or both: the command line does not say what to plan (a usage error, exit 2).
  if (flags.synthetic && !flags.trace_path.empty()) {
    std::cerr << "dc-plan: " << flags.trace_path
              << ": a trace and --synthetic exclude each other (the trace has its own model); "
                 "drop one\n";
    return cli::kUsageExitCode;
  }
  if (!flags.synthetic && flags.trace_path.empty()) {
    std::cerr << "dc-plan: give a trace, or --synthetic with --model (see --help)\n";
    return cli::kUsageExitCode;
  }
  if (!flags.synthetic) {
    // A trace brings its own model, world and machine: flags that describe another would be
    // silently ignored.
    std::vector<std::string> ignored = flags.model.Given(app);
    for (const char* name : {"--world", "--hardware", "--gpus-per-node"}) {
      if (app.count(name) > 0) ignored.push_back(name);
    }
    if (!ignored.empty()) {
      return cli::Fail("dc-plan", Status::Error(flags.trace_path + ": " + Join(ignored, ", ") +
                                                " describe a model for --synthetic, and the trace "
                                                "has its own; re-record it with dc-collect to "
                                                "change the model, or drop them"));
    }
  }
  for (const auto& [flag, names] :
       {std::pair{"--passes", &flags.passes}, std::pair{"--disable", &flags.disable}}) {
    if (std::find(names->begin(), names->end(), "") != names->end()) {
      std::cerr << "dc-plan: " << flag
                << " has an empty pass name; give names separated by commas, e.g. " << flag
                << (std::string(flag) == "--passes" ? " zero3,prefetch" : " bucket") << "\n";
      return cli::kUsageExitCode;
    }
  }
  for (size_t i = 0; i < flags.passes.size(); ++i) {
    for (size_t k = 0; k < i; ++k) {
      if (flags.passes[i] == flags.passes[k]) {
        return cli::Fail("dc-plan", Status::Error("--passes names " + flags.passes[i] +
                                                  " twice; each pass runs once"));
      }
    }
  }
  const std::string data_path = flags.model.overrides.data_path.value_or("");
  for (const std::string& output : {flags.out, flags.perfetto}) {
    Status distinct =
        CheckOutputIsNotAnInput(output, {flags.trace_path, flags.from_plan, data_path});
    if (!distinct.ok()) return cli::Fail("dc-plan", distinct);
  }
  // The timeline is written after the plan: over it, it would replace the plan with JSON.
  if (!flags.perfetto.empty() && !CheckOutputIsNotAnInput(flags.perfetto, {flags.out}).ok()) {
    return cli::Fail("dc-plan",
                     Status::Error("--perfetto " + flags.perfetto + " is also the plan file (-o " +
                                   flags.out + "); write the timeline to another file"));
  }
  // Both outputs are checked before planning, so that a timeline that cannot be written does not
  // fail the command after the plan is written.
  for (const std::string& output : {flags.out, flags.perfetto}) {
    if (output.empty()) continue;
    if (Status writable = CheckOutputWritable(output); !writable.ok()) {
      return cli::Fail("dc-plan", writable);
    }
  }
  StatusOr<Outcome> outcome = Plan(flags);
  if (!outcome.ok()) return cli::Fail("dc-plan", outcome.status());
  if (flags.json) {
    PrintJson(flags, *outcome);
  } else {
    PrintText(flags, *outcome);
  }
  for (const auto& warning : outcome->warnings) {
    std::fprintf(stderr, "dc-plan: warning: %s\n", warning.c_str());
  }
  return 0;
}
