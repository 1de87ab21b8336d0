#include "tracetools/svg.h"

#include <gtest/gtest.h>

#include <regex>

namespace dc {
namespace {

// A minimal XML check: every tag closes in order, attribute quotes balance, no stray '<' or
// '&'. Returns the names of the elements seen (with repeats).
std::vector<std::string> CheckXml(const std::string& text) {
  std::vector<std::string> open, seen;
  size_t i = 0;
  while ((i = text.find('<', i)) != std::string::npos) {
    const size_t end = text.find('>', i);
    if (end == std::string::npos) {
      ADD_FAILURE() << "unclosed tag at " << i;
      break;
    }
    const std::string tag = text.substr(i + 1, end - i - 1);
    EXPECT_EQ(tag.find('<'), std::string::npos) << tag;
    EXPECT_EQ(std::count(tag.begin(), tag.end(), '"') % 2, 0) << tag;
    if (tag.starts_with("?")) {
      // declaration
    } else if (tag.starts_with("/")) {
      EXPECT_FALSE(open.empty()) << tag;
      if (!open.empty()) {
        EXPECT_EQ(open.back(), tag.substr(1));
        open.pop_back();
      }
    } else {
      const std::string name = tag.substr(0, tag.find_first_of(" /"));
      seen.push_back(name);
      if (!tag.ends_with("/")) open.push_back(name);
    }
    i = end + 1;
  }
  EXPECT_TRUE(open.empty()) << "unclosed: " << (open.empty() ? "" : open.back());
  for (size_t a = text.find('&'); a != std::string::npos; a = text.find('&', a + 1)) {
    const std::string entity = text.substr(a, 6);
    EXPECT_TRUE(entity.starts_with("&amp;") || entity.starts_with("&lt;") ||
                entity.starts_with("&gt;") || entity.starts_with("&quot;"))
        << entity;
  }
  return seen;
}

int Count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t i = text.find(part); i != std::string::npos; i = text.find(part, i + 1)) ++n;
  return n;
}

// One rank, step 3 over [1000, 2000) ns: 40 B of shard live before the capture; a gathered
// buffer of 100 B over [1100, 1600); an activation of 60 B from 1300; an all-gather at 1050, an
// offload at 1700, a reload at 1800; warm-up step 2 before it.
TimelineData OneStep() {
  TimelineData data;
  data.path = "trace <&>.db";
  data.format = TimelineFormat::kDc;
  data.ranks.push_back({0, 7, "cpu", 0});
  data.steps.push_back({0, 2, 0, 1000, true});
  data.steps.push_back({0, 3, 1000, 2000, false});
  auto activity = [&](ActivityClass kind, const char* name, int64_t start) {
    TimelineActivity a;
    a.kind = kind;
    a.name = name;
    a.start_ns = start;
    a.end_ns = start + 50;
    data.activities.push_back(a);
  };
  activity(ActivityClass::kCommunication, "all_gather", 1050);
  activity(ActivityClass::kCopy, "[CUDA memcpy Device-to-Host]", 1700);
  activity(ActivityClass::kCopy, "[CUDA memcpy Host-to-Device]", 1800);
  activity(ActivityClass::kCompute, "matmul", 1200);
  auto memory = [&](int64_t ts, int64_t address, int64_t bytes, bool alloc, const char* kind) {
    TimelineMemoryEvent e;
    e.ts_ns = ts;
    e.address = address;
    e.bytes = bytes;
    e.alloc = alloc;
    e.kind = kind;
    data.memory_events.push_back(e);
  };
  memory(1100, 1, 100, true, "gathered");
  memory(1300, 2, 60, true, "activation");
  memory(1600, 1, 100, false, "gathered");
  memory(2500, 9, 40, false, "shard");
  return data;
}

TEST(MemoryChart, StackedLevelsPeakAndTicks) {
  auto timeline = MakeTimeline(OneStep());
  MemoryChartOptions options;
  options.budget_bytes = 256;
  auto chart = BuildMemoryChart(*timeline, options);
  ASSERT_TRUE(chart.ok()) << chart.status().message();
  EXPECT_EQ(chart->window, "step 3");
  EXPECT_EQ(chart->kinds, (std::vector<std::string>{"gathered", "shard", "activation"}));
  EXPECT_EQ(chart->duration_ns, 1000);
  EXPECT_EQ(chart->peak_bytes, 200);
  EXPECT_EQ(chart->peak_t_ns, 300);
  ASSERT_FALSE(chart->points.empty());
  EXPECT_EQ(chart->points.front().t_ns, 0);
  EXPECT_EQ(chart->points.front().total_bytes, 40);  // the shard, live before the capture
  EXPECT_EQ(chart->gathers_ns, std::vector<int64_t>{50});
  EXPECT_EQ(chart->offloads_ns, std::vector<int64_t>{700});
  EXPECT_EQ(chart->reloads_ns, std::vector<int64_t>{800});
}

TEST(MemoryChart, SvgIsWellFormedWithOneAreaPerKind) {
  auto timeline = MakeTimeline(OneStep());
  MemoryChartOptions options;
  options.budget_bytes = 256;
  auto chart = BuildMemoryChart(*timeline, options);
  ASSERT_TRUE(chart.ok());
  const std::string svg = RenderMemorySvg(*chart);
  const std::vector<std::string> elements = CheckXml(svg);
  EXPECT_EQ(elements.at(0), "svg");
  EXPECT_EQ(Count(svg, "<path class=\"area\""), 3);
  for (const char* kind : {"gathered", "shard", "activation"}) {
    EXPECT_EQ(Count(svg, std::string("data-kind=\"") + kind + "\""), 1) << kind;
    EXPECT_NE(svg.find(std::string(">") + kind + "</text>"), std::string::npos) << kind;  // legend
  }
  EXPECT_NE(svg.find(">peak 200 B at 0.300 us</text>"), std::string::npos) << svg;
  EXPECT_EQ(Count(svg, "<line class=\"budget\""), 1);
  EXPECT_NE(svg.find(">budget 256 B</text>"), std::string::npos);
  EXPECT_EQ(Count(svg, "class=\"tick gather\""), 1);
  EXPECT_EQ(Count(svg, "class=\"tick offload\""), 1);
  EXPECT_NE(svg.find("time into step 3 (us)"), std::string::npos);
  EXPECT_NE(svg.find("live device memory (B)"), std::string::npos);
  EXPECT_NE(svg.find("trace &lt;&amp;&gt;.db"), std::string::npos);
  EXPECT_EQ(RenderMemorySvg(*BuildMemoryChart(*timeline, options)), svg);  // deterministic
}

TEST(MemoryChart, NoBudgetNoLine) {
  auto timeline = MakeTimeline(OneStep());
  auto chart = BuildMemoryChart(*timeline, {});
  ASSERT_TRUE(chart.ok());
  const std::string svg = RenderMemorySvg(*chart);
  CheckXml(svg);
  EXPECT_EQ(Count(svg, "class=\"budget"), 0);
}

TEST(MemoryChart, ManyLevelsAreThinnedKeepingThePeak) {
  TimelineData data = OneStep();
  data.memory_events.clear();
  for (int i = 0; i < 20000; ++i) {
    TimelineMemoryEvent e;
    e.ts_ns = 1000 + i / 20;
    e.address = i;
    e.bytes = i == 12345 ? 5000 : 10;
    e.alloc = true;
    e.tracked = false;
    e.kind = "activation";
    data.memory_events.push_back(e);
    e.alloc = false;
    e.ts_ns = 1000 + (i + 1) / 20;
    data.memory_events.push_back(e);
  }
  auto timeline = MakeTimeline(std::move(data));
  MemoryChartOptions options;
  options.max_points = 200;
  auto chart = BuildMemoryChart(*timeline, options);
  ASSERT_TRUE(chart.ok());
  EXPECT_LE(chart->points.size(), 220u);
  const int64_t highest =
      std::max_element(chart->points.begin(), chart->points.end(),
                       [](const auto& a, const auto& b) { return a.total_bytes < b.total_bytes; })
          ->total_bytes;
  EXPECT_EQ(highest, chart->peak_bytes);
}

TEST(MemoryChart, ErrorsNameTheFile) {
  auto timeline = MakeTimeline(OneStep());
  MemoryChartOptions options;
  options.step = 9;
  auto chart = BuildMemoryChart(*timeline, options);
  ASSERT_FALSE(chart.ok());
  EXPECT_NE(chart.status().message().find("has no step 9"), std::string::npos);
  options = {};
  options.rank = 4;
  EXPECT_NE(BuildMemoryChart(*timeline, options).status().message().find("no rank 4"),
            std::string::npos);
  TimelineData without = OneStep();
  without.memory_events.clear();
  auto empty = BuildMemoryChart(*MakeTimeline(std::move(without)), {});
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("no memory events"), std::string::npos);
}

// Found by fuzzing (issue 13): a rank without steps, activity or memory events has no span; its
// window once ran from INT64_MIN to INT64_MAX and the duration overflowed.
TEST(MemoryChart, ARankWithNothingToDrawIsAnError) {
  TimelineData data = OneStep();
  data.steps.clear();
  data.ranks.push_back({7, 77, "", 0});
  MemoryChartOptions options;
  options.rank = 7;
  auto chart = BuildMemoryChart(*MakeTimeline(std::move(data)), options);
  ASSERT_FALSE(chart.ok());
  EXPECT_NE(chart.status().message().find("rank 7 has no activity or memory event to draw"),
            std::string::npos)
      << chart.status().message();
}

}  // namespace
}  // namespace dc
