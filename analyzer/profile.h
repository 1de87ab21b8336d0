// The profile: what the analyzer derives from a trace for the planner and for people.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "analyzer/cost_model.h"
#include "analyzer/trace.h"
#include "schemas/status.h"

namespace dc {

struct StepOverlap {
  int64_t global_pid = 0;
  int step = 0;
  double span_seconds = 0;
  double compute_seconds = 0;        // union of compute kernels
  double communication_seconds = 0;  // union of collectives / NCCL kernels
  double overlap_seconds = 0;        // |compute ∩ communication|
  double exposed_communication_seconds = 0;  // |communication \ compute|
  double copy_seconds = 0;
  double idle_seconds = 0;
};

struct MemoryTimeline {
  struct Point {
    int64_t ts_ns = 0;
    int64_t total_bytes = 0;
    std::vector<int64_t> bytes_by_kind;  // index = position in `kinds`
  };
  std::vector<std::string> kinds;
  std::vector<Point> points;  // one rank (the first), in time order
  int64_t peak_bytes = 0;
  int64_t peak_ts_ns = 0;
  std::vector<int64_t> peak_by_kind;
};

struct Profile {
  std::string trace_path;
  int world_size = 1;
  int steps_measured = 0;  // optimizer steps after warm-up
  CostModel costs;         // op medians, fitted collective models, serial_streams by backend
  std::vector<StepOverlap> overlap;  // per rank and measured step
  MemoryTimeline memory;
  double step_seconds_median = 0;
  // Stable digest of what the planner uses (costs), for the plan cache key.
  std::string digest;
};

// Per-instruction durations as medians over measured steps (warm-up excluded), collective
// costs fitted by least squares as latency + bytes / bandwidth per kind, memory timeline,
// overlap and exposed communication per step.
StatusOr<Profile> BuildProfile(const Trace& trace);

}  // namespace dc
