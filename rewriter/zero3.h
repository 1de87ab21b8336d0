// The ZeRO-3 baseline: every param sharded evenly over the ranks, all-gathered before its first
// use and released after its last use in forward and again in backward; every grad
// reduce-scattered right after the backward op that produces it (summed into the rank's grad
// shard, which accumulates over micro-steps); activations released after their last use; the
// optimizer step on each rank's shard after the last micro-step.
#pragma once

#include "rewriter/pass.h"

namespace dc {

class Zero3Pass : public Pass {
 public:
  std::string_view name() const override { return "zero3"; }
  // Replaces schedule->instructions with the baseline stream for schedule->program.
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
};

}  // namespace dc
