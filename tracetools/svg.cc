#include "tracetools/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>

#include "schemas/units.h"

namespace dc {
namespace {

constexpr int64_t kMinNs = std::numeric_limits<int64_t>::min();
constexpr int64_t kMaxNs = std::numeric_limits<int64_t>::max();

// ----- the window -----

struct ChartWindow {
  int rank_index = 0;
  int step = 0;
  bool whole_span = false;
  int64_t start_ns = kMinNs, end_ns = kMaxNs;
  bool Contains(int64_t ts) const { return ts >= start_ns && ts <= end_ns; }
};

StatusOr<ChartWindow> ChooseWindow(const Timeline& timeline, const MemoryChartOptions& options) {
  ChartWindow w;
  const std::vector<TimelineRank>& ranks = timeline.ranks();
  if (ranks.empty()) return Status::Error(timeline.path() + ": no ranks");
  if (options.rank >= 0) {
    auto it = std::find_if(ranks.begin(), ranks.end(),
                           [&](const TimelineRank& r) { return r.rank == options.rank; });
    if (it == ranks.end()) {
      return Status::Error(timeline.path() + ": no rank " + std::to_string(options.rank) +
                           " (ranks " + std::to_string(ranks.front().rank) + " to " +
                           std::to_string(ranks.back().rank) + ")");
    }
    w.rank_index = static_cast<int>(it - ranks.begin());
  }
  std::optional<TimelineStep> chosen;
  bool rank_has_steps = false;
  for (const TimelineStep& s : timeline.steps()) {
    if (s.rank_index != w.rank_index) continue;
    rank_has_steps = true;
    const bool match = options.step >= 0 ? s.step == options.step : !s.warmup;
    if (match && !chosen) chosen = s;
  }
  if (chosen) {
    w.step = chosen->step;
    w.start_ns = chosen->start_ns;
    w.end_ns = chosen->end_ns;
    return w;
  }
  if (rank_has_steps) {
    return Status::Error(timeline.path() + ": rank " + std::to_string(ranks[w.rank_index].rank) +
                         (options.step >= 0 ? " has no step " + std::to_string(options.step)
                                            : std::string(" has no measured step")) +
                         "; see dc-trace summary for its steps");
  }
  w.whole_span = true;
  return w;
}

// ----- collecting -----

bool Contains(const std::string& text, const char* part) {
  return text.find(part) != std::string::npos;
}

void AddTick(const TimelineActivity& a, MemoryChart* chart) {
  if (a.kind == ActivityClass::kCommunication) {
    if (Contains(a.name, "all_gather") || Contains(a.name, "AllGather") ||
        Contains(a.name, "allgather") || Contains(a.name, "all_gather_into_tensor")) {
      chart->gathers_ns.push_back(a.start_ns);
    }
  } else if (a.kind == ActivityClass::kCopy) {
    if (Contains(a.name, "Device-to-Host") || Contains(a.name, "DtoH")) {
      chart->offloads_ns.push_back(a.start_ns);
    } else if (Contains(a.name, "Host-to-Device") || Contains(a.name, "HtoD")) {
      chart->reloads_ns.push_back(a.start_ns);
    }
  }
}

Status CollectTicks(const Timeline& timeline, ChartWindow* w, MemoryChart* chart) {
  int64_t first = kMaxNs, last = kMinNs;
  DC_RETURN_IF_ERROR(timeline.ForEachActivity({}, [&](const TimelineActivity& a) {
    if (a.rank_index != w->rank_index || !w->Contains(a.start_ns)) return;
    first = std::min(first, a.start_ns);
    last = std::max(last, a.end_ns);
    AddTick(a, chart);
  }));
  if (w->whole_span && first <= last) {
    w->start_ns = first;
    w->end_ns = last;
  }
  return Status::Ok();
}

struct Levels {
  std::vector<std::string> kinds;
  std::vector<MemoryChart::Point> points;  // absolute times; the first is the level at start
};

StatusOr<Levels> CollectLevels(const Timeline& timeline, ChartWindow* w) {
  DC_ASSIGN_OR_RETURN(MemoryReplay replay, MemoryReplay::Prepare(timeline));
  Levels levels;
  levels.kinds = replay.kinds();
  if (replay.empty()) return levels;
  MemoryChart::Point before{kMinNs, replay.preexisting(w->rank_index), 0};
  before.bytes_by_kind.resize(levels.kinds.size(), 0);
  int64_t first = kMaxNs, last = kMinNs;
  DC_RETURN_IF_ERROR(replay.Run(timeline, [&](const MemoryLevel& m) {
    if (m.rank_index != w->rank_index) return;
    first = std::min(first, m.ts_ns);
    last = std::max(last, m.ts_ns);
    MemoryChart::Point p{m.ts_ns, *m.bytes_by_kind, m.total_bytes};
    if (!w->whole_span && m.ts_ns < w->start_ns) {
      before = std::move(p);
    } else if (w->whole_span || m.ts_ns <= w->end_ns) {
      levels.points.push_back(std::move(p));
    }
  }));
  if (w->whole_span && first <= last) {
    w->start_ns = std::min(w->start_ns == kMinNs ? first : w->start_ns, first);
    w->end_ns = std::max(w->end_ns == kMaxNs ? last : w->end_ns, last);
  }
  before.t_ns = w->start_ns;
  before.total_bytes = 0;
  for (int64_t b : before.bytes_by_kind) before.total_bytes += b;
  if (levels.points.empty() || levels.points.front().t_ns > w->start_ns) {
    levels.points.insert(levels.points.begin(), std::move(before));
  }
  return levels;
}

// At most about `max_points`: per time bucket the highest level and the bucket's last level.
std::vector<MemoryChart::Point> Thin(std::vector<MemoryChart::Point> points, int64_t duration_ns,
                                     int max_points) {
  if (static_cast<int>(points.size()) <= max_points || duration_ns <= 0) return points;
  const int64_t buckets = std::max(1, max_points / 2);
  // In 128 bits: a time (up to 2^62 ns) times the buckets leaves 64.
  auto bucket_of = [&](int64_t t_ns) {
    return static_cast<__int128>(t_ns) * buckets / duration_ns;
  };
  std::vector<MemoryChart::Point> thinned;
  size_t i = 0;
  while (i < points.size()) {
    const __int128 bucket = bucket_of(points[i].t_ns);
    size_t highest = i, end = i;
    while (end < points.size() && bucket_of(points[end].t_ns) == bucket) {
      if (points[end].total_bytes > points[highest].total_bytes) highest = end;
      ++end;
    }
    thinned.push_back(points[highest]);
    if (end - 1 != highest) thinned.push_back(points[end - 1]);
    i = end;
  }
  return thinned;
}

void Finish(const Levels& levels, const ChartWindow& w, MemoryChart* chart, int max_points) {
  chart->duration_ns = std::max<int64_t>(0, w.end_ns - w.start_ns);
  std::vector<bool> used(levels.kinds.size(), false);
  for (const MemoryChart::Point& p : levels.points) {
    for (size_t k = 0; k < used.size(); ++k) used[k] = used[k] || p.bytes_by_kind[k] != 0;
  }
  for (size_t k = 0; k < used.size(); ++k) {
    if (used[k]) chart->kinds.push_back(levels.kinds[k]);
  }
  std::vector<MemoryChart::Point> points;
  for (const MemoryChart::Point& p : levels.points) {
    MemoryChart::Point q{p.t_ns - w.start_ns, {}, p.total_bytes};
    for (size_t k = 0; k < used.size(); ++k) {
      if (used[k]) q.bytes_by_kind.push_back(p.bytes_by_kind[k]);
    }
    if (points.empty() || q.total_bytes > chart->peak_bytes) {
      chart->peak_bytes = q.total_bytes;
      chart->peak_t_ns = q.t_ns;
    }
    points.push_back(std::move(q));
  }
  chart->points = Thin(std::move(points), chart->duration_ns, max_points);
  for (std::vector<int64_t>* ticks :
       {&chart->gathers_ns, &chart->offloads_ns, &chart->reloads_ns}) {
    for (int64_t& t : *ticks) t -= w.start_ns;
  }
}

// ----- drawing -----

constexpr double kWidth = 960, kHeight = 540;
constexpr double kLeft = 90, kRight = 750, kTop = 60, kBottom = 445;
constexpr double kTickRugPx = 9;  // one row of activity ticks under the x axis
constexpr double kRugBottom = kBottom + 3 * kTickRugPx + 4;
constexpr double kHeadroom = 1.1;  // the y axis ends this far above the highest line
constexpr int kAxisTicks = 5;

const char* KindColor(const std::string& kind, size_t index) {
  static const std::map<std::string, const char*> kFixed = {
      {"gathered", "#4e79a7"},   {"shard", "#f28e2b"},           {"grad", "#e15759"},
      {"grad_shard", "#76b7b2"}, {"optimizer_state", "#59a14f"}, {"activation", "#edc948"},
      {"input", "#b07aa1"}};
  static const char* kOthers[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                  "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
  auto it = kFixed.find(kind);
  return it != kFixed.end() ? it->second : kOthers[index % std::size(kOthers)];
}

std::string Escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::string Num(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", value);
  return std::string(text) == "-0.0" ? "0.0" : text;
}

struct Unit {
  const char* name;
  double scale;  // units per base unit
};

Unit TimeUnit(int64_t duration_ns) {
  if (duration_ns >= 1000000000) return {"s", 1e-9};
  if (duration_ns >= 1000000) return {"ms", 1e-6};
  return {"us", 1e-3};
}

Unit ByteUnit(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return {"GiB", 1.0 / (1024.0 * 1024 * 1024)};
  if (bytes >= 1024.0 * 1024) return {"MiB", 1.0 / (1024.0 * 1024)};
  if (bytes >= 1024.0) return {"KiB", 1.0 / 1024};
  return {"B", 1.0};
}

// A 1, 2 or 5 times a power of ten step giving about kAxisTicks ticks up to `max`.
double NiceStep(double max) {
  if (max <= 0) return 1;
  const double raw = max / kAxisTicks;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * power) return m * power;
  }
  return 10 * power;
}

std::string TickLabel(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", std::round(value * 1000) / 1000);
  return text;
}

class Canvas {
 public:
  Canvas(const MemoryChart& chart)
      : chart_(chart),
        x_max_ns_(std::max<int64_t>(1, chart.duration_ns)),
        y_max_bytes_(std::max<double>(
            1, kHeadroom * static_cast<double>(std::max(chart.peak_bytes, chart.budget_bytes)))) {}

  double X(int64_t t_ns) const {
    const double f = static_cast<double>(std::clamp<int64_t>(t_ns, 0, x_max_ns_)) / x_max_ns_;
    return kLeft + f * (kRight - kLeft);
  }
  double Y(double bytes) const { return kBottom - bytes / y_max_bytes_ * (kBottom - kTop); }
  double y_max_bytes() const { return y_max_bytes_; }
  int64_t x_max_ns() const { return x_max_ns_; }

 private:
  const MemoryChart& chart_;
  int64_t x_max_ns_;
  double y_max_bytes_;
};

void Axes(const MemoryChart& chart, const Canvas& c, std::string* out) {
  *out += "<g class=\"axes\" stroke=\"#333\" stroke-width=\"1\">\n";
  *out += "<line x1=\"" + Num(kLeft) + "\" y1=\"" + Num(kBottom) + "\" x2=\"" + Num(kRight) +
          "\" y2=\"" + Num(kBottom) + "\"/>\n";
  *out += "<line x1=\"" + Num(kLeft) + "\" y1=\"" + Num(kTop) + "\" x2=\"" + Num(kLeft) +
          "\" y2=\"" + Num(kBottom) + "\"/>\n</g>\n";
  const Unit time = TimeUnit(c.x_max_ns());
  const double x_step = NiceStep(static_cast<double>(c.x_max_ns()) * time.scale);
  *out += "<g class=\"x-ticks\" text-anchor=\"middle\">\n";
  for (int i = 0; i * x_step <= c.x_max_ns() * time.scale + 1e-9; ++i) {
    const double x = c.X(std::llround(i * x_step / time.scale));
    *out += "<line x1=\"" + Num(x) + "\" y1=\"" + Num(kBottom) + "\" x2=\"" + Num(x) + "\" y2=\"" +
            Num(kRugBottom) + "\" stroke=\"#bbb\"/><text x=\"" + Num(x) + "\" y=\"" +
            Num(kRugBottom + 15) + "\">" + TickLabel(i * x_step) + "</text>\n";
  }
  *out += "</g>\n";
  const Unit bytes = ByteUnit(c.y_max_bytes());
  const double y_step = NiceStep(c.y_max_bytes() * bytes.scale);
  *out += "<g class=\"y-ticks\" text-anchor=\"end\">\n";
  for (int i = 0; i * y_step <= c.y_max_bytes() * bytes.scale + 1e-9; ++i) {
    const double y = c.Y(i * y_step / bytes.scale);
    *out += "<line x1=\"" + Num(kLeft - 5) + "\" y1=\"" + Num(y) + "\" x2=\"" + Num(kRight) +
            "\" y2=\"" + Num(y) + "\" stroke=\"#ddd\"/><text x=\"" + Num(kLeft - 8) + "\" y=\"" +
            Num(y + 4) + "\">" + TickLabel(i * y_step) + "</text>\n";
  }
  *out += "</g>\n";
  *out += "<text class=\"x-label\" x=\"" + Num((kLeft + kRight) / 2) + "\" y=\"" +
          Num(kRugBottom + 38) + "\" text-anchor=\"middle\">time into " + Escape(chart.window) +
          " (" + time.name + ")</text>\n";
  *out += "<text class=\"y-label\" transform=\"translate(" + Num(kLeft - 60) + " " +
          Num((kTop + kBottom) / 2) +
          ") rotate(-90)\" text-anchor=\"middle\">live device memory (" + bytes.name + ")</text>\n";
}

// One closed outline per kind: the top of its band left to right, its bottom right to left.
void Areas(const MemoryChart& chart, const Canvas& c, std::string* out) {
  *out += "<g class=\"areas\">\n";
  const size_t n = chart.points.size();
  std::vector<int64_t> below(n, 0);
  for (size_t k = 0; k < chart.kinds.size(); ++k) {
    std::string d;
    auto step_edge = [&](const std::vector<int64_t>& level, bool forward) {
      for (size_t j = 0; j < n; ++j) {
        const size_t i = forward ? j : n - 1 - j;
        const int64_t t0 = chart.points[i].t_ns;
        const int64_t t1 = i + 1 < n ? chart.points[i + 1].t_ns : c.x_max_ns();
        const double y = c.Y(static_cast<double>(level[i]));
        const double xa = c.X(forward ? t0 : t1), xb = c.X(forward ? t1 : t0);
        d += (d.empty() ? "M" : " L") + Num(xa) + " " + Num(y) + " L" + Num(xb) + " " + Num(y);
      }
    };
    std::vector<int64_t> top(n);
    for (size_t i = 0; i < n; ++i) top[i] = below[i] + chart.points[i].bytes_by_kind[k];
    step_edge(top, true);
    step_edge(below, false);
    *out += "<path class=\"area\" data-kind=\"" + Escape(chart.kinds[k]) + "\" fill=\"" +
            KindColor(chart.kinds[k], k) + "\" fill-opacity=\"0.85\" stroke=\"none\" d=\"" + d +
            " Z\"/>\n";
    below = std::move(top);
  }
  *out += "</g>\n";
}

void Ticks(const MemoryChart& chart, const Canvas& c, std::string* out) {
  const struct {
    const std::vector<int64_t>* times;
    const char* name;
    const char* color;
    double row;  // rows of the rug under the x axis
  } kinds[] = {{&chart.gathers_ns, "gather", "#1f3b73", 0},
               {&chart.offloads_ns, "offload", "#b3541e", 1},
               {&chart.reloads_ns, "reload", "#2e7d32", 2}};
  *out += "<g class=\"ticks\">\n";
  for (const auto& kind : kinds) {
    const double y0 = kBottom + 2 + kind.row * kTickRugPx, y1 = y0 + kTickRugPx - 2;
    std::string previous_x;  // ticks that land on the same spot are drawn once
    for (int64_t t : *kind.times) {
      const std::string x = Num(c.X(t));
      if (x == previous_x) continue;
      previous_x = x;
      *out += "<line class=\"tick " + std::string(kind.name) + "\" x1=\"" + x + "\" y1=\"" +
              Num(y0) + "\" x2=\"" + x + "\" y2=\"" + Num(y1) + "\" stroke=\"" + kind.color +
              "\"/>\n";
    }
  }
  *out += "</g>\n";
}

void BudgetAndPeak(const MemoryChart& chart, const Canvas& c, std::string* out) {
  if (chart.budget_bytes > 0) {
    const double y = c.Y(static_cast<double>(chart.budget_bytes));
    *out += "<line class=\"budget\" x1=\"" + Num(kLeft) + "\" y1=\"" + Num(y) + "\" x2=\"" +
            Num(kRight) + "\" y2=\"" + Num(y) +
            "\" stroke=\"#c00\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/>\n";
    *out += "<text class=\"budget-label\" x=\"" + Num(kRight - 4) + "\" y=\"" + Num(y - 5) +
            "\" text-anchor=\"end\" fill=\"#c00\">budget " + FormatBytes(chart.budget_bytes) +
            "</text>\n";
  }
  if (chart.points.empty()) return;
  const double x = c.X(chart.peak_t_ns), y = c.Y(static_cast<double>(chart.peak_bytes));
  const Unit time = TimeUnit(std::max<int64_t>(1, chart.duration_ns));
  char at[32];
  std::snprintf(at, sizeof(at), "%.3f", static_cast<double>(chart.peak_t_ns) * time.scale);
  const bool right_half = x > (kLeft + kRight) / 2;
  *out += "<circle class=\"peak\" cx=\"" + Num(x) + "\" cy=\"" + Num(y) +
          "\" r=\"4\" fill=\"#000\"/>\n";
  *out += "<text class=\"peak-label\" x=\"" + Num(right_half ? x - 8 : x + 8) + "\" y=\"" +
          Num(y - 8) + "\" text-anchor=\"" + (right_half ? "end" : "start") + "\">peak " +
          FormatBytes(chart.peak_bytes) + " at " + at + " " + time.name + "</text>\n";
}

void Legend(const MemoryChart& chart, std::string* out) {
  double y = kTop;
  const double x = kRight + 20;
  *out += "<g class=\"legend\">\n";
  for (size_t k = chart.kinds.size(); k-- > 0;) {  // top of the stack first
    *out += "<rect x=\"" + Num(x) + "\" y=\"" + Num(y) + "\" width=\"12\" height=\"12\" fill=\"" +
            KindColor(chart.kinds[k], k) + "\"/><text x=\"" + Num(x + 18) + "\" y=\"" +
            Num(y + 10) + "\">" + Escape(chart.kinds[k]) + "</text>\n";
    y += 20;
  }
  y += 10;
  const std::pair<const char*, const char*> marks[] = {
      {"all-gather", "#1f3b73"}, {"offload", "#b3541e"}, {"reload", "#2e7d32"}};
  for (const auto& [name, color] : marks) {
    *out += "<line x1=\"" + Num(x + 6) + "\" y1=\"" + Num(y) + "\" x2=\"" + Num(x + 6) +
            "\" y2=\"" + Num(y + 12) + "\" stroke=\"" + color +
            "\" stroke-width=\"2\"/><text x=\"" + Num(x + 18) + "\" y=\"" + Num(y + 10) + "\">" +
            name + "</text>\n";
    y += 20;
  }
  if (chart.budget_bytes > 0) {
    *out += "<line x1=\"" + Num(x) + "\" y1=\"" + Num(y + 6) + "\" x2=\"" + Num(x + 12) +
            "\" y2=\"" + Num(y + 6) + "\" stroke=\"#c00\" stroke-dasharray=\"4 2\"/><text x=\"" +
            Num(x + 18) + "\" y=\"" + Num(y + 10) + "\">budget</text>\n";
  }
  *out += "</g>\n";
}

}  // namespace

StatusOr<MemoryChart> BuildMemoryChart(const Timeline& timeline,
                                       const MemoryChartOptions& options) {
  DC_ASSIGN_OR_RETURN(ChartWindow w, ChooseWindow(timeline, options));
  MemoryChart chart;
  chart.budget_bytes = options.budget_bytes;
  chart.window = timeline.format() == TimelineFormat::kPlan ? "the predicted step"
                 : w.whole_span                             ? "the trace"
                                                            : "step " + std::to_string(w.step);
  DC_RETURN_IF_ERROR(CollectTicks(timeline, &w, &chart));
  DC_ASSIGN_OR_RETURN(Levels levels, CollectLevels(timeline, &w));
  if (levels.kinds.empty()) {
    return Status::Error(timeline.path() +
                         ": no memory events; nothing to draw (nsys: record with "
                         "--cuda-memory-usage=true; PyTorch: profile_memory=True)");
  }
  if (w.whole_span && (w.start_ns == kMinNs || w.end_ns == kMaxNs)) {
    // Found by fuzzing: a rank whose rows were all left out has no span to draw over.
    return Status::Error(timeline.path() + ": rank " +
                         std::to_string(timeline.ranks()[w.rank_index].rank) +
                         " has no activity or memory event to draw; pick another with --rank");
  }
  chart.title = timeline.path() + ": live device memory, rank " +
                std::to_string(timeline.ranks()[w.rank_index].rank) + ", " + chart.window;
  Finish(levels, w, &chart, options.max_points);
  return chart;
}

std::string RenderMemorySvg(const MemoryChart& chart) {
  const Canvas canvas(chart);
  std::string out =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
      "width=\"" +
      Num(kWidth) + "\" height=\"" + Num(kHeight) + "\" viewBox=\"0 0 " + Num(kWidth) + " " +
      Num(kHeight) + "\" font-family=\"sans-serif\" font-size=\"12\">\n<title>" +
      Escape(chart.title) +
      "</title>\n<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n<text class=\"title\" x=\"" +
      Num(kLeft) + "\" y=\"30\" font-size=\"15\">" + Escape(chart.title) + "</text>\n";
  Axes(chart, canvas, &out);
  Areas(chart, canvas, &out);
  Ticks(chart, canvas, &out);
  BudgetAndPeak(chart, canvas, &out);
  Legend(chart, &out);
  return out + "</svg>\n";
}

nlohmann::json MemoryChartJson(const MemoryChart& chart) {
  nlohmann::json points = nlohmann::json::array();
  for (const MemoryChart::Point& p : chart.points) {
    points.push_back({{"t_seconds", static_cast<double>(p.t_ns) * 1e-9},
                      {"total_bytes", p.total_bytes},
                      {"bytes_by_kind", p.bytes_by_kind}});
  }
  nlohmann::json peak_by_kind = nlohmann::json::object();
  for (const MemoryChart::Point& p : chart.points) {
    if (p.t_ns != chart.peak_t_ns || p.total_bytes != chart.peak_bytes) continue;
    for (size_t k = 0; k < chart.kinds.size(); ++k)
      peak_by_kind[chart.kinds[k]] = p.bytes_by_kind[k];
    break;
  }
  return {{"title", chart.title},
          {"window", chart.window},
          {"duration_seconds", static_cast<double>(chart.duration_ns) * 1e-9},
          {"kinds", chart.kinds},
          {"budget_bytes", chart.budget_bytes},
          {"peak",
           {{"bytes", chart.peak_bytes},
            {"at_seconds", static_cast<double>(chart.peak_t_ns) * 1e-9},
            {"by_kind", peak_by_kind}}},
          {"gathers", chart.gathers_ns.size()},
          {"offloads", chart.offloads_ns.size()},
          {"reloads", chart.reloads_ns.size()},
          {"points", points}};
}

}  // namespace dc
