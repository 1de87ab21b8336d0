// dc-trace's library: the reports made from the one timeline view over every source it reads
// (analyzer/timeline.h: dc traces, nsys exports and PyTorch profiler traces; here, a plan's
// simulated step): the per-rank, per-step summary with HTA's
// overlap definitions, and the diff of two timelines.
//
// A Timeline streams: Summarize and Diff read activities and memory events once or twice in
// order and keep only aggregates, so a dc trace with millions of activities is summarized in
// bounded memory. Timelines are not thread-safe; the functions here are pure.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "analyzer/timeline.h"
#include "machine/cost_model.h"
#include "machine/simulator.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// A plan's step as the simulator predicts it, on one rank (every rank runs the same stream):
// one activity per instruction that takes time, the memory timeline by BufferKind as untracked
// events, one step window [0, step].
std::unique_ptr<Timeline> PlanTimeline(const std::string& path, const proto::Schedule& plan,
                                       const SimResult& sim);

// Where a plan's re-simulation takes its costs: the profile of a dc trace of the plan's program;
// or a hardware profile (a built-in name or a profile file, as dc-plan --hardware) on the plan's
// world in nodes of `gpus_per_node`, which gives a synthetic plan the very costs it was made with;
// or, with neither, the built-in profile and node shape whose costs have the plan's profile digest
// (a synthetic plan's own costs), else the default CostModel (serial streams for the cpu backend).
struct PlanCostSource {
  std::string profile_trace;
  std::string hardware;
  int gpus_per_node = 8;  // dc-plan's default
};
// `note` says which costs, and for a hardware profile whether they are the plan's own (the
// plan's profile digest), so a user comparing a run with its prediction knows what was compared.
struct PlanCosts {
  CostModel costs;
  std::string note;
};
StatusOr<PlanCosts> CostsForPlan(const proto::Schedule& plan, const PlanCostSource& source);

enum class InputKind { kTrace, kKineto, kPlan };
// By content: the plan magic, SQLite's header, JSON or gzip; a directory holds Kineto traces.
StatusOr<InputKind> DetectInput(const std::string& path);

// Opens any input: a dc trace, an nsys export, Kineto traces (a file, several files or a
// directory of them, one per rank), or a plan (re-simulated with CostsForPlan).
struct OpenOptions {
  PlanCostSource plan_costs;  // for plans
  ProgressFn progress;
};
StatusOr<std::unique_ptr<Timeline>> OpenTimeline(const std::vector<std::string>& paths,
                                                 const OpenOptions& options);

// A readable name of schedule instruction `index`: the op of a compute, else its kind and
// first tensor ("all_gather layers.0.wq +3"). Like ops, the name repeats in every micro-step.
std::string InstructionName(const proto::Schedule& schedule, int index);

// What a diff matches on: a compute is its op; a collective, offload or reload is one part per
// tensor ("all_gather layers.0.wq"), its time shared by the tensors' bytes, so a bucketed
// gather in one schedule still matches the single gathers of another. Shares sum to 1.
struct InstructionPart {
  std::string name;
  double share = 1;
};
std::vector<InstructionPart> InstructionParts(const proto::Schedule& schedule, int index);

// ----- summary -----

struct PeakMemory {
  int64_t bytes = 0;
  int64_t at_ns = 0;
  std::vector<std::pair<std::string, int64_t>> by_kind;  // kinds with bytes at the peak
};

// HTA's definitions over one rank's step window, activities clipped to it: C the union of
// compute, N of communication, M of copies (memcpy, memset).
struct StepSummary {
  int step = 0;
  int64_t start_ns = 0, end_ns = 0;
  double step_seconds = 0;
  double compute_seconds = 0;                // |C|
  double communication_seconds = 0;          // |N|
  double copy_seconds = 0;                   // |M|
  double overlap_seconds = 0;                // |C ∩ N|
  double overlap_ratio = 0;                  // |C ∩ N| / |N|; 0 without communication
  double exposed_communication_seconds = 0;  // |N \ C|
  double idle_seconds = 0;                   // span - |C ∪ N ∪ M|
  std::optional<PeakMemory> peak_memory;     // where the source has memory events
};

struct NameStat {
  std::string name;
  ActivityClass kind = ActivityClass::kCompute;
  int64_t count = 0;
  int64_t total_ns = 0;
  int64_t bytes = 0;
};

struct StreamStat {
  int64_t stream_id = 0;
  std::string name;
  int64_t activities = 0;
  int64_t busy_ns = 0;  // union of the stream's activity intervals
};

// Rank-level figures count the activities that start inside a measured window.
struct RankSummary {
  TimelineRank rank;
  std::vector<StepSummary> steps;
  std::vector<StreamStat> streams;    // by stream id
  std::vector<NameStat> top_kernels;  // compute and communication, by total time
  std::vector<NameStat> copies;       // memcpy / memset by name
  std::optional<PeakMemory> peak_memory;
  int64_t activities = 0;
};

struct Summary {
  std::string path;
  TimelineFormat format = TimelineFormat::kDc;
  bool report_only = false;  // a foreign trace: no program to re-plan
  std::string incomplete;    // Timeline::incomplete(): why the run stopped early
  int last_step = -1;        // the last step in the trace (measured or warm-up)
  std::vector<std::string> notes;
  // Records the reader left out (Timeline::skipped), shown as warnings.
  std::vector<SkippedRecords> skipped;
  int64_t dropped_records = 0;
  int warmup_steps_excluded = 0;  // (rank, step) windows
  std::vector<RankSummary> ranks;
  // Over all ranks and measured steps: medians of step time and exposed communication, the
  // largest peak.
  double step_seconds_median = 0;
  double exposed_communication_seconds_median = 0;
  int64_t peak_memory_bytes = 0;
  int measured_windows = 0;
  // Filled with SummaryOptions::by_instruction: per InstructionParts name (the kernel name
  // where the instruction is unknown), summed over ranks and measured windows. Ordered by name.
  std::vector<NameStat> by_instruction;
};

struct SummaryOptions {
  int top_kernels = 10;
  bool by_instruction = false;
  ProgressFn progress;
};

StatusOr<Summary> Summarize(const Timeline& timeline, const SummaryOptions& options);
nlohmann::json SummaryJson(const Summary& summary);
std::string SummaryText(const Summary& summary);

// ----- diff -----

struct DiffRow {
  std::string name;
  ActivityClass kind = ActivityClass::kCompute;
  // Seconds per measured window (per rank and step), -1 where the side lacks the name.
  double a_seconds = -1, b_seconds = -1;
  double change_seconds = 0;  // b - a (a missing side counts as 0)
};

struct Diff {
  Summary a, b;
  std::vector<DiffRow> rows;  // top N by |change|, then by name
  int changed = 0;            // names whose time differs at all
  int only_a = 0, only_b = 0;
};

StatusOr<Diff> DiffTimelines(const Timeline& a, const Timeline& b, int top,
                             const ProgressFn& progress);
nlohmann::json DiffJson(const Diff& diff);
std::string DiffText(const Diff& diff);

// ----- shared by the writers -----

// Live bytes by kind of each rank, replayed from the memory events (two passes: the first
// finds the kinds and the buffers that were live before the capture).
struct MemoryLevel {
  int rank_index = 0;
  int64_t ts_ns = 0;
  int64_t total_bytes = 0;
  const std::vector<int64_t>* bytes_by_kind = nullptr;  // index = position in kinds
};
class MemoryReplay {
 public:
  static StatusOr<MemoryReplay> Prepare(const Timeline& timeline);
  // Kinds in a fixed order: dc's BufferKind order, then others sorted by name.
  const std::vector<std::string>& kinds() const { return kinds_; }
  bool empty() const { return events_ == 0; }
  // Bytes by kind live before the rank's first event (buffers made before the capture).
  const std::vector<int64_t>& preexisting(int rank_index) const;
  // Calls `fn` once per (rank, distinct timestamp), after applying the events at it.
  Status Run(const Timeline& timeline, const std::function<void(const MemoryLevel&)>& fn) const;

 private:
  std::vector<std::string> kinds_;
  std::vector<std::vector<int64_t>> preexisting_;  // [rank_index][kind]
  int64_t events_ = 0;
};

// The all-gather -> first consumer compute pairs of a schedule: for each all-gather, the
// lowest-indexed compute instruction that depends on it. Ordered by gather.
std::vector<std::pair<int, int>> GatherConsumers(const proto::Schedule& schedule);

}  // namespace dc
