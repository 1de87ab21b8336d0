// A lower bound on the step time of every schedule of a program under a cost model: no plan, of
// any policy and at any memory budget, simulates (machine/simulator.h) faster. It is a function
// of the program, the world size and the costs alone, so the same bound stands beside every
// policy's prediction and the gap to it is what a better plan could still win at most.
//
// What every schedule the verifier accepts must do (rewriter/verifier.cc, schemas/effects.h):
// run each forward and backward op once per micro-step (a recompute op may instead be a rename,
// which costs nothing) and each optimizer op once, on the compute stream or, as ZeRO-Offload's
// CPU Adam, on the host; gather every param a compute reads at least once (all of them in one
// bucket at best: one latency); reduce-scatter every grad once per micro-step (a collective is
// of one micro-step: at least one latency each). The bound is the largest of:
// - compute: the first gather a compute needs (nothing computes before it), the mandatory
//   compute, and after the last forward or backward op the reduce-scatter of a grad and its
//   param's optimizer step;
// - compute and host optimizer together: the optimizer ops split between the compute stream and
//   the host as evenly as their costs allow (a fractional split, so it is a bound);
// - communication: each collective stream's work, and the rank's links, which an all-gather and
//   a reduce-scatter share (their transfer terms add up);
// - the overlap slowdown: compute that overlaps a collective runs slower, so a step cannot hide
//   all of its communication behind compute for free;
// - with serial streams (the cpu backend), the sum of all of the above work.
// It ignores the budget and the host link (offload costs only where memory forces it), and so
// holds at every budget; the gap is loosest where memory binds. Thread-safe (pure function).
#pragma once

#include <string>

#include "machine/cost_model.h"
#include "schemas/program.h"

namespace dc {

struct StepBound {
  double seconds = 0;  // the bound: the largest term below
  // The terms, each a bound on its own (seconds).
  double compute_seconds = 0;       // first gather + mandatory compute + the last grad's tail
  double compute_host_seconds = 0;  // compute stream and host optimizer, balanced
  double communication_seconds = 0;
  double overlap_seconds = 0;  // communication and compute under the overlap slowdown
  double serial_seconds = 0;   // serial streams only: every resource's work in a row
  std::string binding;         // the term that gives `seconds`: "compute", "communication", ...
};

StepBound StepLowerBound(const proto::Program& program, int world_size, const CostModel& costs);

// The host's time for every optimizer op of `program` (ZeRO-Offload's CPU Adam): a bound on the
// step of any schedule that runs all of them there, which the host stream runs one at a time.
double HostOptimizerSeconds(const proto::Program& program, int world_size, const CostModel& costs);

// How far a predicted step is above its bound, as a share of the bound: step / bound - 1
// ("1.126 s, bound 0.94 s, gap 20%"); 0 where the bound is not positive.
double BoundGap(double step_seconds, double bound_seconds);

}  // namespace dc
