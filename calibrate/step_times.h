// Measured step times of named configurations (a CSV from dc-run or any framework) as
// dc-calibrate's input (machine/calibrate.h): each row planned by its policy and simulated on a
// candidate profile, for the constants only whole steps reveal (matmul efficiency at the model's
// shapes, per-op and per-collective overheads). Thread-safe (pure functions).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "machine/calibrate.h"
#include "models/model.h"
#include "schemas/status.h"

namespace dc {

// The FitGroup::kind of a step-time table's group.
inline constexpr char kStepTimesKind[] = "step times";

// One configuration and its measured step.
struct StepTimeRow {
  int line = 0;  // 1-based, in the file
  std::string name;
  std::string model;  // a preset (models/model.h)
  ModelOverrides overrides;
  int world = 1, gpus_per_node = 0;  // 0: the whole world on one node
  std::string policy;                // one of PolicyNames() (rewriter/policy.h)
  int64_t budget_bytes = 0;          // 0: the profile's device memory
  double measured_seconds = 0;       // one optimizer step
};

// The columns a step-time CSV may have; the first seven are required, the rest may be left
// empty (the preset's value).
inline constexpr const char* kStepTimeColumns[] = {
    "name",          "model",   "world",  "gas",   "micro_batch", "policy", "measured_seconds",
    "gpus_per_node", "layers",  "hidden", "heads", "kv_heads",    "ffn",    "vocab",
    "seq",           "experts", "top_k",  "dtype", "recompute",   "budget"};

// Parses a CSV with a header line naming its columns (any order, kStepTimeColumns only), one
// configuration per line; '#' lines and blank lines are skipped. Errors name the origin and line:
// an unknown, repeated or missing column, a row of the wrong width, a quoted field, a value that
// is not a whole number (or too large), an unknown policy, a measured time that is not a positive
// finite number of seconds, a bad byte size, a file with no rows.
StatusOr<std::vector<StepTimeRow>> ParseStepTimes(const std::string& text,
                                                  const std::string& origin);

// The rows as one group: each row's program (MakeConfig, BuildProgram) planned once by its policy
// on `plan_profile`'s cost model (the plan stays fixed while constants move), then predicted by
// simulating that plan on the candidate profile's cost model (machine/estimate.h). `keys`: the
// constants to fit; empty: DefaultStepTimeKeys(plan_profile, false)'s. Errors name the origin and
// line (an unknown preset, a cluster the profile cannot build, a budget no plan meets).
StatusOr<FitGroup> StepTimeGroup(const std::vector<StepTimeRow>& rows, const std::string& origin,
                                 const HardwareProfile& plan_profile,
                                 const std::vector<std::string>& keys);

// What a step-time table fits by default, and what it leaves to other inputs and why.
struct StepTimeKeys {
  std::vector<std::string> keys;
  std::vector<std::string> undetermined;  // "key: why", for FitGroup::undetermined
};

// The launch time per op and the base latency per collective (the overheads only whole steps
// show), and, unless `rates_measured` (a trace beside it measured the ops), the matmul efficiency
// (or the peak, where the profile folds it in: EfficiencyOrRateKeys). Small models' steps are
// mostly overhead: fitting the rate from them alone trades it against the overheads. Where
// `network_tables` is not empty (nccl-tests tables beside it fit the network), the base latency is
// theirs: a few small steps, each a median on a machine whose millisecond steps move by a third,
// fitted it 1.3 us -> 114 us over the tables' fit, and the configurations with many collectives
// were then predicted 2-3.6x their measured steps (bench/results/cross_config-2026-12-02b.md).
StepTimeKeys DefaultStepTimeKeys(const HardwareProfile& profile, bool rates_measured,
                                 const std::string& network_tables = "");

// Sets the calibrated profile's step_error_fraction (machine/hardware.h) from its "step times"
// groups (StepTimeGroup's): the median |predicted / measured - 1| over every row, under the
// calibrated profile (at most the constant's ceiling), with a source naming the tables and their
// rows. Nothing where there are no such groups: a profile fitted to traces or tables alone keeps
// the base's.
void RecordStepError(Calibration* calibration);

}  // namespace dc
