// Fitting a hardware profile to measurements (dc-calibrate): each input becomes a FitGroup, the
// observations it holds (a measured time and how a profile predicts it) and the constants it can
// determine; Calibrate fits each group's constants in turn by a small deterministic search and
// says, per input, the error before and after. The constants are named by their keys in the
// profile file (machine/hardware.h's HardwareConstants), so any constant, new ones too, can be
// fitted. Also the reader of nccl-tests' text tables (all_gather_perf, reduce_scatter_perf) and
// their group. No SQLite: traces become groups in analyzer/calibration.h, step-time tables in
// calibrate/step_times.h. Thread-safe (pure functions).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "machine/hardware.h"
#include "schemas/status.h"

namespace dc {

// One measurement and how a profile predicts it. `predict` returns seconds (NaN or <= 0 where the
// profile cannot predict it: that candidate is refused).
struct Observation {
  std::string what;  // "all_gather 4194304 B", "row 3 (small-gas4)"
  double measured_seconds = 0;
  std::function<double(const HardwareProfile&)> predict;
};

// What one input tells: its observations, the constants it fits from them (in order) and those it
// could have told but cannot, with why ("collective_base_latency_s: one message size: latency and
// bandwidth cannot both be fitted").
struct FitGroup {
  // What the fit minimizes. kRelative: the mean squared log(predicted / measured), for
  // measurements that span orders of magnitude (nccl-tests' 8 B to 8 GiB, steps of different
  // models). kAbsolute: the sum of squared (predicted - measured) seconds, the least
  // squares of machine/cost_model.h's fits: the line through the mean, so that the many samples
  // of a trace add up to the time they took, stalls included.
  enum class Error { kRelative, kAbsolute };
  Error error = Error::kRelative;
  std::string input;  // the file(s) it came from, for sources and output
  std::string kind;   // "nccl-tests", "trace ops", "trace collectives", "step times", ...
  std::vector<std::string> keys;
  std::vector<Observation> observations;
  std::vector<std::string> undetermined;
  // Where the base profile holds 0 for a key (a constant it does not model), the value its
  // search is centred on instead (a fit by the input itself: a trace's own
  // collective_compute_seconds). 0 stays a candidate: the fit keeps it where nothing is better.
  std::map<std::string, double> start_values;
};

struct CalibrateOptions {
  // Each constant is searched within [value / range_factor, value * range_factor] of its value in
  // the base profile (widened to hold its value when its group starts), clipped to its valid
  // range (machine/hardware.h).
  double range_factor = 1000;
  int sweeps = 4;         // coordinate-descent sweeps over a group's constants
  int grid_points = 13;   // a log-spaced grid first (the objective need not be unimodal) ...
  int golden_steps = 24;  // ... then golden-section steps between the best point's neighbours
};

struct FittedConstant {
  std::string key;
  double before = 0, after = 0;
  bool at_bound = false;  // the search ended at the edge of its range
};

struct GroupResult {
  std::string input, kind;
  int points = 0;
  std::vector<FittedConstant> fitted;
  std::vector<std::string> undetermined;
  // |predicted / measured - 1| over the group's observations: median and worst, under the base
  // profile and under the calibrated one (every group fitted).
  double median_error_before = 0, worst_error_before = 0;
  double median_error_after = 0, worst_error_after = 0;
  // Under the profile right after this group's own fit (before the groups after it): where a
  // later group fits one of its keys again, the two can differ by much.
  double median_error_fit = 0, worst_error_fit = 0;
  // Its keys that a later group fitted again (so the calibrated profile holds that group's
  // value): "collective_base_latency_s by step times (steps.csv)".
  std::vector<std::string> refitted_later;
  // Each observation under the base profile and under the calibrated one.
  struct Point {
    std::string what;
    double measured_seconds = 0, before_seconds = 0, after_seconds = 0;
  };
  std::vector<Point> observations;
};

struct Calibration {
  HardwareProfile profile;  // the base with the fitted constants and their new sources
  std::vector<GroupResult> groups;
};

// Fits the groups in order, each from the profile the earlier ones left (a later group fitting a
// key an earlier one fitted has the last word), minimizing the group's FitGroup::Error. Each fitted
// constant's source becomes "fitted from <input> (<N> points, residual <X>%)" (X: the group's
// median error after its fit); the others keep theirs. `name`, when not empty, renames the profile.
// Errors: a key that is not a numeric constant, a group with no observations, a measurement that is
// not a positive finite time, an observation the base cannot predict.
StatusOr<Calibration> Calibrate(const HardwareProfile& base, const std::vector<FitGroup>& groups,
                                const CalibrateOptions& options = {});

// Median and worst |predicted / measured - 1| of `observations` under `profile`.
struct ErrorSummary {
  double median = 0, worst = 0;
};
ErrorSummary Errors(const std::vector<Observation>& observations, const HardwareProfile& profile);

// The key to fit for an achievable rate: `efficiency` (a fraction of a datasheet peak), or, where
// the profile already folds it into its rates (efficiency 1, as the cpu profile does), the
// `rates` themselves: an efficiency cannot rise above 1 to follow a machine faster than its peak.
std::vector<std::string> EfficiencyOrRateKeys(const HardwareProfile& profile,
                                              const std::string& efficiency,
                                              const std::vector<std::string>& rates);

// ----- nccl-tests -----

// One row of an nccl-tests table (the out-of-place columns).
struct NcclTestsRow {
  int line = 0;  // 1-based, in the file
  int64_t size_bytes = 0;
  double time_us = 0, algbw_gb_per_s = 0, busbw_gb_per_s = 0;
};

// The output of one all_gather_perf or reduce_scatter_perf run.
struct NcclTestsTable {
  std::string origin;
  std::string collective;  // "all_gather" or "reduce_scatter"
  int ranks = 0, nodes = 0;
  std::vector<NcclTestsRow> rows;
};

// Parses nccl-tests' text output: the "# Collective test starting: X_perf" line (or, failing it,
// a file name holding all_gather or reduce_scatter) says the collective; the "#  Rank N ... on
// HOST device ..." lines the ranks and nodes (distinct hosts); the header line naming size, time,
// algbw and busbw the columns; every row of numbers below it a measurement. Errors name the
// origin and line: no rank lines, no table, a table with no rows, a row with too few columns, a
// value that is not a number, non-finite or not positive, another collective (all_reduce...).
StatusOr<NcclTestsTable> ParseNcclTests(const std::string& text, const std::string& origin);

// The group of nccl-tests tables: every row predicted by the ring model (machine/estimate.h's
// RingCollectiveCost) on the table's cluster, at the profile's HostShareSlowdown as plans are
// (ranks beyond a host's cores: the cpu backend's sweeps, bench/comm_bench --nccl-tests). Tables on
// one node fit the NVLink bus bandwidth and latency; tables across nodes the network's bandwidth
// per GPU and step latency. Base and step latency are told apart only with two rank counts; latency
// and bandwidth only with two sizes.
StatusOr<FitGroup> NcclTestsGroup(const std::vector<NcclTestsTable>& tables);

// Where a nccl-tests group fits network constants, the trace-collectives groups after it do not
// fit them again: a sweep of sizes run back to back measures the network, while a trace's
// collectives hold the model's few sizes and every wait for a late peer. Each such key moves to
// the trace group's undetermined list, saying why; the group still reports its error under the
// tables' fit. (The step-times group's default keys leave collective_base_latency_s to the tables
// too, calibrate/step_times.h's DefaultStepTimeKeys; --fit-steps may still name it.) Where no table
// fits
// the network and the trace collectives do, the "trace skew" group fits nothing and says why:
// those collectives' durations hold the waits for the last rank already.
void PreferNcclTestsForTheNetwork(std::vector<FitGroup>* groups);

}  // namespace dc
