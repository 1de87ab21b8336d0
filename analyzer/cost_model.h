// What an instruction costs: measured op durations from a profile, fitted collective and copy
// models, and a roofline fallback for what was never measured.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schemas/program.h"

namespace dc {

// seconds = latency_seconds + bytes / bandwidth_bytes_per_second
struct LinearCost {
  double latency_seconds = 0;
  double bandwidth_bytes_per_second = 0;
  double Seconds(int64_t bytes) const {
    return latency_seconds + (bandwidth_bytes_per_second > 0 ? bytes / bandwidth_bytes_per_second : 0);
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
  double release_seconds = 0;
  // True when the backend runs one instruction at a time (the cpu backend today): streams do not
  // overlap and the simulator serializes them.
  bool serial_streams = false;
  // Compute that overlaps communication runs this much slower (1 = no slowdown).
  double overlap_compute_slowdown = 1.0;

  double OpSeconds(const proto::Program& program, int op_id) const;
  double InstructionSeconds(const proto::Program& program, int world_size,
                            const proto::Instruction& instruction) const;
};

// Bytes an instruction moves: an all-gather the whole params (compute dtype), a reduce-scatter
// the whole grads; 0 for others.
int64_t InstructionBytes(const proto::Program& program, const proto::Instruction& instruction);

}  // namespace dc
