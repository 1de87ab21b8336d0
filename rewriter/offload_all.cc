#include "rewriter/offload_all.h"

#include <utility>

#include "rewriter/offload_planner.h"

namespace dc {

StatusOr<bool> ZeroOffloadPass::Run(proto::Schedule* schedule, const PassContext& context) {
  stats_ = OffloadStats();
  budget_bytes_ = context.budget_bytes;
  const CostModel& costs = rewriter_internal::CostsOf(context);
  DC_ASSIGN_OR_RETURN(rewriter_internal::Layout layout,
                      rewriter_internal::AnalyzeLayout(*schedule));
  if (layout.fragments.empty()) return false;
  DC_ASSIGN_OR_RETURN(SimResult base,
                      rewriter_internal::SimulateInput(*schedule, costs, layout, &stats_));
  // Every fragment, every reload after the backward.
  rewriter_internal::OffloadPlanner::Mode mode;
  mode.minimal = false;
  mode.early_reloads = false;
  rewriter_internal::OffloadPlanner planner(*schedule, layout, costs, context.budget_bytes, mode,
                                            &stats_);
  DC_ASSIGN_OR_RETURN(proto::Schedule out, planner.Run(base));
  *schedule = std::move(out);
  return true;
}

std::string ZeroOffloadPass::Summary() const {
  return rewriter_internal::StatsSummary(stats_, budget_bytes_);
}

std::unique_ptr<Pass> MakeZeroOffloadPass() { return std::make_unique<ZeroOffloadPass>(); }

}  // namespace dc
