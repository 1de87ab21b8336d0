// A discrete-event replay of a schedule: each stream serial, instructions waiting for their
// dependencies (and for the previous instruction on the same stream), durations from a cost
// model, and exact buffer lifetimes (schemas/program.h's accounting) for memory.
#pragma once

#include <cstdint>
#include <vector>

#include "analyzer/cost_model.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct MemoryPoint {
  double time_seconds = 0;
  int64_t total_bytes = 0;
  std::vector<int64_t> bytes_by_kind;  // index = BufferKind
};

struct SimResult {
  double step_seconds = 0;
  int64_t peak_device_bytes = 0;
  double peak_at_seconds = 0;
  int peak_instruction = -1;
  std::vector<int64_t> peak_by_kind;  // index = BufferKind, at the peak instant
  double compute_seconds = 0;         // busy time of the compute stream
  double communication_seconds = 0;   // busy time of gather + reduce streams
  double exposed_communication_seconds = 0;  // communication not overlapped by compute
  std::vector<double> start_seconds, end_seconds;  // per instruction
  std::vector<MemoryPoint> memory_timeline;        // one point per change
};

// Errors on a malformed schedule (a dep on a later instruction, a tensor released twice, used
// while not live, ...), naming the instruction.
StatusOr<SimResult> Simulate(const proto::Schedule& schedule, const CostModel& costs);

// The SimResult as the plan file's Prediction.
proto::Prediction ToPrediction(const SimResult& result);

}  // namespace dc
