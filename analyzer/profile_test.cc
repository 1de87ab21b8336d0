#include "analyzer/profile.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "schemas/digest.h"
#include "tests/support/test_traces.h"

namespace dc {
namespace {

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

TEST_F(ProfileTest, OpMediansExcludeWarmup) {
  const CostModel& costs = profile_.costs;
  ASSERT_EQ(costs.op_seconds.size(), 3u);
  // fwd0 ran 100, 300, 200 ns (rank 0) and 400, 500, 600 ns (rank 1); the 5000 ns warm-up
  // runs are left out.
  EXPECT_DOUBLE_EQ(costs.op_seconds[0], 350e-9);
  EXPECT_DOUBLE_EQ(costs.op_seconds[1], 3000e-9);
  EXPECT_EQ(costs.op_seconds[2], -1);  // bwd never ran
  // Roofline for bwd from the measured flops rate: 3500 flops in 350 ns.
  EXPECT_DOUBLE_EQ(costs.flops_per_second, 1e10);
  EXPECT_DOUBLE_EQ(costs.OpSeconds(trace_->schedule()->program(), 2), 1e4 / 1e10);
  EXPECT_EQ(profile_.steps_measured, 3);
  EXPECT_EQ(profile_.world_size, 2);
}

TEST_F(ProfileTest, CollectiveAndCopyCostsAreFitted) {
  const CostModel& costs = profile_.costs;
  // Gathers: 1000 ns + 1 ns per byte; the warm-up's 1000 bytes in 8000 ns is left out.
  EXPECT_NEAR(costs.all_gather.latency_seconds, 1e-6, 1e-15);
  EXPECT_NEAR(costs.all_gather.bandwidth_bytes_per_second, 1e9, 1e-3);
  // Reduce-scatters all move 500 bytes: no latency, the median's rate (200 ns).
  EXPECT_EQ(costs.reduce_scatter.latency_seconds, 0);
  EXPECT_NEAR(costs.reduce_scatter.bandwidth_bytes_per_second, 2.5e9, 1e-3);
  EXPECT_NEAR(costs.device_to_host.bandwidth_bytes_per_second, 4e9, 1e-3);
  EXPECT_EQ(costs.host_to_device.bandwidth_bytes_per_second, 0);  // no reloads: default
  EXPECT_TRUE(costs.serial_streams);                              // the cpu backend
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

}  // namespace
}  // namespace dc
