// DeepCompile's selective gather (deepspeed/compile/passes/selective_gather.py, as of v0.19.5)
// reproduced as a pass over our schedules, mapped as dc-prefetch's header says
// (rewriter/dc_prefetch.h). Every constant of theirs is an option here, with their value as the
// default.
#pragma once

#include <cstdint>
#include <string>

#include "rewriter/pass.h"

namespace dc {

// Selective unsharding (DeepCompile §selective_gather). Candidates are all gathered params,
// sorted by all-gather seconds per byte (the seconds of one micro-step's gathers of the param,
// each alone), descending; available = (1 - margin) x device memory - the simulated peak of the
// input (their profiled transient peak); the longest prefix whose bytes fit is made persistent:
// gathered at its first use in the step and released after its last use before the optimizer
// phase. Deviation as for dc-prefetch: a result over the budget on our simulator lowers the
// available bytes by the overshoot and plans again, up to max_attempts times.
struct DcSelectiveGatherOptions {
  double margin = 0.1;  // MEM_MARGIN
  int max_attempts = 4;
};

class DcSelectiveGatherPass : public Pass {
 public:
  explicit DcSelectiveGatherPass(DcSelectiveGatherOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "dc-selective-gather"; }
  std::string OptionsText() const override;
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;

 private:
  DcSelectiveGatherOptions options_;
};

}  // namespace dc
