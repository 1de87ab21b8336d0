#include "machine/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

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

// Single-tensor collectives at several sizes on the line latency + bytes / bandwidth.
std::vector<CostSample> OnTheLine(double latency, double bandwidth,
                                  std::initializer_list<int64_t> sizes) {
  std::vector<CostSample> samples;
  for (int64_t bytes : sizes) samples.push_back({bytes, latency + bytes / bandwidth});
  return samples;
}

TEST(FitCollectiveCostsTest, EachKindFitsAloneWhereItsSizesDiffer) {
  const CollectiveCosts fit = FitCollectiveCosts(OnTheLine(2e-5, 1e11, {1 << 20, 1 << 24}),
                                                 OnTheLine(3e-5, 5e10, {1 << 21, 1 << 25}));
  EXPECT_NEAR(fit.all_gather.latency_seconds, 2e-5, 1e-12);
  EXPECT_NEAR(fit.reduce_scatter.latency_seconds, 3e-5, 1e-12);
  EXPECT_FALSE(fit.all_gather_pooled);
  EXPECT_FALSE(fit.reduce_scatter_pooled);
}

TEST(FitCollectiveCostsTest, OneSizeTakesTheLatencyOfBothKinds) {
  // Every gather moved 1 MiB: alone, the fit is latency 0 and four of them fused cost four
  // times one. The reduce-scatters (the same ring) show the latency.
  const double latency = 2e-5, bandwidth = 1e11;
  const int64_t one = 1 << 20;
  const std::vector<CostSample> gathers = OnTheLine(latency, bandwidth, {one, one, one});
  const std::vector<CostSample> reductions =
      OnTheLine(latency, bandwidth, {2 * one, 8 * one, 32 * one});
  const LinearCost alone = FitLinearCost(gathers);
  EXPECT_EQ(alone.latency_seconds, 0);
  EXPECT_DOUBLE_EQ(alone.Seconds(4 * one), 4 * alone.Seconds(one));

  const CollectiveCosts fit = FitCollectiveCosts(gathers, reductions);
  EXPECT_TRUE(fit.all_gather_pooled);
  EXPECT_FALSE(fit.reduce_scatter_pooled);
  EXPECT_NEAR(fit.all_gather.latency_seconds, latency, 1e-12);
  EXPECT_NEAR(fit.all_gather.bandwidth_bytes_per_second / bandwidth, 1, 1e-9);
  // Its own samples stay on its line; four fused pay the latency once.
  EXPECT_NEAR(fit.all_gather.Seconds(one), latency + one / bandwidth, 1e-15);
  EXPECT_NEAR(fit.all_gather.Seconds(4 * one), latency + 4 * one / bandwidth, 1e-15);
}

TEST(FitCollectiveCostsTest, NeverBelowWhatItsOwnSamplesShow) {
  // The reduce-scatters' latency (1 ms) is longer than a whole measured gather (0.5 ms): it
  // cannot be the gathers' latency, so they keep latency 0 and the rate they showed.
  const int64_t one = 1 << 20;
  const std::vector<CostSample> gathers = {{one, 5e-4}, {one, 5e-4}};
  const CollectiveCosts fit = FitCollectiveCosts(gathers, OnTheLine(1e-3, 1e10, {one, 16 * one}));
  EXPECT_FALSE(fit.all_gather_pooled);
  EXPECT_EQ(fit.all_gather.latency_seconds, 0);
  EXPECT_DOUBLE_EQ(fit.all_gather.bandwidth_bytes_per_second, one / 5e-4);
  // One size each, on one line through the origin: the fit over both has no latency to give.
  const CollectiveCosts flat = FitCollectiveCosts(gathers, {{2 * one, 1e-3}});
  EXPECT_FALSE(flat.all_gather_pooled);
  EXPECT_FALSE(flat.reduce_scatter_pooled);
  EXPECT_EQ(flat.reduce_scatter.latency_seconds, 0);
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

TEST(CostModelTest, GroupedCollectiveCostsTheLatencyOnce) {
  // A model fitted from single-tensor gathers, costing a bucket of four params: the fitted
  // latency once plus all the bytes at the fitted bandwidth; never the sum of four
  // single-tensor costs, never under the bandwidth bound.
  proto::Program program = TwoTensorProgram();
  for (int i = 0; i < 3; ++i) {
    proto::Tensor* w = program.add_tensors();
    *w = program.tensors(0);
    w->set_id(program.tensors_size() - 1);
    w->set_name("w" + std::to_string(i + 1));
  }
  const double latency = 25e-6, bandwidth = 1e9;
  CostModel costs;
  costs.all_gather = FitLinearCost(OnTheLine(latency, bandwidth, {100, 200, 400}));
  costs.reduce_scatter = costs.all_gather;
  const proto::Instruction bucket = Instr(proto::INSTR_ALL_GATHER, {0, 2, 3, 4});
  const int64_t bytes = InstructionBytes(program, bucket);
  ASSERT_EQ(bytes, 4 * 200);  // four bf16 [10, 10]
  const double fused = costs.InstructionSeconds(program, 2, bucket);
  EXPECT_NEAR(fused, latency + bytes / bandwidth, 1e-15);
  double apart = 0;
  for (int t : {0, 2, 3, 4}) {
    apart += costs.InstructionSeconds(program, 2, Instr(proto::INSTR_ALL_GATHER, {t}));
  }
  EXPECT_NEAR(apart - fused, 3 * latency, 1e-15);
  EXPECT_GE(fused, bytes / costs.all_gather.bandwidth_bytes_per_second);
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
