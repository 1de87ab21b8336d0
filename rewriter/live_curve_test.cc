#include "rewriter/live_curve.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "rewriter/prefetch.h"
#include "tests/support/prefetch_test_util.h"

namespace dc {
namespace {

using rewriter_internal::LiveCurve;
using testing::MakeModelCase;
using testing::MustSimulate;

// The curve the passes edit is the simulator's memory timeline: same points, same peak.
TEST(LiveCurve, PeaksWhereTheSimulatorDoes) {
  for (int64_t gas : {1, 3}) {
    const auto c = MakeModelCase("small", gas, ClusterShape{1, 2});
    proto::Schedule s = c.schedule;
    PrefetchPass pass;
    ASSERT_TRUE(pass.Run(&s, PassContext{&c.costs, 0}).ok());
    for (const proto::Schedule* schedule : {&c.schedule, static_cast<const proto::Schedule*>(&s)}) {
      const SimResult sim = MustSimulate(*schedule, c.costs);
      auto curve = LiveCurve::Build(*schedule, sim);
      ASSERT_TRUE(curve.ok()) << curve.status().message();
      EXPECT_EQ(curve->Max(0, curve->size()), sim.peak_device_bytes);
      // Every point of the simulator's timeline is a value of the curve at the same time.
      for (size_t k = 1; k < sim.memory_timeline.size(); ++k) {
        const MemoryPoint& point = sim.memory_timeline[k];
        const int at = curve->FirstPointAtOrAfter(point.time_seconds);
        bool found = false;
        for (int p = at; p < curve->size() && curve->TimeOf(p) == point.time_seconds; ++p) {
          found |= curve->Max(p, p + 1) == point.total_bytes;
        }
        EXPECT_TRUE(found) << k;
      }
    }
  }
}

// Range adds and maxima, and the leftmost fitting point, against a plain array of the values.
TEST(LiveCurve, MatchesBruteForceUnderRandomEdits) {
  const auto c = MakeModelCase("small", 2, ClusterShape{1, 2});
  const SimResult sim = MustSimulate(c.schedule, c.costs);
  auto built = LiveCurve::Build(c.schedule, sim);
  ASSERT_TRUE(built.ok()) << built.status().message();
  for (const bool flat : {false, true}) {
    LiveCurve curve = flat ? built->Flat(1000) : *built;
    const int n = curve.size();
    ASSERT_GT(n, 2);
    std::vector<int64_t> values(n);
    for (int p = 0; p < n; ++p) values[p] = curve.Max(p, p + 1);
    auto brute_max = [&](int begin, int end) {
      return *std::max_element(values.begin() + begin, values.begin() + end);
    };
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> point(0, n);
    std::uniform_int_distribution<int64_t> bytes(-5000, 5000);
    for (int step = 0; step < 3000; ++step) {
      int begin = point(rng), end = point(rng);
      if (begin > end) std::swap(begin, end);
      if (step % 3 == 0) {
        const int64_t delta = bytes(rng);
        curve.Add(begin, end, delta);
        for (int p = begin; p < end; ++p) values[p] += delta;
        continue;
      }
      if (begin == end) continue;
      ASSERT_EQ(curve.Max(begin, end), brute_max(begin, end)) << step;
      const int64_t limit = brute_max(begin, end) - bytes(rng) % 3000;
      int fitting = begin;
      for (int p = end - 1; p >= begin; --p) {
        if (values[p] > limit) {
          fitting = p + 1;
          break;
        }
      }
      ASSERT_EQ(curve.LeftmostFitting(begin, end, limit), fitting) << step;
    }
  }
}

}  // namespace
}  // namespace dc
