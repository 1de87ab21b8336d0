// The memory chart: live device bytes by kind over one rank's step, as a stacked-area SVG with
// a legend, the budget line, the peak marked and labelled, all-gathers / offloads / reloads as
// ticks, and labelled axes with units. Made from any timeline (a trace, or a plan's predicted
// step through PlanTimeline). Output is deterministic (fixed number formatting). Thread-safe
// (pure).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "schemas/status.h"
#include "tracetools/report.h"

namespace dc {

struct MemoryChartOptions {
  int rank = -1;             // a rank number; -1: the first rank
  int step = -1;             // a step number; -1: the first measured step (whole span without)
  int64_t budget_bytes = 0;  // drawn when > 0
  int max_points = 2000;     // more level changes than this are thinned, keeping each peak
};

struct MemoryChart {
  std::string title;
  std::string window;              // "step 2" or "whole trace"
  std::vector<std::string> kinds;  // drawn kinds (those with bytes), in stacking order
  struct Point {
    int64_t t_ns = 0;  // from the window start; the level holds until the next point
    std::vector<int64_t> bytes_by_kind;
    int64_t total_bytes = 0;
  };
  std::vector<Point> points;
  int64_t duration_ns = 0;
  int64_t budget_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t peak_t_ns = 0;
  std::vector<int64_t> gathers_ns, offloads_ns, reloads_ns;  // activity starts in the window
};

StatusOr<MemoryChart> BuildMemoryChart(const Timeline& timeline, const MemoryChartOptions& options);
std::string RenderMemorySvg(const MemoryChart& chart);
nlohmann::json MemoryChartJson(const MemoryChart& chart);

}  // namespace dc
