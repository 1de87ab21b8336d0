#include "calibrate/step_times.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "machine/estimate.h"
#include "machine/intervals.h"
#include "machine/simulator.h"
#include "rewriter/planner.h"
#include "rewriter/policy.h"
#include "schemas/units.h"

namespace dc {

namespace {

std::string Trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t");
  return s.substr(a, b - a + 1);
}

std::vector<std::string> Split(const std::string& line) {
  std::vector<std::string> cells;
  std::string cell;
  std::istringstream in(line);
  while (std::getline(in, cell, ',')) cells.push_back(Trim(cell));
  if (!line.empty() && line.back() == ',') cells.push_back("");
  return cells;
}

StatusOr<int64_t> WholeNumber(const std::string& column, const std::string& text, int64_t min) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE) {
    return Status::Error("column '" + column + "': '" + text + "' is not a whole number");
  }
  if (v < min) {
    return Status::Error("column '" + column + "': " + text + " is below " + std::to_string(min));
  }
  return static_cast<int64_t>(v);
}

// Sets one column of `row` from `text` (not empty).
Status SetColumn(const std::string& column, const std::string& text,
                 const std::set<std::string>& policies, StepTimeRow* row) {
  constexpr int64_t kMaxRanks = 1 << 20;
  if (column == "name") {
    row->name = text;
  } else if (column == "model") {
    row->model = text;
  } else if (column == "policy") {
    if (!policies.count(text)) {
      std::string known;
      for (const std::string& p : policies) known += (known.empty() ? "" : ", ") + p;
      return Status::Error("column 'policy': unknown policy '" + text + "'; known: " + known);
    }
    row->policy = text;
  } else if (column == "measured_seconds") {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size() || !std::isfinite(v) || v <= 0) {
      return Status::Error("column 'measured_seconds': '" + text +
                           "' is not a positive finite number of seconds");
    }
    row->measured_seconds = v;
  } else if (column == "world" || column == "gpus_per_node") {
    DC_ASSIGN_OR_RETURN(int64_t v, WholeNumber(column, text, 1));
    if (v > kMaxRanks) return Status::Error("column '" + column + "': " + text + " is too large");
    (column == "world" ? row->world : row->gpus_per_node) = static_cast<int>(v);
  } else if (column == "dtype") {
    row->overrides.compute_dtype = text;
  } else if (column == "recompute") {
    if (text != "0" && text != "1" && text != "true" && text != "false") {
      return Status::Error("column 'recompute': '" + text + "' is not 0, 1, true or false");
    }
    row->overrides.recompute_layers = text == "1" || text == "true";
  } else if (column == "budget") {
    StatusOr<int64_t> bytes = ParseBytes(text);
    if (!bytes.ok()) return bytes.status().Prefixed("column 'budget': ");
    row->budget_bytes = *bytes;
  } else {
    const std::map<std::string, std::optional<int64_t> ModelOverrides::*> ints = {
        {"gas", &ModelOverrides::gas},       {"micro_batch", &ModelOverrides::micro_batch},
        {"layers", &ModelOverrides::layers}, {"hidden", &ModelOverrides::hidden},
        {"heads", &ModelOverrides::heads},   {"kv_heads", &ModelOverrides::kv_heads},
        {"ffn", &ModelOverrides::ffn},       {"vocab", &ModelOverrides::vocab},
        {"seq", &ModelOverrides::seq},       {"experts", &ModelOverrides::experts},
        {"top_k", &ModelOverrides::top_k}};
    const auto it = ints.find(column);
    if (it == ints.end()) return Status::Error("unknown column '" + column + "'");
    DC_ASSIGN_OR_RETURN(int64_t v, WholeNumber(column, text, 1));
    row->overrides.*(it->second) = v;
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<StepTimeRow>> ParseStepTimes(const std::string& text,
                                                  const std::string& origin) {
  const std::vector<std::string> names = PolicyNames();
  const std::set<std::string> policies(names.begin(), names.end());
  const std::set<std::string> known(std::begin(kStepTimeColumns), std::end(kStepTimeColumns));
  constexpr int kRequired = 7;
  std::vector<std::string> header;
  std::vector<StepTimeRow> rows;
  std::istringstream in(text);
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::string trimmed = Trim(line);
    if (trimmed.empty() || trimmed[0] == '#') continue;
    const std::string at = origin + ":" + std::to_string(line_no) + ": ";
    if (line.find('"') != std::string::npos) {
      return Status::Error(at + "a quoted field; write plain comma-separated values");
    }
    const std::vector<std::string> cells = Split(line);
    if (header.empty()) {
      std::set<std::string> seen;
      for (const std::string& c : cells) {
        if (!known.count(c)) {
          return Status::Error(at + "unknown column '" + c + "'; known: " +
                               Join(std::vector<std::string>(std::begin(kStepTimeColumns),
                                                             std::end(kStepTimeColumns)),
                                    ", "));
        }
        if (!seen.insert(c).second) return Status::Error(at + "column '" + c + "' twice");
      }
      for (int k = 0; k < kRequired; ++k) {
        if (!seen.count(kStepTimeColumns[k])) {
          return Status::Error(at + "no column '" + kStepTimeColumns[k] +
                               "' (the header needs name, model, world, gas, micro_batch, "
                               "policy, measured_seconds)");
        }
      }
      header = cells;
      continue;
    }
    if (cells.size() != header.size()) {
      return Status::Error(at + std::to_string(cells.size()) + " fields; the header has " +
                           std::to_string(header.size()));
    }
    StepTimeRow row;
    row.line = line_no;
    for (size_t c = 0; c < cells.size(); ++c) {
      if (cells[c].empty()) {
        for (int k = 0; k < kRequired; ++k) {
          if (header[c] == kStepTimeColumns[k]) {
            return Status::Error(at + "column '" + header[c] + "' is empty");
          }
        }
        continue;
      }
      DC_RETURN_IF_ERROR(SetColumn(header[c], cells[c], policies, &row).Prefixed(at));
    }
    rows.push_back(std::move(row));
  }
  if (header.empty()) return Status::Error(origin + ": no header line");
  if (rows.empty()) return Status::Error(origin + ": no rows under the header");
  return rows;
}

StepTimeKeys DefaultStepTimeKeys(const HardwareProfile& profile, bool rates_measured,
                                 const std::string& network_tables) {
  StepTimeKeys out;
  if (!rates_measured) {
    out.keys = EfficiencyOrRateKeys(profile, "matmul_efficiency", {"peak_fp32_flops_per_s"});
  }
  out.keys.push_back("kernel_launch_seconds");
  if (network_tables.empty()) {
    out.keys.push_back("collective_base_latency_s");
  } else {
    out.undetermined.push_back(
        "collective_base_latency_s: taken from the nccl-tests tables (" + network_tables +
        "): a sweep of sizes measures the latency; a few whole steps only trade it against the "
        "other overheads (--fit-steps collective_base_latency_s fits it here anyway)");
  }
  return out;
}

void RecordStepError(Calibration* calibration) {
  std::vector<double> errors;
  std::vector<std::string> tables;
  for (const GroupResult& g : calibration->groups) {
    if (g.kind != kStepTimesKind) continue;
    tables.push_back(g.input);
    for (const GroupResult::Point& p : g.observations) {
      errors.push_back(std::abs(p.after_seconds / p.measured_seconds - 1));
    }
  }
  if (errors.empty()) return;
  const size_t n = errors.size();
  double median = analyzer_internal::Median(std::move(errors));
  // Past the file's ceiling (a range that wide says nothing), the ceiling: the file stays valid.
  for (const HardwareConstantInfo& info : HardwareConstants()) {
    if (info.key == "step_error_fraction") median = std::min(median, info.max_value);
  }
  calibration->profile.step_error_fraction = median;
  std::string input;
  for (const std::string& t : tables) input += (input.empty() ? "" : ", ") + t;
  calibration->profile.sources["step_error_fraction"] =
      "measured: the median |error| of this profile's predictions of the " + std::to_string(n) +
      " step(s) it was fitted to (" + input + ")";
}

StatusOr<FitGroup> StepTimeGroup(const std::vector<StepTimeRow>& rows, const std::string& origin,
                                 const HardwareProfile& plan_profile,
                                 const std::vector<std::string>& keys) {
  FitGroup group;
  group.input = origin;
  group.kind = kStepTimesKind;
  group.keys = keys.empty() ? DefaultStepTimeKeys(plan_profile, false).keys : keys;
  bool any_collective = false;
  for (const StepTimeRow& row : rows) {
    const std::string at = origin + ":" + std::to_string(row.line) + ": ";
    StatusOr<proto::ModelConfig> config = MakeConfig(row.model, row.overrides);
    if (!config.ok()) return config.status().Prefixed(at);
    StatusOr<proto::Program> built = BuildProgram(*config);
    if (!built.ok()) return built.status().Prefixed(at);
    proto::Program program = std::move(built).value();
    StatusOr<ClusterShape> shape =
        MakeCluster(row.world, row.gpus_per_node > 0 ? row.gpus_per_node : row.world);
    if (!shape.ok()) return shape.status().Prefixed(at);
    const ClusterShape cluster = *shape;
    DC_RETURN_IF_ERROR(ValidateCluster(plan_profile, cluster).Prefixed(at));
    PlanRequest request;
    request.world_size = row.world;
    request.backend = plan_profile.serial_streams ? "cpu" : "cuda";
    request.device = plan_profile.name;
    request.costs = EstimateCostModel(program, plan_profile, cluster);
    request.budget_bytes =
        row.budget_bytes > 0 ? row.budget_bytes : plan_profile.device_memory_bytes;
    request.policy = row.policy;
    request.program = program;
    StatusOr<proto::Schedule> plan = MakePlan(request);
    if (!plan.ok()) return plan.status().Prefixed(at + "planning " + row.name + ": ");
    any_collective = any_collective || row.world > 1;
    Observation o;
    o.what = origin + ":" + std::to_string(row.line) + " " + row.name;
    o.measured_seconds = row.measured_seconds;
    auto schedule = std::make_shared<const proto::Schedule>(std::move(plan).value());
    o.predict = [schedule, cluster](const HardwareProfile& hw) {
      SimOptions options;
      options.memory_timeline = false;
      const StatusOr<SimResult> sim =
          Simulate(*schedule, EstimateCostModel(schedule->program(), hw, cluster), options);
      return sim.ok() ? sim->step_seconds : -1.0;
    };
    group.observations.push_back(std::move(o));
  }
  if (!any_collective) {
    std::vector<std::string> kept;
    for (const std::string& k : group.keys) {
      if (k == "collective_base_latency_s") {
        group.undetermined.push_back(k + ": every row runs on one rank: no collective");
      } else {
        kept.push_back(k);
      }
    }
    group.keys = kept;
  }
  if (rows.size() < group.keys.size()) {
    group.undetermined.push_back("fewer rows (" + std::to_string(rows.size()) +
                                 ") than constants (" + std::to_string(group.keys.size()) +
                                 "): the fit is not unique; measure more configurations");
  }
  return group;
}

}  // namespace dc
