// The memory-plan pass: packs the schedule's static memory plan (rewriter/memory_packer.h) into
// schedule->memory_plan and, since reuse across asynchronous streams is safe only in order,
// makes every instruction that allocates a buffer wait for the instructions on other streams
// that freed the bytes it reuses (ReuseDependencies), so the executor only has to honour deps.
// It takes the packing the offload pass's arena check left in PassContext::packings when that
// is for the same instructions and budget. The pass is not thread-safe.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rewriter/memory_packer.h"
#include "rewriter/pass.h"

namespace dc {

// The orderings a static arena needs on asynchronous streams: (allocating instruction, freeing
// instruction) for each allocation that reuses bytes a buffer freed by an instruction on another
// stream (the same stream orders them already), sorted, without repeats. Needs the schedule's
// memory plan; errors if it does not match the schedule.
StatusOr<std::vector<std::pair<int, int>>> ReuseDependencies(const proto::Schedule& schedule);
// Adds ReuseDependencies to the instructions' deps; `added` (optional) gets how many were new.
Status AddReuseDependencies(proto::Schedule* schedule, int* added);

class MemoryPlanPass : public Pass {
 public:
  explicit MemoryPlanPass(MemoryPlanOptions options = {}) : options_(std::move(options)) {}
  std::string_view name() const override { return "memory-plan"; }
  std::string OptionsText() const override;
  // Fills schedule->memory_plan (and, per the options, adds reuse dependencies). Errors when
  // the arena is over PassContext::budget_bytes, naming the arena, the budget, the live peak
  // and the simulated peak.
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  // Arena against the live and simulated peaks.
  std::string Summary() const override { return summary_; }
  bool NeverSpeedsUp() const override { return true; }
  const MemoryPlanStats& stats() const { return stats_; }
  int64_t simulated_peak_bytes() const { return simulated_peak_bytes_; }
  int reuse_dependencies_added() const { return reuse_dependencies_added_; }

 private:
  MemoryPlanOptions options_;
  MemoryPlanStats stats_;
  int64_t simulated_peak_bytes_ = 0;
  int reuse_dependencies_added_ = 0;
  std::string summary_;
};

std::unique_ptr<Pass> MakeMemoryPlanPass(MemoryPlanOptions options = {});
}  // namespace dc
