#include "machine/simulator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <initializer_list>
#include <string>

#include "tests/support/program_builder.h"

namespace dc {
namespace {

// A small program (world size 2, fp32):
//   tensors  w0 param [4] (16 B gathered, 8 B shard), w1 param [8] (32 B, 16 B shard),
//            x input i32 [2] (8 B), a0 / a1 activations [4] (16 B), g0 grad of w0 [4] (16 B,
//            8 B shard), m0 / v0 optimizer states of w0 [4] (8 B shards)
//   ops      0 fwd0 (x, w0 -> a0), 1 fwd1 (a0, w1 -> a1), 2 bwd (a1, a0, w0 -> g0),
//            3 adamw (w0, g0, m0, v0)
// Persistent bytes: shards 24, grad shard 8 (only w0 has a grad), optimizer states 16 = 48.
enum TensorId { kW0, kW1, kX, kA0, kA1, kG0, kM0, kV0 };
enum OpId { kFwd0, kFwd1, kBwd, kAdam };
constexpr int64_t kPersistentBytes = 48;

using test::AddOp;
using test::AddTensor;

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
  program.mutable_ops(kFwd0)->set_flops(100);
  return program;
}

// Builds schedules one instruction at a time.
class ScheduleBuilder {
 public:
  ScheduleBuilder() {
    schedule_.set_world_size(2);
    *schedule_.mutable_program() = SmallProgram();
  }
  ScheduleBuilder& Add(proto::InstrKind kind, proto::Stream stream, int op,
                       std::initializer_list<int> tensors, std::initializer_list<int> deps,
                       int micro_step = 0) {
    proto::Instruction* instr = schedule_.add_instructions();
    instr->set_kind(kind);
    instr->set_stream(stream);
    instr->set_micro_step(micro_step);
    instr->set_op(op);
    for (int t : tensors) instr->add_tensors(t);
    for (int d : deps) instr->add_deps(d);
    return *this;
  }
  ScheduleBuilder& Gather(std::initializer_list<int> params, std::initializer_list<int> deps = {}) {
    return Add(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, -1, params, deps);
  }
  ScheduleBuilder& Compute(int op, std::initializer_list<int> deps = {}, int micro_step = 0) {
    return Add(proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, op, {}, deps, micro_step);
  }
  ScheduleBuilder& Release(std::initializer_list<int> tensors, std::initializer_list<int> deps = {},
                           proto::Stream stream = proto::STREAM_COMPUTE) {
    return Add(proto::INSTR_RELEASE, stream, -1, tensors, deps);
  }
  ScheduleBuilder& ReduceScatter(std::initializer_list<int> grads,
                                 std::initializer_list<int> deps = {}) {
    return Add(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, -1, grads, deps);
  }
  const proto::Schedule& schedule() const { return schedule_; }

 private:
  proto::Schedule schedule_;
};

// The zero3 shape of the small program:
//   0 AG w0 | 1 AG w1 | 2 fwd0 | 3 R x | 4 fwd1 | 5 R w1 | 6 bwd | 7 R w0 a0 a1 | 8 RS g0 |
//   9 R g0 (reduce stream) | 10 adam (optimizer phase)
proto::Schedule Zero3Schedule() {
  ScheduleBuilder b;
  b.Gather({kW0})
      .Gather({kW1})
      .Compute(kFwd0, {0})
      .Release({kX}, {2})
      .Compute(kFwd1, {1})
      .Release({kW1}, {4})
      .Compute(kBwd)
      .Release({kW0, kA0, kA1}, {6})
      .ReduceScatter({kG0}, {6})
      .Release({kG0}, {8}, proto::STREAM_REDUCE)
      .Compute(kAdam, {8}, -1);
  return b.schedule();
}

// Op seconds 1, 2, 3, 0.5; all-gather 0.5 s + 16 B/s (w0 1.5 s, w1 2.5 s); reduce-scatter
// 1 s + 16 B/s (g0 2 s).
CostModel Costs() {
  CostModel costs;
  costs.op_seconds = {1.0, 2.0, 3.0, 0.5};
  costs.all_gather = {0.5, 16};
  costs.reduce_scatter = {1.0, 16};
  return costs;
}

StatusOr<SimResult> SimulateWith(const proto::Schedule& schedule,
                                 const CostModel& costs = Costs()) {
  return Simulate(schedule, costs);
}

TEST(SimulatorTest, OverlappedStreamsTiming) {
  StatusOr<SimResult> result = SimulateWith(Zero3Schedule());
  ASSERT_TRUE(result.ok()) << result.status().message();
  const std::vector<double> start = {0, 1.5, 1.5, 2.5, 4, 6, 6, 9, 9, 11, 11};
  const std::vector<double> end = {1.5, 4, 2.5, 2.5, 6, 6, 9, 9, 11, 11, 11.5};
  EXPECT_EQ(result->start_seconds, start);
  EXPECT_EQ(result->end_seconds, end);
  EXPECT_DOUBLE_EQ(result->step_seconds, 11.5);
  EXPECT_DOUBLE_EQ(result->compute_seconds, 6.5);
  EXPECT_DOUBLE_EQ(result->communication_seconds, 6);  // [0, 4] and [9, 11]
  // fwd0 [1.5, 2.5] hides 1 s of the gathers; the reduce-scatter is fully exposed.
  EXPECT_DOUBLE_EQ(result->exposed_communication_seconds, 5);
}

TEST(SimulatorTest, SerialStreamsRunOneInstructionAtATime) {
  CostModel costs = Costs();
  costs.serial_streams = true;
  StatusOr<SimResult> result = SimulateWith(Zero3Schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  const std::vector<double> start = {0, 1.5, 4, 5, 5, 7, 7, 10, 10, 12, 12};
  EXPECT_EQ(result->start_seconds, start);
  EXPECT_DOUBLE_EQ(result->step_seconds, 12.5);
  EXPECT_DOUBLE_EQ(result->compute_seconds, 6.5);
  EXPECT_DOUBLE_EQ(result->communication_seconds, 6);
  EXPECT_DOUBLE_EQ(result->exposed_communication_seconds, 6);
}

TEST(SimulatorTest, ComputeOverlappingAGatherRunsSlower) {
  CostModel costs = Costs();
  costs.overlap_compute_slowdown = 2;
  StatusOr<SimResult> result = SimulateWith(Zero3Schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  // fwd0 starts at 1.5 inside w1's gather [1.5, 4): twice as long. fwd1 starts at 4, when the
  // gather has just ended: full speed.
  EXPECT_DOUBLE_EQ(result->end_seconds[2], 3.5);
  EXPECT_DOUBLE_EQ(result->start_seconds[4], 4);
  EXPECT_DOUBLE_EQ(result->end_seconds[4], 6);
  EXPECT_DOUBLE_EQ(result->end_seconds[6], 9);  // bwd: nothing in flight at 6
}

TEST(SimulatorTest, ComputeSlowsOnlyWhileACollectiveIsInFlight) {
  // fwd0 (4 s of work) starts at 1.5 as w1's gather does; the gather runs [1.5, 4). At half
  // speed fwd0 does 1.25 s of work by 4, the other 2.75 s at full speed after it, whether the
  // gather is listed before or after it.
  CostModel costs = Costs();
  costs.op_seconds[kFwd0] = 4;
  costs.overlap_compute_slowdown = 2;
  ScheduleBuilder after;
  after.Gather({kW0}).Compute(kFwd0, {0}).Gather({kW1});
  StatusOr<SimResult> result = SimulateWith(after.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->start_seconds, (std::vector<double>{0, 1.5, 1.5}));
  EXPECT_EQ(result->end_seconds, (std::vector<double>{1.5, 6.75, 4}));
  ScheduleBuilder before;
  before.Gather({kW0}).Gather({kW1}).Compute(kFwd0, {0});
  result = SimulateWith(before.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->end_seconds, (std::vector<double>{1.5, 4, 6.75}));
}

TEST(SimulatorTest, ComputeSlowsWhenACollectiveStartsDuringIt) {
  // w1's gather waits for an offload that ends at 2, half-way through fwd0 [1.5, ...): fwd0's
  // first 0.5 s of work runs at full speed, its last 0.5 s at half speed, overlapping [2, 4.5).
  ScheduleBuilder b;
  b.Gather({kW0})
      .Add(proto::INSTR_OFFLOAD, proto::STREAM_D2H, -1, {kM0}, {})
      .Compute(kFwd0, {0})
      .Gather({kW1}, {1});
  CostModel costs = Costs();
  costs.device_to_host = {0, 4};  // m0's 8 B shard in 2 s
  costs.overlap_compute_slowdown = 2;
  StatusOr<SimResult> result = SimulateWith(b.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->start_seconds, (std::vector<double>{0, 0, 1.5, 2}));
  EXPECT_EQ(result->end_seconds, (std::vector<double>{1.5, 2, 3, 4.5}));
}

TEST(SimulatorTest, ACollectiveTakesComputeStreamTimeWhenItStarts) {
  // collective_compute_seconds 0.25: w0's gather starts at 0 with no compute running, so fwd0
  // (1 s) takes it when it starts at 1.5 and ends at 2.75; w1's gather starts at 1.5 beside it
  // and adds 0.25 s more: 3.0.
  CostModel costs = Costs();
  costs.collective_compute_seconds = 0.25;
  ScheduleBuilder b;
  b.Gather({kW0}).Compute(kFwd0, {0}).Gather({kW1});
  StatusOr<SimResult> result = SimulateWith(b.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->start_seconds, (std::vector<double>{0, 1.5, 1.5}));
  EXPECT_DOUBLE_EQ(result->end_seconds[1], 3.0);
  EXPECT_DOUBLE_EQ(result->end_seconds[2], 4.0);  // the gather's own time is unchanged
  // Serial streams: a collective's time is its own, nothing is added.
  costs.serial_streams = true;
  result = SimulateWith(b.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_DOUBLE_EQ(result->end_seconds[1], 2.5);
}

TEST(SimulatorTest, ACollectiveWaitsForTheLastRankBySkewSinceItsStreamsPreviousOne) {
  // collective_skew_fraction 0.5: w0's gather is the stream's first and starts with the step (no
  // time since, no wait); w1's starts 1.5 s after it and waits 0.75 s before its own 2.5 s.
  CostModel costs = Costs();
  costs.collective_skew_fraction = 0.5;
  ScheduleBuilder b;
  b.Gather({kW0}).Compute(kFwd0, {0}).Gather({kW1});
  StatusOr<SimResult> result = SimulateWith(b.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->start_seconds, (std::vector<double>{0, 1.5, 1.5}));
  EXPECT_EQ(result->end_seconds, (std::vector<double>{1.5, 2.5, 4.75}));
  // The wait is latency: it does not share the links, so a transfer beside it is not slowed,
  // and it is the same with serial streams.
  costs.serial_streams = true;
  result = SimulateWith(b.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  // Serial: fwd0 [1.5, 2.5), w1's gather from 2.5, 2.5 s after w0's: waits 1.25 s, ends 6.25.
  EXPECT_EQ(result->end_seconds, (std::vector<double>{1.5, 2.5, 6.25}));
  // A ceiling of 0.5 s on the wait.
  costs.collective_skew_max_seconds = 0.5;
  result = SimulateWith(b.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->end_seconds, (std::vector<double>{1.5, 2.5, 5.5}));
}

// w0's gather [0, 1.5), then fwd0 (1 s) beside w1's gather (0.5 s latency + 2 s transfer), both
// from 1.5.
proto::Schedule ComputeBesideGather() {
  ScheduleBuilder b;
  b.Gather({kW0}).Compute(kFwd0, {0}).Gather({kW1});
  return b.schedule();
}

TEST(SimulatorTest, CollectiveTransferSlowsBesideCompute) {
  // w1's latency [1.5, 2) at full speed; its transfer at half speed while fwd0 runs [2, 2.5)
  // (0.25 s of work), the other 1.75 s alone: it ends at 4.25, not 4. fwd0 is not slowed.
  CostModel costs = Costs();
  costs.overlap_collective_slowdown = 2;
  StatusOr<SimResult> result = SimulateWith(ComputeBesideGather(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->start_seconds, (std::vector<double>{0, 1.5, 1.5}));
  EXPECT_EQ(result->end_seconds, (std::vector<double>{1.5, 2.5, 4.25}));
}

TEST(SimulatorTest, ComputeAndCollectiveSlowEachOther) {
  // The cpu backend's shape: both share the rank's cores. fwd0 at half speed while w1's gather
  // is in flight: [1.5, 3.5). w1's transfer at half speed from the end of its latency (2) to 3.5
  // (0.75 s of work), the other 1.25 s alone: it ends at 4.75.
  CostModel costs = Costs();
  costs.overlap_compute_slowdown = 2;
  costs.overlap_collective_slowdown = 2;
  StatusOr<SimResult> result = SimulateWith(ComputeBesideGather(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->end_seconds, (std::vector<double>{1.5, 3.5, 4.75}));
  EXPECT_DOUBLE_EQ(result->exposed_communication_seconds, 1.5 + 1.25);
}

TEST(SimulatorTest, CollectiveLatencyIsNotSlowedByCompute) {
  // fwd0 (0.4 s) ends inside w1's latency term [1.5, 2): the transfer never meets it, so the
  // gather lasts exactly its cost model duration.
  CostModel costs = Costs();
  costs.op_seconds[kFwd0] = 0.4;
  costs.overlap_collective_slowdown = 3;
  StatusOr<SimResult> result = SimulateWith(ComputeBesideGather(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_DOUBLE_EQ(result->end_seconds[1], 1.9);
  EXPECT_DOUBLE_EQ(result->end_seconds[2], 4);
}

TEST(SimulatorTest, SerialStreamsIgnoreTheOverlapSlowdowns) {
  // Under DC_CPU_STREAMS=serial nothing runs beside anything: the slowdowns never apply.
  CostModel serial = Costs();
  serial.serial_streams = true;
  CostModel slowed = serial;
  slowed.overlap_compute_slowdown = 2;
  slowed.overlap_collective_slowdown = 2;
  StatusOr<SimResult> plain = SimulateWith(Zero3Schedule(), serial);
  StatusOr<SimResult> result = SimulateWith(Zero3Schedule(), slowed);
  ASSERT_TRUE(plain.ok() && result.ok());
  EXPECT_EQ(result->end_seconds, plain->end_seconds);
  EXPECT_DOUBLE_EQ(result->step_seconds, 12.5);
}

// The zero3 shape up to bwd, then w1 gathered again while g0 is reduce-scattered:
//   0 AG w0 | 1 AG w1 | 2 fwd0 | 3 fwd1 | 4 R w1 | 5 bwd | 6 RS g0 | 7 AG w1
proto::Schedule GatherDuringReduceScatter() {
  ScheduleBuilder b;
  b.Gather({kW0})
      .Gather({kW1})
      .Compute(kFwd0, {0})
      .Compute(kFwd1, {1})
      .Release({kW1}, {3})
      .Compute(kBwd)
      .ReduceScatter({kG0}, {5})
      .Gather({kW1}, {5});
  return b.schedule();
}

TEST(SimulatorTest, ConcurrentCollectivesShareTheLinks) {
  // Both start at 9, when bwd ends. Alone the reduce-scatter is 1 s latency + 1 s transfer
  // [9, 11) and the gather 0.5 s + 2 s [9, 11.5). Together: the gather's transfer runs alone
  // over [9.5, 10) (0.5 s done), both transfers at half speed from 10 (the reduce-scatter's 1 s
  // ends at 12, the gather has 0.5 s left then), the gather alone again until 12.5. The link
  // moves the same 3 s of transfer either way; the latencies are not slowed.
  StatusOr<SimResult> result = SimulateWith(GatherDuringReduceScatter());
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_DOUBLE_EQ(result->start_seconds[6], 9);
  EXPECT_DOUBLE_EQ(result->start_seconds[7], 9);
  EXPECT_DOUBLE_EQ(result->end_seconds[6], 12);
  EXPECT_DOUBLE_EQ(result->end_seconds[7], 12.5);
  EXPECT_DOUBLE_EQ(result->step_seconds, 12.5);
  EXPECT_DOUBLE_EQ(result->communication_seconds, 4 + 3.5);  // [0, 4) and [9, 12.5)
}

TEST(SimulatorTest, CopiesInOppositeDirectionsDoNotShare) {
  // PCIe is full duplex: m0's reload and v0's offload, both from 2, each take their time alone.
  ScheduleBuilder b;
  b.Add(proto::INSTR_OFFLOAD, proto::STREAM_D2H, -1, {kM0}, {})
      .Add(proto::INSTR_RELOAD, proto::STREAM_H2D, -1, {kM0}, {0})
      .Add(proto::INSTR_OFFLOAD, proto::STREAM_D2H, -1, {kV0}, {});
  CostModel costs = Costs();
  costs.device_to_host = {0, 4};  // 8 B in 2 s
  costs.host_to_device = {0, 8};  // 8 B in 1 s
  StatusOr<SimResult> result = SimulateWith(b.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->start_seconds, (std::vector<double>{0, 2, 2}));
  EXPECT_EQ(result->end_seconds, (std::vector<double>{2, 3, 4}));
}

TEST(SimulatorTest, PeakMemoryIsExact) {
  StatusOr<SimResult> result = SimulateWith(Zero3Schedule());
  ASSERT_TRUE(result.ok()) << result.status().message();
  // At t=4 fwd1 allocates a1 with w0, w1 gathered and a0 live (x released at 2.5).
  EXPECT_EQ(result->peak_device_bytes, kPersistentBytes + 16 + 32 + 16 + 16);
  EXPECT_DOUBLE_EQ(result->peak_at_seconds, 4);
  EXPECT_EQ(result->peak_instruction, 4);
  std::vector<int64_t> by_kind(kNumBufferKinds, 0);
  by_kind[static_cast<int>(BufferKind::kGathered)] = 48;
  by_kind[static_cast<int>(BufferKind::kShard)] = 24;
  by_kind[static_cast<int>(BufferKind::kGradShard)] = 8;
  by_kind[static_cast<int>(BufferKind::kOptimizerState)] = 16;
  by_kind[static_cast<int>(BufferKind::kActivation)] = 32;
  EXPECT_EQ(result->peak_by_kind, by_kind);

  // Timeline: the persistent shards, then one point per changing instruction; all freed at
  // the end.
  ASSERT_FALSE(result->memory_timeline.empty());
  EXPECT_EQ(result->memory_timeline.front().total_bytes, kPersistentBytes);
  EXPECT_EQ(result->memory_timeline.back().total_bytes, kPersistentBytes);
  EXPECT_DOUBLE_EQ(result->memory_timeline.back().time_seconds, 11);
  std::vector<int64_t> totals;
  for (const MemoryPoint& p : result->memory_timeline) totals.push_back(p.total_bytes);
  EXPECT_EQ(totals, (std::vector<int64_t>{48, 64, 96, 120, 112, 128, 96, 112, 64, 48}));
}

TEST(SimulatorTest, SerialPeakMovesWithTheTimes) {
  CostModel costs = Costs();
  costs.serial_streams = true;
  StatusOr<SimResult> result = SimulateWith(Zero3Schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->peak_device_bytes, 128);
  EXPECT_DOUBLE_EQ(result->peak_at_seconds, 5);
}

// A gather issued before a release but started after it (it waits for micro-step 1's forward,
// while the release on the reduce stream runs as soon as micro-step 0's forward ends): in time
// the release frees x's 8 bytes first, in issue order the gather allocates w1's 32 first. The
// executor counts in issue order, so the prediction promises that larger peak.
TEST(SimulatorTest, PeakIsAtLeastTheIssueOrderPeak) {
  ScheduleBuilder b;
  b.Gather({kW0})              // 0: 0-1.5, +16
      .Compute(kFwd0, {0}, 0)  // 1: 1.5-2.5, +8 (x) +16 (a0)
      .Compute(kFwd0, {}, 1)   // 2: 2.5-3.5, +8 +16
      .Gather({kW1}, {2})      // 3: from 3.5, +32
      .Add(proto::INSTR_RELEASE, proto::STREAM_REDUCE, -1, {kX}, {1}, 0);  // 4: at 2.5, -8
  StatusOr<SimResult> result = SimulateWith(b.schedule());
  ASSERT_TRUE(result.ok()) << result.status().message();
  // In time: 48 + 16 + 24 + 24 - 8 + 32 = 136 at 3.5; in issue order the gather's 32 come
  // before the release's -8: 144.
  ASSERT_FALSE(result->memory_timeline.empty());
  int64_t timed_peak = 0;
  for (const MemoryPoint& p : result->memory_timeline)
    timed_peak = std::max(timed_peak, p.total_bytes);
  EXPECT_EQ(timed_peak, kPersistentBytes + 88);
  EXPECT_EQ(result->peak_device_bytes, kPersistentBytes + 96);
  EXPECT_EQ(result->peak_instruction, 3);
  EXPECT_DOUBLE_EQ(result->peak_at_seconds, 3.5);
  int64_t by_kind_sum = 0;
  for (int64_t bytes : result->peak_by_kind) by_kind_sum += bytes;
  EXPECT_EQ(by_kind_sum, result->peak_device_bytes);
  EXPECT_EQ(result->peak_by_kind[static_cast<int>(BufferKind::kGathered)], 48);

  // Serial streams run in issue order: the two peaks are one.
  CostModel serial = Costs();
  serial.serial_streams = true;
  StatusOr<SimResult> in_order = SimulateWith(b.schedule(), serial);
  ASSERT_TRUE(in_order.ok()) << in_order.status().message();
  EXPECT_EQ(in_order->peak_device_bytes, kPersistentBytes + 96);
}

TEST(SimulatorTest, ToPredictionNamesNonzeroKinds) {
  StatusOr<SimResult> result = SimulateWith(Zero3Schedule());
  ASSERT_TRUE(result.ok()) << result.status().message();
  const proto::Prediction p = ToPrediction(*result);
  EXPECT_DOUBLE_EQ(p.step_seconds(), 11.5);
  EXPECT_EQ(p.peak_device_bytes(), 128);
  EXPECT_DOUBLE_EQ(p.peak_at_seconds(), 4);
  EXPECT_DOUBLE_EQ(p.exposed_communication_seconds(), 5);
  ASSERT_EQ(p.peak_by_kind_size(), 5);
  EXPECT_EQ(p.peak_by_kind(0).kind(), "gathered");
  EXPECT_EQ(p.peak_by_kind(0).role(), proto::ROLE_PARAM);
  EXPECT_EQ(p.peak_by_kind(0).bytes(), 48);
  EXPECT_EQ(p.peak_by_kind(4).kind(), "activation");
  EXPECT_EQ(p.peak_by_kind(4).bytes(), 32);
}

void ExpectError(const proto::Schedule& schedule, const std::string& want) {
  StatusOr<SimResult> result = SimulateWith(schedule);
  ASSERT_FALSE(result.ok()) << "expected: " << want;
  EXPECT_EQ(result.status().message(), want);
}

TEST(SimulatorTest, DependencyOnItselfIsAnError) {
  ScheduleBuilder b;
  b.Gather({kW0}).Compute(kFwd0, {1});
  ExpectError(b.schedule(),
              "instruction 1 (compute) depends on instruction 1, which does not come before it");
}

TEST(SimulatorTest, DependencyOnALaterInstructionIsAnError) {
  ScheduleBuilder b;
  b.Gather({kW0}, {1}).Compute(kFwd0);
  ExpectError(b.schedule(),
              "instruction 0 (all_gather) depends on instruction 1, which does "
              "not come before it");
}

TEST(SimulatorTest, ReleaseOfSomethingNotLiveIsAnError) {
  ScheduleBuilder b;
  b.Gather({kW0}).Compute(kFwd0).Release({kA0}).Release({kA0});
  ExpectError(b.schedule(),
              "instruction 3 (release) releases a0 (micro-step 0), which is not live");
  ScheduleBuilder params;
  params.Gather({kW0}).Release({kW0}).Release({kW0});
  ExpectError(params.schedule(),
              "instruction 2 (release) releases param w0, which is not gathered");
}

TEST(SimulatorTest, ReadingAnActivationThatIsNotLiveIsAnError) {
  ScheduleBuilder b;
  b.Gather({kW0, kW1}).Compute(kFwd0).Release({kA0}).Compute(kFwd1);
  ExpectError(b.schedule(), "instruction 3 (compute) reads a0 (micro-step 0), which is not live");
  // The same activation in another micro-step is another buffer.
  ScheduleBuilder other;
  other.Gather({kW0, kW1}).Compute(kFwd0, {}, 0).Compute(kFwd1, {}, 1);
  ExpectError(other.schedule(),
              "instruction 2 (compute) reads a0 (micro-step 1), which is not live");
}

TEST(SimulatorTest, ReadingAParamThatIsNotGatheredIsAnError) {
  ScheduleBuilder b;
  b.Gather({kW0}).Compute(kFwd0).Compute(kFwd1);
  ExpectError(b.schedule(), "instruction 2 (compute) reads param w1, which is not gathered");
}

TEST(SimulatorTest, GatheringALiveParamIsAnError) {
  ScheduleBuilder b;
  b.Gather({kW0}).Gather({kW1, kW0});
  ExpectError(b.schedule(),
              "instruction 1 (all_gather) gathers w0, which is already gathered "
              "and not released");
}

TEST(SimulatorTest, ReduceScatterOfAGradThatIsNotLiveIsAnError) {
  ScheduleBuilder b;
  b.ReduceScatter({kG0});
  ExpectError(b.schedule(),
              "instruction 0 (reduce_scatter) reduce-scatters g0 (micro-step 0), which is not "
              "live");
}

TEST(SimulatorTest, OptimizerReadsShardsNotGatheredParams) {
  ScheduleBuilder b;
  b.Compute(kAdam, {}, -1);
  StatusOr<SimResult> result = SimulateWith(b.schedule());
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->peak_device_bytes, kPersistentBytes);
  EXPECT_EQ(result->peak_instruction, -1);
}

TEST(SimulatorTest, OffloadFreesShardsAndReloadBringsThemBack) {
  ScheduleBuilder b;
  b.Add(proto::INSTR_OFFLOAD, proto::STREAM_D2H, -1, {kM0, kV0}, {}).Compute(kAdam, {}, -1);
  ExpectError(b.schedule(),
              "instruction 1 (compute) reads m0, which is offloaded to the host; "
              "reload it first");

  ScheduleBuilder ok;
  ok.Add(proto::INSTR_OFFLOAD, proto::STREAM_D2H, -1, {kM0, kV0}, {})
      .Add(proto::INSTR_RELOAD, proto::STREAM_H2D, -1, {kM0, kV0}, {0})
      .Compute(kAdam, {1}, -1);
  CostModel costs = Costs();
  costs.device_to_host = {0, 8};  // 16 B of shards in 2 s
  costs.host_to_device = {0, 4};  // in 4 s
  StatusOr<SimResult> result = SimulateWith(ok.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_EQ(result->end_seconds, (std::vector<double>{2, 6, 6.5}));
  std::vector<int64_t> totals;
  for (const MemoryPoint& p : result->memory_timeline) totals.push_back(p.total_bytes);
  EXPECT_EQ(totals, (std::vector<int64_t>{48, 32, 48}));  // freed at 2, back from 2
}

TEST(SimulatorTest, DurationsAreTheCostModels) {
  ScheduleBuilder b;
  b.Gather({kW0, kW1})
      .Compute(kFwd0)
      .Release({kX})
      .Add(proto::INSTR_OFFLOAD, proto::STREAM_D2H, -1, {kM0, kA0}, {})
      .Add(proto::INSTR_RELOAD, proto::STREAM_H2D, -1, {kM0, kA0}, {3})
      .Compute(kFwd1, {4})
      .Compute(kBwd)
      .ReduceScatter({kG0}, {6})
      .Release({kG0, kW0, kW1, kA0, kA1}, {7});
  CostModel costs = Costs();
  costs.device_to_host = {0.25, 8};
  costs.host_to_device = {0.5, 4};
  costs.release_seconds = 0.125;
  const proto::Schedule& schedule = b.schedule();
  StatusOr<SimResult> result = SimulateWith(schedule, costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    EXPECT_DOUBLE_EQ(result->end_seconds[i] - result->start_seconds[i],
                     costs.InstructionSeconds(schedule.program(), schedule.world_size(),
                                              schedule.instructions(i)))
        << "instruction " << i;
  }
}

TEST(SimulatorTest, InputsAreAllocatedByTheirFirstReader) {
  ScheduleBuilder b;
  b.Gather({kW0}).Compute(kFwd0).Release({kX});
  StatusOr<SimResult> result = SimulateWith(b.schedule());
  ASSERT_TRUE(result.ok()) << result.status().message();
  // w0 gathered (16) + x (8) + a0 (16).
  EXPECT_EQ(result->peak_device_bytes, kPersistentBytes + 40);
  EXPECT_EQ(result->peak_by_kind[static_cast<int>(BufferKind::kInput)], 8);
}

TEST(SimulatorTest, UnmeasuredOpsUseTheRoofline) {
  CostModel costs = Costs();
  costs.op_seconds = {-1, 2, 3, 0.5};
  costs.flops_per_second = 50;  // fwd0 has 100 flops: 2 s
  ScheduleBuilder b;
  b.Gather({kW0}).Compute(kFwd0, {0});
  StatusOr<SimResult> result = SimulateWith(b.schedule(), costs);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_DOUBLE_EQ(result->end_seconds[1], 3.5);
}

// 100k instructions: gather, compute, release param, release previous activation, over many
// micro-steps of a 100-layer chain.
TEST(SimulatorTest, HundredThousandInstructionsSimulateQuickly) {
  constexpr int kLayers = 100, kMicroSteps = 250;
  proto::Schedule schedule;
  schedule.set_world_size(8);
  proto::Program* program = schedule.mutable_program();
  program->mutable_config()->set_compute_dtype(proto::DTYPE_BF16);
  AddTensor(program, "x", 1024, proto::ROLE_INPUT, proto::DTYPE_I32);
  for (int l = 0; l < kLayers; ++l) {
    AddTensor(program, "w" + std::to_string(l), 1 << 20, proto::ROLE_PARAM);
    AddTensor(program, "a" + std::to_string(l), 1 << 16, proto::ROLE_ACTIVATION);
  }
  auto param = [](int l) { return 1 + 2 * l; };
  auto activation = [](int l) { return l < 0 ? 0 : 2 + 2 * l; };
  for (int l = 0; l < kLayers; ++l) {
    AddOp(program, "layer" + std::to_string(l), proto::PHASE_FORWARD, {activation(l - 1), param(l)},
          {activation(l)});
  }
  auto add = [&](proto::InstrKind kind, proto::Stream stream, int micro, int op, int tensor,
                 int dep) {
    proto::Instruction* instr = schedule.add_instructions();
    instr->set_kind(kind);
    instr->set_stream(stream);
    instr->set_micro_step(micro);
    instr->set_op(op);
    if (tensor >= 0) instr->add_tensors(tensor);
    if (dep >= 0) instr->add_deps(dep);
    return schedule.instructions_size() - 1;
  };
  for (int m = 0; m < kMicroSteps; ++m) {
    for (int l = 0; l < kLayers; ++l) {
      const int gather = add(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, m, -1, param(l), -1);
      const int compute = add(proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, m, l, -1, gather);
      add(proto::INSTR_RELEASE, proto::STREAM_COMPUTE, m, -1, param(l), compute);
      add(proto::INSTR_RELEASE, proto::STREAM_COMPUTE, m, -1, activation(l - 1), compute);
    }
    add(proto::INSTR_RELEASE, proto::STREAM_COMPUTE, m, -1, activation(kLayers - 1), -1);
  }
  ASSERT_GE(schedule.instructions_size(), 100'000);
  CostModel costs;
  costs.op_seconds.assign(kLayers, 1e-3);
  costs.all_gather = {1e-5, 1e10};
  auto timed = [&](const SimOptions& options, double* ms) {
    const auto t0 = std::chrono::steady_clock::now();
    StatusOr<SimResult> result = Simulate(schedule, costs, options);
    *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return result;
  };
  double with_timeline_ms = 0, peak_only_ms = 0;
  StatusOr<SimResult> result = timed(SimOptions{}, &with_timeline_ms);
  ASSERT_TRUE(result.ok()) << result.status().message();
  StatusOr<SimResult> peak_only = timed(SimOptions{.memory_timeline = false}, &peak_only_ms);
  ASSERT_TRUE(peak_only.ok()) << peak_only.status().message();
  std::printf("simulated %d instructions in %.1f ms (%.1f ms without the memory timeline)\n",
              schedule.instructions_size(), with_timeline_ms, peak_only_ms);
  // How long it takes is printed here and measured by bench/speed_bench; tests never assert speed.
  EXPECT_GT(result->step_seconds, kMicroSteps * kLayers * 1e-3);
  // Every instruction changes memory: one point each after the persistent shards.
  EXPECT_EQ(result->memory_timeline.size(), 1 + static_cast<size_t>(schedule.instructions_size()));
  EXPECT_TRUE(peak_only->memory_timeline.empty());
  EXPECT_EQ(peak_only->peak_device_bytes, result->peak_device_bytes);
  EXPECT_EQ(peak_only->peak_instruction, result->peak_instruction);
}

}  // namespace
}  // namespace dc
