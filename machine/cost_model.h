// What an instruction costs: measured op durations from a profile, fitted collective and copy
// models, and a roofline fallback for what was never measured.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schemas/effects.h"  // InstructionBytes, CopyBytes
#include "schemas/program.h"

namespace dc {

// seconds = latency_seconds + bytes / bandwidth_bytes_per_second
struct LinearCost {
  double latency_seconds = 0;
  double bandwidth_bytes_per_second = 0;
  double Seconds(int64_t bytes) const {
    return latency_seconds +
           (bandwidth_bytes_per_second > 0 ? bytes / bandwidth_bytes_per_second : 0);
  }
};

struct CostModel {
  // By program op id: measured median seconds of one execution; < 0 where not measured.
  std::vector<double> op_seconds;
  // Fallback for unmeasured ops: op.flops / flops_per_second.
  double flops_per_second = 50e9;
  LinearCost all_gather;      // bytes = whole gathered size
  LinearCost reduce_scatter;  // bytes = whole grad size
  LinearCost host_to_device, device_to_host;
  // An optimizer op on the host (STREAM_HOST, ZeRO-Offload's CPU Adam) takes the rank's shard
  // elements of the params it updates over this rate; 0: its OpSeconds (the host is the device).
  double host_optimizer_elements_per_second = 0;
  double release_seconds = 0;
  // True when the backend runs one instruction at a time (the cpu backend under
  // DC_CPU_STREAMS=serial): streams do not overlap and the simulator serializes them.
  bool serial_streams = false;
  // Compute runs this much slower (1 = no slowdown) over the part of it that overlaps an
  // all-gather or reduce-scatter in flight (machine/simulator.h).
  double overlap_compute_slowdown = 1.0;
  // A collective's transfer (past its latency term) runs this much slower (1 = no slowdown) over
  // the part of it that overlaps a compute on the device: on the cpu backend Gloo's copies and
  // loopback TCP take the cores the compute thread runs on (machine/simulator.h).
  double overlap_collective_slowdown = 1.0;
  // Each collective (schemas/program.h's IsCollective) also takes this many seconds of the
  // compute stream when it starts (machine/simulator.h): on the cpu backend the rank's
  // communication threads take the compute thread's core for their sends, copies and sums between
  // ops, which no op's own time shows. 0 (none) unless fitted from a trace (analyzer/profile.h).
  double collective_compute_seconds = 0;
  // Ranks reach a collective apart, by about this fraction of the time since the previous
  // collective on its stream started (their progress drifts apart between syncs: on the cpu
  // backend, ranks share cores), and the collective ends only once the last is in. The simulator
  // times the mean rank, so each collective waits this fraction of that gap for the last arrival
  // (the latest of the ranks' starts less their mean) before its own latency (machine/simulator.h).
  // 0 (lockstep ranks) unless fitted from traces (dc-calibrate). The wait is at most
  // collective_skew_max_seconds (0: no ceiling): long after the last collective on a stream, the
  // ranks have met at others' (a compute waits for a gather) and drifted no further.
  double collective_skew_fraction = 0;
  double collective_skew_max_seconds = 0;

  // Measured seconds of `op_id` if op_seconds has them (>= 0), else its roofline estimate.
  double OpSeconds(const proto::Program& program, int op_id) const;
  // What a collective waits for the last rank, `since_previous` seconds after its stream's
  // previous collective started: collective_skew_fraction of that, under the ceiling.
  double SkewWaitSeconds(double since_previous) const;
  // Unscaled duration of one instruction: compute its op's seconds, collectives their fitted
  // cost of InstructionBytes, offload / reload the copy cost of CopyBytes (schemas/effects.h),
  // release
  // release_seconds.
  double InstructionSeconds(const proto::Program& program, int world_size,
                            const proto::Instruction& instruction) const;
  // An all-reduce of `bytes` (a small scalar: the grads' squared norm) as a ring does it: a
  // reduce-scatter then an all-gather of the same bytes, so both latencies.
  double AllReduceSeconds(int64_t bytes) const {
    return reduce_scatter.Seconds(bytes) + all_gather.Seconds(bytes);
  }
};

// Elements a host optimizer op updates: the rank's shard elements of the params its op reads;
// 0 for anything but a compute.
int64_t HostOptimizerElements(const proto::Program& program, int world_size,
                              const proto::Instruction& instruction);

// One measurement of a transfer.
struct CostSample {
  int64_t bytes = 0;
  double seconds = 0;
};

// Least-squares fit of seconds = latency + bytes / bandwidth. The latency is clamped at 0 (then
// the line is refitted through the origin). Degenerate inputs: no samples give the zero cost;
// samples that all move the same bytes (or where more bytes are not slower) give latency 0 and
// bandwidth = bytes / median seconds, or, with 0 bytes, a pure latency of the median.
LinearCost FitLinearCost(const std::vector<CostSample>& samples);

// The all-gather and reduce-scatter models from their samples, each FitLinearCost of its own
// where its samples tell latency from bandwidth. Where they cannot (every sample moves the same
// bytes, as in a trace that gathered tensors of one size only), FitLinearCost's fallback of
// latency 0 would cost a grouped collective of k such tensors k times one: the latency paid k
// times, which is exactly what fusing saves. Both kinds run the same ring over the same links
// (NCCL models them alike), so such a kind takes the latency of the fit over both kinds' samples
// together and the bandwidth that keeps its own median sample on its line; a grouped collective
// then pays the latency once. Only where that latency is below the kind's median time: the
// bandwidth stays finite and a fused collective never costs less than its bytes at the rate its
// own samples show.
struct CollectiveCosts {
  LinearCost all_gather, reduce_scatter;
  // Which kinds took their latency from the fit over both.
  bool all_gather_pooled = false, reduce_scatter_pooled = false;
};
CollectiveCosts FitCollectiveCosts(const std::vector<CostSample>& all_gather,
                                   const std::vector<CostSample>& reduce_scatter);

// A stable text of every number the planner uses (%.9g), one "name value" per line; its
// SHA-256 is the profile digest in plan cache keys.
std::string CostModelText(const CostModel& costs);

}  // namespace dc
