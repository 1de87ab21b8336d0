#include "calibrate/step_times.h"

#include <gtest/gtest.h>

#include <string>

namespace dc {
namespace {

HardwareProfile H100() {
  auto hw = FindHardware("h100-sxm");
  EXPECT_TRUE(hw.ok());
  return *hw;
}

constexpr char kHeader[] = "name,model,world,gas,micro_batch,policy,measured_seconds,layers,seq\n";

TEST(StepTimes, ParsesRowsByHeader) {
  auto rows = ParseStepTimes(std::string("# measured on our cluster\n") +
                                 "policy,name,model,world,gas,micro_batch,measured_seconds,seq,"
                                 "budget,recompute,gpus_per_node\n"
                                 "dc,a,small,8,2,1,0.25,,1GiB,1,4\n"
                                 "\n"
                                 "baseline, b ,tiny,2,1,2,1e-3,64,,,\n",
                             "s.csv");
  ASSERT_TRUE(rows.ok()) << rows.status().message();
  ASSERT_EQ(rows->size(), 2u);
  const StepTimeRow& a = (*rows)[0];
  EXPECT_EQ(a.line, 3);
  EXPECT_EQ(a.name, "a");
  EXPECT_EQ(a.policy, "dc");
  EXPECT_EQ(a.world, 8);
  EXPECT_EQ(a.gpus_per_node, 4);
  EXPECT_EQ(*a.overrides.gas, 2);
  EXPECT_FALSE(a.overrides.seq.has_value());
  EXPECT_EQ(a.budget_bytes, int64_t{1} << 30);
  EXPECT_TRUE(*a.overrides.recompute_layers);
  EXPECT_EQ((*rows)[1].name, "b");
  EXPECT_EQ(*(*rows)[1].overrides.seq, 64);
  EXPECT_DOUBLE_EQ((*rows)[1].measured_seconds, 1e-3);
}

TEST(StepTimes, RefusesHostileRows) {
  struct Case {
    std::string text, words;
  };
  const std::string h = kHeader;
  for (const Case& c : std::vector<Case>{
           {"", "s.csv: no header line"},
           {h, "s.csv: no rows under the header"},
           {"name,model,world\n", "s.csv:1: no column 'gas'"},
           {h.substr(0, h.size() - 1) + ",colour\n", "s.csv:1: unknown column 'colour'"},
           {"name,name\n", "s.csv:1: column 'name' twice"},
           {h + "a,tiny,2,1,1,dc,0.1,2\n", "s.csv:2: 8 fields; the header has 9"},
           {h + "a,tiny,2,1,1,fastest,0.1,2,64\n", "s.csv:2: column 'policy': unknown policy"},
           {h + "a,tiny,2,1,1,dc,nan,2,64\n", "s.csv:2: column 'measured_seconds': 'nan'"},
           {h + "a,tiny,2,1,1,dc,-0.5,2,64\n", "s.csv:2: column 'measured_seconds': '-0.5'"},
           {h + "a,tiny,two,1,1,dc,0.1,2,64\n", "s.csv:2: column 'world': 'two'"},
           {h + "a,tiny,0,1,1,dc,0.1,2,64\n", "s.csv:2: column 'world': 0 is below 1"},
           {h + "a,tiny,2,1,1,dc,0.1,99999999999999999999,64\n", "column 'layers'"},
           {h + "\"a\",tiny,2,1,1,dc,0.1,2,64\n", "s.csv:2: a quoted field"},
           {h + "a,tiny,2,,1,dc,0.1,2,64\n", "s.csv:2: column 'gas' is empty"},
       }) {
    auto rows = ParseStepTimes(c.text, "s.csv");
    ASSERT_FALSE(rows.ok()) << c.words;
    EXPECT_NE(rows.status().message().find(c.words), std::string::npos) << rows.status().message();
    EXPECT_EQ(rows.status().message().find('\n'), std::string::npos);
  }
}

TEST(StepTimes, UnknownPresetNamesTheLine) {
  auto rows = ParseStepTimes(std::string(kHeader) + "a,gpt5,2,1,1,dc,0.1,2,64\n", "s.csv");
  ASSERT_TRUE(rows.ok());
  auto group = StepTimeGroup(*rows, "s.csv", H100(), {});
  ASSERT_FALSE(group.ok());
  EXPECT_NE(group.status().message().find("s.csv:2: "), std::string::npos)
      << group.status().message();
}

// Step times simulated on a profile whose bus bandwidth is B, fitted from one with 2B, give B
// back: the simulator's own predictions are recovered through planning and the fit.
TEST(StepTimes, RecoversTheBandwidthTheyWereMeasuredAt) {
  HardwareProfile truth = H100();
  truth.intra_node_bus_bandwidth_bytes_per_s = 30e9;
  HardwareProfile base = truth;
  base.intra_node_bus_bandwidth_bytes_per_s = 60e9;
  auto rows = ParseStepTimes(std::string(kHeader) +
                                 "a,small,8,1,1,baseline,1,4,256\n"
                                 "b,small,8,2,2,baseline,1,4,512\n"
                                 "c,small,4,4,1,baseline,1,2,256\n"
                                 "d,tiny,8,1,1,baseline,1,2,128\n",
                             "s.csv");
  ASSERT_TRUE(rows.ok()) << rows.status().message();
  const std::vector<std::string> keys = {"intra_node_bus_bandwidth_bytes_per_s"};
  auto measured = StepTimeGroup(*rows, "s.csv", truth, keys);
  ASSERT_TRUE(measured.ok()) << measured.status().message();
  for (size_t i = 0; i < rows->size(); ++i) {
    (*rows)[i].measured_seconds = measured->observations[i].predict(truth);
  }
  auto group = StepTimeGroup(*rows, "s.csv", base, keys);
  ASSERT_TRUE(group.ok()) << group.status().message();
  auto fit = Calibrate(base, {*group});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_NEAR(fit->profile.intra_node_bus_bandwidth_bytes_per_s / 30e9, 1, 0.02);
  EXPECT_GT(fit->groups[0].median_error_before, 0.05);  // the base was off ...
  EXPECT_LT(fit->groups[0].median_error_after, 0.01);   // ... and the fit is not
}

TEST(StepTimes, RecoversMatmulEfficiencyAndLaunchTime) {
  HardwareProfile truth = H100();
  truth.matmul_efficiency = 0.55;
  truth.kernel_launch_seconds = 9e-6;
  const HardwareProfile base = H100();  // 0.70 and 4 us
  auto rows = ParseStepTimes(std::string(kHeader) +
                                 "a,small,8,1,1,dc,1,4,256\n"
                                 "b,small,8,2,2,dc,1,8,1024\n"
                                 "c,tiny,2,4,1,baseline,1,2,128\n"
                                 "d,small,2,1,4,deepcompile,1,4,1024\n",
                             "s.csv");
  ASSERT_TRUE(rows.ok()) << rows.status().message();
  const std::vector<std::string> keys = {"matmul_efficiency", "kernel_launch_seconds"};
  auto measured = StepTimeGroup(*rows, "s.csv", truth, keys);
  ASSERT_TRUE(measured.ok()) << measured.status().message();
  for (size_t i = 0; i < rows->size(); ++i) {
    (*rows)[i].measured_seconds = measured->observations[i].predict(truth);
  }
  auto group = StepTimeGroup(*rows, "s.csv", truth, keys);  // the plans the runs used
  ASSERT_TRUE(group.ok());
  auto fit = Calibrate(base, {*group});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  EXPECT_NEAR(fit->profile.matmul_efficiency / 0.55, 1, 0.02);
  EXPECT_NEAR(fit->profile.kernel_launch_seconds / 9e-6, 1, 0.05);
}

// Beside nccl-tests tables the step times leave the collectives' base latency to them (a few
// whole steps trade it against the other overheads), and say so; alone, they fit it.
TEST(StepTimes, LeaveTheBaseLatencyToNcclTestsTables) {
  const HardwareProfile base = H100();
  const StepTimeKeys alone = DefaultStepTimeKeys(base, /*rates_measured=*/true);
  EXPECT_EQ(alone.keys,
            (std::vector<std::string>{"kernel_launch_seconds", "collective_base_latency_s"}));
  EXPECT_TRUE(alone.undetermined.empty());
  const StepTimeKeys beside = DefaultStepTimeKeys(base, true, "ag.txt, rs.txt");
  EXPECT_EQ(beside.keys, std::vector<std::string>{"kernel_launch_seconds"});
  ASSERT_EQ(beside.undetermined.size(), 1u);
  EXPECT_EQ(beside.undetermined[0].find(
                "collective_base_latency_s: taken from the nccl-tests tables (ag.txt, rs.txt)"),
            0u)
      << beside.undetermined[0];
  const StepTimeKeys unmeasured = DefaultStepTimeKeys(base, false, "ag.txt");
  EXPECT_EQ(unmeasured.keys,
            (std::vector<std::string>{"matmul_efficiency", "kernel_launch_seconds"}));
}

// The calibrated profile carries the median error of its step-time rows (every table's rows
// together, the other inputs' points aside), with a source naming them; with no table, nothing.
TEST(StepTimes, RecordTheirMedianErrorInTheProfile) {
  Calibration c;
  c.profile = H100();
  GroupResult ops;
  ops.kind = "trace ops";
  ops.input = "t.db";
  ops.observations = {{"op", 1e-3, 1e-3, 9e-3}};  // 800% off: not a step
  GroupResult a, b;
  a.kind = b.kind = kStepTimesKind;
  a.input = "a.csv";
  b.input = "b.csv";
  a.observations = {{"a1", 1.0, 2.0, 1.1}, {"a2", 2.0, 2.0, 1.4}};  // errors 0.1, 0.3
  b.observations = {{"b1", 0.5, 0.5, 0.6}};                         // 0.2
  const std::string unmeasured = c.profile.sources.at("step_error_fraction");
  c.groups = {ops};
  RecordStepError(&c);
  EXPECT_EQ(c.profile.step_error_fraction, 0);
  EXPECT_EQ(c.profile.sources.at("step_error_fraction"), unmeasured);
  c.groups = {ops, a, b};
  RecordStepError(&c);
  EXPECT_NEAR(c.profile.step_error_fraction, 0.2, 1e-12);
  EXPECT_EQ(c.profile.sources.at("step_error_fraction"),
            "measured: the median |error| of this profile's predictions of the 3 step(s) it was "
            "fitted to (a.csv, b.csv)");
  // A profile 50x off still writes a file dc-plan reads: the error stops at the ceiling.
  b.observations = {{"b1", 0.5, 0.5, 25.0}};
  c.groups = {b};
  RecordStepError(&c);
  EXPECT_EQ(c.profile.step_error_fraction, 10);
  EXPECT_TRUE(ParseHardwareProfiles(HardwareProfileJson(c.profile), "calibrated.json").ok());
}

}  // namespace
}  // namespace dc
