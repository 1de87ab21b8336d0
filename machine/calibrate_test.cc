#include "machine/calibrate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "machine/estimate.h"
#include "schemas/files.h"

namespace dc {
namespace {

HardwareProfile H100() {
  auto hw = FindHardware("h100-sxm");
  EXPECT_TRUE(hw.ok());
  return *hw;
}

// nccl-tests' text around rows the ring model of `truth` predicts exactly, on `ranks` ranks of
// `hosts` hosts.
std::string SyntheticTable(const HardwareProfile& truth, const char* test, int ranks, int hosts,
                           const std::vector<int64_t>& sizes) {
  std::string text = "# Collective test starting: " + std::string(test) + "\n#\n# Using devices\n";
  for (int r = 0; r < ranks; ++r) {
    text += "#  Rank " + std::to_string(r) + " Group  0 Pid  1 on node" +
            std::to_string(r / (ranks / hosts)) + " device  0 [0x18] NVIDIA H100\n";
  }
  text +=
      "#       size         count      type   redop    root     time   algbw   busbw #wrong     "
      "time   algbw   busbw #wrong\n";
  const ClusterShape cluster{hosts, ranks / hosts};
  for (int64_t size : sizes) {
    const double us = RingCollectiveCost(truth, cluster).Seconds(size) * 1e6;
    char row[256];
    std::snprintf(row, sizeof(row), "%12lld %12lld float none -1 %.6g %.2f %.2f 0 %.6g 1 1 0\n",
                  static_cast<long long>(size), static_cast<long long>(size / 4), us,
                  size / us / 1e3, size / us / 1e3 * (ranks - 1) / ranks, us);
    text += row;
  }
  return text;
}

TEST(NcclTests, ParsesARealTable) {
  auto text = ReadFileBytes(std::string(DC_SOURCE_DIR) + "/tests/data/all_gather_perf_h100.txt");
  ASSERT_TRUE(text.ok()) << text.status().message();
  auto table = ParseNcclTests(*text, "ag.txt");
  ASSERT_TRUE(table.ok()) << table.status().message();
  EXPECT_EQ(table->collective, "all_gather");
  EXPECT_EQ(table->ranks, 8);
  EXPECT_EQ(table->nodes, 1);
  ASSERT_EQ(table->rows.size(), 7u);
  EXPECT_EQ(table->rows[0].size_bytes, 1048576);
  EXPECT_DOUBLE_EQ(table->rows[0].time_us, 32.52);  // out-of-place, not in-place
  EXPECT_DOUBLE_EQ(table->rows[6].busbw_gb_per_s, 343.05);
  EXPECT_EQ(table->rows[6].line, 26);
  // Fitted from the built-in profile, its bus bandwidth lands near the table's large-size busbw.
  auto group = NcclTestsGroup({*table});
  ASSERT_TRUE(group.ok()) << group.status().message();
  auto fit = Calibrate(H100(), {*group});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_NEAR(fit->profile.intra_node_bus_bandwidth_bytes_per_s, 345e9, 15e9);
  EXPECT_LT(fit->groups[0].median_error_after, fit->groups[0].median_error_before);
}

TEST(NcclTests, RecoversBandwidthAndLatency) {
  HardwareProfile truth = H100();
  truth.intra_node_bus_bandwidth_bytes_per_s = 300e9;
  truth.collective_base_latency_s = 20e-6;
  const std::vector<int64_t> sizes = {1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28, 1LL << 32};
  auto ag = ParseNcclTests(SyntheticTable(truth, "all_gather_perf", 8, 1, sizes), "ag.txt");
  auto rs = ParseNcclTests(SyntheticTable(truth, "reduce_scatter_perf", 8, 1, sizes), "rs.txt");
  ASSERT_TRUE(ag.ok() && rs.ok());
  EXPECT_EQ(rs->collective, "reduce_scatter");
  auto group = NcclTestsGroup({*ag, *rs});
  ASSERT_TRUE(group.ok());
  HardwareProfile base = H100();
  base.intra_node_bus_bandwidth_bytes_per_s = 600e9;  // twice the truth
  auto fit = Calibrate(base, {*group});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_NEAR(fit->profile.intra_node_bus_bandwidth_bytes_per_s / 300e9, 1, 0.02);
  EXPECT_NEAR(fit->profile.collective_base_latency_s / 20e-6, 1, 0.02);
  EXPECT_LT(fit->groups[0].median_error_after, 0.01);
  const std::string& source = fit->profile.sources.at("intra_node_bus_bandwidth_bytes_per_s");
  EXPECT_NE(source.find("fitted from ag.txt, rs.txt (nccl-tests, 12 points, residual"),
            std::string::npos)
      << source;
  // Constants not fitted keep their source.
  EXPECT_EQ(fit->profile.sources.at("matmul_efficiency"), base.sources.at("matmul_efficiency"));
  // One rank count: the per-step latency is named as not determined.
  ASSERT_FALSE(group->undetermined.empty());
  EXPECT_NE(group->undetermined[0].find("intra_node_step_latency_s"), std::string::npos);
}

TEST(NcclTests, AcrossNodesFitsTheNetwork) {
  HardwareProfile truth = H100();
  truth.inter_node_bandwidth_per_gpu_bytes_per_s = 20e9;  // 8 x 20 = 160 GB/s < NVLink's 360
  auto table = ParseNcclTests(
      SyntheticTable(truth, "all_gather_perf", 16, 2, {1 << 20, 1 << 26, 1LL << 32}), "two.txt");
  ASSERT_TRUE(table.ok()) << table.status().message();
  EXPECT_EQ(table->nodes, 2);
  auto group = NcclTestsGroup({*table});
  ASSERT_TRUE(group.ok());
  auto fit = Calibrate(H100(), {*group});
  ASSERT_TRUE(fit.ok());
  EXPECT_NEAR(fit->profile.inter_node_bandwidth_per_gpu_bytes_per_s / 20e9, 1, 0.02);
}

TEST(NcclTests, OneSizeCannotTellLatencyFromBandwidth) {
  auto table = ParseNcclTests(SyntheticTable(H100(), "all_gather_perf", 8, 1, {1 << 26}), "one");
  ASSERT_TRUE(table.ok());
  auto group = NcclTestsGroup({*table});
  ASSERT_TRUE(group.ok());
  EXPECT_EQ(group->keys, std::vector<std::string>{"intra_node_bus_bandwidth_bytes_per_s"});
  ASSERT_FALSE(group->undetermined.empty());
  EXPECT_NE(group->undetermined[0].find("one message size"), std::string::npos);
}

// The cpu backend's sweeps (bench/comm_bench --nccl-tests) run their ranks on one host's cores:
// a table of 4 ranks on 2 cores holds times twice what one rank per core would take, as a plan of
// 4 ranks on that host is priced (EstimateCostModel's HostShareSlowdown). The fit takes the times
// at that share, so its constants are a rank's on a core of its own, as the plan's are.
TEST(NcclTests, SweepsOfRanksSharingCoresFitTheRatesOfARankPerCore) {
  auto cpu = FindHardware("cpu");
  ASSERT_TRUE(cpu.ok());
  HardwareProfile truth = *cpu;
  truth.intra_node_bus_bandwidth_bytes_per_s = 1e9;
  truth.collective_base_latency_s = 20e-6;
  truth.intra_node_step_latency_s = 50e-6;
  const std::vector<int64_t> sizes = {1 << 10, 1 << 16, 1 << 20, 1 << 24};
  std::vector<NcclTestsTable> tables;
  for (int ranks : {2, 4}) {
    auto table = ParseNcclTests(SyntheticTable(truth, "all_gather_perf", ranks, 1, sizes), "t");
    ASSERT_TRUE(table.ok()) << table.status().message();
    if (ranks == 4) {
      for (NcclTestsRow& row : table->rows) row.time_us *= 2;  // 4 ranks on 2 cores
    }
    tables.push_back(*table);
  }
  auto group = NcclTestsGroup(tables);
  ASSERT_TRUE(group.ok()) << group.status().message();
  HardwareProfile base = *cpu;
  base.host_cores_per_node = 2;
  CalibrateOptions options;
  options.sweeps = 16;  // three correlated constants: coordinate descent needs more sweeps
  auto fit = Calibrate(base, {*group}, options);
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_LT(fit->groups[0].median_error_after, 0.01);
  EXPECT_NEAR(fit->profile.intra_node_bus_bandwidth_bytes_per_s / 1e9, 1, 0.02);
  EXPECT_NEAR(fit->profile.intra_node_step_latency_s / 50e-6, 1, 0.05);
  // Without the host's cores the same tables cannot be told by the ring model alone.
  base.host_cores_per_node = 0;
  auto blind = Calibrate(base, {*group}, options);
  ASSERT_TRUE(blind.ok());
  EXPECT_GT(blind->groups[0].median_error_after, 0.05);
}

TEST(NcclTests, RefusesHostileTables) {
  const std::string head =
      "# Collective test starting: all_gather_perf\n"
      "#  Rank  0 Group  0 Pid  1 on  a device  0 [0x18] X\n"
      "#  Rank  1 Group  0 Pid  1 on  a device  1 [0x18] X\n"
      "#       size         count      type   redop    root     time   algbw   busbw #wrong\n";
  struct Case {
    std::string text, words;
  };
  for (const Case& c : std::vector<Case>{
           {head, "f.txt: the table has no rows"},
           {head + "1024 256 float none -1 nan 1 1 0\n", "f.txt:5: time 'nan'"},
           {head + "1024 256 float none -1 -3 1 1 0\n", "f.txt:5: time '-3'"},
           {head + "1024 256 float none -1 0 1 1 0\n", "f.txt:5: time '0' us is not positive"},
           {head + "1024 256 float\n", "f.txt:5: a row of 3 columns"},
           {head + "-8 256 float none -1 1 1 1 0\n", "f.txt:5: size '-8'"},
           {"#  Rank  0 Group  0 Pid  1 on  a device 0\n# size time algbw busbw\n",
            "cannot tell the collective"},
           {"# Collective test starting: all_reduce_perf\n", "all_reduce_perf table"},
           {"# Collective test starting: all_gather_perf\n# size time algbw busbw\n1 1 1 1\n",
            "no '#  Rank N"},
       }) {
    auto table = ParseNcclTests(c.text, "f.txt");
    ASSERT_FALSE(table.ok()) << c.words;
    EXPECT_NE(table.status().message().find(c.words), std::string::npos)
        << table.status().message();
    EXPECT_EQ(table.status().message().find('\n'), std::string::npos);
  }
}

TEST(Calibrate, FitsAnyConstantByItsKey) {
  // A made-up observation on the host link: the generic fitter finds the bandwidth.
  FitGroup group;
  group.input = "made-up";
  group.kind = "test";
  group.keys = {"host_link_bandwidth_bytes_per_s"};
  for (int64_t bytes : {1 << 20, 1 << 24}) {
    Observation o;
    o.what = std::to_string(bytes);
    o.measured_seconds = 10e-6 + bytes / 20e9;
    o.predict = [bytes](const HardwareProfile& hw) {
      return hw.host_link_latency_s + bytes / hw.host_link_bandwidth_bytes_per_s;
    };
    group.observations.push_back(o);
  }
  auto fit = Calibrate(H100(), {group});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_NEAR(fit->profile.host_link_bandwidth_bytes_per_s / 20e9, 1, 0.01);
  // Written and read back, the calibrated profile is the same.
  const std::string json = HardwareProfileJson(fit->profile);
  auto back = ParseHardwareProfiles(json, "back.json");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(HardwareProfileJson(back->front()), json);

  group.keys = {"no_such_constant"};
  auto bad = Calibrate(H100(), {group});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unknown constant 'no_such_constant'"), std::string::npos);
  group.keys = {"host_link_bandwidth_bytes_per_s"};
  group.observations[0].measured_seconds = std::nan("");
  EXPECT_FALSE(Calibrate(H100(), {group}).ok());
}

// A constant the base holds at 0 (a profile that does not model it) is searched around the
// group's start value; 0 stays where nothing in the range does better.
TEST(Calibrate, StartsAConstantTheBaseHoldsAtZeroFromTheGroupsValue) {
  FitGroup group;
  group.input = "steps";
  group.kind = "test";
  group.keys = {"collective_compute_seconds"};
  Observation o;
  o.what = "a step of 10 collectives";
  o.measured_seconds = 1e-3 + 10 * 40e-6;
  o.predict = [](const HardwareProfile& hw) { return 1e-3 + 10 * hw.collective_compute_seconds; };
  group.observations.push_back(o);
  HardwareProfile base = H100();
  ASSERT_EQ(base.collective_compute_seconds, 0);
  auto refused = Calibrate(base, {group});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("give it a non-zero start value"), std::string::npos);
  group.start_values["collective_compute_seconds"] = 10e-6;
  auto fit = Calibrate(base, {group});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_NEAR(fit->profile.collective_compute_seconds / 40e-6, 1, 0.01);
  // Measured at what the rest already predicts: nothing beats 0.
  group.observations[0].measured_seconds = 1e-3;
  fit = Calibrate(base, {group});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_EQ(fit->profile.collective_compute_seconds, 0);
}

// Where a later group fits a key an earlier one fitted, the calibrated profile holds the later
// value; the earlier group's result says so and keeps its error under its own fit.
TEST(Calibrate, SaysWhichKeysALaterGroupFittedAgain) {
  auto group_at = [](const std::string& input, double latency_s) {
    FitGroup group;
    group.input = input;
    group.kind = "test";
    group.keys = {"host_link_latency_s"};
    for (int64_t bytes : {1 << 10, 1 << 12}) {
      Observation o;
      o.what = std::to_string(bytes);
      o.measured_seconds = latency_s + bytes / 20e9;
      o.predict = [bytes](const HardwareProfile& hw) {
        return hw.host_link_latency_s + bytes / 20e9;
      };
      group.observations.push_back(o);
    }
    return group;
  };
  auto fit = Calibrate(H100(), {group_at("sweep", 5e-6), group_at("steps", 50e-6)});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_NEAR(fit->profile.host_link_latency_s / 50e-6, 1, 0.01);
  ASSERT_EQ(fit->groups[0].refitted_later.size(), 1u);
  EXPECT_EQ(fit->groups[0].refitted_later[0], "host_link_latency_s by test (steps)");
  EXPECT_LT(fit->groups[0].median_error_fit, 0.01);   // its own fit matched it ...
  EXPECT_GT(fit->groups[0].median_error_after, 1.0);  // ... the calibrated profile does not
  EXPECT_TRUE(fit->groups[1].refitted_later.empty());
  EXPECT_EQ(fit->groups[1].median_error_fit, fit->groups[1].median_error_after);
}

// The skew's waits are fitted only where nccl-tests tables give the network: otherwise the trace
// collectives' durations fit it, every wait for the last rank inside them.
TEST(Calibrate, TheSkewIsFittedOnlyBesideANetworkFromTables) {
  auto groups_with = [](bool tables) {
    std::vector<FitGroup> groups;
    if (tables) {
      FitGroup nccl;
      nccl.kind = "nccl-tests";
      nccl.input = "ag.txt";
      nccl.keys = {"intra_node_bus_bandwidth_bytes_per_s", "collective_base_latency_s"};
      groups.push_back(nccl);
    }
    FitGroup coll;
    coll.kind = "trace collectives";
    coll.input = "t.db";
    coll.keys = {"intra_node_bus_bandwidth_bytes_per_s", "collective_base_latency_s"};
    groups.push_back(coll);
    FitGroup skew;
    skew.kind = "trace skew";
    skew.input = "t.db";
    skew.keys = {"collective_skew_fraction", "collective_skew_max_seconds"};
    skew.start_values = {{"collective_skew_fraction", 0.2}};
    skew.observations.resize(3);
    groups.push_back(skew);
    PreferNcclTestsForTheNetwork(&groups);
    return groups;
  };
  const std::vector<FitGroup> alone = groups_with(false);
  EXPECT_FALSE(alone[0].keys.empty());  // the traces fit the network
  EXPECT_TRUE(alone[1].keys.empty());
  EXPECT_TRUE(alone[1].observations.empty());
  ASSERT_EQ(alone[1].undetermined.size(), 2u);
  EXPECT_NE(alone[1].undetermined[0].find("their waits for the last rank included"),
            std::string::npos);
  const std::vector<FitGroup> beside = groups_with(true);
  EXPECT_TRUE(beside[1].keys.empty());  // the tables fit the network
  EXPECT_EQ(beside[2].keys.size(), 2u);
  EXPECT_EQ(beside[2].observations.size(), 3u);
}

TEST(HardwareConstants, SetRefusesOutOfRange) {
  HardwareProfile hw = H100();
  EXPECT_FALSE(SetHardwareConstant(&hw, "matmul_efficiency", 1.5).ok());
  EXPECT_FALSE(SetHardwareConstant(&hw, "overlap_compute_slowdown", 0.9).ok());
  EXPECT_FALSE(SetHardwareConstant(&hw, "serial_streams", 1).ok());          // not numeric
  EXPECT_FALSE(SetHardwareConstant(&hw, "step_error_fraction", 10.5).ok());  // over 1000%
  EXPECT_FALSE(SetHardwareConstant(&hw, "step_error_fraction", -0.1).ok());
  EXPECT_TRUE(SetHardwareConstant(&hw, "step_error_fraction", 0.38).ok());
  ASSERT_TRUE(SetHardwareConstant(&hw, "matmul_efficiency", 0.5).ok());
  EXPECT_EQ(*GetHardwareConstant(hw, "matmul_efficiency"), 0.5);
  ASSERT_TRUE(SetHardwareConstant(&hw, "max_gpus_per_node", 4.4).ok());
  EXPECT_EQ(hw.max_gpus_per_node, 4);
}

}  // namespace
}  // namespace dc
