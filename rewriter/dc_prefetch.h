// DeepCompile's rules (DeepSpeed deepspeed/compile/passes/prefetch.py and selective_gather.py,
// as of v0.19.5) reproduced as passes over our schedules, so that the `deepcompile` policy and
// dc's own passes are compared on the same simulator. Every constant of theirs is an option
// here, with their value as the default.
//
// Mapping: one DeepCompile FX graph is one (micro-step, phase) segment of the stream; its nodes
// are the compute-stream instructions and all-gathers of that segment; a node's profiled peak
// is the peak of live bytes while it runs in the no-prefetch version of the input (every
// all-gather issued right before its use), simulated once; total device memory is the budget
// (0: unlimited); the communication predictor is the cost model's all-gather line.
#pragma once

#include <cstdint>
#include <string>

#include "rewriter/pass.h"

namespace dc {

// Proactive prefetching and all-gather fusion (DeepCompile §prefetch). Walks each segment in
// reverse, carrying the all-gathers hoisted above the current node in fusion groups; while the
// previous node's profiled peak plus the pending bytes exceeds (1 - margin) x device memory, or
// the pending bytes exceed max_buffered_bytes, the oldest closed group is issued right after the
// current node; at the segment's start everything left is issued. An all-gather joins the open
// group when max(t(group), t(it)) x fuse_factor > t(group + it) and the group stays below
// max_fuse_bytes. Each group becomes one multi-tensor all-gather (at its first member's place
// in the stream, depending on the compute-stream instruction it is issued after). The decision
// is additive against the pre-prefetch curve, as theirs is. Deviation: when the result does not
// fit the budget on our simulator (DeepCompile would run out of memory), the pass plans again
// with the device memory lowered by the overshoot, up to max_attempts times, then keeps its
// input.
struct DcPrefetchOptions {
  double margin = 0.1;                         // MARGIN
  int64_t max_fuse_bytes = 1'000'000'000;      // MAX_FUSE_SIZE
  int64_t max_buffered_bytes = 4'000'000'000;  // MAX_BUFFERED_SIZE
  double fuse_factor = 1.2;                    // the literal in do_fuse
  int max_attempts = 4;
};

class DcPrefetchPass : public Pass {
 public:
  explicit DcPrefetchPass(DcPrefetchOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "dc-prefetch"; }
  std::string OptionsText() const override;
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;

 private:
  DcPrefetchOptions options_;
};

}  // namespace dc
