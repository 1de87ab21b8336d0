// One timeline view over every trace dc reads: dc traces and Nsight Systems exports (through
// analyzer/trace.h), PyTorch profiler traces (analyzer/kineto.h), and whatever a caller builds in
// memory (a plan's simulated step, tests). dc-trace's reports (tracetools/report.h) and tools
// read only this.
//
// A Timeline streams: readers go through activities and memory events once or twice in order
// and keep only aggregates, so a dc trace with millions of activities is read in bounded memory.
// Timelines are not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "analyzer/limits.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Called now and then during long reads with what is being read and how many records so far.
using ProgressFn = std::function<void(const std::string& what, int64_t records)>;

enum class ActivityClass { kCompute, kCommunication, kCopy };
const char* ActivityClassName(ActivityClass kind);

struct TimelineRank {
  int rank = 0;  // the rank's number in its run
  int64_t global_pid = 0;
  std::string device;
  int64_t device_memory_bytes = 0;
};

// One device activity. `rank_index` indexes Timeline::ranks().
struct TimelineActivity {
  int rank_index = 0;
  int64_t stream_id = 0;
  ActivityClass kind = ActivityClass::kCompute;
  std::string name;  // kernel name, collective kind, "[CUDA memcpy Device-to-Host]", ...
  int64_t start_ns = 0, end_ns = 0;
  int64_t bytes = 0;  // copies and collectives; 0 when unknown
  // The schedule instruction it ran and the step it ran in, where the source knows them (dc
  // traces when asked for, plans); else -1.
  int instruction = -1;
  int step = -1;
};

// An allocation or free on the device. `tracked` events name a buffer by address (a free
// subtracts what the allocation at that address added; a free of an address never allocated is
// a buffer made before the capture). Untracked events change `kind` by `bytes` directly.
struct TimelineMemoryEvent {
  int rank_index = 0;
  int64_t ts_ns = 0;
  int64_t address = 0;
  int64_t bytes = 0;
  bool alloc = true;
  bool tracked = true;
  std::string kind;  // a BufferKindName (dc), the memKind label (nsys), "allocated" (Kineto)
};

struct TimelineStep {
  int rank_index = 0;
  int step = 0;
  int64_t start_ns = 0, end_ns = 0;
  bool warmup = false;
};

enum class TimelineFormat { kDc, kNsys, kKineto, kPlan };
const char* TimelineFormatName(TimelineFormat format);

struct ActivityOptions {
  // Fill TimelineActivity::instruction and ::step where the source can (a lookup per activity
  // in dc traces).
  bool with_instructions = false;
  ProgressFn progress;
};

// A trace as ranks, step windows, activities and memory events.
class Timeline {
 public:
  virtual ~Timeline() = default;
  virtual const std::string& path() const = 0;
  virtual TimelineFormat format() const = 0;
  // Ordered by rank.
  virtual const std::vector<TimelineRank>& ranks() const = 0;
  // Ordered by (rank_index, start_ns). Empty where the source has no step markers.
  virtual const std::vector<TimelineStep>& steps() const = 0;
  // The schedule the activities ran (dc traces, plans); null for foreign traces.
  virtual const proto::Schedule* schedule() const = 0;
  virtual const std::vector<std::string>& notes() const = 0;
  // Why the run stopped before its last step (a dc trace marked incomplete); empty otherwise.
  virtual std::string incomplete() const { return {}; }
  // Records the reader left out for breaking analyzer/limits.h's rules, counted.
  virtual const std::vector<SkippedRecords>& skipped() const = 0;
  virtual int64_t dropped_records() const = 0;
  virtual std::string StreamName(int rank_index, int64_t stream_id) const = 0;
  // Activities ordered by (rank_index, start_ns).
  virtual Status ForEachActivity(const ActivityOptions& options,
                                 const std::function<void(const TimelineActivity&)>& fn) const = 0;
  // Memory events ordered by (rank_index, ts_ns).
  virtual Status ForEachMemoryEvent(
      const std::function<void(const TimelineMemoryEvent&)>& fn) const = 0;
};

// Everything in memory: what Kineto import and plans produce, and what tests construct.
struct TimelineData {
  std::string path;
  TimelineFormat format = TimelineFormat::kKineto;
  std::vector<TimelineRank> ranks;
  std::vector<TimelineStep> steps;
  std::optional<proto::Schedule> schedule;
  std::vector<std::string> notes;
  std::vector<SkippedRecords> skipped;
  int64_t dropped_records = 0;
  struct StreamLabel {
    int rank_index = 0;
    int64_t stream_id = 0;
    std::string name;
  };
  std::vector<StreamLabel> stream_names;
  std::vector<TimelineActivity> activities;
  std::vector<TimelineMemoryEvent> memory_events;
};

// Sorts the steps, activities and memory events of `data` into the orders Timeline promises;
// the ranks stay as given (activities index them), so give them in rank order.
std::unique_ptr<Timeline> MakeTimeline(TimelineData data);

// A dc trace or nsys export (Trace::Open's checks and messages), streaming from SQLite.
StatusOr<std::unique_ptr<Timeline>> OpenTraceTimeline(const std::string& path);

}  // namespace dc
