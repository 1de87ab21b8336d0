// The ramp pass: splits the step's first all-gather into gathers that grow, so that only the
// first, small one is exposed. Nothing computes before the step's first gather, so its whole
// transfer is exposed; bucket and unshard make it large (the whole model on a small one: 13 ms
// of a 150 ms step on `small` with 2 cpu ranks). Split into a ramp (a lead of L bytes, then
// pieces capped at 2L, 4L, ... in the order the params are used), each later piece moves while
// the compute of the params before it runs, at the price of one more latency per piece.
//
// Algorithm: leads of half the gather's bytes, a quarter, ... (`halvings` of them) are each
// emitted and simulated; the fastest within the budget that beats the input is kept (step time
// against the lead has one best: the search stops at the first lead slower than the one
// before). Placed after the passes that time and merge gathers (bucket, prefetch, unshard),
// where a communication-bound step shows that the extra latency costs more than the exposure
// saves. Each piece keeps the gather's deps; an instruction that waited for the gather waits
// for the last piece holding a tensor it touches (the last piece where it touches none).
#pragma once

#include <string>

#include "rewriter/pass.h"

namespace dc {

struct RampOptions {
  // Leads tried: the first gather's bytes halved 1 .. halvings times. 0: the pass does nothing.
  int halvings = 4;
};

class RampPass : public Pass {
 public:
  explicit RampPass(RampOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "ramp"; }
  std::string OptionsText() const override;
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override { return summary_; }

 private:
  RampOptions options_;
  std::string summary_;
};

}  // namespace dc
