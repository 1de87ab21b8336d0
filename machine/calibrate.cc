#include "machine/calibrate.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "machine/estimate.h"

namespace dc {

namespace {

constexpr double kSecondsPerUs = 1e-6;

// The group's objective (FitGroup::Error); +inf where a prediction fails.
double Objective(const FitGroup& group, const HardwareProfile& profile) {
  double sum = 0;
  for (const Observation& o : group.observations) {
    const double predicted = o.predict(profile);
    if (!std::isfinite(predicted) || predicted <= 0) return std::numeric_limits<double>::infinity();
    if (group.error == FitGroup::Error::kRelative) {
      const double e = std::log(predicted / o.measured_seconds);
      sum += e * e;
    } else {
      sum += (predicted - o.measured_seconds) * (predicted - o.measured_seconds);
    }
  }
  return sum / static_cast<double>(group.observations.size());
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string Percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f%%", 100 * fraction);
  return text;
}

// The search range of one constant: [value / f, value * f] within its valid values.
struct SearchRange {
  double lo = 0, hi = 0;
};

StatusOr<SearchRange> RangeOf(const HardwareConstantInfo& info, double value, double factor) {
  if (!(value > 0)) {
    return Status::Error("constant '" + info.key +
                         "' is 0 in the profile it starts from; give it a non-zero start value");
  }
  SearchRange r{value / factor, value * factor};
  const double min_valid = info.min_exclusive ? info.min_value * (1 + 1e-12) : info.min_value;
  r.lo = std::max(r.lo, min_valid > 0 ? min_valid : r.lo);
  r.hi = std::min(r.hi, info.max_value);
  if (info.integral) r.lo = std::max(r.lo, 1.0);
  if (r.hi < r.lo) r.hi = r.lo;
  return r;
}

// Minimizes the group's objective over `key` alone, from `profile`'s value, within `range`.
// A log-spaced grid, then golden section between the best grid point's neighbours. Ties keep
// the current value (deterministic, no drift on a flat objective).
Status FitOne(const std::string& key, const SearchRange& range, const FitGroup& group,
              const CalibrateOptions& options, HardwareProfile* profile) {
  DC_ASSIGN_OR_RETURN(double current, GetHardwareConstant(*profile, key));
  auto eval = [&](double log_value) {
    HardwareProfile candidate = *profile;
    if (!SetHardwareConstant(&candidate, key, std::exp(log_value)).ok()) {
      return std::numeric_limits<double>::infinity();
    }
    return Objective(group, candidate);
  };
  const double a = std::log(range.lo), b = std::log(range.hi);
  if (!(b > a)) return Status::Ok();
  const int n = std::max(3, options.grid_points);
  double best_x = std::log(current), best_f = eval(best_x);
  int best_i = -1;
  std::vector<double> xs(n);
  for (int i = 0; i < n; ++i) {
    xs[i] = a + (b - a) * i / (n - 1);
    const double f = eval(xs[i]);
    if (f < best_f) best_f = f, best_x = xs[i], best_i = i;
  }
  if (best_i < 0 && !std::isfinite(best_x)) return Status::Ok();  // 0 beats the whole range
  double lo = best_i < 0 ? std::max(a, best_x - (b - a) / (n - 1)) : xs[std::max(0, best_i - 1)];
  double hi =
      best_i < 0 ? std::min(b, best_x + (b - a) / (n - 1)) : xs[std::min(n - 1, best_i + 1)];
  const double ratio = (std::sqrt(5.0) - 1) / 2;
  double x1 = hi - ratio * (hi - lo), x2 = lo + ratio * (hi - lo);
  double f1 = eval(x1), f2 = eval(x2);
  for (int step = 0; step < options.golden_steps; ++step) {
    if (f1 < f2) {
      hi = x2, x2 = x1, f2 = f1;
      x1 = hi - ratio * (hi - lo);
      f1 = eval(x1);
    } else {
      lo = x1, x1 = x2, f1 = f2;
      x2 = lo + ratio * (hi - lo);
      f2 = eval(x2);
    }
  }
  if (f1 < best_f) best_f = f1, best_x = x1;
  if (f2 < best_f) best_f = f2, best_x = x2;
  if (best_x != std::log(current)) {
    DC_RETURN_IF_ERROR(SetHardwareConstant(profile, key, std::exp(best_x)));
  }
  return Status::Ok();
}

Status CheckGroup(const FitGroup& group, const HardwareProfile& base) {
  // A group that fits nothing may only say what its input cannot determine (a one-rank trace's
  // collectives are local copies): reported, not fitted.
  if (group.observations.empty() && (!group.keys.empty() || group.undetermined.empty())) {
    return Status::Error(group.input + ": no measurements to fit (" + group.kind + ")");
  }
  for (const std::string& key : group.keys) {
    DC_RETURN_IF_ERROR(GetHardwareConstant(base, key).status().Prefixed(group.input + ": "));
  }
  // Predicted with the group's start values where the base holds 0 (where its search starts).
  HardwareProfile start = base;
  for (const auto& [key, value] : group.start_values) {
    const StatusOr<double> held = GetHardwareConstant(base, key);
    if (held.ok() && *held == 0) DC_RETURN_IF_ERROR(SetHardwareConstant(&start, key, value));
  }
  for (const Observation& o : group.observations) {
    if (!std::isfinite(o.measured_seconds) || o.measured_seconds <= 0) {
      return Status::Error(group.input + ": " + o.what +
                           ": measured time is not a positive number");
    }
    const double predicted = o.predict(start);
    if (!std::isfinite(predicted) || predicted <= 0) {
      return Status::Error(group.input + ": " + o.what + ": the base profile cannot predict it");
    }
  }
  return Status::Ok();
}

}  // namespace

ErrorSummary Errors(const std::vector<Observation>& observations, const HardwareProfile& profile) {
  std::vector<double> errors;
  for (const Observation& o : observations) {
    errors.push_back(std::abs(o.predict(profile) / o.measured_seconds - 1));
  }
  ErrorSummary s;
  s.median = Median(errors);
  for (double e : errors) s.worst = std::max(s.worst, e);
  return s;
}

std::vector<std::string> EfficiencyOrRateKeys(const HardwareProfile& profile,
                                              const std::string& efficiency,
                                              const std::vector<std::string>& rates) {
  const StatusOr<double> value = GetHardwareConstant(profile, efficiency);
  return value.ok() && *value < 1 ? std::vector<std::string>{efficiency} : rates;
}

StatusOr<Calibration> Calibrate(const HardwareProfile& base, const std::vector<FitGroup>& groups,
                                const CalibrateOptions& options) {
  std::map<std::string, HardwareConstantInfo> infos;
  for (const HardwareConstantInfo& info : HardwareConstants()) infos[info.key] = info;
  Calibration out;
  out.profile = base;
  for (const FitGroup& group : groups) {
    DC_RETURN_IF_ERROR(CheckGroup(group, out.profile));
    GroupResult result;
    result.input = group.input;
    result.kind = group.kind;
    result.points = static_cast<int>(group.observations.size());
    result.undetermined = group.undetermined;
    std::vector<SearchRange> ranges;
    for (const std::string& key : group.keys) {
      // The range is around the base's value, not an earlier group's: a group that fitted a
      // constant badly (a roofline that cannot describe every op) does not fence in a later one.
      const double value = *GetHardwareConstant(out.profile, key);
      double centre = *GetHardwareConstant(base, key);
      if (const auto start = group.start_values.find(key);
          centre == 0 && start != group.start_values.end()) {
        centre = start->second;
      }
      DC_ASSIGN_OR_RETURN(SearchRange range, RangeOf(infos.at(key), centre, options.range_factor));
      if (value > 0) range.lo = std::min(range.lo, value);
      range.hi = std::max(range.hi, value);
      ranges.push_back(range);
      result.fitted.push_back({key, value, value, false});
    }
    for (int sweep = 0; sweep < options.sweeps; ++sweep) {
      for (size_t k = 0; k < group.keys.size(); ++k) {
        DC_RETURN_IF_ERROR(FitOne(group.keys[k], ranges[k], group, options, &out.profile));
      }
    }
    const ErrorSummary fit = Errors(group.observations, out.profile);
    result.median_error_fit = fit.median;
    result.worst_error_fit = fit.worst;
    for (size_t k = 0; k < group.keys.size(); ++k) {
      FittedConstant& c = result.fitted[k];
      c.after = *GetHardwareConstant(out.profile, c.key);
      constexpr double kAtBound = 1e-3;  // relative distance to an end of the range
      c.at_bound = std::abs(c.after / ranges[k].lo - 1) < kAtBound ||
                   std::abs(c.after / ranges[k].hi - 1) < kAtBound;
      out.profile.sources[c.key] = "fitted from " + group.input + " (" + group.kind + ", " +
                                   std::to_string(result.points) + " points, residual " +
                                   Percent(fit.median) + ")";
    }
    out.groups.push_back(std::move(result));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const std::string& key : groups[g].keys) {
      for (size_t later = g + 1; later < groups.size(); ++later) {
        const std::vector<std::string>& keys = groups[later].keys;
        if (std::find(keys.begin(), keys.end(), key) == keys.end()) continue;
        out.groups[g].refitted_later.push_back(key + " by " + groups[later].kind + " (" +
                                               groups[later].input + ")");
      }
    }
    const ErrorSummary before = Errors(groups[g].observations, base);
    const ErrorSummary after = Errors(groups[g].observations, out.profile);
    out.groups[g].median_error_before = before.median;
    out.groups[g].worst_error_before = before.worst;
    out.groups[g].median_error_after = after.median;
    out.groups[g].worst_error_after = after.worst;
    for (const Observation& o : groups[g].observations) {
      out.groups[g].observations.push_back(
          {o.what, o.measured_seconds, o.predict(base), o.predict(out.profile)});
    }
  }
  return out;
}

// ----- nccl-tests -----

namespace {

std::vector<std::string> Tokens(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> tokens;
  for (std::string t; in >> t;) tokens.push_back(t);
  return tokens;
}

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// A finite number spelled whole ("12.5", "1e3"); nothing else.
bool ParseNumber(const std::string& text, double* value) {
  if (text.empty()) return false;
  char* end = nullptr;
  *value = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && std::isfinite(*value);
}

std::string CollectiveOf(const std::string& test_name) {
  if (test_name.find("all_gather") != std::string::npos) return "all_gather";
  if (test_name.find("reduce_scatter") != std::string::npos) return "reduce_scatter";
  return "";
}

}  // namespace

StatusOr<NcclTestsTable> ParseNcclTests(const std::string& text, const std::string& origin) {
  NcclTestsTable table;
  table.origin = origin;
  std::set<std::string> hosts;
  std::string named_test;
  int size_col = -1, time_col = -1, algbw_col = -1, busbw_col = -1, columns = 0;
  int line_no = 0;
  std::istringstream in(text);
  auto at = [&](int line) { return origin + ":" + std::to_string(line) + ": "; };
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<std::string> tokens = Tokens(line);
    if (tokens.empty()) continue;
    if (tokens[0] == "#" || StartsWith(tokens[0], "#")) {
      if (tokens[0] != "#")
        tokens[0] = tokens[0].substr(1);  // "#Rank" spelled without a space
      else
        tokens.erase(tokens.begin());
      if (tokens.size() >= 4 && tokens[0] == "Collective" && tokens[1] == "test" &&
          tokens[2] == "starting:") {
        named_test = tokens[3];
      } else if (tokens.size() >= 6 && tokens[0] == "Rank") {
        // "Rank  0 Group  0 Pid 123 on host device 0 [..] NAME"; older: "Rank 0 Pid 123 on host"
        const auto on = std::find(tokens.begin(), tokens.end(), "on");
        if (on == tokens.end() || on + 1 == tokens.end()) {
          return Status::Error(at(line_no) + "a rank line without 'on HOST'");
        }
        hosts.insert(*(on + 1));
        ++table.ranks;
      } else if (size_col < 0 && std::find(tokens.begin(), tokens.end(), "size") != tokens.end() &&
                 std::find(tokens.begin(), tokens.end(), "busbw") != tokens.end()) {
        auto col = [&](const char* name) {
          const auto it = std::find(tokens.begin(), tokens.end(), name);
          return it == tokens.end() ? -1 : static_cast<int>(it - tokens.begin());
        };
        size_col = col("size"), time_col = col("time"), algbw_col = col("algbw"),
        busbw_col = col("busbw");
        columns = static_cast<int>(tokens.size());
        if (time_col < 0 || algbw_col < 0) {
          return Status::Error(at(line_no) + "the table header names no time or algbw column");
        }
      }
      continue;
    }
    if (size_col < 0) continue;  // NCCL INFO lines and the like before the table
    double first = 0;
    if (!ParseNumber(tokens[0], &first)) continue;  // log lines between rows
    const int needed = std::max({size_col, time_col, algbw_col, busbw_col}) + 1;
    if (static_cast<int>(tokens.size()) < needed) {
      return Status::Error(at(line_no) + "a row of " + std::to_string(tokens.size()) +
                           " columns; the header has " + std::to_string(columns));
    }
    NcclTestsRow row;
    row.line = line_no;
    double size = 0;
    if (!ParseNumber(tokens[size_col], &size) || size <= 0 || size > 9.2e18 ||
        size != std::floor(size)) {
      return Status::Error(at(line_no) + "size '" + tokens[size_col] +
                           "' is not a positive whole number of bytes");
    }
    row.size_bytes = static_cast<int64_t>(size);
    struct Cell {
      int col;
      const char* name;
      double* value;
    };
    for (const Cell& c :
         {Cell{time_col, "time", &row.time_us}, Cell{algbw_col, "algbw", &row.algbw_gb_per_s},
          Cell{busbw_col, "busbw", &row.busbw_gb_per_s}}) {
      if (!ParseNumber(tokens[c.col], c.value) || *c.value < 0) {
        return Status::Error(at(line_no) + c.name + " '" + tokens[c.col] +
                             "' is not a finite number >= 0");
      }
    }
    if (row.time_us <= 0) {
      return Status::Error(at(line_no) + "time '" + tokens[time_col] + "' us is not positive");
    }
    table.rows.push_back(row);
  }
  table.collective = CollectiveOf(named_test);
  if (!named_test.empty() && table.collective.empty()) {
    return Status::Error(origin + ": a " + named_test +
                         " table; dc-calibrate reads all_gather_perf and reduce_scatter_perf");
  }
  if (table.collective.empty()) {
    const size_t slash = origin.find_last_of('/');
    table.collective = CollectiveOf(slash == std::string::npos ? origin : origin.substr(slash + 1));
  }
  if (table.collective.empty()) {
    return Status::Error(origin +
                         ": cannot tell the collective: no '# Collective test starting:' line "
                         "and the file name holds neither all_gather nor reduce_scatter");
  }
  if (table.ranks == 0) {
    return Status::Error(origin +
                         ": no '#  Rank N ... on HOST' lines: cannot tell the ranks; "
                         "keep nccl-tests' whole output");
  }
  if (size_col < 0) {
    return Status::Error(origin + ": no table header (a '#' line naming size, time and busbw)");
  }
  if (table.rows.empty()) return Status::Error(origin + ": the table has no rows");
  table.nodes = static_cast<int>(hosts.size());
  if (table.ranks % table.nodes != 0) {
    return Status::Error(origin + ": " + std::to_string(table.ranks) + " ranks on " +
                         std::to_string(table.nodes) +
                         " hosts: not the same number on each; dc models whole nodes");
  }
  return table;
}

StatusOr<FitGroup> NcclTestsGroup(const std::vector<NcclTestsTable>& tables) {
  FitGroup group;
  group.kind = "nccl-tests";
  std::set<int64_t> sizes;
  std::set<int> intra_rank_counts;
  bool inter = false, intra = false;
  for (const NcclTestsTable& t : tables) {
    group.input += (group.input.empty() ? "" : ", ") + t.origin;
    const ClusterShape cluster{t.nodes, t.ranks / t.nodes};
    if (cluster.world_size() < 2) continue;
    (t.nodes > 1 ? inter : intra) = true;
    if (t.nodes == 1) intra_rank_counts.insert(t.ranks);
    for (const NcclTestsRow& row : t.rows) {
      sizes.insert(row.size_bytes);
      Observation o;
      o.what = t.origin + ":" + std::to_string(row.line) + " " + t.collective + " " +
               std::to_string(row.size_bytes) + " B on " + std::to_string(t.ranks) + " ranks";
      o.measured_seconds = row.time_us * kSecondsPerUs;
      // At the profile's host share, as a plan's collectives are priced (EstimateCostModel):
      // the cpu backend's sweeps ran their ranks on the cores of one host.
      o.predict = [cluster, bytes = row.size_bytes](const HardwareProfile& hw) {
        return Slowed(RingCollectiveCost(hw, cluster), HostShareSlowdown(hw, cluster))
            .Seconds(bytes);
      };
      group.observations.push_back(std::move(o));
    }
  }
  if (group.observations.empty()) {
    return Status::Error(group.input + ": every table is of one rank: no network to fit");
  }
  const bool one_size = sizes.size() < 2;
  if (intra) group.keys.push_back("intra_node_bus_bandwidth_bytes_per_s");
  if (inter) group.keys.push_back("inter_node_bandwidth_per_gpu_bytes_per_s");
  const char* why_size = ": one message size: latency and bandwidth cannot both be fitted";
  if (one_size) {
    group.undetermined.push_back(std::string("collective_base_latency_s") + why_size);
  } else {
    group.keys.push_back("collective_base_latency_s");
    if (intra_rank_counts.size() >= 2) {
      group.keys.push_back("intra_node_step_latency_s");
    } else if (intra) {
      group.undetermined.push_back(
          "intra_node_step_latency_s: one rank count on one node: the base latency and the "
          "per-step latency cannot be told apart (the base takes the whole)");
    }
    if (inter) group.keys.push_back("inter_node_step_latency_s");
  }
  if (!intra) {
    group.undetermined.push_back(
        "intra_node_bus_bandwidth_bytes_per_s: no table on one node (each crosses nodes)");
  }
  if (!inter) {
    group.undetermined.push_back(
        "inter_node_bandwidth_per_gpu_bytes_per_s: no table across nodes (one host each)");
  }
  return group;
}

void PreferNcclTestsForTheNetwork(std::vector<FitGroup>* groups) {
  std::set<std::string> network;
  std::string tables;
  for (FitGroup& group : *groups) {
    if (group.kind == "nccl-tests") {
      network.insert(group.keys.begin(), group.keys.end());
      tables = group.input;
      continue;
    }
    if (group.kind != "trace collectives" || network.empty()) continue;
    std::vector<std::string> kept;
    for (std::string& key : group.keys) {
      if (network.count(key) == 0) {
        kept.push_back(std::move(key));
        continue;
      }
      group.undetermined.push_back(key + ": taken from the nccl-tests tables (" + tables +
                                   "): a trace's collectives hold its model's sizes and the waits "
                                   "for late peers");
    }
    group.keys = std::move(kept);
  }
  // Without the tables, the trace collectives' durations fit the network, waits for the last rank
  // included: the skew's wait on top of them would count those waits twice.
  bool network_from_traces = false;
  for (const FitGroup& group : *groups) {
    network_from_traces = network_from_traces || (group.kind == "trace collectives" &&
                                                  !group.keys.empty() && network.empty());
  }
  if (!network_from_traces) return;
  for (FitGroup& group : *groups) {
    if (group.kind != "trace skew") continue;
    for (const std::string& key : group.keys) {
      group.undetermined.push_back(key +
                                   ": the trace collectives fit the network, their waits for the "
                                   "last rank included (give nccl-tests tables for the network)");
    }
    group.keys.clear();
    group.observations.clear();
    group.start_values.clear();
  }
}

}  // namespace dc
