// Editing an instruction stream: ScheduleEditor rebuilds one from an old one (instructions kept,
// merged, dropped or inserted) and renumbers every dependency; ScheduleShell and
// CopyAllButInstructions give a pass an output to build into without copying the input's
// instructions; SameInstructions compares two streams; EndOfBackward names what an instruction
// waits for to start after the backward. Private to rewriter/: the passes' headers are the
// public surface.
#pragma once

#include <google/protobuf/arena.h>

#include <vector>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc::rewriter_internal {

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
  // Drops `old`; its dependents depend on `targets` (old indices) instead, and on what precedes
  // `old` on its stream (which waiting for `old` implied).
  void Drop(int old, std::vector<int> targets);

  // Renumbers every dep, sorted and deduplicated. Where an instruction's deps changed (a dropped
  // or merged dep), only the latest dep on each stream is kept: a stream runs in order, so it
  // implies the others, and chains of dropped instructions cannot pile up every earlier
  // instruction as a dep (Llama 3 405B's unshard used to grow 10k deps into 800k). Errors (a
  // pass's own mistake) when an old instruction was neither kept, merged nor dropped, or a dep
  // would not point backwards.
  Status Finish();

 private:
  // Appends what a dependent of old instruction `old` waits for (new indices).
  void Resolve(int old, std::vector<int>* out) const;
  // Sorts `deps` (new indices) and keeps the latest on each stream.
  void LatestPerStream(std::vector<int>* deps) const;

  const proto::Schedule& in_;
  google::protobuf::RepeatedPtrField<proto::Instruction>* out_;
  std::vector<int> new_of_old_;                 // -1: not mapped
  std::vector<int> drop_of_old_;                // index into drop_targets_; -1: not dropped
  std::vector<std::vector<int>> drop_targets_;  // of the dropped old instructions
  // By drop: what a dependent of the dropped instruction waits for (new indices, the latest per
  // stream); filled by Finish in index order, so each is resolved once.
  std::vector<std::vector<int>> drop_waits_;
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

}  // namespace dc::rewriter_internal
