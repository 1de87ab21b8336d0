#include "rewriter/unshard.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "machine/simulator.h"
#include "rewriter/bridges.h"
#include "rewriter/gather_index.h"
#include "rewriter/live_curve.h"
#include "rewriter/schedule_editor.h"
#include "rewriter/simulation_cache.h"
#include "schemas/effects.h"

namespace dc {
namespace {

using rewriter_internal::Bridge;
using rewriter_internal::GatherIndex;
using rewriter_internal::LiveCurve;

struct Gap {
  Bridge bridge;
  int64_t bytes = 0;
  double saved_seconds = 0;
  double span_seconds = 0;
  int from_point = 0, to_point = 0;  // the param becomes live over [from, to)
  int64_t rank = 0;                  // saved seconds per byte, quantized: larger first
};

// Which fraction of each all-gather's seconds removing it saves: all of them where it is on the
// critical path (its first use waited for it: it ended after the compute stream was ready for
// that use; or the gather stream is the bottleneck: it started the moment the gather before it
// on its stream ended, so everything queued behind it moves up), else only the slowdown it
// inflicts on the compute it overlaps (CostModel::overlap_compute_slowdown - 1 of its
// duration).
std::vector<double> SavedFraction(const proto::Schedule& schedule, const CostModel& costs,
                                  const SimResult& sim, const GatherIndex& index) {
  const double hidden = std::clamp(costs.overlap_compute_slowdown - 1, 0.0, 1.0);
  std::vector<double> fraction(schedule.instructions_size(), 0);
  std::vector<double> stream_end(proto::Stream_MAX + 1, 0);
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    if (instr.kind() != proto::INSTR_ALL_GATHER) continue;
    // Relative tolerance: the times are sums of many durations.
    const double tolerance = 1e-9 * std::max(1.0, sim.end_seconds[i]);
    const bool saturated = sim.start_seconds[i] <= stream_end[instr.stream()] + tolerance;
    stream_end[instr.stream()] = sim.end_seconds[i];
    bool waited_for = false;
    if (const int use = index.FirstUse(i); use >= 0) {
      const int before = index.ComputeStreamBefore(use);
      const double ready = before >= 0 ? sim.end_seconds[before] : 0;
      waited_for = sim.end_seconds[i] > ready + tolerance;
    }
    fraction[i] = saturated || waited_for ? 1.0 : hidden;
  }
  return fraction;
}

// Every gap the options allow, best first.
std::vector<Gap> Candidates(const proto::Schedule& schedule, const CostModel& costs,
                            const SimResult& sim, const GatherIndex& index, const LiveCurve& curve,
                            const UnshardOptions& options) {
  const std::vector<int64_t> bytes = rewriter_internal::TensorBytes(schedule.program());
  const std::vector<double> fraction = SavedFraction(schedule, costs, sim, index);
  // What removing `param` from all-gather `gather` saves: the whole call when it is alone,
  // else its bytes' transfer.
  auto saved_seconds = [&](int gather, int param) {
    const proto::Instruction& instr = schedule.instructions(gather);
    const LinearCost& line = costs.all_gather;
    const double transfer =
        line.bandwidth_bytes_per_second > 0
            ? static_cast<double>(bytes[param]) / line.bandwidth_bytes_per_second
            : 0;
    const double latency = instr.tensors_size() == 1 ? line.latency_seconds : 0;
    return fraction[gather] * (latency + transfer);
  };
  std::vector<Gap> gaps;
  for (size_t param = 0; param < index.spans_by_param.size(); ++param) {
    const auto& spans = index.spans_by_param[param];
    for (size_t s = 0; s + 1 < spans.size(); ++s) {
      const int release = spans[s].release;
      const int gather = spans[s + 1].gather;
      if (release < 0 || gather < 0) continue;
      const int micro_before = schedule.instructions(release).micro_step();
      const int micro_after = schedule.instructions(gather).micro_step();
      // Never across the optimizer phase (which reads shards, not gathered params).
      if (micro_before < 0 || micro_after < 0) continue;
      const bool same = micro_before == micro_after;
      if ((same && !options.within_micro_step) || (!same && !options.across_micro_steps)) continue;
      Gap gap;
      gap.bridge = {static_cast<int>(param), static_cast<int>(s)};
      gap.bytes = bytes[param];
      gap.saved_seconds = saved_seconds(gather, static_cast<int>(param));
      gap.from_point = curve.PointOf(release);
      gap.to_point = curve.PointOf(gather);
      gap.span_seconds = std::max(0.0, curve.TimeOf(gap.to_point) - curve.TimeOf(gap.from_point));
      if (gap.bytes <= 0 || gap.saved_seconds <= 0) continue;  // nothing to gain
      gaps.push_back(gap);
    }
  }
  // Seconds saved per byte, on a relative grid fine enough to order what differs and coarse
  // enough that rounding noise in equal ratios does not.
  constexpr double kRatioGrid = 1e6;
  for (Gap& gap : gaps) {
    const double ratio = gap.saved_seconds / static_cast<double>(gap.bytes);
    gap.rank = std::llround(std::log(ratio) * kRatioGrid);
  }
  std::sort(gaps.begin(), gaps.end(), [](const Gap& a, const Gap& b) {
    if (a.rank != b.rank) return a.rank > b.rank;
    if (a.span_seconds != b.span_seconds) return a.span_seconds < b.span_seconds;
    if (a.bridge.param != b.bridge.param) return a.bridge.param < b.bridge.param;
    return a.bridge.span < b.bridge.span;
  });
  return gaps;
}

// The gaps to bridge under `limit` bytes live at any instant.
std::vector<Bridge> Choose(const std::vector<Gap>& gaps, const LiveCurve& base, int64_t limit,
                           int64_t max_kept_bytes) {
  LiveCurve curve = base;
  LiveCurve kept = base.Flat(0);
  std::vector<Bridge> chosen;
  for (const Gap& gap : gaps) {
    if (curve.Max(gap.from_point, gap.to_point) + gap.bytes > limit) continue;
    if (max_kept_bytes > 0 && kept.Max(gap.from_point, gap.to_point) + gap.bytes > max_kept_bytes) {
      continue;
    }
    curve.Add(gap.from_point, gap.to_point, gap.bytes);
    if (max_kept_bytes > 0) kept.Add(gap.from_point, gap.to_point, gap.bytes);
    chosen.push_back(gap.bridge);
  }
  return chosen;
}

}  // namespace

std::string UnshardPass::OptionsText() const {
  char text[256];
  std::snprintf(text, sizeof(text),
                "within_micro_step=%d across_micro_steps=%d max_kept_bytes=%lld max_attempts=%d "
                "slowdown_tolerance=%.9g",
                options_.within_micro_step ? 1 : 0, options_.across_micro_steps ? 1 : 0,
                static_cast<long long>(options_.max_kept_bytes), options_.max_attempts,
                options_.slowdown_tolerance);
  return text;
}

StatusOr<bool> UnshardPass::Run(proto::Schedule* schedule, const PassContext& context) {
  if (!context.costs) return Status::Error("unshard needs a cost model");
  SimOptions quick;
  quick.memory_timeline = false;
  const GatherIndex index = rewriter_internal::IndexGathers(*schedule);
  // Compare with (and plan on) what the input means: gathers after their previous copy's
  // release.
  const bool ordered = rewriter_internal::OrderGathersAfterReleases(index, schedule);
  DC_ASSIGN_OR_RETURN(const SimResult input, InputSimulation(context, *schedule, ordered));
  DC_ASSIGN_OR_RETURN(LiveCurve curve, LiveCurve::Build(*schedule, input));
  const std::vector<Gap> gaps =
      Candidates(*schedule, *context.costs, input, index, curve, options_);
  if (gaps.empty()) return ordered;

  const int64_t budget = context.budget_bytes;
  int64_t limit = budget > 0 ? budget : kUnlimitedBytes;
  google::protobuf::Arena arena;
  proto::Schedule* candidate = rewriter_internal::ScheduleShell(schedule, &arena);
  // A plan slower than its input, or far over the budget, keeps only the better half of its
  // bridges (they are in greedy order, best seconds per byte first) on the next attempt.
  size_t max_bridges = gaps.size();
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    std::vector<Bridge> bridges = Choose(gaps, curve, limit, options_.max_kept_bytes);
    if (bridges.size() > max_bridges) bridges.resize(max_bridges);
    if (bridges.empty()) return ordered;
    DC_RETURN_IF_ERROR(rewriter_internal::ApplyBridges(*schedule, index, bridges, candidate));
    DC_ASSIGN_OR_RETURN(SimResult output, SimulateIn(context, *candidate, quick));
    if (rewriter_internal::Acceptable(input, output, budget, options_.slowdown_tolerance)) {
      *schedule->mutable_instructions() = candidate->instructions();
      return true;
    }
    // Over the budget: plan against a limit lowered by the overshoot. Where the overshoot is
    // as large as half the limit the curve's timing (the input's) is far from the plan's (many
    // bridges shorten the step and move every instant), so halve the bridges instead.
    const int64_t overshoot = output.peak_device_bytes - budget;
    if (budget > 0 && overshoot > 0 && overshoot < limit / 2) {
      limit -= overshoot;
    } else {
      max_bridges = bridges.size() / 2;
    }
  }
  return ordered;
}

}  // namespace dc
