// The profile: what the analyzer derives from a trace for the planner and for people.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "analyzer/trace.h"
#include "machine/cost_model.h"
#include "schemas/status.h"

namespace dc {

// HTA's definitions, over one rank's step window (activities clipped to it): unions of
// intervals, so concurrent kernels count once.
struct StepOverlap {
  int64_t global_pid = 0;
  int step = 0;
  double span_seconds = 0;
  double compute_seconds = 0;                // union of compute kernels
  double communication_seconds = 0;          // union of collectives / NCCL kernels
  double overlap_seconds = 0;                // |compute ∩ communication|
  double exposed_communication_seconds = 0;  // |communication \ compute|
  double copy_seconds = 0;                   // union of memcpys and memsets
  double idle_seconds = 0;                   // span minus the union of everything
};

// Live device bytes over time from the allocation events of one rank. A free of a buffer never
// seen allocated is a buffer made before the capture: its bytes are live from the start.
struct MemoryTimeline {
  struct Point {
    int64_t ts_ns = 0;
    int64_t total_bytes = 0;
    std::vector<int64_t> bytes_by_kind;  // index = position in `kinds`
  };
  std::vector<std::string> kinds;
  std::vector<Point> points;  // one rank (the first), one point per timestamp, in time order
  int64_t peak_bytes = 0;
  int64_t peak_ts_ns = 0;
  std::vector<int64_t> peak_by_kind;
};

// How a profile measures the overlap slowdowns (CostModel::overlap_compute_slowdown and
// overlap_collective_slowdown) from a run whose streams overlapped: a compute (or collective)
// sample counts as alone when nothing of the other class ran during it, and as beside when at
// least beside_min_fraction of its span had the other class running.
struct ConcurrencyFitOptions {
  double beside_min_fraction = 0.9;
  // Compute: ops with samples both alone and beside needed (fewer: the hardware profile's).
  int min_ops = 3;
  // Collectives: samples alone, and samples beside, needed.
  int min_collectives = 3;
};

struct Profile {
  std::string trace_path;
  int world_size = 1;
  int steps_measured = 0;  // optimizer steps after warm-up
  // Op medians and fitted collective models (each sample as the work it takes alone), and the
  // run's concurrency: serial_streams where no two instructions of a rank overlapped (a cpu run
  // under DC_CPU_STREAMS=serial), the overlap slowdowns measured from samples alone and beside
  // (ConcurrencyFitOptions) or, where too few, the cpu hardware profile's for a cpu trace.
  CostModel costs;
  // Per rank and measured step, ordered by (global_pid, step). nsys exports have no steps: one
  // entry per rank (step 0) over its first to last activity.
  std::vector<StepOverlap> overlap;
  MemoryTimeline memory;
  // Median over measured steps of the step's span over all ranks (first start to last end).
  double step_seconds_median = 0;
  // Stable digest of what the planner uses (costs), for the plan cache key.
  std::string digest;
  // What could not be derived and why ("no reload samples: its cost keeps the default").
  std::vector<std::string> notes;
  // Trace rows left out for breaking analyzer/limits.h's rules (Trace::skipped), for warnings.
  std::vector<SkippedRecords> skipped;
};

// What a dc trace measured, warm-up and stalled steps left out (a stalled step: over twice the
// median step, as a step on a busy host takes): every compute's seconds by op id, every
// collective's and host copy's bytes and seconds (for BuildProfile's fits and dc-calibrate's),
// each as the work it would take alone (the run's overlap slowdowns taken out).
// One kind of work measured alone and beside the other kind on its rank (compute beside a
// collective, a collective beside compute).
struct BesidePair {
  double alone_seconds = 0, beside_seconds = 0;
};
// One collective of a measured step as its ranks reached it: the time since its stream's
// previous collective started (the mean over the ranks) and how long after the ranks' mean start
// the last of them started (what the collective waited for it, as the simulator's mean rank
// sees it: CostModel::collective_skew_fraction).
struct SkewSample {
  double gap_seconds = 0, wait_seconds = 0;
};
struct CostSamples {
  std::vector<std::vector<double>> op_seconds;  // by op id
  std::vector<CostSample> all_gather, reduce_scatter, host_to_device, device_to_host;
  // What the overlap slowdowns are measured from (empty for a serial run): per op with samples
  // both alone and beside a collective (ConcurrencyFitOptions::beside_min_fraction of its span),
  // the median of each; per collective beside compute, its kind's line fitted to the collectives
  // alone (its bytes) and its seconds (none where either side has fewer than min_collectives).
  // The profile's slowdown is the sum beside over the sum alone, at least 1, where there are at
  // least min_ops (min_collectives) pairs.
  std::vector<BesidePair> compute_beside, collectives_beside;
  // Every collective of a measured step that every rank ran, after the first on its stream, where
  // the trace's ranks are 2 or more on one host (one clock; across hosts the clocks' offsets would
  // read as skew).
  std::vector<SkewSample> collective_skews;
};
StatusOr<CostSamples> CollectCostSamples(const Trace& trace);

// Per-instruction durations as medians over measured steps (warm-up and stalled steps excluded,
// with a note naming each stalled one; the step time is the median of them all), collective
// costs fitted by least squares as latency + bytes / bandwidth per kind, memory timeline,
// overlap and exposed communication per step. dc traces give op medians (mapped to ops through
// the schedule the trace embeds); the flops rate of the measured ops becomes the roofline for
// unmeasured ones. nsys exports (no program) give overlap and memory only. A trace with a
// program but no measured step is an error. Errors name the trace file.
StatusOr<Profile> BuildProfile(const Trace& trace);

}  // namespace dc
