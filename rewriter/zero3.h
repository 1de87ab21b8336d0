// The ZeRO-3 baseline: every param sharded evenly over the ranks, all-gathered before its first
// use and released after its last use in forward and again in backward; every grad
// reduce-scattered right after the backward op that produces it (summed into the rank's grad
// shard, which accumulates over micro-steps); activations released after their last use; the
// optimizer step on each rank's shard after the last micro-step.
//
// Gathers are issued with one op of lookahead, as ZeRO-3's default prefetch bucket gives for
// large layers: a param's gather waits for the compute two ops before its consumer (so it
// overlaps the op just before), and for the release of the param's previous gathered copy.
#pragma once

#include "rewriter/pass.h"

namespace dc {

struct Zero3Options {
  // Ops of lookahead for each all-gather: the gather of op k's params waits for the compute of
  // op k - 1 - lookahead_ops. 0 = gather on demand (fully exposed).
  int lookahead_ops = 1;
};

class Zero3Pass : public Pass {
 public:
  explicit Zero3Pass(Zero3Options options = {}) : options_(options) {}
  std::string_view name() const override { return "zero3"; }
  std::string OptionsText() const override;
  std::string Summary() const override { return summary_; }
  bool BuildsSchedule() const override { return true; }
  // Replaces schedule->instructions with the baseline stream for schedule->program.
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;

 private:
  Zero3Options options_;
  std::string summary_;
};

}  // namespace dc
