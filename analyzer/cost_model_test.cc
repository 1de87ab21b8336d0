#include "analyzer/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>

namespace dc {
namespace {

TEST(FitLinearCostTest, RecoversLatencyAndBandwidth) {
  const double latency = 25e-6, bandwidth = 12e9;
  std::vector<CostSample> samples;
  for (int64_t bytes : {1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26}) {
    samples.push_back({bytes, latency + bytes / bandwidth});
  }
  const LinearCost fit = FitLinearCost(samples);
  EXPECT_NEAR(fit.latency_seconds, latency, 1e-12);
  EXPECT_NEAR(fit.bandwidth_bytes_per_second / bandwidth, 1.0, 1e-9);
}

TEST(FitLinearCostTest, RecoversThemThroughSymmetricNoise) {
  const double latency = 1e-4, bandwidth = 2e9;
  std::vector<CostSample> samples;
  for (int i = 1; i <= 20; ++i) {
    const int64_t bytes = int64_t{i} << 20;
    const double noise = (i % 2 == 0 ? 1 : -1) * 2e-6;  // +-2 us, alternating
    samples.push_back({bytes, latency + bytes / bandwidth + noise});
    samples.push_back({bytes, latency + bytes / bandwidth - noise});
  }
  const LinearCost fit = FitLinearCost(samples);
  EXPECT_NEAR(fit.latency_seconds, latency, 1e-9);
  EXPECT_NEAR(fit.bandwidth_bytes_per_second / bandwidth, 1.0, 1e-6);
}

TEST(FitLinearCostTest, EqualBytesGiveBandwidthAtTheMedian) {
  const LinearCost fit = FitLinearCost({{1000, 1e-6}, {1000, 3e-6}, {1000, 2e-6}});
  EXPECT_EQ(fit.latency_seconds, 0);
  EXPECT_DOUBLE_EQ(fit.bandwidth_bytes_per_second, 1000 / 2e-6);
}

TEST(FitLinearCostTest, NegativeInterceptIsClampedToZeroLatency) {
  // seconds = bytes / 1e9 - 1 ms would need a negative latency.
  std::vector<CostSample> samples;
  for (int64_t bytes : {int64_t{2'000'000}, int64_t{4'000'000}, int64_t{8'000'000}}) {
    samples.push_back({bytes, bytes / 1e9 - 1e-3});
  }
  const LinearCost fit = FitLinearCost(samples);
  EXPECT_EQ(fit.latency_seconds, 0);
  EXPECT_GT(fit.bandwidth_bytes_per_second, 0);
  for (const CostSample& s : samples) EXPECT_GE(fit.Seconds(s.bytes), 0);
}

TEST(FitLinearCostTest, DegenerateInputs) {
  const LinearCost none = FitLinearCost({});
  EXPECT_EQ(none.Seconds(1 << 20), 0);
  // Nothing moved: a pure latency.
  const LinearCost empty_messages = FitLinearCost({{0, 1e-5}, {0, 3e-5}});
  EXPECT_DOUBLE_EQ(empty_messages.latency_seconds, 2e-5);
  EXPECT_DOUBLE_EQ(empty_messages.Seconds(1 << 20), 2e-5);
  // Bigger transfers faster (noise): no slope, the median's rate.
  const LinearCost inverted = FitLinearCost({{100, 4e-6}, {200, 2e-6}});
  EXPECT_EQ(inverted.latency_seconds, 0);
  EXPECT_GT(inverted.bandwidth_bytes_per_second, 0);
}

proto::Program TwoTensorProgram() {
  proto::Program program;
  program.mutable_config()->set_compute_dtype(proto::DTYPE_BF16);
  proto::Tensor* w = program.add_tensors();
  w->set_id(0);
  w->set_name("w");
  w->add_shape(10);
  w->add_shape(10);
  w->set_dtype(proto::DTYPE_F32);
  w->set_role(proto::ROLE_PARAM);
  proto::Tensor* g = program.add_tensors();
  g->set_id(1);
  g->set_name("g");
  g->add_shape(10);
  g->add_shape(10);
  g->set_dtype(proto::DTYPE_F32);
  g->set_role(proto::ROLE_GRAD);
  g->set_param(0);
  proto::Op* op = program.add_ops();
  op->set_id(0);
  op->set_flops(1e9);
  return program;
}

proto::Instruction Instr(proto::InstrKind kind, std::initializer_list<int> tensors, int op = -1) {
  proto::Instruction instr;
  instr.set_kind(kind);
  instr.set_op(op);
  for (int t : tensors) instr.add_tensors(t);
  return instr;
}

TEST(CostModelTest, InstructionBytesUseTheComputeDtypeForGathers) {
  const proto::Program program = TwoTensorProgram();
  EXPECT_EQ(InstructionBytes(program, Instr(proto::INSTR_ALL_GATHER, {0})), 200);      // bf16
  EXPECT_EQ(InstructionBytes(program, Instr(proto::INSTR_REDUCE_SCATTER, {1})), 400);  // f32
  EXPECT_EQ(InstructionBytes(program, Instr(proto::INSTR_RELEASE, {0})), 0);
  // Offload moves the rank's fp32 shard: 100 elements over 3 ranks -> 34.
  EXPECT_EQ(CopyBytes(program, 3, Instr(proto::INSTR_OFFLOAD, {0})), 34 * 4);
}

TEST(CostModelTest, InstructionSecondsPerKind) {
  const proto::Program program = TwoTensorProgram();
  CostModel costs;
  costs.flops_per_second = 1e12;
  costs.all_gather = {1e-5, 1e8};
  costs.reduce_scatter = {2e-5, 1e8};
  costs.device_to_host = {0, 1e6};
  costs.host_to_device = {1e-3, 0};
  costs.release_seconds = 7e-7;
  // Unmeasured: the roofline; measured: the median.
  EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, 2, Instr(proto::INSTR_COMPUTE, {}, 0)), 1e-3);
  costs.op_seconds = {0.25};
  EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, 2, Instr(proto::INSTR_COMPUTE, {}, 0)), 0.25);
  EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, 2, Instr(proto::INSTR_ALL_GATHER, {0})),
                   1e-5 + 200 / 1e8);
  EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, 2, Instr(proto::INSTR_REDUCE_SCATTER, {1})),
                   2e-5 + 400 / 1e8);
  EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, 2, Instr(proto::INSTR_OFFLOAD, {0})),
                   200 / 1e6);
  EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, 2, Instr(proto::INSTR_RELOAD, {0})), 1e-3);
  EXPECT_DOUBLE_EQ(costs.InstructionSeconds(program, 2, Instr(proto::INSTR_RELEASE, {0})), 7e-7);
}

TEST(CostModelTest, TextIsStableAndCoversEveryNumber) {
  CostModel costs;
  costs.op_seconds = {1.5e-3, -1};
  costs.all_gather = {1e-5, 2.5e10};
  const std::string text = CostModelText(costs);
  EXPECT_EQ(text, CostModelText(costs));
  EXPECT_NE(text.find("op_seconds.0 0.0015\n"), std::string::npos) << text;
  EXPECT_NE(text.find("op_seconds.1 -1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("all_gather.bandwidth_bytes_per_second 2.5e+10\n"), std::string::npos)
      << text;
  costs.serial_streams = true;
  EXPECT_NE(CostModelText(costs), text);
}

}  // namespace
}  // namespace dc
