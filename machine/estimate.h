// Cost estimates for a program on hardware it never ran on: a roofline per op and NCCL's ring
// model per collective, from a HardwareProfile (machine/hardware.h), as the CostModel the
// simulator consumes. A profile built from a trace (analyzer/profile.h) supersedes these numbers
// wherever it measured something. Thread-safe (pure functions).
#pragma once

#include <cstdint>

#include "machine/cost_model.h"
#include "machine/hardware.h"
#include "schemas/program.h"

namespace dc {

// The roofline of one op on one rank.
struct OpRoofline {
  double flops = 0;            // this rank's floating-point operations
  int64_t bytes = 0;           // device memory read and written
  double compute_seconds = 0;  // flops / (peak for its math × matmul_efficiency)
  double memory_seconds = 0;   // bytes / (memory bandwidth × memory_efficiency)
  double seconds = 0;          // max(compute, memory) × the kind's op_time_scale + kernel launch
  bool memory_bound() const { return memory_seconds > compute_seconds; }
};

// Roofline of `op` on one of `world_size` ranks, times HardwareProfile::op_time_scale of its kind
// (1 for a kind the table does not name).
// - Peak: by the kind's OpMath (schemas/op_kinds.h). Matrix products (matmuls and attention
//   and their backwards) run on tensor cores at the rate of the program's compute dtype
//   (bf16 / fp16: peak_bf16, fp32: peak_fp32); every other op runs on the vector units at
//   peak_fp32 (norms and softmax reduce in fp32).
// - Bytes: every input and output once, params gathered in the compute dtype
//   (TransientBytes); a row gather (embedding) reads only the table rows of its ids.
// - Optimizer-phase ops update this rank's fp32 shards in place: they read every input shard and
//   write back the param and optimizer-state shards; their flops are divided by the world size.
OpRoofline EstimateOp(const proto::Program& program, const proto::Op& op, const HardwareProfile& hw,
                      int world_size);

// Ring all-gather or reduce-scatter over `cluster`, as NCCL models it (src/graph/tuning.cc), in
// terms of the WHOLE gathered (or reduced) bytes B: each rank moves B (N-1)/N at the ring's bus
// bandwidth, so bandwidth_bytes_per_second = bus_bandwidth × N / (N - 1), and latency_seconds =
// base + (N - nodes) intra-node steps + (nodes - 1) inter-node steps. The bus bandwidth is the
// NVLink busBw in one node; across nodes NCCL spreads its ring channels over every NIC of a node,
// so it is min(NVLink busBw, gpus_per_node × network bandwidth per GPU). One rank: a local copy.
LinearCost RingCollectiveCost(const HardwareProfile& hw, const ClusterShape& cluster);

// How much slower each rank's ops, collectives and host copies run on `cluster` because the ranks
// of a node outnumber the cores they share: ranks per node over HardwareProfile::
// host_cores_per_node, at least 1 (ranks time-share the cores; a rank's profile rates are those
// of a core of its own); 1 where host_cores_per_node is 0 (a device per rank).
double HostShareSlowdown(const HardwareProfile& hw, const ClusterShape& cluster);
// The same for `host_cores_per_node` cores (a trace's, dc-calibrate's fits).
double HostShareSlowdown(int host_cores_per_node, const ClusterShape& cluster);

// `cost` `slowdown` times slower: its latency longer and its bandwidth lower.
LinearCost Slowed(const LinearCost& cost, double slowdown);

// How the backend of `hw` runs streams side by side, into `costs`: serial_streams, the two
// overlap slowdowns, the compute-stream time a collective takes (unscaled by the host share) and
// the ranks' skew at a collective.
// The one home of that rule for every cost model: estimated ones, the default one a plan is
// re-simulated with, and the fallback of a profile whose trace could not measure them
// (analyzer/profile.h).
void ApplyConcurrency(const HardwareProfile& hw, CostModel* costs);

// The backend that runs plans for `hw`: "cpu" where the host is the device (the profile's
// host_optimizer_elements_per_s is 0), else "cuda".
std::string BackendOf(const HardwareProfile& hw);

// The whole cost model of `program` on `cluster` of `hw`: op_seconds for every op (EstimateOp),
// all_gather and reduce_scatter (RingCollectiveCost), host copies over the host link, each at
// the cluster's HostShareSlowdown, the fallback flops rate, and the concurrency of
// ApplyConcurrency (its collective_compute_seconds at the HostShareSlowdown too).
CostModel EstimateCostModel(const proto::Program& program, const HardwareProfile& hw,
                            const ClusterShape& cluster);

}  // namespace dc
