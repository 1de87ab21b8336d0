// dc-calibrate end to end: a trace from dc-collect on the cpu backend, an nccl-tests table and a
// step-time CSV in; a profile file out that dc-plan --hardware reads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "analyzer/calibration.h"
#include "analyzer/profile.h"
#include "analyzer/trace.h"
#include "machine/estimate.h"
#include "machine/simulator.h"
#include "schemas/files.h"
#include "tests/run_command.h"

namespace dc {
namespace {

using testing::FreshDir;
using testing::RunCommand;
using testing::Tool;

class DcCalibrate : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = FreshDir("calibrate");
    auto r = RunCommand(Tool("dc-collect") +
                        " --backend cpu --model tiny --nproc 2 --steps 3 --warmup 1 -o " + dir_ +
                        "/t.db");
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  static std::string dir_;
};
std::string DcCalibrate::dir_;

double RelativeError(double predicted, double measured) {
  return std::abs(predicted / measured - 1);
}

// The profile fitted from a trace predicts that trace's own step about as well as the profile
// dc-plan builds from it (op medians and fitted lines): a roofline over a few constants cannot
// match every op, so allow it some more.
TEST_F(DcCalibrate, ATraceGivesAProfileThatPredictsItsOwnStep) {
  auto trace = Trace::Open(dir_ + "/t.db");
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  auto profile = BuildProfile(**trace);
  ASSERT_TRUE(profile.ok()) << profile.status().message();
  const double measured = profile->step_seconds_median;
  ASSERT_GT(measured, 0);
  // The calibrated hardware profile is held to the trace's measured rates alone (what a
  // profile of op and collective costs can say, without the fit to the whole step below).
  CostModel rates = profile->costs;
  rates.collective_compute_seconds = 0;
  auto from_trace = Simulate(*(*trace)->schedule(), rates);
  ASSERT_TRUE(from_trace.ok());
  const double trace_error = RelativeError(from_trace->step_seconds, measured);
  // Where the rates alone simulate a shorter step than was measured, the profile charges each
  // collective the compute-stream time that makes up the difference; else none.
  auto own = Simulate(*(*trace)->schedule(), profile->costs);
  ASSERT_TRUE(own.ok());
  if (from_trace->step_seconds < measured) {
    EXPECT_GT(profile->costs.collective_compute_seconds, 0);
    EXPECT_LT(RelativeError(own->step_seconds, measured), 0.01)
        << "measured " << measured << " s, simulated " << own->step_seconds << " s";
  } else {
    EXPECT_EQ(profile->costs.collective_compute_seconds, 0);
  }

  auto base = FindHardware("cpu");
  ASSERT_TRUE(base.ok());
  auto groups = TraceGroups({trace->get()}, *base);
  ASSERT_TRUE(groups.ok()) << groups.status().message();
  // The ranks' skew at collectives is measured (two ranks on one host), from the ratio of the
  // last rank's waits to the time since each stream's previous collective.
  bool skew = false;
  for (const FitGroup& g : *groups) {
    if (g.kind != "trace skew") continue;
    skew = true;
    EXPECT_EQ(g.keys.front(), "collective_skew_fraction");
    EXPECT_GT(g.start_values.at("collective_skew_fraction"), 0);
  }
  EXPECT_TRUE(skew);
  // As dc-calibrate takes them: with no nccl-tests tables the trace collectives fit the network
  // from durations that hold the waits, so the skew is not fitted on top.
  PreferNcclTestsForTheNetwork(&*groups);
  for (const FitGroup& g : *groups) {
    if (g.kind != "trace skew") continue;
    EXPECT_TRUE(g.keys.empty());
    ASSERT_FALSE(g.undetermined.empty());
    EXPECT_EQ(g.undetermined.front().find("collective_skew_fraction: the trace collectives fit"),
              0u);
  }
  // The whole step fits the hardware constant from the value the trace's own profile needed.
  for (const FitGroup& g : *groups) {
    if (g.kind != "trace step") continue;
    const bool fits = std::count(g.keys.begin(), g.keys.end(), "collective_compute_seconds") > 0;
    EXPECT_EQ(fits, profile->costs.collective_compute_seconds > 0);
    if (fits) {
      EXPECT_EQ(g.start_values.at("collective_compute_seconds"),
                profile->costs.collective_compute_seconds);
    }
  }
  auto fit = Calibrate(*base, *groups);
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  const ClusterShape cluster{1, 2};
  auto calibrated = Simulate(*(*trace)->schedule(),
                             EstimateCostModel(*(*trace)->program(), fit->profile, cluster));
  ASSERT_TRUE(calibrated.ok());
  const double calibrated_error = RelativeError(calibrated->step_seconds, measured);
  auto uncalibrated =
      Simulate(*(*trace)->schedule(), EstimateCostModel(*(*trace)->program(), *base, cluster));
  ASSERT_TRUE(uncalibrated.ok());
  EXPECT_LE(calibrated_error, std::max(2 * trace_error, trace_error + 0.15))
      << "measured " << measured << " s, from the trace " << from_trace->step_seconds
      << " s, calibrated " << calibrated->step_seconds << " s";
  EXPECT_LT(calibrated_error, RelativeError(uncalibrated->step_seconds, measured));
  // The groups say what they fitted and what a two-rank trace cannot tell.
  bool said_step_latency = false;
  for (const FitGroup& g : *groups) {
    for (const std::string& u : g.undetermined) {
      said_step_latency = said_step_latency || u.find("intra_node_step_latency_s") == 0;
    }
  }
  EXPECT_TRUE(said_step_latency);
  // Each op kind's factor on the shared roofline: the shared rates alone put this backend's
  // attention (forward and backward) 3-5x too fast; with its factor it is within 35%.
  std::vector<FitGroup> shared_only;
  for (const FitGroup& g : *groups) {
    if (g.kind != "trace ops by kind") shared_only.push_back(g);
  }
  ASSERT_EQ(shared_only.size() + 1, groups->size());
  auto shared_fit = Calibrate(*base, shared_only);
  ASSERT_TRUE(shared_fit.ok()) << shared_fit.status().message();
  // The median |predicted / measured - 1| of the attention ops under a calibration.
  auto attention_error = [](const Calibration& c) {
    std::vector<double> errors;
    for (const GroupResult& g : c.groups) {
      if (g.kind != "trace ops") continue;
      for (const GroupResult::Point& p : g.observations) {
        if (p.what.find("(attention") != std::string::npos) {
          errors.push_back(std::abs(p.after_seconds / p.measured_seconds - 1));
        }
      }
    }
    std::sort(errors.begin(), errors.end());
    return errors.empty() ? -1.0 : errors[errors.size() / 2];
  };
  for (const GroupResult& g : fit->groups) {
    if (g.kind == "trace ops by kind") {
      EXPECT_GE(g.fitted.size(), 10u);
    }
  }
  EXPECT_GT(attention_error(*shared_fit), 0.5);
  EXPECT_LT(attention_error(*fit), 0.35);
}

// A one-rank trace alone (its plan issues no collectives) fits the op rates and says that the
// collectives cannot be told from it, instead of refusing the whole input.
TEST(DcCalibrateOneRank, FitsTheOpsAndSaysTheCollectivesAreUndetermined) {
  const std::string dir = FreshDir("calibrate-one-rank");
  auto collect = RunCommand(Tool("dc-collect") +
                            " --backend cpu --model tiny --nproc 1 --gas 2 --steps 2 --warmup 1 "
                            "-o " +
                            dir + "/t1.db");
  ASSERT_EQ(collect.exit_code, 0) << collect.err;
  auto r = RunCommand(Tool("dc-calibrate") + " --base cpu --trace " + dir + "/t1.db -o " + dir +
                      "/one.json --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto report = nlohmann::json::parse(r.out);
  bool ops_fitted = false, collectives_undetermined = false;
  for (const auto& input : report["inputs"]) {
    if (input["kind"] == "trace ops") ops_fitted = !input["fitted"].empty();
    if (input["kind"] == "trace collectives") {
      EXPECT_TRUE(input["fitted"].empty());
      for (const auto& u : input["undetermined"]) {
        collectives_undetermined =
            collectives_undetermined || u.get<std::string>().find("one rank") != std::string::npos;
      }
    }
  }
  EXPECT_TRUE(ops_fitted) << r.out;
  EXPECT_TRUE(collectives_undetermined) << r.out;
  EXPECT_TRUE(LoadHardwareFile(dir + "/one.json").ok());
}

TEST_F(DcCalibrate, WritesAProfileDcPlanReads) {
  const std::string csv = dir_ + "/steps.csv";
  {
    std::ofstream out(csv);
    out << "name,model,world,gas,micro_batch,policy,measured_seconds\n"
           "tiny-2,tiny,2,1,1,baseline,0.08\n"
           "tiny-2-gas2,tiny,2,2,1,baseline,0.15\n"
           "tiny-2-dc,tiny,2,2,1,dc,0.12\n";
  }
  const std::string nccl = std::string(DC_SOURCE_DIR) + "/tests/data/all_gather_perf_h100.txt";
  const std::string out = dir_ + "/mine.json";
  auto r = RunCommand(Tool("dc-calibrate") + " --base cpu --trace " + dir_ + "/t.db --nccl-tests " +
                      nccl + " --steps " + csv + " --name mine -o " + out + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto report = nlohmann::json::parse(r.out);
  EXPECT_EQ(report["name"], "mine");
  ASSERT_GE(report["inputs"].size(), 3u);
  EXPECT_EQ(report["inputs"][0]["kind"], "nccl-tests");
  bool fitted_step_kind = false;
  for (const auto& input : report["inputs"]) {
    EXPECT_TRUE(input.contains("error_before") && input.contains("error_after"));
    if (input["kind"] != "step times") continue;
    fitted_step_kind = !input["fitted"].empty();
    // The tables measured the collectives' latency: the steps leave it to them, and say so.
    for (const auto& fitted : input["fitted"]) {
      EXPECT_NE(fitted["key"], "collective_base_latency_s");
    }
    ASSERT_FALSE(input["undetermined"].empty()) << input.dump();
    EXPECT_EQ(input["undetermined"][0].get<std::string>().find(
                  "collective_base_latency_s: taken from the nccl-tests tables (" + nccl + ")"),
              0u)
        << input.dump();
  }
  EXPECT_TRUE(fitted_step_kind);
  // The trace's ops fitted the launch time before the steps fitted it again: that input says so.
  bool refit_said = false;
  for (const auto& input : report["inputs"]) {
    if (input["kind"] != "trace ops") continue;
    ASSERT_TRUE(input.contains("refitted_later") && input.contains("error_own_fit"));
    for (const auto& said : input["refitted_later"]) {
      refit_said = refit_said || said.get<std::string>().find(
                                     "kernel_launch_seconds by step "
                                     "times (") == 0;
    }
  }
  EXPECT_TRUE(refit_said) << r.out;
  // The tables measured the network: the trace's collectives leave what they fitted alone.
  bool saw_trace_collectives = false;
  for (const auto& input : report["inputs"]) {
    if (input["kind"] != "trace collectives") continue;
    saw_trace_collectives = true;
    for (const auto& fitted : input["fitted"]) {
      EXPECT_NE(fitted["key"], "intra_node_bus_bandwidth_bytes_per_s");
      EXPECT_NE(fitted["key"], "collective_base_latency_s");
    }
    bool deferred = false;
    for (const auto& why : input["undetermined"]) {
      deferred = deferred || why.get<std::string>().find(
                                 "intra_node_bus_bandwidth_bytes_per_s: taken from the "
                                 "nccl-tests tables") == 0;
    }
    EXPECT_TRUE(deferred) << input.dump();
  }
  EXPECT_TRUE(saw_trace_collectives) << r.out;

  auto hw = LoadHardwareFile(out);
  ASSERT_TRUE(hw.ok()) << hw.status().message();
  EXPECT_EQ(hw->name, "mine");
  EXPECT_EQ(hw->sources.at("matmul_efficiency").find("fitted from"), std::string::npos)
      << "the cpu profile folds the efficiency into its peak: the peak is fitted instead";
  EXPECT_EQ(hw->sources.at("peak_fp32_flops_per_s").find("fitted from "), 0u);
  EXPECT_NE(hw->sources.at("intra_node_bus_bandwidth_bytes_per_s").find("(nccl-tests"),
            std::string::npos)
      << hw->sources.at("intra_node_bus_bandwidth_bytes_per_s");
  EXPECT_EQ(hw->sources.at("host_optimizer_elements_per_s"),
            FindHardware("cpu")->sources.at("host_optimizer_elements_per_s"));
  // The steps' median error under the profile is in the file and the report, for dc-plan's range.
  EXPECT_GT(hw->step_error_fraction, 0);
  EXPECT_EQ(report["step_error_fraction"].get<double>(), hw->step_error_fraction);
  EXPECT_EQ(hw->sources.at("step_error_fraction").find("measured: the median |error|"), 0u)
      << hw->sources.at("step_error_fraction");

  auto plan = RunCommand(Tool("dc-plan") + " --synthetic --hardware " + out +
                         " --model tiny --world 2 --no-cache -o " + dir_ + "/p.dcplan");
  EXPECT_EQ(plan.exit_code, 0) << plan.err;

  // Text output names each input and what it could not determine.
  auto text = RunCommand(Tool("dc-calibrate") + " --base cpu --trace " + dir_ + "/t.db");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("trace collectives"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("not determined: intra_node_step_latency_s"), std::string::npos);
}

}  // namespace
}  // namespace dc
