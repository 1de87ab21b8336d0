#include "machine/estimate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>

#include "models/model.h"
#include "schemas/op_kinds.h"

namespace dc {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

HardwareProfile Hardware(const std::string& name) {
  auto hw = FindHardware(name);
  EXPECT_TRUE(hw.ok()) << hw.status().message();
  return hw.ok() ? *hw : HardwareProfile{};
}

// The tiny preset's program (nullopt, with the failure recorded, where it does not build).
std::optional<proto::Program> TinyProgram() {
  auto config = MakeConfig("tiny", {});
  EXPECT_TRUE(config.ok()) << config.status().message();
  if (!config.ok()) return std::nullopt;
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  if (!program.ok()) return std::nullopt;
  return std::move(program).value();
}

// Llama-3 70B at DeepCompile's setting: seq 1024, micro-batch 1, one micro-step.
class Llama70bEstimateTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    ModelOverrides overrides;
    overrides.seq = 1024;
    overrides.micro_batch = 1;
    overrides.gas = 1;
    auto config = MakeConfig("llama3-70b", overrides);
    ASSERT_TRUE(config.ok()) << config.status().message();
    auto program = BuildProgram(*config);
    ASSERT_TRUE(program.ok()) << program.status().message();
    program_ = new proto::Program(std::move(program).value());
  }
  static void TearDownTestSuite() {
    delete program_;
    program_ = nullptr;
  }

  // The forward op of `kind` with the most flops.
  static const proto::Op& LargestForward(const std::string& kind) {
    const proto::Op* best = nullptr;
    for (const proto::Op& op : program_->ops()) {
      if (op.kind() != kind || op.phase() != proto::PHASE_FORWARD) continue;
      if (!best || op.flops() > best->flops()) best = &op;
    }
    EXPECT_NE(best, nullptr) << kind;
    return best ? *best : program_->ops(0);
  }

  static const proto::Program* program_;
  const ClusterShape cluster_{4, 8};  // 32 x H100, 8 per node
};
const proto::Program* Llama70bEstimateTest::program_ = nullptr;

// The biggest matmul of the model is compute-bound: flops / (peak × efficiency) + launch, exactly.
TEST_F(Llama70bEstimateTest, LargeMatmulIsComputeBound) {
  const HardwareProfile hw = Hardware("h100-sxm");
  const proto::Op& op = LargestForward(op_kind::kMatmul);
  const OpRoofline r = EstimateOp(*program_, op, hw, cluster_.world_size());
  EXPECT_FALSE(r.memory_bound()) << op.name();
  EXPECT_EQ(r.flops, op.flops());
  const double expected =
      op.flops() / (hw.peak_bf16_flops_per_s * hw.matmul_efficiency) + hw.kernel_launch_seconds;
  EXPECT_DOUBLE_EQ(r.seconds, expected);
  const CostModel costs = EstimateCostModel(*program_, hw, cluster_);
  EXPECT_DOUBLE_EQ(costs.op_seconds[op.id()], expected);

  // A layer's MLP projection: 2 × tokens × hidden × ffn flops, also compute-bound.
  int found = 0;
  for (const proto::Op& mlp : program_->ops()) {
    if (mlp.name() != "layers.0.mlp.gate_proj") continue;
    ++found;
    EXPECT_DOUBLE_EQ(mlp.flops(), 2.0 * 1024 * 8192 * 28672);
    const OpRoofline m = EstimateOp(*program_, mlp, hw, cluster_.world_size());
    EXPECT_FALSE(m.memory_bound());
    EXPECT_DOUBLE_EQ(m.seconds,
                     mlp.flops() / (989e12 * hw.matmul_efficiency) + hw.kernel_launch_seconds);
  }
  EXPECT_EQ(found, 1);
}

// An elementwise op is memory-bound: bytes of its inputs and output / (bandwidth × efficiency).
TEST_F(Llama70bEstimateTest, ElementwiseIsMemoryBound) {
  const HardwareProfile hw = Hardware("h100-sxm");
  const proto::Op& op = LargestForward(op_kind::kSwiglu);
  const OpRoofline r = EstimateOp(*program_, op, hw, cluster_.world_size());
  EXPECT_TRUE(r.memory_bound()) << op.name();
  const int64_t tokens_x_ffn = int64_t{1024} * 28672;
  constexpr int64_t kBf16Bytes = 2;
  EXPECT_EQ(r.bytes, 3 * tokens_x_ffn * kBf16Bytes);  // gate and up in, y out
  EXPECT_DOUBLE_EQ(r.seconds, static_cast<double>(r.bytes) /
                                      (hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency) +
                                  hw.kernel_launch_seconds);
}

// An op kind's time scale multiplies its roofline time (not the launch) and no other kind's.
TEST_F(Llama70bEstimateTest, OpTimeScaleMultipliesOnlyItsKind) {
  HardwareProfile hw = Hardware("h100-sxm");
  const proto::Op& swiglu = LargestForward(op_kind::kSwiglu);
  const proto::Op& matmul = LargestForward(op_kind::kMatmul);
  const OpRoofline plain = EstimateOp(*program_, swiglu, hw, cluster_.world_size());
  const OpRoofline plain_matmul = EstimateOp(*program_, matmul, hw, cluster_.world_size());
  ASSERT_TRUE(SetHardwareConstant(&hw, "op_time_scale.swiglu", 2.5).ok());
  const OpRoofline scaled = EstimateOp(*program_, swiglu, hw, cluster_.world_size());
  EXPECT_DOUBLE_EQ(scaled.seconds - hw.kernel_launch_seconds,
                   2.5 * (plain.seconds - hw.kernel_launch_seconds));
  EXPECT_EQ(scaled.bytes, plain.bytes);
  EXPECT_DOUBLE_EQ(EstimateOp(*program_, matmul, hw, cluster_.world_size()).seconds,
                   plain_matmul.seconds);
}

// The embedding reads the rows of its tokens, not the whole table.
TEST_F(Llama70bEstimateTest, EmbeddingReadsOnlyItsRows) {
  const HardwareProfile hw = Hardware("h100-sxm");
  const proto::Op& op = LargestForward(op_kind::kEmbedding);
  const OpRoofline r = EstimateOp(*program_, op, hw, cluster_.world_size());
  constexpr int64_t kTokens = 1024, kHidden = 8192, kTokenIdBytes = 4, kBf16Bytes = 2;
  EXPECT_EQ(r.bytes, kTokens * kTokenIdBytes + 2 * kTokens * kHidden * kBf16Bytes);
}

// Optimizer ops update this rank's fp32 shards: flops and bytes divided by the world size.
TEST_F(Llama70bEstimateTest, OptimizerOpsRunOnShards) {
  const HardwareProfile hw = Hardware("h100-sxm");
  const int world = cluster_.world_size();
  for (const proto::Op& op : program_->ops()) {
    if (op.kind() != op_kind::kAdamW) continue;
    const proto::Tensor& param = program_->tensors(op.inputs(0));
    const int64_t shard = ShardElements(NumElements(param), world);
    const OpRoofline r = EstimateOp(*program_, op, hw, world);
    EXPECT_DOUBLE_EQ(r.flops, op.flops() / world) << op.name();
    // param, grad, m, v read; param, m, v written back; fp32.
    EXPECT_EQ(r.bytes, (4 + 3) * shard * 4) << op.name();
    EXPECT_TRUE(r.memory_bound()) << op.name();
  }
}

// 1 GiB all-gathered over 8 GPUs of one node and over 32 GPUs on 4 nodes: each rank moves
// B (N - 1) / N at the ring's bus bandwidth, plus NCCL's ring latency; more ranks are slower.
TEST(CollectiveEstimateTest, AllGatherOneNodeVersusFourNodes) {
  const HardwareProfile hw = Hardware("h100-sxm");
  const double bytes = static_cast<double>(kGiB);

  const LinearCost one_node = RingCollectiveCost(hw, ClusterShape{1, 8});
  const double one_node_latency = hw.collective_base_latency_s + 7 * hw.intra_node_step_latency_s;
  EXPECT_NEAR(one_node.latency_seconds, one_node_latency, 1e-12);
  EXPECT_NEAR(one_node.Seconds(kGiB),
              one_node_latency + bytes * 7 / 8 / hw.intra_node_bus_bandwidth_bytes_per_s, 1e-12);

  const LinearCost four_nodes = RingCollectiveCost(hw, ClusterShape{4, 8});
  const double four_nodes_latency = hw.collective_base_latency_s +
                                    28 * hw.intra_node_step_latency_s +
                                    3 * hw.inter_node_step_latency_s;
  const double bus = std::min(hw.intra_node_bus_bandwidth_bytes_per_s,
                              8 * hw.inter_node_bandwidth_per_gpu_bytes_per_s);
  EXPECT_NEAR(four_nodes.latency_seconds, four_nodes_latency, 1e-12);
  EXPECT_NEAR(four_nodes.Seconds(kGiB), four_nodes_latency + bytes * 31 / 32 / bus, 1e-12);
  EXPECT_GT(four_nodes.Seconds(kGiB), one_node.Seconds(kGiB));
  // ~3 ms for 1 GiB on H100 NVLink (~360 GB/s busBw).
  EXPECT_GT(one_node.Seconds(kGiB), 2.5e-3);
  EXPECT_LT(four_nodes.Seconds(kGiB), 3.5e-3);  // 2.64 ms and 3.04 ms
}

// Where a node's NICs carry less than NVLink (A100, 8 x 200 Gb/s HDR), the network sets the
// bus bandwidth; with one GPU per node, it is one NIC's.
TEST(CollectiveEstimateTest, NetworkBoundWhenNicsAreSlowerThanNvlink) {
  const HardwareProfile a100 = Hardware("a100-80gb");
  const LinearCost one_node = RingCollectiveCost(a100, ClusterShape{1, 8});
  const LinearCost four_nodes = RingCollectiveCost(a100, ClusterShape{4, 8});
  EXPECT_DOUBLE_EQ(one_node.bandwidth_bytes_per_second,
                   a100.intra_node_bus_bandwidth_bytes_per_s * 8 / 7);
  EXPECT_DOUBLE_EQ(four_nodes.bandwidth_bytes_per_second,
                   8 * a100.inter_node_bandwidth_per_gpu_bytes_per_s * 32 / 31);
  EXPECT_GT(four_nodes.Seconds(kGiB), 1.1 * one_node.Seconds(kGiB));

  const HardwareProfile h100 = Hardware("h100-sxm");
  const LinearCost one_gpu_per_node = RingCollectiveCost(h100, ClusterShape{8, 1});
  EXPECT_DOUBLE_EQ(one_gpu_per_node.bandwidth_bytes_per_second,
                   h100.inter_node_bandwidth_per_gpu_bytes_per_s * 8 / 7);
}

// One rank gathers nothing over a link: a copy in device memory.
TEST(CollectiveEstimateTest, SingleRankIsALocalCopy) {
  const HardwareProfile hw = Hardware("h100-sxm");
  const LinearCost cost = RingCollectiveCost(hw, ClusterShape{1, 1});
  EXPECT_DOUBLE_EQ(cost.bandwidth_bytes_per_second,
                   hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency / 2);
  EXPECT_LT(cost.Seconds(kGiB), 1e-3);
}

// Forward + backward of one micro-step of Llama-3 70B on H100: near 6 × params × tokens /
// (peak × efficiency), the usual training-flops rule (0.45-0.8 s for efficiencies 0.55-0.7).
TEST_F(Llama70bEstimateTest, MicroStepComputeNearSixNT) {
  const HardwareProfile hw = Hardware("h100-sxm");
  const CostModel costs = EstimateCostModel(*program_, hw, cluster_);
  double micro_step_seconds = 0;
  for (const proto::Op& op : program_->ops()) {
    if (op.phase() == proto::PHASE_FORWARD || op.phase() == proto::PHASE_BACKWARD) {
      micro_step_seconds += costs.op_seconds[op.id()];
    }
  }
  const double params = static_cast<double>(ParamCount(*program_));
  EXPECT_NEAR(params, 70.6e9, 0.5e9);
  const double tokens = 1024;
  const double six_nt_seconds =
      6 * params * tokens / (hw.peak_bf16_flops_per_s * hw.matmul_efficiency);
  EXPECT_GT(micro_step_seconds, 0.45);
  EXPECT_LT(micro_step_seconds, 0.8);
  EXPECT_GT(micro_step_seconds, 0.95 * six_nt_seconds);
  EXPECT_LT(micro_step_seconds, 1.15 * six_nt_seconds);
}

// The cost model carries every op and the profile's stream and overlap behaviour.
TEST_F(Llama70bEstimateTest, CostModelFields) {
  const HardwareProfile hw = Hardware("h100-sxm");
  const CostModel costs = EstimateCostModel(*program_, hw, cluster_);
  ASSERT_EQ(costs.op_seconds.size(), static_cast<size_t>(program_->ops_size()));
  for (double seconds : costs.op_seconds) EXPECT_GE(seconds, hw.kernel_launch_seconds);
  EXPECT_FALSE(costs.serial_streams);
  EXPECT_DOUBLE_EQ(costs.overlap_compute_slowdown, hw.overlap_compute_slowdown);
  EXPECT_DOUBLE_EQ(costs.flops_per_second, hw.peak_bf16_flops_per_s * hw.matmul_efficiency);
  EXPECT_DOUBLE_EQ(costs.host_to_device.bandwidth_bytes_per_second,
                   hw.host_link_bandwidth_bytes_per_s);
  EXPECT_DOUBLE_EQ(costs.device_to_host.latency_seconds, hw.host_link_latency_s);
  EXPECT_DOUBLE_EQ(costs.reduce_scatter.bandwidth_bytes_per_second,
                   costs.all_gather.bandwidth_bytes_per_second);

  EXPECT_DOUBLE_EQ(costs.overlap_collective_slowdown, 1.0);
  EXPECT_EQ(BackendOf(hw), "cuda");

  // The cpu backend runs its streams on threads that share the rank's cores: both slow.
  const HardwareProfile cpu_hw = Hardware("cpu");
  const CostModel cpu = EstimateCostModel(*program_, cpu_hw, ClusterShape{1, 4});
  EXPECT_FALSE(cpu.serial_streams);
  EXPECT_GT(cpu.overlap_compute_slowdown, 1.0);
  EXPECT_DOUBLE_EQ(cpu.overlap_compute_slowdown, cpu_hw.overlap_compute_slowdown);
  EXPECT_GT(cpu.overlap_collective_slowdown, 1.0);
  EXPECT_DOUBLE_EQ(cpu.overlap_collective_slowdown, cpu_hw.overlap_collective_slowdown);
  EXPECT_EQ(BackendOf(cpu_hw), "cpu");
}

// How fast the 70B estimate runs (cheap enough to redo for every plan) is bench/speed_bench's to
// measure; tests never assert speed.
TEST_F(Llama70bEstimateTest, EstimatesEveryOp) {
  EXPECT_GT(program_->ops_size(), 3000);
  const CostModel costs = EstimateCostModel(*program_, Hardware("h100-sxm"), cluster_);
  EXPECT_EQ(costs.op_seconds.size(), static_cast<size_t>(program_->ops_size()));
}

// A small fp32 program on the cpu profile: matmuls at the fp32 rate.
TEST(CpuEstimateTest, Fp32ProgramUsesTheFp32Rate) {
  const std::optional<proto::Program> program = TinyProgram();
  ASSERT_TRUE(program.has_value());
  const HardwareProfile cpu = Hardware("cpu");
  const CostModel costs = EstimateCostModel(*program, cpu, ClusterShape{1, 2});
  EXPECT_DOUBLE_EQ(costs.flops_per_second, cpu.peak_fp32_flops_per_s * cpu.matmul_efficiency);
  for (const proto::Op& op : program->ops()) {
    const OpRoofline r = EstimateOp(*program, op, cpu, 2);
    if (op.phase() != proto::PHASE_OPTIMIZER) {
      EXPECT_DOUBLE_EQ(r.compute_seconds,
                       op.flops() / (cpu.peak_fp32_flops_per_s * cpu.matmul_efficiency));
    }
    EXPECT_DOUBLE_EQ(costs.op_seconds[op.id()], r.seconds);
  }
}

// Ranks beyond the cores of their node time-share them: every op, collective and host copy of a
// rank takes ranks-per-node / cores times as long (4 cpu ranks on 2 cores: twice); no slower
// with a core each or where the profile does not say (GPUs).
TEST(CpuEstimateTest, RanksBeyondTheHostsCoresRunSlowerByTheirShare) {
  const std::optional<proto::Program> program = TinyProgram();
  ASSERT_TRUE(program.has_value());
  HardwareProfile cpu = Hardware("cpu");
  EXPECT_EQ(cpu.host_cores_per_node, 0);
  cpu.collective_compute_seconds = 30e-6;
  const ClusterShape four{1, 4};
  const CostModel own_cores = EstimateCostModel(*program, cpu, four);
  EXPECT_EQ(HostShareSlowdown(cpu, four), 1);
  cpu.host_cores_per_node = 2;
  EXPECT_EQ(HostShareSlowdown(cpu, four), 2);
  EXPECT_EQ(HostShareSlowdown(cpu, ClusterShape{1, 2}), 1);
  EXPECT_EQ(HostShareSlowdown(cpu, ClusterShape{1, 1}), 1);
  EXPECT_EQ(HostShareSlowdown(cpu, ClusterShape{2, 3}), 1.5);  // per node, not the world
  const CostModel shared = EstimateCostModel(*program, cpu, four);
  for (size_t op = 0; op < shared.op_seconds.size(); ++op) {
    EXPECT_DOUBLE_EQ(shared.op_seconds[op], 2 * own_cores.op_seconds[op]);
  }
  EXPECT_DOUBLE_EQ(shared.all_gather.Seconds(1 << 20), 2 * own_cores.all_gather.Seconds(1 << 20));
  EXPECT_DOUBLE_EQ(shared.reduce_scatter.Seconds(4096), 2 * own_cores.reduce_scatter.Seconds(4096));
  EXPECT_DOUBLE_EQ(shared.host_to_device.Seconds(1 << 20),
                   2 * own_cores.host_to_device.Seconds(1 << 20));
  EXPECT_DOUBLE_EQ(shared.flops_per_second, own_cores.flops_per_second / 2);
  EXPECT_DOUBLE_EQ(own_cores.collective_compute_seconds, 30e-6);
  EXPECT_DOUBLE_EQ(shared.collective_compute_seconds, 60e-6);
}

// Every kind of the table (schemas/op_kinds.h) is costed by its math: matrix products at the
// compute dtype's tensor-core rate, the rest at the fp32 vector rate.
TEST(KindEstimateTest, EveryKindOfTheTableRunsAtItsMathsRate) {
  const HardwareProfile hw = Hardware("h100-sxm");
  ASSERT_NE(hw.peak_bf16_flops_per_s, hw.peak_fp32_flops_per_s);
  proto::Program program;
  program.mutable_config()->set_compute_dtype(proto::DTYPE_BF16);
  constexpr double kFlops = 1e12;
  for (const OpKindInfo& info : kOpKinds) {
    proto::Op op;
    op.set_name(std::string("test.") + info.name);
    op.set_kind(info.name);
    op.set_phase(proto::PHASE_FORWARD);
    op.set_flops(kFlops);
    const double peak =
        info.math == OpMath::kMatrix ? hw.peak_bf16_flops_per_s : hw.peak_fp32_flops_per_s;
    EXPECT_DOUBLE_EQ(EstimateOp(program, op, hw, 1).compute_seconds,
                     kFlops / (peak * hw.matmul_efficiency))
        << info.name;
  }
}

}  // namespace
}  // namespace dc
