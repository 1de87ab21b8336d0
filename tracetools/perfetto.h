// Chrome trace-event JSON of a timeline, for ui.perfetto.dev and chrome://tracing: a process
// per rank, a thread per stream (named as the source names it), a complete event ("ph":"X",
// microseconds) per activity named by its kernel (or, where the schedule is known, by its
// instruction), step windows on a "steps" thread, a counter track ("ph":"C") of live device
// memory by kind, and flow arrows ("ph":"s"/"f") from each all-gather to the first compute
// that depends on it. Written event by event (a trace of millions of activities is never held
// as a document); output is a pure function of the input. Thread-safe (pure).
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "machine/simulator.h"
#include "schemas/program.h"
#include "schemas/status.h"
#include "tracetools/report.h"

namespace dc {

struct PerfettoStats {
  int64_t slices = 0;    // complete events
  int64_t counters = 0;  // memory counter events
  int64_t flows = 0;     // flow arrows (pairs of s/f events)
  int processes = 0;
  int threads = 0;
};

StatusOr<PerfettoStats> WritePerfetto(const Timeline& timeline, std::ostream& out,
                                      const ProgressFn& progress);

// The same into `path`, written beside it and renamed: the file is whole or absent.
StatusOr<PerfettoStats> WritePerfettoFile(const Timeline& timeline, const std::string& path,
                                          const ProgressFn& progress);

// A simulated plan (its predicted step, PlanTimeline) into `path`, to open beside a measured
// trace.
StatusOr<PerfettoStats> WritePlanPerfettoFile(const proto::Schedule& plan, const SimResult& sim,
                                              const std::string& path);

}  // namespace dc
