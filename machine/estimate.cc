#include "machine/estimate.h"

#include <algorithm>
#include <optional>
#include <string>

#include "schemas/op_kinds.h"

namespace dc {

namespace {

// Persistent shards (params, grad accumulators, optimizer states) are fp32 (schemas/program.h).
constexpr int64_t kShardElementBytes = 4;

double TensorCorePeak(const HardwareProfile& hw, proto::DType compute_dtype) {
  return compute_dtype == proto::DTYPE_F32 ? hw.peak_fp32_flops_per_s : hw.peak_bf16_flops_per_s;
}

// The peak rate of an op of `math`: matrix products on tensor cores at the compute dtype's rate,
// the rest on the vector units (norms and softmax reduce in fp32).
double PeakFlopsPerSecond(const HardwareProfile& hw, proto::DType compute_dtype, OpMath math) {
  switch (math) {
    case OpMath::kMatrix:
      return TensorCorePeak(hw, compute_dtype);
    case OpMath::kVector:
    case OpMath::kRowGather:
      return hw.peak_fp32_flops_per_s;
  }
  return hw.peak_fp32_flops_per_s;
}

const proto::Tensor* FindTensor(const proto::Program& program, int id) {
  return id >= 0 && id < program.tensors_size() ? &program.tensors(id) : nullptr;
}

// Bytes an op of the forward or backward reads and writes.
int64_t MicroStepOpBytes(const proto::Program& program, const proto::Op& op, OpMath math) {
  int64_t bytes = 0;
  for (int i = 0; i < op.inputs_size(); ++i) {
    const proto::Tensor* t = FindTensor(program, op.inputs(i));
    if (!t) continue;
    int64_t input_bytes = TransientBytes(program, *t);
    // A row gather (an embedding) reads the rows of its ids, not the whole table.
    constexpr int kTokensInput = 0, kTableInput = 1;
    if (math == OpMath::kRowGather && i == kTableInput && t->shape_size() == 2) {
      if (const proto::Tensor* tokens = FindTensor(program, op.inputs(kTokensInput))) {
        const int64_t row_bytes = input_bytes / std::max<int64_t>(1, t->shape(0));
        input_bytes = std::min(input_bytes, NumElements(*tokens) * row_bytes);
      }
    }
    bytes += input_bytes;
  }
  for (int id : op.outputs()) {
    if (const proto::Tensor* t = FindTensor(program, id)) bytes += TransientBytes(program, *t);
  }
  return bytes;
}

// Bytes an optimizer-phase op moves on one rank: every input's fp32 shard read, the param and
// optimizer-state shards written back (in place), outputs written.
int64_t OptimizerOpBytes(const proto::Program& program, const proto::Op& op, int world_size) {
  int64_t bytes = 0;
  for (int id : op.inputs()) {
    const proto::Tensor* t = FindTensor(program, id);
    if (!t) continue;
    const int64_t shard_bytes = ShardElements(NumElements(*t), world_size) * kShardElementBytes;
    const bool updated_in_place =
        t->role() == proto::ROLE_PARAM || t->role() == proto::ROLE_OPTIMIZER_STATE;
    bytes += shard_bytes * (updated_in_place ? 2 : 1);
  }
  for (int id : op.outputs()) {
    if (const proto::Tensor* t = FindTensor(program, id)) {
      bytes += ShardElements(NumElements(*t), world_size) * kShardElementBytes;
    }
  }
  return bytes;
}

}  // namespace

OpRoofline EstimateOp(const proto::Program& program, const proto::Op& op, const HardwareProfile& hw,
                      int world_size) {
  world_size = std::max(1, world_size);
  OpRoofline r;
  const bool on_shards = op.phase() == proto::PHASE_OPTIMIZER;
  r.flops = on_shards ? op.flops() / world_size : op.flops();
  const std::optional<OpKind> kind = FindOpKind(op.kind());
  const OpMath math = kind ? InfoOf(*kind).math : OpMath::kVector;
  r.bytes =
      on_shards ? OptimizerOpBytes(program, op, world_size) : MicroStepOpBytes(program, op, math);
  const double peak_flops_per_s = PeakFlopsPerSecond(hw, program.config().compute_dtype(), math);
  const double flops_per_s = peak_flops_per_s * hw.matmul_efficiency;
  const double bytes_per_s = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency;
  r.compute_seconds = flops_per_s > 0 ? r.flops / flops_per_s : 0;
  r.memory_seconds = bytes_per_s > 0 ? static_cast<double>(r.bytes) / bytes_per_s : 0;
  const double scale = kind ? hw.op_time_scale[static_cast<size_t>(*kind)] : 1.0;
  r.seconds = std::max(r.compute_seconds, r.memory_seconds) * scale + hw.kernel_launch_seconds;
  return r;
}

LinearCost RingCollectiveCost(const HardwareProfile& hw, const ClusterShape& cluster) {
  const int ranks = cluster.world_size();
  if (ranks <= 1) {
    // NCCL copies the rank's own buffer: one read and one write of B in device memory.
    constexpr double kCopyReadsAndWrites = 2;
    return {hw.kernel_launch_seconds,
            hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency / kCopyReadsAndWrites};
  }
  double bus_bytes_per_s = hw.intra_node_bus_bandwidth_bytes_per_s;
  if (cluster.nodes > 1) {
    // Each of the ring's channels leaves a node through one NIC; NCCL uses every NIC of the node,
    // so a node's network bandwidth is gpus_per_node × the bandwidth per GPU (rail-optimized,
    // one NIC per GPU). The ring is as fast as the slower of NVLink and that.
    bus_bytes_per_s = std::min(bus_bytes_per_s,
                               cluster.gpus_per_node * hw.inter_node_bandwidth_per_gpu_bytes_per_s);
  }
  const int steps = ranks - 1;
  const int inter_node_steps = cluster.nodes - 1;
  LinearCost cost;
  cost.latency_seconds = hw.collective_base_latency_s +
                         (steps - inter_node_steps) * hw.intra_node_step_latency_s +
                         inter_node_steps * hw.inter_node_step_latency_s;
  // Per rank B (N - 1) / N bytes at the bus bandwidth = B at bus × N / (N - 1).
  cost.bandwidth_bytes_per_second = bus_bytes_per_s * ranks / steps;
  return cost;
}

double HostShareSlowdown(int host_cores_per_node, const ClusterShape& cluster) {
  if (host_cores_per_node <= 0) return 1;
  return std::max(1.0, static_cast<double>(cluster.gpus_per_node) / host_cores_per_node);
}

double HostShareSlowdown(const HardwareProfile& hw, const ClusterShape& cluster) {
  return HostShareSlowdown(hw.host_cores_per_node, cluster);
}

LinearCost Slowed(const LinearCost& cost, double slowdown) {
  return {cost.latency_seconds * slowdown, cost.bandwidth_bytes_per_second / slowdown};
}

CostModel EstimateCostModel(const proto::Program& program, const HardwareProfile& hw,
                            const ClusterShape& cluster) {
  const int world_size = cluster.world_size();
  const double slowdown = HostShareSlowdown(hw, cluster);
  CostModel costs;
  costs.op_seconds.reserve(program.ops_size());
  for (const proto::Op& op : program.ops()) {
    costs.op_seconds.push_back(EstimateOp(program, op, hw, world_size).seconds * slowdown);
  }
  costs.flops_per_second =
      TensorCorePeak(hw, program.config().compute_dtype()) * hw.matmul_efficiency / slowdown;
  costs.all_gather = Slowed(RingCollectiveCost(hw, cluster), slowdown);
  costs.reduce_scatter = costs.all_gather;
  costs.host_to_device =
      Slowed({hw.host_link_latency_s, hw.host_link_bandwidth_bytes_per_s}, slowdown);
  costs.device_to_host = costs.host_to_device;
  costs.host_optimizer_elements_per_second = hw.host_optimizer_elements_per_s;
  costs.release_seconds = 0;  // a release is bookkeeping in the executor's arena
  ApplyConcurrency(hw, &costs);
  costs.collective_compute_seconds *= slowdown;
  return costs;
}

void ApplyConcurrency(const HardwareProfile& hw, CostModel* costs) {
  costs->serial_streams = hw.serial_streams;
  costs->overlap_compute_slowdown = hw.overlap_compute_slowdown;
  costs->overlap_collective_slowdown = hw.overlap_collective_slowdown;
  costs->collective_compute_seconds = hw.collective_compute_seconds;
  costs->collective_skew_fraction = hw.collective_skew_fraction;
  costs->collective_skew_max_seconds = hw.collective_skew_max_seconds;
}

std::string BackendOf(const HardwareProfile& hw) {
  return hw.host_optimizer_elements_per_s == 0 ? "cpu" : "cuda";
}

}  // namespace dc
