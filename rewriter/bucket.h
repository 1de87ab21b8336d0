// The bucket pass: fuses runs of consecutive all-gathers (on the gather stream) and of
// consecutive reduce-scatters (on the reduce stream, within one micro-step) into one
// multi-tensor instruction each, a grouped collective that pays the fitted latency once.
// Releases stay per tensor.
//
// All-gathers: a run grows from its first gather, which keeps its place and issue point; each
// following gather joins when the run stays within the bucket cap, none of its params is
// released between the run's start and itself (their previous copies must be gone), its own
// non-compute deps come before the run, its bytes fit the budget on the editable curve of live
// bytes from the run's start (fusing makes later params live earlier), and the longer transfer
// delays the run's earliest use by no more than the compute stream idles in the window after
// it (time the compute stream spends waiting anyway, i.e. the gather stream was the
// bottleneck and saving its latency is the gain).
// Reduce-scatters: a run is issued where its last member was (after the last grad is
// produced), so the earlier grads stay live until it ends: each joins when the run stays within
// the cap and their longer lives fit the budget on the curve.
//
// The caps are chosen by simulation, one kind at a time: first the gathers' (reduce-scatters
// unfused), then the reduce-scatters' (gathers at their chosen cap). For each kind, caps from
// max_bucket_bytes down, each cap_ratio times smaller, at most candidate_caps of them, are
// planned and simulated until one is slower than the one before (one best cap is assumed); a
// plan within the budget is kept only if it makes the step faster than the best so far
// (fusing for nothing would only make grads live longer). The kinds are apart because what
// suits one rarely suits the other: fused gathers save latency on the critical path, fused
// reduce-scatters hold grads longer, expose a larger tail after the last grad and, sharing the
// links with the gathers, slow those. O(n log n) per candidate plus one simulation.
#pragma once

#include <cstdint>
#include <optional>

#include "rewriter/pass.h"

namespace dc {

struct BucketOptions {
  // The largest bytes of one fused collective, and the caps tried below it.
  int64_t max_bucket_bytes = int64_t{2} << 30;  // 2 GiB
  int candidate_caps = 4;
  double cap_ratio = 4;
  // A run of gathers may delay its earliest use by as much compute-stream idle time as there is
  // in the window of this many times the run's transfer time after that use.
  double idle_window_factor = 4;
  bool all_gathers = true;
  bool reduce_scatters = true;
};

class BucketPass : public Pass {
 public:
  explicit BucketPass(BucketOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "bucket"; }
  std::string OptionsText() const override;
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;

 private:
  BucketOptions options_;
};

}  // namespace dc
