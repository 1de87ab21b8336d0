// Interval arithmetic and medians shared by the simulator and the profile. Private to
// analyzer/.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

namespace dc::analyzer_internal {

// A half-open time interval [start, end).
template <typename T>
struct Interval {
  T start{}, end{};
};

// The union of `intervals` as disjoint intervals sorted by start; empty ones dropped.
template <typename T>
std::vector<Interval<T>> UnionOf(std::vector<Interval<T>> intervals) {
  std::erase_if(intervals, [](const Interval<T>& i) { return !(i.end > i.start); });
  auto before = [](const Interval<T>& a, const Interval<T>& b) {
    return a.start < b.start || (a.start == b.start && a.end < b.end);
  };
  // Intervals of one stream come sorted already.
  if (!std::is_sorted(intervals.begin(), intervals.end(), before)) {
    std::sort(intervals.begin(), intervals.end(), before);
  }
  std::vector<Interval<T>> merged;
  for (const Interval<T>& i : intervals) {
    if (!merged.empty() && i.start <= merged.back().end) {
      merged.back().end = std::max(merged.back().end, i.end);
    } else {
      merged.push_back(i);
    }
  }
  return merged;
}

template <typename T>
T TotalLength(const std::vector<Interval<T>>& disjoint) {
  T total{};
  for (const Interval<T>& i : disjoint) total += i.end - i.start;
  return total;
}

// |a ∩ b| for two unions (disjoint and sorted, as UnionOf returns).
template <typename T>
T IntersectionLength(const std::vector<Interval<T>>& a, const std::vector<Interval<T>>& b) {
  T total{};
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const T lo = std::max(a[i].start, b[j].start);
    const T hi = std::min(a[i].end, b[j].end);
    if (hi > lo) total += hi - lo;
    if (a[i].end < b[j].end) {
      ++i;
    } else {
      ++j;
    }
  }
  return total;
}

// The median (mean of the two middle values for an even count); 0 for none.
inline double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  if (values.size() % 2 == 1) return values[mid];
  const double upper = values[mid];
  const double lower = *std::max_element(values.begin(), values.begin() + mid);
  return (lower + upper) / 2;
}

}  // namespace dc::analyzer_internal
