#include "machine/uncertainty.h"

#include <gtest/gtest.h>

namespace dc {
namespace {

// h100-sxm assumes five constants (machine/HARDWARE.md): each has its documented range, and the
// variants are the two corners and each one alone at either end.
TEST(UncertaintyTest, H100AssumptionsAndTheirRanges) {
  auto hw = FindHardware("h100-sxm");
  ASSERT_TRUE(hw.ok());
  const std::vector<AssumedRange> ranges = AssumedRanges(*hw);
  std::vector<std::string> keys;
  for (const AssumedRange& r : ranges) keys.push_back(r.key);
  EXPECT_EQ(keys, (std::vector<std::string>{"matmul_efficiency", "memory_efficiency",
                                            "overlap_compute_slowdown", "kernel_launch_seconds",
                                            "host_link_latency_s"}));
  EXPECT_DOUBLE_EQ(ranges[0].slow, 0.7 * 0.8);
  EXPECT_DOUBLE_EQ(ranges[0].fast, 0.7 * 1.15);
  EXPECT_DOUBLE_EQ(ranges[2].slow, 1.25);
  EXPECT_DOUBLE_EQ(ranges[2].fast, 1.0);
  EXPECT_DOUBLE_EQ(ranges[4].slow, 10e-6);
  EXPECT_DOUBLE_EQ(ranges[4].fast, 2e-6);

  const std::vector<ProfileVariant> variants = AssumptionVariants(*hw);
  ASSERT_EQ(variants.size(), 2 + 2 * ranges.size());
  EXPECT_EQ(variants[0].name, "all assumptions slow");
  EXPECT_DOUBLE_EQ(variants[0].profile.matmul_efficiency, 0.7 * 0.8);
  EXPECT_DOUBLE_EQ(variants[0].profile.overlap_compute_slowdown, 1.25);
  EXPECT_DOUBLE_EQ(variants[1].profile.matmul_efficiency, 0.7 * 1.15);
  // A measured constant never moves.
  for (const ProfileVariant& v : variants) {
    EXPECT_EQ(v.profile.peak_bf16_flops_per_s, hw->peak_bf16_flops_per_s) << v.name;
  }
}

// A calibrated profile (no source says ASSUMPTION) has no range.
TEST(UncertaintyTest, MeasuredProfileHasNoRange) {
  auto hw = FindHardware("h100-sxm");
  ASSERT_TRUE(hw.ok());
  HardwareProfile measured = *hw;
  for (auto& [key, source] : measured.sources) source = "measured on our cluster";
  EXPECT_TRUE(AssumedRanges(measured).empty());
  EXPECT_TRUE(AssumptionVariants(measured).empty());
}

// The measured step error widens a step's range both ways, never below 0; none leaves it.
TEST(UncertaintyTest, TheMeasuredStepErrorWidensTheStepRange) {
  HardwareProfile hw;
  const StepRange none = WidenedByStepError(hw, {1.0, 2.0});
  EXPECT_EQ(none.min_seconds, 1.0);
  EXPECT_EQ(none.max_seconds, 2.0);
  hw.step_error_fraction = 0.25;
  const StepRange wide = WidenedByStepError(hw, {1.0, 2.0});
  EXPECT_DOUBLE_EQ(wide.min_seconds, 0.75);
  EXPECT_DOUBLE_EQ(wide.max_seconds, 2.5);
  hw.step_error_fraction = 3;
  EXPECT_EQ(WidenedByStepError(hw, {1.0, 2.0}).min_seconds, 0);
}

}  // namespace
}  // namespace dc
