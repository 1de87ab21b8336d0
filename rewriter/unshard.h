// The unshard pass: keeps params gathered across the gaps where the stream would release them
// and gather them again (forward to backward within a micro-step, backward of one micro-step to
// forward of the next), wherever the time-resolved memory timeline has room, so their
// re-gathers disappear. The gain grows with gradient accumulation: a param kept for the whole
// step is gathered once instead of twice per micro-step.
//
// Algorithm: simulate the input once; every gap of every param (its release, then its next
// gather) is a candidate, worth the gather seconds it avoids (from the cost model: the whole
// call when the param is gathered alone, its bytes' transfer when it shares a bucket; counted
// in full where the gather is on the critical path, i.e. its use waited for it or the gather
// stream was saturated, and at CostModel::overlap_compute_slowdown - 1 of it where it hides
// behind compute) and costing its bytes over the instants between the release and the gather.
// Candidates are taken greedily by seconds saved per byte (ties: the shorter gap first, as it
// holds memory for less time) while an editable curve of live bytes plus the param's bytes
// stays within the budget at every instant of the gap. Accepted gaps lose their release and
// gather; computes that waited for a removed gather wait for the one that keeps the param
// live. A param whose every gap is taken is gathered once at its first use in the step and
// released after its last use before the optimizer phase. Then simulate: over the budget (the
// curve's timing is the input's) plans again against a budget lowered by the overshoot, or,
// where the overshoot is half the budget or more (or the plan is slower), with the better half
// of the bridges; after max_attempts the input is kept. O(n log n) per attempt plus one simulation.
#pragma once

#include <cstdint>
#include <optional>

#include "rewriter/pass.h"

namespace dc {

struct UnshardOptions {
  // Which gaps may be bridged: between forward and backward of one micro-step, and between
  // micro-steps (backward of one, forward of the next).
  bool within_micro_step = true;
  bool across_micro_steps = true;
  // At most this many bytes kept gathered by this pass at any instant; 0 = as much as the
  // budget allows (everything, with an unlimited budget).
  int64_t max_kept_bytes = 0;
  // Plans made before the input is kept unchanged (each after a full simulation found the plan
  // over the budget or slower than the input).
  int max_attempts = 8;
  // How much slower than its input a plan may be, as a fraction (0 = never slower).
  double slowdown_tolerance = 0;
};

class UnshardPass : public Pass {
 public:
  explicit UnshardPass(UnshardOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "unshard"; }
  std::string OptionsText() const override;
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;

 private:
  UnshardOptions options_;
};

}  // namespace dc
