#include "machine/lower_bound.h"

#include <gtest/gtest.h>

#include "machine/simulator.h"
#include "tests/support/program_builder.h"

namespace dc {
namespace {

using test::AddOp;
using test::AddTensor;

// w0, w1 params [4] and [8] (fp32: 16 B and 32 B gathered), x input, a0 / a1 activations,
// g0 the grad of w0, m0 / v0 its Adam state. fwd0 (x, w0 -> a0), fwd1 (a0, w1 -> a1),
// bwd (a1, a0, w0 -> g0), adam (w0, g0, m0, v0).
enum TensorId { kW0, kW1, kX, kA0, kA1, kG0, kM0, kV0 };
enum OpId { kFwd0, kFwd1, kBwd, kAdam };

proto::Program SmallProgram() {
  proto::Program program;
  program.mutable_config()->set_compute_dtype(proto::DTYPE_F32);
  AddTensor(&program, "w0", 4, proto::ROLE_PARAM);
  AddTensor(&program, "w1", 8, proto::ROLE_PARAM);
  AddTensor(&program, "x", 2, proto::ROLE_INPUT, proto::DTYPE_I32);
  AddTensor(&program, "a0", 4, proto::ROLE_ACTIVATION);
  AddTensor(&program, "a1", 4, proto::ROLE_ACTIVATION);
  AddTensor(&program, "g0", 4, proto::ROLE_GRAD, proto::DTYPE_F32, kW0);
  AddTensor(&program, "m0", 4, proto::ROLE_OPTIMIZER_STATE, proto::DTYPE_F32, kW0);
  AddTensor(&program, "v0", 4, proto::ROLE_OPTIMIZER_STATE, proto::DTYPE_F32, kW0);
  AddOp(&program, "fwd0", proto::PHASE_FORWARD, {kX, kW0}, {kA0});
  AddOp(&program, "fwd1", proto::PHASE_FORWARD, {kA0, kW1}, {kA1});
  AddOp(&program, "bwd", proto::PHASE_BACKWARD, {kA1, kA0, kW0}, {kG0});
  AddOp(&program, "adam", proto::PHASE_OPTIMIZER, {kW0, kG0, kM0, kV0}, {});
  return program;
}

proto::Instruction* Add(proto::Schedule* s, proto::InstrKind kind, proto::Stream stream, int op,
                        std::initializer_list<int> tensors, std::initializer_list<int> deps,
                        int micro_step = 0) {
  proto::Instruction* instr = s->add_instructions();
  instr->set_kind(kind);
  instr->set_stream(stream);
  instr->set_op(op);
  instr->set_micro_step(micro_step);
  for (int t : tensors) instr->add_tensors(t);
  for (int d : deps) instr->add_deps(d);
  return instr;
}

// The best schedule there is: both params in one gather, kept for the backward, one
// reduce-scatter, Adam on the device.
proto::Schedule BestSchedule() {
  proto::Schedule s;
  s.set_world_size(2);
  *s.mutable_program() = SmallProgram();
  Add(&s, proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, -1, {kW0, kW1}, {});  // 0
  Add(&s, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, kFwd0, {}, {0});        // 1
  Add(&s, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, kFwd1, {}, {1});        // 2
  Add(&s, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, kBwd, {}, {2});         // 3
  Add(&s, proto::INSTR_RELEASE, proto::STREAM_COMPUTE, -1, {kW0, kW1, kX, kA0, kA1}, {3});
  Add(&s, proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, -1, {kG0}, {3});  // 5
  Add(&s, proto::INSTR_RELEASE, proto::STREAM_REDUCE, -1, {kG0}, {5});         // 6
  Add(&s, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, kAdam, {}, {5}, -1);    // 7
  return s;
}

// Op seconds 1, 2, 3, 4; an all-gather 0.5 s + 16 B/s, a reduce-scatter 0.25 s + 16 B/s.
CostModel Costs() {
  CostModel costs;
  costs.op_seconds = {1.0, 2.0, 3.0, 4.0};
  costs.all_gather = {0.5, 16};
  costs.reduce_scatter = {0.25, 16};
  return costs;
}

// By hand, one instruction at a time (the cpu backend): the gather of w0 and w1 (48 B) 0.5 +
// 3 = 3.5 s, the ops 1 + 2 + 3 = 6 s, the reduce-scatter of g0 (16 B) 0.25 + 1 = 1.25 s, Adam
// 4 s: 14.75 s, and no schedule can do less of any of it.
TEST(LowerBoundTest, EqualsTheBestScheduleOnSerialStreams) {
  CostModel costs = Costs();
  costs.serial_streams = true;
  const StepBound bound = StepLowerBound(SmallProgram(), 2, costs);
  EXPECT_DOUBLE_EQ(bound.serial_seconds, 14.75);
  EXPECT_DOUBLE_EQ(bound.seconds, 14.75);
  EXPECT_EQ(bound.binding, "serial streams");
  auto sim = Simulate(BestSchedule(), costs);
  ASSERT_TRUE(sim.ok()) << sim.status().message();
  EXPECT_DOUBLE_EQ(sim->step_seconds, 14.75);
}

// Concurrent streams: nothing computes before fwd0's gather of w0 (0.5 + 1 = 1.5 s); then 6 s of
// ops; then g0's reduce-scatter (1.25 s) and Adam (4 s on the device, or 4 s on the host: the
// cpu-like host rate 0 costs what the device does): 1.5 + 6 + 5.25 = 12.75 s. The best
// schedule gathers both params first (3.5 s), so it takes 3.5 + 6 + 1.25 + 4 = 14.75 s.
TEST(LowerBoundTest, ComputeAndItsUnavoidableHeadAndTail) {
  const CostModel costs = Costs();
  const StepBound bound = StepLowerBound(SmallProgram(), 2, costs);
  EXPECT_DOUBLE_EQ(bound.compute_seconds, 12.75);
  EXPECT_DOUBLE_EQ(bound.seconds, 12.75);
  EXPECT_EQ(bound.binding, "compute");
  // The collectives: 3.5 s of gathers, 1.25 s of reductions, on shared links 0.25 + 3 + 1.
  EXPECT_DOUBLE_EQ(bound.communication_seconds, 4.25);
  auto sim = Simulate(BestSchedule(), costs);
  ASSERT_TRUE(sim.ok()) << sim.status().message();
  EXPECT_LE(bound.seconds, sim->step_seconds);
}

// Collective-bound: slow links. The gathers and reductions share the links; compute overlapped
// by them runs 1.5x slower, so the bound is above the communication alone.
TEST(LowerBoundTest, CommunicationAndTheOverlapSlowdown) {
  CostModel costs = Costs();
  costs.all_gather = {0.5, 2};       // 48 B: 24.5 s
  costs.reduce_scatter = {0.25, 2};  // 16 B: 8.25 s
  costs.overlap_compute_slowdown = 1.5;
  const StepBound bound = StepLowerBound(SmallProgram(), 2, costs);
  // Links: 0.25 + 24 + 8 = 32.25 s.
  EXPECT_DOUBLE_EQ(bound.communication_seconds, 32.25);
  // K = 32.25 > s * C = 9: max(K, C + (1 - 1/s) * 9) = K.
  EXPECT_DOUBLE_EQ(bound.overlap_seconds, 32.25);
  EXPECT_GE(bound.seconds, 32.25);
  auto sim = Simulate(BestSchedule(), costs);
  ASSERT_TRUE(sim.ok()) << sim.status().message();
  EXPECT_LE(bound.seconds, sim->step_seconds);
}

// The overlap term when compute dominates: C = 6 s of forward and backward, K = 4.25 s of
// collectives, s = 2: C + (1 - 1/2) * 4.25 = 8.125 s.
TEST(LowerBoundTest, OverlapSlowdownTerm) {
  CostModel costs = Costs();
  costs.overlap_compute_slowdown = 2;
  const StepBound bound = StepLowerBound(SmallProgram(), 2, costs);
  EXPECT_DOUBLE_EQ(bound.overlap_seconds, 8.125);
}

// A host optimizer as fast as the device lets Adam run beside the compute: the balanced split
// of compute (1.5 s before, 6 s of ops, 4 s of Adam) against the host is not below the tail.
TEST(LowerBoundTest, HostOptimizerSplit) {
  CostModel costs = Costs();
  costs.host_optimizer_elements_per_second = 1;  // w0's shard: 2 elements = 2 s on the host
  const StepBound bound = StepLowerBound(SmallProgram(), 2, costs);
  // Device 1.5 + 6 + 4 = 11.5 against host 1.5: moving Adam (4 s there, 2 s here) whole leaves
  // device 7.5 and host 3.5.
  EXPECT_DOUBLE_EQ(bound.compute_host_seconds, 7.5);
  // The tail takes the cheaper of the two: 1.5 + 6 + 1.25 + 2.
  EXPECT_DOUBLE_EQ(bound.compute_seconds, 10.75);
}

TEST(LowerBoundTest, Gap) {
  EXPECT_NEAR(BoundGap(1.126, 0.94), 0.198, 1e-3);
  EXPECT_DOUBLE_EQ(BoundGap(1.0, 0.0), 0.0);
}

}  // namespace
}  // namespace dc
