#include "rewriter/live_curve.h"

#include <algorithm>
#include <array>
#include <string>

#include "schemas/effects.h"

namespace dc::rewriter_internal {
namespace {

constexpr int kNumStreams = proto::Stream_MAX + 1;
// Padding leaves of the segment tree: below any real value.
constexpr int64_t kNoPoint = std::numeric_limits<int64_t>::min() / 4;

// The buffer effects (schemas/effects.h) reduced to one byte delta per instruction.
class Deltas : public BufferListener {
 public:
  explicit Deltas(int num_instructions) : delta_(num_instructions, 0) {}
  void Allocated(int instruction, const BufferKey& /*key*/, int64_t size_bytes, BufferKind /*kind*/,
                 bool /*at_end*/, int /*handle*/) override {
    if (instruction >= 0) delta_[instruction] += size_bytes;
  }
  void Freed(int instruction, const BufferKey& /*key*/, int64_t size_bytes, BufferKind /*kind*/,
             bool /*at_end*/, int /*handle*/) override {
    delta_[instruction] -= size_bytes;
  }
  int64_t delta(int instruction) const { return delta_[instruction]; }

 private:
  std::vector<int64_t> delta_;
};

}  // namespace

// ----- LiveCurve -----

StatusOr<LiveCurve> LiveCurve::Build(const proto::Schedule& schedule, const SimResult& sim) {
  const int n = schedule.instructions_size();
  if (static_cast<int>(sim.start_seconds.size()) != n ||
      static_cast<int>(sim.end_seconds.size()) != n) {
    return Status::Error("the simulation does not belong to this schedule (" +
                         std::to_string(sim.start_seconds.size()) + " instructions simulated, " +
                         std::to_string(n) + " in the schedule)");
  }
  LiveCurve curve;
  for (int64_t bytes : PersistentBytesByKind(schedule)) {
    curve.persistent_bytes_ += bytes;
  }
  DC_RETURN_IF_ERROR(CheckReferences(schedule));
  Deltas deltas(n);
  DC_RETURN_IF_ERROR(BufferReplay(schedule, &deltas).Run());
  std::vector<int64_t> delta(n);
  std::vector<double> time(n);
  std::array<std::vector<int>, kNumStreams> by_stream;
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    delta[i] = deltas.delta(i);
    time[i] = EffectsAtEnd(instr.kind()) ? sim.end_seconds[i] : sim.start_seconds[i];
    const int stream = instr.stream() >= 0 && instr.stream() < kNumStreams ? instr.stream() : 0;
    by_stream[stream].push_back(i);
  }
  // Each stream's events are in time order already: merge the streams (time, then index).
  std::array<size_t, kNumStreams> next{};
  curve.point_of_.assign(n, 0);
  curve.times_.reserve(n);
  std::vector<int64_t> values;
  values.reserve(n);
  int64_t now = curve.persistent_bytes_;
  for (int p = 0; p < n; ++p) {
    int best = -1;
    for (int s = 0; s < kNumStreams; ++s) {
      if (next[s] == by_stream[s].size()) continue;
      const int i = by_stream[s][next[s]];
      if (best < 0) {
        best = s;
        continue;
      }
      const int b = by_stream[best][next[best]];
      if (time[i] < time[b] || (time[i] == time[b] && i < b)) best = s;
    }
    const int i = by_stream[best][next[best]++];
    now += delta[i];
    curve.point_of_[i] = p;
    curve.times_.push_back(time[i]);
    values.push_back(now);
  }
  curve.BuildTree(values);
  return curve;
}

void LiveCurve::BuildTree(const std::vector<int64_t>& values) {
  leaves_ = 1;
  while (leaves_ < static_cast<int>(values.size())) leaves_ *= 2;
  max_.assign(2 * leaves_, kNoPoint);
  added_.assign(2 * leaves_, 0);
  for (size_t i = 0; i < values.size(); ++i) max_[leaves_ + i] = values[i];
  for (int node = leaves_ - 1; node >= 1; --node) {
    max_[node] = std::max(max_[2 * node], max_[2 * node + 1]);
  }
}

LiveCurve LiveCurve::Flat(int64_t bytes) const {
  LiveCurve flat;
  flat.times_ = times_;
  flat.point_of_ = point_of_;
  flat.persistent_bytes_ = bytes;
  flat.BuildTree(std::vector<int64_t>(times_.size(), bytes));
  return flat;
}

int LiveCurve::FirstPointAtOrAfter(double time_seconds) const {
  return static_cast<int>(std::lower_bound(times_.begin(), times_.end(), time_seconds) -
                          times_.begin());
}

void LiveCurve::AddToNode(int node, int64_t bytes) {
  max_[node] += bytes;
  added_[node] += bytes;
}

void LiveCurve::Recompute(int first, int last) {
  auto recompute = [this](int node) {
    max_[node] = std::max(max_[2 * node], max_[2 * node + 1]) + added_[node];
  };
  // Both leaves are at the same depth: up in step until the paths meet, then once.
  for (first /= 2, last /= 2; first != last; first /= 2, last /= 2) {
    recompute(first);
    recompute(last);
  }
  for (; first >= 1; first /= 2) recompute(first);
}

void LiveCurve::Add(int begin, int end, int64_t bytes) {
  begin = std::max(begin, 0);
  end = std::min(end, size());
  if (begin >= end || bytes == 0) return;
  // The canonical cover of the leaves [lo, hi) takes the bytes; the ancestors of its two ends
  // are all the nodes whose maximum can change.
  const int first = begin + leaves_, last = end - 1 + leaves_;
  for (int lo = first, hi = end + leaves_; lo < hi; lo /= 2, hi /= 2) {
    if (lo & 1) AddToNode(lo++, bytes);
    if (hi & 1) AddToNode(--hi, bytes);
  }
  Recompute(first, last);
}

int64_t LiveCurve::Max(int begin, int end) const {
  begin = std::max(begin, 0);
  end = std::min(end, size());
  if (begin >= end) return persistent_bytes_;
  // Bottom-up over the canonical cover of [lo, hi). A node's maximum leaves out what was added
  // at its ancestors: once a level up, lo - 1 is an ancestor of every left cover node taken so
  // far and hi of every right one, so their additions join the running maxima level by level.
  int64_t left = kNoPoint, right = kNoPoint;
  int lo = begin + leaves_, hi = end + leaves_;
  for (; lo < hi; lo /= 2, hi /= 2) {
    if (lo & 1) left = std::max(left, max_[lo++]);
    if (hi & 1) right = std::max(right, max_[--hi]);
    left += added_[(lo - 1) / 2];
    right += added_[hi / 2];
  }
  for (int node = (lo - 1) / 2; node >= 1; node /= 2) left += added_[node];
  for (int node = hi / 2; node >= 1; node /= 2) right += added_[node];
  return std::max(left, right);
}

int LiveCurve::LeftmostFitting(int lo, int end, int64_t limit) const {
  // Max(p, end) does not grow with p: binary search for the first p that fits.
  int a = std::max(lo, 0), b = std::max(end, a);
  while (a < b) {
    const int mid = a + (b - a) / 2;
    if (Max(mid, end) <= limit) {
      b = mid;
    } else {
      a = mid + 1;
    }
  }
  return a;
}
// ----- SimulatedTimeline -----

SimulatedTimeline::SimulatedTimeline(const std::vector<MemoryPoint>& points, double horizon_seconds,
                                     int64_t base_bytes)
    : base_bytes_(base_bytes) {
  for (const MemoryPoint& p : points) {
    if (p.time_seconds >= horizon_seconds) break;  // points come in time order
    times_.push_back(p.time_seconds);
    totals_.push_back(p.total_bytes);
  }
  suffix_max_.assign(totals_.size() + 1, std::numeric_limits<int64_t>::min());
  for (int i = static_cast<int>(totals_.size()) - 1; i >= 0; --i) {
    suffix_max_[i] = std::max(suffix_max_[i + 1], totals_[i]);
  }
}

int64_t SimulatedTimeline::MaxFrom(double from) const {
  const size_t i = FirstAtOrAfter(from);
  return std::max(LevelBefore(i), suffix_max_[i]);
}

int64_t SimulatedTimeline::MaxIn(double from, double to) const {
  size_t i = FirstAtOrAfter(from);
  int64_t best = LevelBefore(i);
  for (; i < times_.size() && times_[i] <= to; ++i) best = std::max(best, totals_[i]);
  return best;
}

size_t SimulatedTimeline::FirstAtOrAfter(double t) const {
  return std::lower_bound(times_.begin(), times_.end(), t) - times_.begin();
}

// ----- Acceptable -----

bool Acceptable(const SimResult& input, const SimResult& output, int64_t budget_bytes,
                double slowdown_tolerance) {
  const bool fits = budget_bytes <= 0 || output.peak_device_bytes <= budget_bytes;
  if (!fits) return false;
  const bool input_fits = budget_bytes <= 0 || input.peak_device_bytes <= budget_bytes;
  if (!input_fits) return true;  // a schedule that fits beats one that does not
  return output.step_seconds <= input.step_seconds * (1 + slowdown_tolerance);
}

}  // namespace dc::rewriter_internal
