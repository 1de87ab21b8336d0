// `dc-offload` (DcOffloadPass): DeepCompile's adaptive rule (offload_adam_states.py) with its
// fixed margin, on a profile without optimizer state, as the paper runs it, over Adam's m and v
// (why not the masters too: DcOffloadPass::Run). On the same machinery as dc's `offload`
// (rewriter/offload_plan.h), so the two compare on equal terms.
#pragma once

#include <memory>
#include <string>

#include "rewriter/offload_plan.h"
#include "rewriter/pass.h"

namespace dc {

struct DcOffloadOptions {
  // DeepCompile's MARGIN: it plans against total_mem = budget × (1 − margin).
  double margin = 0.2;
};

// DeepCompile's rule, on this schedule's memory timeline without optimizer state (the profile
// DeepCompile takes after evicting all of it):
// - Forward (micro-step 0): peak_mem[node] = running max of the profiled peak from the start;
//   at each forward compute, while total_mem − peak_mem[node] − (bytes of fragments still
//   resident) < 0, the next fragment in list order (optimizer op order, m before v) is chosen;
//   the node waits for its offload copy. All chosen offloads start at the head of the step.
// - Backward (last micro-step): peak_mem[node] = running max from the node to the end of
//   backward; after each backward compute, while total_mem > peak_mem[node] + reloaded + next,
//   the next fragment is reloaded there. The rest reload after the last backward.
// No change without a budget. The verifier judges whether the result fits (DeepCompile's rule
// does not look at the whole backward).
class DcOffloadPass : public Pass {
 public:
  bool FreesMemory() const override { return true; }
  explicit DcOffloadPass(DcOffloadOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "dc-offload"; }
  std::string OptionsText() const override;
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override;
  const OffloadStats& stats() const { return stats_; }

 private:
  DcOffloadOptions options_;
  OffloadStats stats_;
  int64_t budget_bytes_ = 0;  // of the last Run
};

std::unique_ptr<Pass> MakeDcOffloadPass(DcOffloadOptions options = {});

}  // namespace dc
