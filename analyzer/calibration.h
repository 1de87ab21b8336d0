// A dc trace as dc-calibrate's inputs (machine/calibrate.h): what the trace measured, as groups of
// observations a hardware profile predicts. Thread-compatible (reads the trace).
#pragma once

#include <vector>

#include "analyzer/trace.h"
#include "machine/calibrate.h"
#include "schemas/status.h"

namespace dc {

// The groups of dc traces (each with a program, a schedule and measured steps), every trace's
// measurements in the same groups, for a profile that starts from `base`:
// - "trace ops": every measured op's median against its roofline (machine/estimate.h), by
//   relative error (a roofline of a few constants cannot match every op; the others are fitted
//   by least squares in seconds, so that the samples add up to the time they took). Fits the
//   matmul efficiency and the memory efficiency, or, where the base already folds an efficiency
//   into its peak (efficiency 1, as the cpu profile does), the peak flops of the program's
//   compute dtype and the memory bandwidth; and the launch time.
// - "trace collectives": every all-gather and reduce-scatter against the ring model on the
//   trace's ranks (one node): the bus bandwidth and the base latency, and the per-step latency
//   where traces of two world sizes tell it from the base; nothing on one rank.
// - "trace host link": every offload and reload: the host link's bandwidth and latency.
// - "trace step": the median measured step against the trace's schedule simulated on the
//   profile. Fits the overlap slowdown where the backend runs streams concurrently and the trace
//   shows compute beside a collective; otherwise it only reports the error.
// Constants a group cannot determine are listed with why. Errors name the trace.
// Every prediction is at the traced host's machine/estimate.h HostShareSlowdown (its
// TraceHostCores where recorded, else the profile's host_cores_per_node), so that a trace of 4
// ranks on 2 cores and one of 2 ranks fit the same per-core rates.
StatusOr<std::vector<FitGroup>> TraceGroups(const std::vector<const Trace*>& traces,
                                            const HardwareProfile& base);

// The cores the trace's ranks could run on, as its ranks recorded them (the most any rank did);
// 0 where none did (GPU ranks, nsys exports, traces before dc recorded them).
int TraceHostCores(const Trace& trace);

}  // namespace dc
