// What the gather-moving passes (prefetch, bucket, unshard and DeepCompile's rules) share: the
// simulated memory timeline as a curve they can edit incrementally, the gathered spans of every
// param, and an editor that rebuilds an instruction stream with its dependencies renumbered.
// Private to rewriter/: the passes' headers are the public surface.
#pragma once

#include <google/protobuf/arena.h>

#include <cstdint>
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

// Each param's gathered spans in stream order: the all-gather that makes it live, the first
// compute that reads it, and the release that frees it (-1 where absent). Optimizer-phase
// computes read shards, not gathered params, so they are not uses.
struct GatheredSpan {
  int gather = -1;
  int first_use = -1;
  int release = -1;
};

struct GatherIndex {
  std::vector<std::vector<GatheredSpan>> spans_by_param;  // by tensor id; empty for non-params
  std::vector<int> compute_stream;         // indices of compute-stream instructions, in order
  std::vector<int> compute_stream_before;  // by instruction: count of compute-stream ones before it
  // By instruction, for all-gathers: the span each of its tensors opens, as (param, span index).
  std::vector<std::vector<std::pair<int, int>>> opened;

  // The last compute-stream instruction before `instruction`; -1 if none.
  int ComputeStreamBefore(int instruction) const {
    const int n = compute_stream_before[instruction];
    return n == 0 ? -1 : compute_stream[n - 1];
  }
  // The earliest first use of the spans `gather` opens; -1 if none of them is used.
  int FirstUse(int gather) const;
};

GatherIndex IndexGathers(const proto::Schedule& schedule);

// Whole bytes of each tensor as the executor allocates it (TransientBytes), by tensor id.
std::vector<int64_t> TensorBytes(const proto::Program& program);

// Rebuilds an instruction stream from an old one into out->instructions: instructions are
// appended in their new order, keeping their deps in OLD indices; Finish() renumbers them. An
// old instruction may be kept, merged into a new one (several old ones may map to one) or
// dropped, in which case whatever depended on it depends on the targets given instead.
// REQUIRES: `in` and `out` are different schedules.
class ScheduleEditor {
 public:
  ScheduleEditor(const proto::Schedule& in, proto::Schedule* out);

  // Appends a copy of old instruction `old` and maps `old` to it.
  proto::Instruction* Keep(int old);
  // Appends a new instruction (deps in old indices), mapping every old index in `olds` to it.
  proto::Instruction* AddMerged(const std::vector<int>& olds);
  // Drops `old`; its dependents depend on `targets` (old indices) instead.
  void Drop(int old, std::vector<int> targets);

  // Renumbers every dep, sorted and deduplicated. Errors (a pass's own mistake) when an old
  // instruction was neither kept, merged nor dropped, or a dep would not point backwards.
  Status Finish();

 private:
  void Resolve(int old, std::vector<int>* out);

  const proto::Schedule& in_;
  google::protobuf::RepeatedPtrField<proto::Instruction>* out_;
  std::vector<int> new_of_old_;                 // -1: not mapped
  std::vector<int> drop_of_old_;                // index into drop_targets_; -1: not dropped
  std::vector<std::vector<int>> drop_targets_;  // of the dropped old instructions
};

// A copy of `schedule` without its instructions (the other fields) on `arena`, for building
// candidate streams without copying the input's; candidates of one pass share the arena, so
// building and dropping them costs no frees. The shell borrows `schedule`'s program instead of
// copying it: nothing may change the shell's program, and the shell must not outlive
// `schedule`. `schedule` is left as it was (its instructions and program are moved out for the
// copy and back).
proto::Schedule* ScheduleShell(proto::Schedule* schedule, google::protobuf::Arena* arena);

// The last instruction of each stream before `first_optimizer` (the first optimizer-phase
// instruction), in index order: what waits for all of them starts once the forward, the
// backward and every reduce-scatter into the grad shards are done.
std::vector<int> EndOfBackward(const proto::Schedule& schedule, int first_optimizer);

// Replaces `to` with a copy of every field of `from` but its instructions (which a caller
// rebuilding the stream would copy only to clear them).
void CopyAllButInstructions(const proto::Schedule& from, proto::Schedule* to);

// Whether two instruction streams are the same (kind, stream, micro-step, op, tensors, deps,
// bucket of every instruction).
bool SameInstructions(const proto::Schedule& a, const proto::Schedule& b);

// Makes explicit that every all-gather waits for the release of its param's previous gathered
// copy, adding that dep where nothing implies it: the zero3 stream leaves gathers without deps,
// so on parallel streams one could start before the release and hold two copies at once,
// which is not what the stream means. Passes plan on (and compare with) the ordered stream.
// Returns whether a dep was added. REQUIRES: `index` is IndexGathers(*schedule).
bool OrderGathersAfterReleases(const GatherIndex& index, proto::Schedule* schedule);

// Whether `sim` is acceptable against the input's simulation: within the budget (0 = unlimited)
// and, when the input was, no slower than it by more than `slowdown_tolerance` (a fraction).
bool Acceptable(const SimResult& input, const SimResult& output, int64_t budget_bytes,
                double slowdown_tolerance);

// Keeping param `param` gathered across the gap between its spans `span` and `span + 1`: the
// release that ends the first and the gather that opens the second lose it.
struct Bridge {
  int param = -1;
  int span = -1;  // the gap between spans[span] and spans[span + 1]
};

// Writes `in`'s stream with every bridge applied to out->instructions: bridged releases and
// gathers lose the param (and vanish when empty); computes that waited for a removed gather
// wait for the gather that now keeps the param live. REQUIRES: `index` is IndexGathers(in).
Status ApplyBridges(const proto::Schedule& in, const GatherIndex& index,
                    const std::vector<Bridge>& bridges, proto::Schedule* out);

}  // namespace dc::rewriter_internal
