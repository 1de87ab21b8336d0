// dc-calibrate: fit a hardware profile to the user's own measurements (traces, nccl-tests tables,
// measured step times) and write it as a profile file dc-plan --hardware reads.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>

#include "analyzer/calibration.h"
#include "analyzer/trace.h"
#include "calibrate/step_times.h"
#include "machine/calibrate.h"
#include "machine/hardware.h"
#include "schemas/files.h"
#include "schemas/units.h"
#include "tools/cli.h"

namespace {

using namespace dc;

struct Flags {
  std::string base, out, name;
  std::vector<std::string> traces, nccl_tests, steps, fit_steps;
  bool json = false;
};

std::string UnitOf(const std::string& key) {
  for (const HardwareConstantInfo& info : HardwareConstants()) {
    if (info.key == key) return info.unit;
  }
  return "";
}

// The groups of every input. Where the base does not say how many cores its ranks share and the
// traces recorded them, the profile takes the traces' (the host they ran on is the one the
// profile describes), before any group predicts with it.
StatusOr<std::vector<FitGroup>> Groups(const Flags& f, HardwareProfile* base_profile) {
  HardwareProfile& base = *base_profile;
  std::vector<FitGroup> groups;
  if (!f.nccl_tests.empty()) {
    std::vector<NcclTestsTable> tables;
    for (const std::string& path : f.nccl_tests) {
      DC_ASSIGN_OR_RETURN(std::string text, ReadFileBytes(path));
      DC_ASSIGN_OR_RETURN(NcclTestsTable table, ParseNcclTests(text, path));
      tables.push_back(std::move(table));
    }
    DC_ASSIGN_OR_RETURN(FitGroup group, NcclTestsGroup(tables));
    groups.push_back(std::move(group));
  }
  if (!f.traces.empty()) {
    std::vector<std::unique_ptr<Trace>> traces;
    std::vector<const Trace*> views;
    for (const std::string& path : f.traces) {
      DC_ASSIGN_OR_RETURN(std::unique_ptr<Trace> trace, Trace::Open(path));
      views.push_back(trace.get());
      traces.push_back(std::move(trace));
    }
    std::set<int> cores;
    for (const Trace* trace : views) {
      if (const int c = TraceHostCores(*trace); c > 0) cores.insert(c);
    }
    if (base.host_cores_per_node == 0 && !cores.empty()) {
      base.host_cores_per_node = *cores.rbegin();
      base.sources["host_cores_per_node"] =
          "recorded in the traces (" + Join(f.traces, ", ") + "): their ranks could run on " +
          std::to_string(*cores.rbegin()) + " core(s) of their host" +
          (cores.size() > 1 ? " (the most any trace recorded; they differ)" : "");
    }
    DC_ASSIGN_OR_RETURN(std::vector<FitGroup> trace_groups, TraceGroups(views, base));
    for (FitGroup& g : trace_groups) groups.push_back(std::move(g));
  }
  for (const std::string& key : f.fit_steps) {
    DC_RETURN_IF_ERROR(GetHardwareConstant(base, key).status().Prefixed("--fit-steps: "));
  }
  StepTimeKeys step_keys{f.fit_steps, {}};
  if (f.fit_steps.empty()) {
    step_keys = DefaultStepTimeKeys(base, !f.traces.empty(), Join(f.nccl_tests, ", "));
  }
  for (const std::string& path : f.steps) {
    DC_ASSIGN_OR_RETURN(std::string text, ReadFileBytes(path));
    DC_ASSIGN_OR_RETURN(std::vector<StepTimeRow> rows, ParseStepTimes(text, path));
    DC_ASSIGN_OR_RETURN(FitGroup group, StepTimeGroup(rows, path, base, step_keys.keys));
    group.undetermined.insert(group.undetermined.begin(), step_keys.undetermined.begin(),
                              step_keys.undetermined.end());
    groups.push_back(std::move(group));
  }
  PreferNcclTestsForTheNetwork(&groups);
  return groups;
}

nlohmann::json ReportJson(const Flags& f, const Calibration& c) {
  nlohmann::json inputs = nlohmann::json::array();
  for (const GroupResult& g : c.groups) {
    nlohmann::json fitted = nlohmann::json::array();
    for (const FittedConstant& k : g.fitted) {
      fitted.push_back({{"key", k.key},
                        {"unit", UnitOf(k.key)},
                        {"before", k.before},
                        {"after", k.after},
                        {"at_bound", k.at_bound}});
    }
    nlohmann::json points = nlohmann::json::array();
    for (const GroupResult::Point& p : g.observations) {
      points.push_back({{"what", p.what},
                        {"measured_seconds", p.measured_seconds},
                        {"predicted_before_seconds", p.before_seconds},
                        {"predicted_after_seconds", p.after_seconds}});
    }
    inputs.push_back(
        {{"input", g.input},
         {"kind", g.kind},
         {"points", g.points},
         {"fitted", fitted},
         {"undetermined", g.undetermined},
         {"observations", points},
         {"error_before", {{"median", g.median_error_before}, {"worst", g.worst_error_before}}},
         {"error_after", {{"median", g.median_error_after}, {"worst", g.worst_error_after}}},
         {"error_own_fit", {{"median", g.median_error_fit}, {"worst", g.worst_error_fit}}},
         {"refitted_later", g.refitted_later}});
  }
  return {{"base", f.base},
          {"name", c.profile.name},
          {"output", f.out},
          {"inputs", inputs},
          {"step_error_fraction", c.profile.step_error_fraction}};
}

void PrintReport(const Flags& f, const Calibration& c) {
  std::printf("dc-calibrate: %s from %s%s%s\n", c.profile.name.c_str(), f.base.c_str(),
              f.out.empty() ? "" : " -> ", f.out.c_str());
  for (const GroupResult& g : c.groups) {
    std::printf("%s (%s): %d point%s, error median %.1f%% -> %.1f%%, worst %.1f%% -> %.1f%%\n",
                g.kind.c_str(), g.input.c_str(), g.points, g.points == 1 ? "" : "s",
                100 * g.median_error_before, 100 * g.median_error_after, 100 * g.worst_error_before,
                100 * g.worst_error_after);
    for (const FittedConstant& k : g.fitted) {
      std::printf("  fitted %-40s %.4g -> %.4g %s%s\n", k.key.c_str(), k.before, k.after,
                  UnitOf(k.key).c_str(), k.at_bound ? " (at the end of its search range)" : "");
    }
    for (const std::string& u : g.undetermined) std::printf("  not determined: %s\n", u.c_str());
    if (!g.refitted_later.empty()) {
      std::printf(
          "  fitted again later: %s; under this input's own fit its error was median %.1f%%, "
          "worst %.1f%%\n",
          Join(g.refitted_later, ", ").c_str(), 100 * g.median_error_fit, 100 * g.worst_error_fit);
    }
    if (g.fitted.empty() && g.undetermined.empty()) std::printf("  (checks the fit only)\n");
  }
  if (c.profile.step_error_fraction > 0) {
    std::printf(
        "step_error_fraction %.3f: the measured steps' median error under this profile; dc-plan "
        "widens each step range by +-%.0f%%\n",
        c.profile.step_error_fraction, 100 * c.profile.step_error_fraction);
  }
}

Status Run(const Flags& f) {
  if (f.traces.empty() && f.nccl_tests.empty() && f.steps.empty()) {
    return Status::Error("nothing to fit: give --trace, --nccl-tests or --steps");
  }
  if (!f.out.empty()) {
    DC_RETURN_IF_ERROR(CheckOutputWritable(f.out));
    std::vector<std::string> inputs = f.traces;
    inputs.insert(inputs.end(), f.nccl_tests.begin(), f.nccl_tests.end());
    inputs.insert(inputs.end(), f.steps.begin(), f.steps.end());
    if (IsHardwareFile(f.base)) inputs.push_back(f.base);
    DC_RETURN_IF_ERROR(CheckOutputIsNotAnInput(f.out, inputs));
  }
  DC_ASSIGN_OR_RETURN(HardwareProfile base, ResolveHardware(f.base));
  DC_ASSIGN_OR_RETURN(std::vector<FitGroup> groups, Groups(f, &base));
  DC_ASSIGN_OR_RETURN(Calibration c, Calibrate(base, groups));
  RecordStepError(&c);
  c.profile.name = f.name.empty() ? base.name + "-calibrated" : f.name;
  c.profile.aliases.clear();
  std::vector<std::string> inputs;
  for (const GroupResult& g : c.groups) {
    if (inputs.empty() || inputs.back() != g.input) inputs.push_back(g.input);
  }
  c.profile.description =
      base.description + "; calibrated by dc-calibrate from " + Join(inputs, ", ");
  if (!f.out.empty()) DC_RETURN_IF_ERROR(WriteFileAtomic(f.out, HardwareProfileJson(c.profile)));
  if (f.json) {
    std::cout << ReportJson(f, c).dump() << "\n";
  } else {
    PrintReport(f, c);
  }
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "dc-calibrate: fit a hardware profile to your own measurements, for dc-plan --synthetic "
      "--hardware FILE.json. Inputs, any mix: dc traces (dc-collect, dc-run --trace: op rates, "
      "collective and host-link costs, overlap), nccl-tests output (all_gather_perf, "
      "reduce_scatter_perf: the network's latency and bus bandwidth), and a CSV of measured step "
      "times of named configurations (columns: " +
      Join(std::vector<std::string>(std::begin(kStepTimeColumns), std::end(kStepTimeColumns)),
           ", ") +
      "; the first seven required) for what only whole steps show. Each fitted constant's source "
      "says what it was fitted from; the output says, per input, what it could and could not "
      "determine and the error before and after (--json: every observation too).\n"
      "Example: dc-calibrate --base h100-sxm --nccl-tests ag.txt --trace t.db --steps steps.csv "
      "-o mine.json"};
  app.add_option("--base", f.base, "the profile to start from: a built-in name or a FILE.json")
      ->required();
  // A missing input file is the readers' one line (exit 1), as in every other dc command, not
  // CLI11's two (exit 2).
  app.add_option("--trace", f.traces,
                 "a dc trace (repeatable); a cpu trace's ranks are fitted at their share of the "
                 "host's cores it recorded, and the profile takes that core count "
                 "(host_cores_per_node); traces of 2 or more ranks on one host also measure the "
                 "ranks' skew at collectives (fitted beside --nccl-tests tables)");
  app.add_option("--nccl-tests", f.nccl_tests,
                 "the text output of all_gather_perf or reduce_scatter_perf (repeatable)");
  app.add_option("--steps", f.steps,
                 "a CSV of measured step times (repeatable); the profile records their median "
                 "error under it (step_error_fraction), which widens dc-plan's step ranges");
  app.add_option("--fit-steps", f.fit_steps,
                 "the constants the step times fit, by their keys in the profile file (default: "
                 "kernel_launch_seconds, collective_base_latency_s, and without --trace "
                 "matmul_efficiency or the peak it scales)")
      ->delimiter(',');
  app.add_option("--name", f.name, "the calibrated profile's name (default: <base>-calibrated)");
  app.add_option("-o,--output", f.out, "the profile file to write (atomically)")
      ->check(cli::NonEmptyPath());
  app.add_flag("--json", f.json, "print one JSON object");
  if (auto code = cli::Parse(app, argc, argv)) return *code;
  if (Status s = Run(f); !s.ok()) return cli::Fail("dc-calibrate", s);
  return 0;
}
