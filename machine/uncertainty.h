// How far a prediction can move with the constants a profile assumed rather than measured: every
// constant whose source says "ASSUMPTION" (machine/hardware_profiles.json) may take any value in
// a documented range (machine/HARDWARE.md, "Uncertainty"), and the profile variants at the ends
// of those ranges, simulated, give a prediction's range. A calibrated profile (sources that name a
// measurement) has no assumptions and so no range from them; the step's range is then widened by
// the error the profile measured on whole steps (HardwareProfile::step_error_fraction), where the
// constants are measured and the model still misses. Thread-safe (pure functions).
#pragma once

#include <string>
#include <vector>

#include "machine/hardware.h"

namespace dc {

// One assumed constant and the values it may take, in its unit; `slow` is the end that makes
// steps longer (lower for rates and efficiencies, higher for latencies and the slowdown).
struct AssumedRange {
  std::string key;  // the constant's key in the file
  double value = 0, slow = 0, fast = 0;
};

// The assumed constants of `hw` (a non-zero value whose source says ASSUMPTION) with their
// ranges, in one fixed order.
std::vector<AssumedRange> AssumedRanges(const HardwareProfile& hw);

struct ProfileVariant {
  std::string name;  // "all assumptions slow", "matmul_efficiency fast", ...
  HardwareProfile profile;
};

// The corners (every assumption at its slow end; every one at its fast end) and each assumption
// alone at either end: 2 + 2 * assumptions variants, none where nothing is assumed.
std::vector<ProfileVariant> AssumptionVariants(const HardwareProfile& hw);

// A step's range, [min, max] over the variants (and the prediction), widened by `hw`'s measured
// step error both ways: min x (1 - error), at least 0, and max x (1 + error).
struct StepRange {
  double min_seconds = 0, max_seconds = 0;
};
StepRange WidenedByStepError(const HardwareProfile& hw, StepRange range);

}  // namespace dc
