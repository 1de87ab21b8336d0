// `offload-all` (ZeroOffloadPass): ZeRO-3 offload with the step on the GPU (the `zero3-offload`
// policy runs Adam on the host instead: rewriter/host_optimizer.h). Every fragment leaves; every
// reload waits for the end of backward. On the same machinery as dc's `offload`
// (rewriter/offload_plan.h, rewriter/offload_planner.h), so the two compare on equal terms.
#pragma once

#include <memory>
#include <string>

#include "rewriter/offload_plan.h"
#include "rewriter/pass.h"

namespace dc {

// ZeRO-3 offload: every fragment leaves at the start of the step and comes back after the last
// backward, whatever the budget (a budget only adds the waits on offload copies it needs).
class ZeroOffloadPass : public Pass {
 public:
  bool FreesMemory() const override { return true; }
  std::string_view name() const override { return "offload-all"; }
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override;
  const OffloadStats& stats() const { return stats_; }

 private:
  OffloadStats stats_;
  int64_t budget_bytes_ = 0;  // of the last Run
};

std::unique_ptr<Pass> MakeZeroOffloadPass();

}  // namespace dc
