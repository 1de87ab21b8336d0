// Live device memory of a simulated schedule, as the passes probe it before they change
// anything: LiveCurve, the bytes held at each instruction's memory event, editable so that a
// pass can try a change first (the gather-moving passes: prefetch, bucket, unshard,
// keep-activations and DeepCompile's rules); SimulatedTimeline, the simulator's memory timeline
// up to a horizon, for "the most held from t on" (the offload passes); and Acceptable, the
// budget and slowdown test a candidate schedule takes. The bytes come from the buffer effects
// (schemas/effects.h). Private to rewriter/: the passes' headers are the public surface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "machine/simulator.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc::rewriter_internal {

// Live device bytes over the instants of one simulated schedule. There is one point per
// instruction, at its memory event (an offload's end, every other instruction's start), in the
// simulator's sweep order (time, then instruction index); the value of a point is the total
// after that instruction's changes, so the maximum over all points is SimResult's peak. Passes
// add a buffer's bytes over a range of points to see what a change would do before making it:
// O(log n) per query or edit. Not thread-safe.
class LiveCurve {
 public:
  // REQUIRES: `sim` is Simulate(schedule, costs) for the same schedule.
  static StatusOr<LiveCurve> Build(const proto::Schedule& schedule, const SimResult& sim);

  // A curve over the same points with every value `bytes` (to track one kind of bytes alone).
  LiveCurve Flat(int64_t bytes) const;

  int size() const { return static_cast<int>(times_.size()); }
  // The point of instruction `instruction`'s memory event.
  int PointOf(int instruction) const { return point_of_[instruction]; }
  double TimeOf(int point) const { return times_[point]; }
  // The first point at or after `time_seconds`; size() if none.
  int FirstPointAtOrAfter(double time_seconds) const;

  // Largest value over points [begin, end); the persistent bytes when the range is empty.
  int64_t Max(int begin, int end) const;
  // Adds `bytes` (may be negative) to every point in [begin, end).
  void Add(int begin, int end, int64_t bytes);
  // The smallest p in [lo, end] with Max(p, end) <= limit (end when even the empty range is
  // over, which cannot happen for limit >= persistent bytes).
  int LeftmostFitting(int lo, int end, int64_t limit) const;

 private:
  void BuildTree(const std::vector<int64_t>& values);
  void AddToNode(int node, int64_t bytes);
  // Recomputes the maxima of the ancestors of the leaves `first` and `last`.
  void Recompute(int first, int last);

  std::vector<double> times_;  // by point
  std::vector<int> point_of_;  // by instruction
  int64_t persistent_bytes_ = 0;
  int leaves_ = 1;
  // A segment tree over the points, iterative (bottom-up): a range add goes to the nodes of the
  // range's canonical cover (added_) and is never pushed down; a node's max_ is the largest
  // value under it counting what was added at it and below, not at its ancestors.
  std::vector<int64_t> max_, added_;
};

// The simulator's memory timeline (SimResult::memory_timeline) up to a horizon, for "the most
// the device holds from t on": O(log n) per MaxFrom. Read-only.
class SimulatedTimeline {
 public:
  static constexpr double kNoHorizon = std::numeric_limits<double>::infinity();
  // Points at or after `horizon_seconds` are left out; `base_bytes` is the level before the
  // first point.
  SimulatedTimeline(const std::vector<MemoryPoint>& points, double horizon_seconds,
                    int64_t base_bytes);
  // The most held at any instant in [from, horizon): the level entering `from` and every
  // change after it.
  int64_t MaxFrom(double from) const;
  // The most held at any instant in [from, to].
  int64_t MaxIn(double from, double to) const;

 private:
  size_t FirstAtOrAfter(double t) const;
  int64_t LevelBefore(size_t i) const { return i == 0 ? base_bytes_ : totals_[i - 1]; }

  int64_t base_bytes_;
  std::vector<double> times_;
  std::vector<int64_t> totals_;
  std::vector<int64_t> suffix_max_;
};

// Whether `sim` is acceptable against the input's simulation: within the budget (0 = unlimited)
// and, when the input was, no slower than it by more than `slowdown_tolerance` (a fraction).
bool Acceptable(const SimResult& input, const SimResult& output, int64_t budget_bytes,
                double slowdown_tolerance);

}  // namespace dc::rewriter_internal
