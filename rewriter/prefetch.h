// The prefetch pass: issues every all-gather at a point of the compute stream early enough to
// hide its transfer behind compute, and never so early that the live device bytes at any
// instant of the simulated timeline go over the budget.
//
// An all-gather's issue point is the compute-stream instruction it depends on: it starts when
// the compute stream has finished that instruction and the serial gather stream is free. The
// pass treats an all-gather's compute-stream deps as issue points and replaces them; its other
// deps stay. Gathers keep their places in the stream (right before their uses, in the order the
// gather stream runs them), so what moves is when they start: never before the release of their
// params' previous gathered copies, never into another phase region (a gather of the optimizer
// phase stays there), never after the compute-stream instruction before them.
//
// Algorithm: simulate the input with every gather free of issue points (the fastest the gather
// stream can go, whatever the memory) and take its timing and memory; put every gather's bytes
// on an editable curve of live bytes from its latest issue point; then, gather by gather in
// stream order, choose the earliest issue point that is (a) no earlier than the time rule asks
// for: hide_slack x its transfer time before the latest start that delays neither its use nor
// the gathers queued after it on its stream, (b) at or after the use of the gather
// max_gathers_in_flight places ahead, (c) no earlier than the gather before it on its stream,
// and (d) keeps curve + its bytes within the budget at every point until its release. Then
// simulate the result: over the budget (the curve's timing is the unconstrained stream's),
// plan again against a budget lowered by the overshoot; slower than the input, plan again
// with twice the slack; after max_attempts, keep the input. O(n log n) per attempt plus two or
// three simulations.
#pragma once

#include <optional>

#include "rewriter/pass.h"

namespace dc {

struct PrefetchOptions {
  // Issue each gather at the last point that leaves this many times its transfer time before
  // the time it must start to finish before its use (chained back along the serial gather
  // stream, so a queue of gathers starts early enough as a whole). <= 0: no time rule, as early
  // as the budget allows.
  double hide_slack = 2.0;
  // The time rule's slack when the budget is unlimited and hide_slack <= 0 (otherwise every
  // gather would be issued at the start of the step).
  double unlimited_hide_slack = 2.0;
  // At most this many gathers issued and not yet consumed at any issue point; 0 = unlimited.
  int max_gathers_in_flight = 0;
  // Plans made before the input is kept unchanged (each after a full simulation found the plan
  // over the budget or slower than the input).
  int max_attempts = 4;
  // How much slower than its input a plan may be, as a fraction (0 = never slower).
  double slowdown_tolerance = 0;
};

class PrefetchPass : public Pass {
 public:
  explicit PrefetchPass(PrefetchOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "prefetch"; }
  std::string OptionsText() const override;
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;

 private:
  PrefetchOptions options_;
};

}  // namespace dc
