#include "analyzer/profile.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "analyzer/calibration.h"
#include "collector/host_tracer.h"
#include "machine/estimate.h"
#include "machine/hardware.h"
#include "schemas/digest.h"
#include "tests/support/test_traces.h"

namespace dc {
namespace {

using testing::CpuSchedule;
using testing::TempDir;

class ProfileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::WriteProfileTrace(dir_);
    ASSERT_FALSE(path_.empty());
    StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path_);
    ASSERT_TRUE(trace.ok()) << trace.status().message();
    trace_ = std::move(trace).value();
    StatusOr<Profile> profile = BuildProfile(*trace_);
    ASSERT_TRUE(profile.ok()) << profile.status().message();
    profile_ = std::move(profile).value();
  }

  TempDir dir_;
  std::string path_;
  std::unique_ptr<Trace> trace_;
  Profile profile_;
};

// The cpu profile's overlap slowdowns: what a concurrent cpu trace takes where it cannot
// measure its own.
CostModel CpuConcurrency() {
  CostModel costs;
  StatusOr<HardwareProfile> cpu = FindHardware("cpu");
  EXPECT_TRUE(cpu.ok());
  if (cpu.ok()) ApplyConcurrency(*cpu, &costs);
  return costs;
}

TEST_F(ProfileTest, OpMediansExcludeWarmup) {
  const CostModel& costs = profile_.costs;
  ASSERT_EQ(costs.op_seconds.size(), 3u);
  // fwd0 ran 100, 300, 200 ns (rank 0) and 400, 500, 600 ns (rank 1); the 5000 ns warm-up
  // runs are left out.
  EXPECT_DOUBLE_EQ(costs.op_seconds[0], 350e-9);
  // fwd1 ran 3000 ns beside the gather for 1/3, 2/3 and all of it (steps 1-3, both ranks): no
  // sample alone, so the slowdown is the cpu profile's k, and each sample is the work it took
  // alone, 3000 (1 - f + f / k); the median is step 2's.
  const double k = CpuConcurrency().overlap_compute_slowdown;
  ASSERT_GT(k, 1);
  EXPECT_DOUBLE_EQ(costs.overlap_compute_slowdown, k);
  EXPECT_NEAR(costs.op_seconds[1], 3000e-9 * (1.0 / 3 + 2.0 / 3 / k), 1e-15);
  EXPECT_EQ(costs.op_seconds[2], -1);  // bwd never ran
  // Roofline for bwd from the measured flops rate: 3500 flops in 350 ns.
  EXPECT_DOUBLE_EQ(costs.flops_per_second, 1e10);
  EXPECT_DOUBLE_EQ(costs.OpSeconds(trace_->schedule()->program(), 2), 1e4 / 1e10);
  EXPECT_EQ(profile_.steps_measured, 3);
  EXPECT_EQ(profile_.world_size, 2);
}

TEST_F(ProfileTest, CollectiveAndCopyCostsAreFitted) {
  const CostModel& costs = profile_.costs;
  // Gathers: 1000 ns + 1 ns per byte, run beside fwd1 for 1/2, 2/3 and 3/4 of their span: each
  // is the work it takes alone at the cpu profile's collective slowdown k. The warm-up's 1000
  // bytes in 8000 ns is left out.
  const double k = CpuConcurrency().overlap_collective_slowdown;
  ASSERT_GT(k, 1);
  EXPECT_DOUBLE_EQ(costs.overlap_collective_slowdown, k);
  auto alone = [&](int64_t bytes, double f) {
    return CostSample{bytes, (1000 + bytes) * 1e-9 * (1 - f + f / k)};
  };
  const LinearCost gathers =
      FitLinearCost({alone(1000, 0.5), alone(2000, 2.0 / 3), alone(3000, 0.75), alone(1000, 0.5),
                     alone(2000, 2.0 / 3), alone(3000, 0.75)});
  EXPECT_NEAR(costs.all_gather.latency_seconds, gathers.latency_seconds, 1e-15);
  EXPECT_NEAR(costs.all_gather.bandwidth_bytes_per_second, gathers.bandwidth_bytes_per_second,
              1e-3);
  EXPECT_LT(costs.all_gather.Seconds(3000), 4000e-9);  // faster than as measured beside fwd1
  // Reduce-scatters all move 500 bytes: no latency, the median's rate (200 ns).
  EXPECT_EQ(costs.reduce_scatter.latency_seconds, 0);
  EXPECT_NEAR(costs.reduce_scatter.bandwidth_bytes_per_second, 2.5e9, 1e-3);
  EXPECT_NEAR(costs.device_to_host.bandwidth_bytes_per_second, 4e9, 1e-3);
  EXPECT_EQ(costs.host_to_device.bandwidth_bytes_per_second, 0);  // no reloads: default
  EXPECT_FALSE(costs.serial_streams);                             // the gathers ran beside fwd1
}

TEST_F(ProfileTest, OverlapFollowsHtaDefinitions) {
  ASSERT_EQ(profile_.overlap.size(), 6u);  // 2 ranks x 3 measured steps
  const StepOverlap& o = profile_.overlap[0];
  EXPECT_EQ(o.global_pid, trace_->ranks()[0].global_pid);
  EXPECT_EQ(o.step, 1);
  // Step 1 of rank 0, [10000, 20000): fwd0 [10000, 10100], gather [11000, 13000],
  // fwd1 [12000, 15000], reduce-scatter [16000, 16100], offload [17000, 18000].
  EXPECT_DOUBLE_EQ(o.span_seconds, 10000e-9);
  EXPECT_DOUBLE_EQ(o.compute_seconds, 3100e-9);
  EXPECT_DOUBLE_EQ(o.communication_seconds, 2100e-9);
  EXPECT_DOUBLE_EQ(o.overlap_seconds, 1000e-9);
  EXPECT_DOUBLE_EQ(o.exposed_communication_seconds, 1100e-9);
  EXPECT_DOUBLE_EQ(o.copy_seconds, 1000e-9);
  EXPECT_DOUBLE_EQ(o.idle_seconds, 4800e-9);
  // Rank 1's step 3 runs to 50000.
  EXPECT_EQ(profile_.overlap[5].step, 3);
  EXPECT_DOUBLE_EQ(profile_.overlap[5].span_seconds, 20000e-9);
}

TEST_F(ProfileTest, StepTimeIsTheMedianOfMeasuredSteps) {
  // Steps span 10000, 10000 and 20000 ns over both ranks.
  EXPECT_DOUBLE_EQ(profile_.step_seconds_median, 10000e-9);
}

TEST_F(ProfileTest, MemoryTimelineOfTheFirstRank) {
  const MemoryTimeline& m = profile_.memory;
  ASSERT_EQ(m.kinds.size(), static_cast<size_t>(kNumBufferKinds));
  EXPECT_EQ(m.kinds[0], "gathered");
  std::vector<int64_t> totals, times;
  for (const auto& p : m.points) {
    totals.push_back(p.total_bytes);
    times.push_back(p.ts_ns);
  }
  // 50 bytes of shard were live before the capture (freed, never allocated).
  EXPECT_EQ(totals, (std::vector<int64_t>{150, 180, 80, 40}));
  EXPECT_EQ(times, (std::vector<int64_t>{10, 20, 30, 40}));
  EXPECT_EQ(m.peak_bytes, 180);
  EXPECT_EQ(m.peak_ts_ns, 20);
  EXPECT_EQ(m.peak_by_kind, (std::vector<int64_t>{100, 50, 0, 0, 0, 30, 0}));
}

TEST_F(ProfileTest, DigestIsStable) {
  EXPECT_EQ(profile_.digest, Sha256Hex(CostModelText(profile_.costs)));
  StatusOr<Profile> again = BuildProfile(*trace_);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->digest, profile_.digest);
  EXPECT_EQ(profile_.trace_path, path_);
}

TEST_F(ProfileTest, NotesSayWhatWasNotMeasured) {
  bool unmeasured = false, no_reload = false;
  for (const std::string& note : profile_.notes) {
    unmeasured |= note.find("1 ops never ran") != std::string::npos;
    no_reload |= note.find("no reload samples") != std::string::npos;
  }
  EXPECT_TRUE(unmeasured);
  EXPECT_TRUE(no_reload);
}

TEST(NsysProfileTest, OverlapAndNoOpCosts) {
  const std::string path = DC_SOURCE_DIR "/../shared/data/nsys/saxpy-mpi-cuda.sqlite";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is absent";
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  StatusOr<Profile> profile = BuildProfile(**trace);
  ASSERT_TRUE(profile.ok()) << profile.status().message();
  EXPECT_TRUE(profile->costs.op_seconds.empty());
  EXPECT_FALSE(profile->costs.serial_streams);
  ASSERT_EQ(profile->overlap.size(), 1u);
  const StepOverlap& o = profile->overlap[0];
  // The whole capture of the one process: first copy start to last copy end.
  EXPECT_DOUBLE_EQ(o.span_seconds, (1985185585 - 887857742) * 1e-9);
  EXPECT_DOUBLE_EQ(o.compute_seconds, 88573480e-9);
  EXPECT_DOUBLE_EQ(o.copy_seconds, 284699600e-9);
  EXPECT_EQ(o.communication_seconds, 0);
  EXPECT_DOUBLE_EQ(o.idle_seconds, (1985185585 - 887857742 - 373273080) * 1e-9);
  EXPECT_TRUE(profile->memory.points.empty());
  EXPECT_EQ(profile->steps_measured, 0);
}

// A one-rank cpu trace of ops mm0, mm1, mm2 (1, 2, 3 us alone) and a gather and a
// reduce-scatter (1 us + 1 ns per byte alone). Steps 1 and 3 run everything apart; with
// `concurrent`, steps 2 and 4 run the ops at half speed beside a 7000-byte gather (12 us, 1.5x
// its 8 us alone) and a 2000-byte reduce-scatter (4.5 us, 1.5x its 3 us); without, they repeat
// steps 1 and 3 (a DC_CPU_STREAMS=serial run).
std::string WriteConcurrencyTrace(const TempDir& dir, bool concurrent) {
  proto::Schedule schedule = CpuSchedule(1);
  proto::Program* program = schedule.mutable_program();
  for (const char* name : {"w0", "g0"}) {
    proto::Tensor* t = program->add_tensors();
    t->set_id(program->tensors_size() - 1);
    t->set_name(name);
    t->add_shape(256);
    t->set_dtype(proto::DTYPE_F32);
    t->set_role(program->tensors_size() == 1 ? proto::ROLE_PARAM : proto::ROLE_GRAD);
    t->set_param(program->tensors_size() == 1 ? -1 : 0);
  }
  for (const char* name : {"mm0", "mm1", "mm2"}) {
    proto::Op* op = program->add_ops();
    op->set_id(program->ops_size() - 1);
    op->set_name(name);
    op->set_phase(proto::PHASE_FORWARD);
  }
  auto add = [&](proto::InstrKind kind, proto::Stream stream, int op, int tensor) {
    proto::Instruction* instr = schedule.add_instructions();
    instr->set_kind(kind);
    instr->set_stream(stream);
    instr->set_op(op);
    if (tensor >= 0) instr->add_tensors(tensor);
  };
  add(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, -1, 0);
  for (int op = 0; op < 3; ++op) add(proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, op, -1);
  add(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, -1, 1);

  RankIdentity identity;
  identity.hostname = "test";
  HostTracer tracer(identity, 0);
  constexpr int64_t kStepNs = 100000;
  for (int s = 0; s <= 4; ++s) {
    const int64_t w = kStepNs * s;
    if (concurrent && s % 2 == 0 && s > 0) {
      tracer.Collective(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, w, w + 12000, 7000, 1, 0,
                        {s, 0, 0});
      tracer.Kernel("mm0", proto::STREAM_COMPUTE, w, w + 2000, {s, 0, 1});
      tracer.Kernel("mm1", proto::STREAM_COMPUTE, w + 2000, w + 6000, {s, 0, 2});
      tracer.Kernel("mm2", proto::STREAM_COMPUTE, w + 6000, w + 12000, {s, 0, 3});
      tracer.Collective(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, w + 6000, w + 10500,
                        2000, 1, 0, {s, 0, 4});
    } else {
      const int64_t gather_bytes = s % 2 == 1 ? 3000 : 5000;
      tracer.Kernel("mm0", proto::STREAM_COMPUTE, w, w + 1000, {s, 0, 1});
      tracer.Kernel("mm1", proto::STREAM_COMPUTE, w + 1000, w + 3000, {s, 0, 2});
      tracer.Kernel("mm2", proto::STREAM_COMPUTE, w + 3000, w + 6000, {s, 0, 3});
      tracer.Collective(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, w + 10000,
                        w + 11000 + gather_bytes, gather_bytes, 1, 0, {s, 0, 0});
      tracer.Collective(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, w + 20000, w + 23000,
                        2000, 1, 0, {s, 0, 4});
    }
    tracer.Step(s, w, w + kStepNs, 1.0, s == 0);
  }
  const std::string rank_path = dir.File("rank0.db");
  if (!tracer.WriteRankFile(rank_path).ok()) return "";
  const std::string out = dir.File("concurrency.db");
  return MergeRankTraces({rank_path}, schedule, out).ok() ? out : "";
}

StatusOr<Profile> ProfileOf(const std::string& path) {
  DC_ASSIGN_OR_RETURN(std::unique_ptr<Trace> trace, Trace::Open(path));
  return BuildProfile(*trace);
}

TEST(ProfileConcurrencyTest, SlowdownsAreMeasuredAndTakenOutOfTheCosts) {
  TempDir dir;
  const std::string path = WriteConcurrencyTrace(dir, /*concurrent=*/true);
  ASSERT_FALSE(path.empty());
  StatusOr<Profile> profile = ProfileOf(path);
  ASSERT_TRUE(profile.ok()) << profile.status().message();
  const CostModel& costs = profile->costs;
  EXPECT_FALSE(costs.serial_streams);
  // (2 + 4 + 6) / (1 + 2 + 3) us, and (12 + 4.5) / (8 + 3) us per step beside.
  EXPECT_DOUBLE_EQ(costs.overlap_compute_slowdown, 2);
  EXPECT_DOUBLE_EQ(costs.overlap_collective_slowdown, 1.5);
  // Every sample as its work alone: the ops' alone times, the collectives on their line.
  ASSERT_EQ(costs.op_seconds.size(), 3u);
  EXPECT_DOUBLE_EQ(costs.op_seconds[0], 1000e-9);
  EXPECT_DOUBLE_EQ(costs.op_seconds[1], 2000e-9);
  EXPECT_DOUBLE_EQ(costs.op_seconds[2], 3000e-9);
  EXPECT_NEAR(costs.all_gather.latency_seconds, 1000e-9, 1e-15);
  EXPECT_NEAR(costs.all_gather.bandwidth_bytes_per_second, 1e9, 1e-3);
  EXPECT_NEAR(costs.reduce_scatter.Seconds(2000), 3000e-9, 1e-15);
}

// A one-rank trace whose step 2 stalled: steps of 100 us but step 2's 1000 us, each an op and
// then a gather of 1 us + 1 ns per byte (3000, 5000, 5000, 3000 bytes in steps 1-4) but step 2's,
// which took 600 us, as a step on a busy host does.
std::string WriteStalledStepTrace(const TempDir& dir) {
  proto::Schedule schedule = CpuSchedule(1);
  proto::Program* program = schedule.mutable_program();
  proto::Tensor* t = program->add_tensors();
  t->set_id(0);
  t->set_name("w0");
  t->add_shape(256);
  t->set_dtype(proto::DTYPE_F32);
  t->set_role(proto::ROLE_PARAM);
  t->set_param(-1);
  proto::Op* op = program->add_ops();
  op->set_id(0);
  op->set_name("mm0");
  op->set_phase(proto::PHASE_FORWARD);
  proto::Instruction* compute = schedule.add_instructions();
  compute->set_kind(proto::INSTR_COMPUTE);
  compute->set_stream(proto::STREAM_COMPUTE);
  compute->set_op(0);
  proto::Instruction* gather = schedule.add_instructions();
  gather->set_kind(proto::INSTR_ALL_GATHER);
  gather->set_stream(proto::STREAM_GATHER);
  gather->add_tensors(0);

  RankIdentity identity;
  identity.hostname = "test";
  HostTracer tracer(identity, 0);
  int64_t w = 0;
  for (int s = 0; s <= 4; ++s) {
    const bool stalled = s == 2;
    const int64_t step_ns = stalled ? 1000000 : 100000;
    const int64_t bytes = s == 1 || s == 4 ? 3000 : 5000;
    tracer.Kernel("mm0", proto::STREAM_COMPUTE, w, w + 1000, {s, 0, 0});
    tracer.Collective(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, w + 2000,
                      w + 2000 + (stalled ? 600000 : 1000 + bytes), bytes, 1, 0, {s, 0, 1});
    tracer.Step(s, w, w + step_ns, 1.0, s == 0);
    w += step_ns;
  }
  const std::string rank_path = dir.File("rank0.db");
  if (!tracer.WriteRankFile(rank_path).ok()) return "";
  const std::string out = dir.File("stalled.db");
  return MergeRankTraces({rank_path}, schedule, out).ok() ? out : "";
}

// A step more than twice the median step's length stalled: its samples are left out of the
// costs (as its time is out of the median), and a note says so. With it, the gathers' line
// through the mean would take 150 us of latency.
TEST(ProfileStallTest, AStalledStepIsLeftOutOfTheCosts) {
  TempDir dir;
  const std::string path = WriteStalledStepTrace(dir);
  ASSERT_FALSE(path.empty());
  StatusOr<Profile> profile = ProfileOf(path);
  ASSERT_TRUE(profile.ok()) << profile.status().message();
  EXPECT_EQ(profile->steps_measured, 4);
  EXPECT_DOUBLE_EQ(profile->step_seconds_median, 100e-6);
  EXPECT_NEAR(profile->costs.all_gather.latency_seconds, 1000e-9, 1e-15);
  EXPECT_NEAR(profile->costs.all_gather.bandwidth_bytes_per_second, 1e9, 1e-3);
  bool said = false;
  for (const std::string& note : profile->notes) {
    said = said || note ==
                       "step 2 took 1.000 ms, more than 2x the median step (0.100 ms): a stall, "
                       "its instructions are left out of the costs";
  }
  EXPECT_TRUE(said);
  // dc-calibrate's samples are the same: steps 1, 3 and 4's gathers.
  auto trace = Trace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  auto samples = CollectCostSamples(**trace);
  ASSERT_TRUE(samples.ok()) << samples.status().message();
  ASSERT_EQ(samples->all_gather.size(), 3u);
  for (const CostSample& s : samples->all_gather) EXPECT_LT(s.seconds, 10e-6);
}

TEST(ProfileConcurrencyTest, SerialRunGivesSerialStreamsAndNoSlowdown) {
  TempDir dir;
  const std::string path = WriteConcurrencyTrace(dir, /*concurrent=*/false);
  ASSERT_FALSE(path.empty());
  StatusOr<Profile> profile = ProfileOf(path);
  ASSERT_TRUE(profile.ok()) << profile.status().message();
  EXPECT_TRUE(profile->costs.serial_streams);
  EXPECT_EQ(profile->costs.overlap_compute_slowdown, 1);
  EXPECT_EQ(profile->costs.overlap_collective_slowdown, 1);
  EXPECT_DOUBLE_EQ(profile->costs.op_seconds[2], 3000e-9);
}

// dc-calibrate takes the slowdowns a trace measures op by op (the same pairs BuildProfile's come
// from), not a fit of the whole step, which would move every unexplained second into them.
TEST(ProfileConcurrencyTest, CalibrationTakesTheSlowdownsTheTraceMeasured) {
  TempDir dir;
  const std::string path = WriteConcurrencyTrace(dir, /*concurrent=*/true);
  ASSERT_FALSE(path.empty());
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  StatusOr<CostSamples> samples = CollectCostSamples(**trace);
  ASSERT_TRUE(samples.ok()) << samples.status().message();
  EXPECT_EQ(samples->compute_beside.size(), 3u);  // mm0, mm1, mm2
  EXPECT_EQ(samples->collectives_beside.size(),
            4u);  // a gather and a reduce-scatter, steps 2 and 4
  StatusOr<HardwareProfile> base = FindHardware("cpu");
  ASSERT_TRUE(base.ok());
  StatusOr<std::vector<FitGroup>> groups = TraceGroups({trace->get()}, *base);
  ASSERT_TRUE(groups.ok()) << groups.status().message();
  const FitGroup* concurrency = nullptr;
  for (const FitGroup& g : *groups) {
    if (g.kind == "trace concurrency") concurrency = &g;
    if (g.kind == "trace step") {
      EXPECT_TRUE(g.keys.empty()) << "the step fits " << g.keys.front();
      // The slowdown measured op by op; the trace's own schedule needed no compute time per
      // collective to reach its step, so nothing starts that constant's fit either.
      ASSERT_EQ(g.undetermined.size(), 2u);
      EXPECT_NE(g.undetermined[0].find("measured op by op"), std::string::npos);
      EXPECT_EQ(g.undetermined[1].find("collective_compute_seconds: no trace"), 0u);
    }
  }
  ASSERT_NE(concurrency, nullptr);
  EXPECT_EQ(concurrency->keys,
            (std::vector<std::string>{"overlap_compute_slowdown", "overlap_collective_slowdown"}));
  // (The synthetic ops have no flops for a roofline: only this group is fitted.)
  StatusOr<Calibration> fit = Calibrate(*base, {*concurrency});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  // Twice as slow beside (2, 4, 6 us against 1, 2, 3), and 1.5x for the collectives.
  EXPECT_NEAR(fit->profile.overlap_compute_slowdown, 2, 0.01);
  EXPECT_NEAR(fit->profile.overlap_collective_slowdown, 1.5, 0.01);
  EXPECT_EQ(fit->profile.sources.at("overlap_compute_slowdown").find("fitted from"), 0u);

  // A serial run measures nothing beside anything: no concurrency group fits.
  TempDir serial_dir;
  const std::string serial_path = WriteConcurrencyTrace(serial_dir, /*concurrent=*/false);
  StatusOr<std::unique_ptr<Trace>> serial = Trace::Open(serial_path);
  ASSERT_TRUE(serial.ok()) << serial.status().message();
  StatusOr<std::vector<FitGroup>> serial_groups = TraceGroups({serial->get()}, *base);
  ASSERT_TRUE(serial_groups.ok()) << serial_groups.status().message();
  for (const FitGroup& g : *serial_groups) EXPECT_NE(g.kind, "trace concurrency");
}

// A trace of `schedule` on two ranks of host "test" whose processes could run on `host_cores`
// cores (0: not recorded): steps 0 (warm-up) to 4 of 100 us from 0, each filled by
// record(tracer, rank, step, its start). "" where a file could not be written.
std::string WriteTwoRanks(const TempDir& dir, const proto::Schedule& schedule, int host_cores,
                          const std::string& name,
                          const std::function<void(HostTracer&, int, int, int64_t)>& record) {
  std::vector<std::string> rank_paths;
  for (int rank = 0; rank < 2; ++rank) {
    RankIdentity identity;
    identity.rank = identity.local_rank = rank;
    identity.world_size = 2;
    identity.hostname = "test";
    identity.host_cores = host_cores;
    identity.threads_per_rank = 1;
    HostTracer tracer(identity, 0);
    constexpr int64_t kStepNs = 100000;
    for (int s = 0; s <= 4; ++s) {
      const int64_t w = kStepNs * s;
      record(tracer, rank, s, w);
      tracer.Step(s, w, w + kStepNs, 1.0, s == 0);
    }
    rank_paths.push_back(dir.File("rank" + std::to_string(rank) + ".db"));
    if (!tracer.WriteRankFile(rank_paths.back()).ok()) return "";
  }
  const std::string out = dir.File(name);
  return MergeRankTraces(rank_paths, schedule, out).ok() ? out : "";
}

// Two cpu ranks of one host whose processes could run on `host_cores` cores (0: not recorded),
// each running ops mm0, mm1, mm2 (1, 2, 3 us) in steps 1-4 after a warm-up step.
std::string WriteTwoRankTrace(const TempDir& dir, int host_cores) {
  proto::Schedule schedule = CpuSchedule(2);
  proto::Program* program = schedule.mutable_program();
  for (const char* name : {"mm0", "mm1", "mm2"}) {
    proto::Op* op = program->add_ops();
    op->set_id(program->ops_size() - 1);
    op->set_name(name);
    op->set_phase(proto::PHASE_FORWARD);
    proto::Instruction* instr = schedule.add_instructions();
    instr->set_kind(proto::INSTR_COMPUTE);
    instr->set_stream(proto::STREAM_COMPUTE);
    instr->set_op(op->id());
  }
  return WriteTwoRanks(dir, schedule, host_cores, "two-ranks.db",
                       [](HostTracer& tracer, int, int s, int64_t w) {
                         tracer.Kernel("mm0", proto::STREAM_COMPUTE, w, w + 1000, {s, 0, 0});
                         tracer.Kernel("mm1", proto::STREAM_COMPUTE, w + 1000, w + 3000, {s, 0, 1});
                         tracer.Kernel("mm2", proto::STREAM_COMPUTE, w + 3000, w + 6000, {s, 0, 2});
                       });
}

// Two ranks on one host, each step three all-gathers on one stream: rank r starts the second
// 10 + 2r us and the third 30 + 3r us into the step, and both end 1 us after the later start.
std::string WriteSkewTrace(const TempDir& dir) {
  proto::Schedule schedule = CpuSchedule(2);
  proto::Program* program = schedule.mutable_program();
  for (int p = 0; p < 3; ++p) {
    proto::Tensor* t = program->add_tensors();
    t->set_id(program->tensors_size() - 1);
    t->set_name("w" + std::to_string(p));
    t->add_shape(256);
    t->set_dtype(proto::DTYPE_F32);
    t->set_role(proto::ROLE_PARAM);
    t->set_param(-1);
    proto::Instruction* instr = schedule.add_instructions();
    instr->set_kind(proto::INSTR_ALL_GATHER);
    instr->set_stream(proto::STREAM_GATHER);
    instr->add_tensors(t->id());
  }
  return WriteTwoRanks(dir, schedule, 0, "skew.db",
                       [](HostTracer& tracer, int rank, int s, int64_t w) {
                         const int64_t starts[2][3] = {{0, 10000, 30000}, {0, 12000, 33000}};
                         for (int g = 0; g < 3; ++g) {
                           const int64_t end = w + std::max(starts[0][g], starts[1][g]) + 1000;
                           tracer.Collective(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER,
                                             w + starts[rank][g], end, 1024, 1, 0, {s, 0, g});
                         }
                       });
}

// Each collective after its stream's first waits for the later rank: how long after the ranks'
// mean start it started, against the mean time since the stream's previous collective. The
// calibration fits the fraction and the ceiling that give back every group of waits.
TEST(CollectiveSkew, TheLastRanksWaitIsMeasuredAgainstTheTimeSinceTheStreamsPreviousCollective) {
  TempDir dir;
  const std::string path = WriteSkewTrace(dir);
  ASSERT_FALSE(path.empty());
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  StatusOr<CostSamples> samples = CollectCostSamples(**trace);
  ASSERT_TRUE(samples.ok()) << samples.status().message();
  // Steps 1-4 (0 is warm-up), the second and third gathers of each.
  ASSERT_EQ(samples->collective_skews.size(), 8u);
  int second = 0, third = 0;
  for (const SkewSample& s : samples->collective_skews) {
    if (std::abs(s.gap_seconds - 11e-6) < 1e-12) {
      EXPECT_NEAR(s.wait_seconds, 1e-6, 1e-12);  // 12 - (10 + 12) / 2
      ++second;
    } else {
      EXPECT_NEAR(s.gap_seconds, 20.5e-6, 1e-12);  // ((30 - 10) + (33 - 12)) / 2
      EXPECT_NEAR(s.wait_seconds, 1.5e-6, 1e-12);  // 33 - (30 + 33) / 2
      ++third;
    }
  }
  EXPECT_EQ(second, 4);
  EXPECT_EQ(third, 4);
  StatusOr<HardwareProfile> base = FindHardware("cpu");
  ASSERT_TRUE(base.ok());
  StatusOr<std::vector<FitGroup>> groups = TraceGroups({trace->get()}, *base);
  ASSERT_TRUE(groups.ok()) << groups.status().message();
  const FitGroup* skew = nullptr;
  for (const FitGroup& g : *groups) {
    if (g.kind == "trace skew") skew = &g;
  }
  ASSERT_NE(skew, nullptr);
  EXPECT_EQ(skew->keys,
            (std::vector<std::string>{"collective_skew_fraction", "collective_skew_max_seconds"}));
  EXPECT_NEAR(skew->start_values.at("collective_skew_fraction"), 10.0 / 126, 1e-9);
  CalibrateOptions options;
  options.sweeps = 16;
  StatusOr<Calibration> fit = Calibrate(*base, {*skew}, options);
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  // 1 us of 11 (the second gathers), and a ceiling of 1.5 us under 20.5 / 11.
  EXPECT_LT(fit->groups[0].median_error_after, 0.01);
  EXPECT_NEAR(fit->profile.collective_skew_fraction, 1.0 / 11, 0.002);
  EXPECT_NEAR(fit->profile.collective_skew_max_seconds, 1.5e-6, 0.02e-6);
}

// A trace says how many cores its ranks could run on, and calibration predicts its ops at that
// host's share of them: two ranks on one core ran at half a core each, so the profile's rates (a
// rank's on a core of its own) predict them twice as long as on two cores; a trace that did not
// record its cores is predicted as ranks with a core each.
TEST(CalibrationHostTest, OpsArePredictedAtTheTracedHostsShareOfItsCores) {
  StatusOr<HardwareProfile> base = FindHardware("cpu");
  ASSERT_TRUE(base.ok());
  std::map<int, std::vector<double>> predicted;
  for (int cores : {1, 2, 0}) {
    TempDir dir;
    const std::string path = WriteTwoRankTrace(dir, cores);
    ASSERT_FALSE(path.empty());
    StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path);
    ASSERT_TRUE(trace.ok()) << trace.status().message();
    ASSERT_EQ((*trace)->ranks().size(), 2u);
    EXPECT_EQ(TraceHostCores(**trace), cores);
    EXPECT_EQ((*trace)->ranks()[1].host_cores, cores);
    EXPECT_EQ((*trace)->ranks()[1].threads_per_rank, 1);
    StatusOr<std::vector<FitGroup>> groups = TraceGroups({trace->get()}, *base);
    ASSERT_TRUE(groups.ok()) << groups.status().message();
    for (const FitGroup& g : *groups) {
      if (g.kind != "trace ops") continue;
      for (const Observation& o : g.observations) predicted[cores].push_back(o.predict(*base));
    }
    ASSERT_EQ(predicted[cores].size(), 3u);
  }
  for (size_t op = 0; op < 3; ++op) {
    EXPECT_GT(predicted[2][op], 0);
    EXPECT_DOUBLE_EQ(predicted[1][op], 2 * predicted[2][op]);
    EXPECT_DOUBLE_EQ(predicted[0][op], predicted[2][op]);
  }
}

}  // namespace
}  // namespace dc
