#include "rewriter/offload_all.h"

#include <utility>

#include "rewriter/offload_planner.h"

namespace dc {

using rewriter_internal::AnalyzeLayout;
using rewriter_internal::CostsOf;
using rewriter_internal::Layout;
using rewriter_internal::OffloadPlanner;
using rewriter_internal::SimulateInput;
using rewriter_internal::StatsSummary;

StatusOr<bool> ZeroOffloadPass::Run(proto::Schedule* schedule, const PassContext& context) {
  stats_ = OffloadStats();
  budget_bytes_ = context.budget_bytes;
  const CostModel& costs = CostsOf(context);
  DC_ASSIGN_OR_RETURN(Layout layout, AnalyzeLayout(*schedule));
  if (layout.fragments.empty()) return false;
  DC_ASSIGN_OR_RETURN(SimResult base, SimulateInput(*schedule, costs, layout, &stats_));
  OffloadPlanner::Mode mode;
  mode.minimal = false;
  mode.early_reloads = false;
  OffloadPlanner planner(*schedule, layout, costs, context.budget_bytes, mode, &stats_);
  DC_ASSIGN_OR_RETURN(proto::Schedule out, planner.Run(base));
  *schedule = std::move(out);
  return true;
}

std::string ZeroOffloadPass::Summary() const { return StatsSummary(stats_, budget_bytes_); }

std::unique_ptr<Pass> MakeZeroOffloadPass() { return std::make_unique<ZeroOffloadPass>(); }

}  // namespace dc
