// dc-trace: look at a trace (dc, nsys export, PyTorch profiler) or a plan's predicted step:
// summary, Perfetto JSON, memory SVG, diff.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "collector/host_tracer.h"
#include "schemas/files.h"
#include "schemas/units.h"
#include "tools/cli.h"
#include "tracetools/perfetto.h"
#include "tracetools/report.h"
#include "tracetools/svg.h"

namespace {

using namespace dc;
constexpr char kProgram[] = "dc-trace";

// Progress on stderr once an operation has run for a second, when stderr is a terminal.
class Progress {
 public:
  explicit Progress(bool quiet) : enabled_(!quiet && ::isatty(STDERR_FILENO)) {}
  ~Progress() {
    if (printed_) std::fprintf(stderr, "\r\033[K");
  }
  ProgressFn Fn() {
    if (!enabled_) return nullptr;
    return [this](const std::string& what, int64_t records) { Report(what, records); };
  }

 private:
  void Report(const std::string& what, int64_t records) {
    using Clock = std::chrono::steady_clock;
    const auto now = Clock::now();
    if (now - start_ < std::chrono::seconds(1)) return;
    std::fprintf(stderr, "\r\033[K%s: reading %s: %lld records", kProgram, what.c_str(),
                 static_cast<long long>(records));
    printed_ = true;
  }
  bool enabled_;
  bool printed_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

struct Common {
  std::vector<std::string> inputs;
  PlanCostSource plan_costs;
  bool json = false, quiet = false;
};

void AddCommon(CLI::App* sub, Common* common) {
  sub->add_option("--profile", common->plan_costs.profile_trace,
                  "for a plan input: re-simulate it with the costs profiled from this dc trace "
                  "(default: the built-in profile the plan was made with, found by its profile "
                  "digest, else the default cost model)");
  sub->add_option("--hardware", common->plan_costs.hardware,
                  "for a plan input: re-simulate it with this hardware profile, a built-in name or "
                  "a profile file (dc-calibrate's), as dc-plan --synthetic --hardware made it; "
                  "says whether these are the costs the plan was made with");
  sub->add_option("--gpus-per-node", common->plan_costs.gpus_per_node,
                  "with --hardware: ranks per node of the plan's world (dc-plan's, default 8)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_flag("--json", common->json, "print one JSON object");
  sub->add_flag("-q,--quiet", common->quiet, "no progress on stderr");
}

StatusOr<std::unique_ptr<Timeline>> Open(const std::vector<std::string>& inputs,
                                         const Common& common, Progress* progress) {
  OpenOptions options;
  options.plan_costs = common.plan_costs;
  options.progress = progress->Fn();
  return OpenTimeline(inputs, options);
}

// Notes, and the records the reader left out (the summary shows those itself).
void PrintNotes(const Timeline& timeline) {
  for (const SkippedRecords& skipped : timeline.skipped()) {
    std::fprintf(stderr, "%s: warning: %s: %s\n", kProgram, timeline.path().c_str(),
                 skipped.Text().c_str());
  }
  for (const std::string& note : timeline.notes()) {
    std::fprintf(stderr, "%s: note: %s\n", kProgram, note.c_str());
  }
}

int RunSummary(const Common& common, int top) {
  Progress progress(common.quiet);
  auto timeline = Open(common.inputs, common, &progress);
  if (!timeline.ok()) return cli::Fail(kProgram, timeline.status());
  SummaryOptions options;
  options.top_kernels = top;
  options.progress = progress.Fn();
  auto summary = Summarize(**timeline, options);
  if (!summary.ok()) return cli::Fail(kProgram, summary.status());
  if (common.json) {
    std::cout << SummaryJson(*summary).dump() << "\n";
  } else {
    std::cout << SummaryText(*summary);
  }
  return 0;
}

int RunPerfetto(const Common& common, const std::string& out) {
  Progress progress(common.quiet);
  auto timeline = Open(common.inputs, common, &progress);
  if (!timeline.ok()) return cli::Fail(kProgram, timeline.status());
  auto stats = WritePerfettoFile(**timeline, out, progress.Fn());
  if (!stats.ok()) return cli::Fail(kProgram, stats.status());
  if (common.json) {
    std::cout << nlohmann::json{{"output", out},
                                {"source", (*timeline)->path()},
                                {"format", TimelineFormatName((*timeline)->format())},
                                {"processes", stats->processes},
                                {"threads", stats->threads},
                                {"slices", stats->slices},
                                {"counters", stats->counters},
                                {"flows", stats->flows}}
                     .dump()
              << "\n";
    return 0;
  }
  std::printf(
      "wrote %s: %d process(es), %d thread(s), %lld slice(s), %lld memory counter(s), "
      "%lld flow(s); open it in ui.perfetto.dev or chrome://tracing\n",
      out.c_str(), stats->processes, stats->threads, static_cast<long long>(stats->slices),
      static_cast<long long>(stats->counters), static_cast<long long>(stats->flows));
  PrintNotes(**timeline);
  return 0;
}

int RunMemory(const Common& common, const std::string& out, MemoryChartOptions options) {
  Progress progress(common.quiet);
  auto timeline = Open(common.inputs, common, &progress);
  if (!timeline.ok()) return cli::Fail(kProgram, timeline.status());
  if (options.budget_bytes == 0 && (*timeline)->schedule()) {
    options.budget_bytes = (*timeline)->schedule()->budget_bytes();
  }
  auto chart = BuildMemoryChart(**timeline, options);
  if (!chart.ok()) return cli::Fail(kProgram, chart.status());
  if (Status written = WriteFileAtomic(out, RenderMemorySvg(*chart)); !written.ok()) {
    return cli::Fail(kProgram, written);
  }
  if (common.json) {
    nlohmann::json j = MemoryChartJson(*chart);
    j["output"] = out;
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf(
      "wrote %s: %s, peak %s at %.6f s, %zu kind(s), %zu all-gather(s), %zu offload(s), "
      "%zu reload(s)\n",
      out.c_str(), chart->title.c_str(), FormatBytes(chart->peak_bytes).c_str(),
      static_cast<double>(chart->peak_t_ns) * 1e-9, chart->kinds.size(), chart->gathers_ns.size(),
      chart->offloads_ns.size(), chart->reloads_ns.size());
  PrintNotes(**timeline);
  return 0;
}

int RunDiff(const Common& common, const std::string& a, const std::string& b, int top) {
  Progress progress(common.quiet);
  auto first = Open({a}, common, &progress);
  if (!first.ok()) return cli::Fail(kProgram, first.status());
  auto second = Open({b}, common, &progress);
  if (!second.ok()) return cli::Fail(kProgram, second.status());
  auto diff = DiffTimelines(**first, **second, top, progress.Fn());
  if (!diff.ok()) return cli::Fail(kProgram, diff.status());
  // Two runs of one program under different plans is what diff is for; two programs (another
  // model or world size) compare different work, which the numbers alone would not say.
  const proto::Schedule* sa = (*first)->schedule();
  const proto::Schedule* sb = (*second)->schedule();
  if (sa != nullptr && sb != nullptr &&
      (sa->program_digest() != sb->program_digest() || sa->world_size() != sb->world_size())) {
    std::fprintf(stderr,
                 "%s: warning: %s (%d rank(s)) and %s (%d rank(s)) are not of the same program "
                 "and world size: the differences include the work itself, not only the "
                 "schedule\n",
                 kProgram, a.c_str(), sa->world_size(), b.c_str(), sb->world_size());
  }
  if (common.json) {
    std::cout << DiffJson(*diff).dump() << "\n";
  } else {
    std::cout << DiffText(*diff);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dc-trace: look at a trace (dc-collect's, an nsys SQLite export, or PyTorch profiler "
      "traces, one .json/.json.gz per rank) or a plan's predicted step.",
      kProgram};
  app.require_subcommand(1);

  Common summary_args;
  int summary_top = 10;
  CLI::App* summary = app.add_subcommand(
      "summary",
      "per rank and step: step time, compute / communication / copy / idle time, "
      "overlap and exposed communication (HTA's definitions), top kernels, streams, "
      "peak memory by kind, dropped records");
  summary
      ->add_option("trace", summary_args.inputs,
                   "a dc trace, nsys export, plan, or PyTorch traces (files or a directory)")
      ->required();
  summary->add_option("--top", summary_top, "kernels to list per rank")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  AddCommon(summary, &summary_args);
  summary->footer("Example: dc-trace summary trace.db --json");

  Common perfetto_args;
  std::string perfetto_out;
  CLI::App* perfetto =
      app.add_subcommand("perfetto",
                         "write Chrome trace-event JSON for ui.perfetto.dev: a process per rank, a "
                         "track per stream, memory counters, all-gather -> use flow arrows");
  perfetto->add_option("trace", perfetto_args.inputs, "a trace, plan or PyTorch traces")
      ->required();
  perfetto->add_option("-o,--output", perfetto_out, "JSON file to write")
      ->required()
      ->check(cli::NonEmptyPath());
  AddCommon(perfetto, &perfetto_args);
  perfetto->footer(
      "Example: dc-trace perfetto trace.db -o trace.json   (then open it in "
      "ui.perfetto.dev)");

  Common memory_args;
  std::string memory_in, memory_out;
  MemoryChartOptions memory_options;
  CLI::App* memory = app.add_subcommand(
      "memory",
      "draw live device memory by kind over one rank's step as an SVG (budget line, "
      "peak, all-gather / offload ticks)");
  memory->add_option("input", memory_in, "a trace or a plan")->required();
  memory->add_option("-o,--output", memory_out, "SVG file to write")
      ->required()
      ->check(cli::NonEmptyPath());
  cli::AddBytesOption(*memory, "--budget", &memory_options.budget_bytes,
                      "draw this budget line, e.g. 2GiB (default: the plan's budget)");
  memory->add_option("--rank", memory_options.rank, "rank to draw (default: the first)")
      ->check(CLI::NonNegativeNumber);
  memory->add_option("--step", memory_options.step, "step to draw (default: the first measured)")
      ->check(CLI::NonNegativeNumber);
  AddCommon(memory, &memory_args);
  memory->footer("Example: dc-trace memory plan.dcplan -o memory.svg --budget 1GiB");

  Common diff_args;
  std::string diff_a, diff_b;
  int diff_top = 10;
  CLI::App* diff = app.add_subcommand(
      "diff",
      "compare two traces, or a trace and a plan's prediction: step time, exposed "
      "communication, peak memory, and the instructions whose time changed most");
  diff->add_option("a", diff_a, "the first trace or plan")->required();
  diff->add_option("b", diff_b, "the second trace or plan")->required();
  diff->add_option("--top", diff_top, "changed instructions to list")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  AddCommon(diff, &diff_args);
  diff->footer("Example: dc-trace diff baseline.db optimized.db --top 20");

  std::vector<std::string> merge_parts;
  std::string merge_out;
  CLI::App* merge = app.add_subcommand(
      "merge",
      "join the rank files a killed or failed dc-collect / dc-run --trace left beside its trace "
      "(t.db.rank0.part, ...) into one trace of the steps every rank completed, marked "
      "incomplete");
  merge->add_option("parts", merge_parts, "the rank files, in rank order")->required();
  merge->add_option("-o,--output", merge_out, "trace file to write (SQLite)")
      ->required()
      ->check(cli::NonEmptyPath());
  merge->footer("Example: dc-trace merge t.db.rank0.part t.db.rank1.part -o t.db");

  // A first word that is no subcommand would get CLI11's "A subcommand is required", which does
  // not say that the word was read, nor which subcommands there are.
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
  if (argc > 1 && argv[1][0] != '-' &&
      std::find(names.begin(), names.end(), argv[1]) == names.end()) {
    std::cerr << "dc-trace: unknown subcommand '" << argv[1] << "'; use one of "
              << Join(names, ", ") << " (dc-trace --help)\n";
    return cli::kUsageExitCode;
  }
  if (std::optional<int> exit_code = cli::Parse(app, argc, argv)) return *exit_code;

  if (summary->parsed()) return RunSummary(summary_args, summary_top);
  if (merge->parsed()) {
    if (Status distinct = CheckOutputIsNotAnInput(merge_out, merge_parts); !distinct.ok()) {
      return cli::Fail("dc-trace", distinct);
    }
    auto merged = MergeRankTraces(merge_parts, merge_out, MergeOptions{});
    if (!merged.ok()) return cli::Fail("dc-trace", merged.status());
    std::printf("wrote %s: %d rank(s), steps up to %lld%s%s\n", merge_out.c_str(), merged->ranks,
                static_cast<long long>(merged->last_step),
                merged->incomplete.empty() ? "" : ", incomplete: ", merged->incomplete.c_str());
    return 0;
  }
  if (perfetto->parsed()) {
    if (Status distinct = CheckOutputIsNotAnInput(perfetto_out, perfetto_args.inputs);
        !distinct.ok()) {
      return cli::Fail("dc-trace", distinct);
    }
    return RunPerfetto(perfetto_args, perfetto_out);
  }
  if (memory->parsed()) {
    if (Status distinct = CheckOutputIsNotAnInput(memory_out, {memory_in}); !distinct.ok()) {
      return cli::Fail("dc-trace", distinct);
    }
    memory_args.inputs = {memory_in};
    return RunMemory(memory_args, memory_out, memory_options);
  }
  return RunDiff(diff_args, diff_a, diff_b, diff_top);
}
