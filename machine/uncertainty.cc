#include "machine/uncertainty.h"

#include <algorithm>

namespace dc {
namespace {

enum class Faster { kWhenHigher, kWhenLower };

// The documented range of an assumed constant, as factors of its value (machine/HARDWARE.md,
// "Uncertainty"), and which way is faster.
struct RangeRule {
  const char* key;
  double HardwareProfile::*member;
  double low_factor, high_factor;
  Faster faster;
};

// Constants not listed take kDefaultLow..kDefaultHigh of their value.
constexpr double kDefaultLow = 0.5, kDefaultHigh = 2.0;

const RangeRule kRules[] = {
    // Model-shaped GEMMs: 0.8x to 1.15x of the assumed 0.70 (0.56 to the MAMF ceiling 0.80).
    {"matmul_efficiency", &HardwareProfile::matmul_efficiency, 0.8, 1.15, Faster::kWhenHigher},
    // Elementwise kernels: 0.68 to 0.90 of HBM peak around the assumed 0.80.
    {"memory_efficiency", &HardwareProfile::memory_efficiency, 0.85, 1.125, Faster::kWhenHigher},
    // NCCL's channels take 12-24% of the SMs: no slowdown to 2.5x the assumed excess (1.0-1.25).
    {"overlap_compute_slowdown", &HardwareProfile::overlap_compute_slowdown, 0, 0,
     Faster::kWhenLower},
    // An eager launch costs 2-5 us of host time around the assumed 4 us.
    {"kernel_launch_seconds", &HardwareProfile::kernel_launch_seconds, 0.5, 1.25,
     Faster::kWhenLower},
    // A copy's issue and DMA set-up: a few us; the assumed 10 us is the conservative end.
    {"host_link_latency_s", &HardwareProfile::host_link_latency_s, 0.2, 1.0, Faster::kWhenLower},
    {"peak_bf16_flops_per_s", &HardwareProfile::peak_bf16_flops_per_s, kDefaultLow, kDefaultHigh,
     Faster::kWhenHigher},
    {"peak_fp32_flops_per_s", &HardwareProfile::peak_fp32_flops_per_s, kDefaultLow, kDefaultHigh,
     Faster::kWhenHigher},
    {"memory_bandwidth_bytes_per_s", &HardwareProfile::memory_bandwidth_bytes_per_s, kDefaultLow,
     kDefaultHigh, Faster::kWhenHigher},
    {"intra_node_bus_bandwidth_bytes_per_s", &HardwareProfile::intra_node_bus_bandwidth_bytes_per_s,
     kDefaultLow, kDefaultHigh, Faster::kWhenHigher},
    {"inter_node_bandwidth_per_gpu_bytes_per_s",
     &HardwareProfile::inter_node_bandwidth_per_gpu_bytes_per_s, kDefaultLow, kDefaultHigh,
     Faster::kWhenHigher},
    {"collective_base_latency_s", &HardwareProfile::collective_base_latency_s, kDefaultLow,
     kDefaultHigh, Faster::kWhenLower},
    {"intra_node_step_latency_s", &HardwareProfile::intra_node_step_latency_s, kDefaultLow,
     kDefaultHigh, Faster::kWhenLower},
    {"inter_node_step_latency_s", &HardwareProfile::inter_node_step_latency_s, kDefaultLow,
     kDefaultHigh, Faster::kWhenLower},
    {"host_link_bandwidth_bytes_per_s", &HardwareProfile::host_link_bandwidth_bytes_per_s,
     kDefaultLow, kDefaultHigh, Faster::kWhenHigher},
    {"host_optimizer_elements_per_s", &HardwareProfile::host_optimizer_elements_per_s, kDefaultLow,
     kDefaultHigh, Faster::kWhenHigher},
};

// The excess of the slowdown over 1 may be up to this multiple of the assumed one.
constexpr double kSlowdownExcessHigh = 2.5;

bool Assumed(const HardwareProfile& hw, const char* key) {
  const auto source = hw.sources.find(key);
  return source != hw.sources.end() && source->second.find("ASSUMPTION") != std::string::npos;
}

AssumedRange RangeOf(const HardwareProfile& hw, const RangeRule& rule) {
  AssumedRange range;
  range.key = rule.key;
  range.value = hw.*rule.member;
  double low = range.value * rule.low_factor, high = range.value * rule.high_factor;
  if (rule.member == &HardwareProfile::overlap_compute_slowdown) {
    low = 1;
    high = 1 + kSlowdownExcessHigh * (range.value - 1);
  }
  if (rule.member == &HardwareProfile::matmul_efficiency ||
      rule.member == &HardwareProfile::memory_efficiency) {
    high = std::min(high, 1.0);
  }
  range.slow = rule.faster == Faster::kWhenHigher ? low : high;
  range.fast = rule.faster == Faster::kWhenHigher ? high : low;
  return range;
}

void Set(HardwareProfile* hw, const std::string& key, double value) {
  for (const RangeRule& rule : kRules) {
    if (key == rule.key) hw->*rule.member = value;
  }
}

}  // namespace

std::vector<AssumedRange> AssumedRanges(const HardwareProfile& hw) {
  std::vector<AssumedRange> ranges;
  for (const RangeRule& rule : kRules) {
    if (Assumed(hw, rule.key) && hw.*rule.member != 0) ranges.push_back(RangeOf(hw, rule));
  }
  return ranges;
}

std::vector<ProfileVariant> AssumptionVariants(const HardwareProfile& hw) {
  const std::vector<AssumedRange> ranges = AssumedRanges(hw);
  std::vector<ProfileVariant> variants;
  if (ranges.empty()) return variants;
  ProfileVariant slow{"all assumptions slow", hw}, fast{"all assumptions fast", hw};
  for (const AssumedRange& r : ranges) {
    Set(&slow.profile, r.key, r.slow);
    Set(&fast.profile, r.key, r.fast);
  }
  variants.push_back(std::move(slow));
  variants.push_back(std::move(fast));
  for (const AssumedRange& r : ranges) {
    for (const auto& [end, value] : {std::pair{"slow", r.slow}, std::pair{"fast", r.fast}}) {
      ProfileVariant one{r.key + " " + end, hw};
      Set(&one.profile, r.key, value);
      variants.push_back(std::move(one));
    }
  }
  return variants;
}

StepRange WidenedByStepError(const HardwareProfile& hw, StepRange range) {
  const double error = hw.step_error_fraction;
  return {range.min_seconds * std::max(0.0, 1 - error), range.max_seconds * (1 + error)};
}

}  // namespace dc
