#include "rewriter/prefetch.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <optional>

#include "machine/simulator.h"
#include "rewriter/gather_index.h"
#include "rewriter/live_curve.h"
#include "rewriter/schedule_editor.h"
#include "rewriter/simulation_cache.h"
#include "schemas/effects.h"

namespace dc {
namespace {

using rewriter_internal::GatherIndex;
using rewriter_internal::LiveCurve;
using rewriter_internal::ScheduleEditor;

// One all-gather as the planner sees it.
struct Gather {
  int instr = -1;
  int first_use = -1;
  bool movable = false;
  int lo_pos = -1;  // earliest compute-stream position it may be issued after (-1: step start)
  int hi_pos = -1;  // latest: the compute-stream instruction right before it in the stream
  std::vector<int> kept_deps;      // deps that are not issue points (kept as they are)
  std::vector<int> copy_releases;  // releases of its params' previous gathered copies
  std::vector<std::pair<int, int64_t>> releases;  // (release point, bytes), by point
  double latest_end_seconds = 0;                  // the latest finish that delays nothing (chained)
  double seconds = 0;                             // its transfer time
};

class Planner {
 public:
  // Which gathers may move, and between which compute-stream instructions.
  Planner(const proto::Schedule& schedule, const GatherIndex& index)
      : schedule_(schedule), index_(index) {
    int first_optimizer = schedule.instructions_size();
    for (int i = 0; i < schedule.instructions_size(); ++i) {
      if (schedule.instructions(i).micro_step() < 0) {
        first_optimizer = i;
        break;
      }
    }
    for (int i = 0; i < schedule.instructions_size(); ++i) {
      const proto::Instruction& instr = schedule.instructions(i);
      if (instr.kind() != proto::INSTR_ALL_GATHER) continue;
      Gather g;
      g.instr = i;
      g.first_use = index.FirstUse(i);
      int lower = instr.micro_step() < 0 ? first_optimizer - 1 : -1;
      for (int d : instr.deps()) {
        if (schedule.instructions(d).stream() == proto::STREAM_COMPUTE) continue;
        g.kept_deps.push_back(d);
        lower = std::max(lower, d);
      }
      for (const auto& [param, span] : index.opened[i]) {
        if (span == 0) continue;
        const int previous = index.spans_by_param[param][span - 1].release;
        if (previous < 0) continue;
        lower = std::max(lower, previous);
        g.copy_releases.push_back(previous);
        if (schedule.instructions(previous).stream() != proto::STREAM_COMPUTE) {
          g.kept_deps.push_back(previous);
        }
      }
      if (g.first_use >= 0) {
        g.lo_pos = lower < 0 ? -1 : index.compute_stream_before[lower];
        g.hi_pos = index.compute_stream_before[i] - 1;
        g.movable = g.lo_pos <= g.hi_pos;
      }
      gathers_.push_back(std::move(g));
    }
  }

  // The input with every movable gather free to start as soon as the gather stream and its
  // params' previous copies allow: the fastest the gathers can go, whatever the memory.
  Status EmitUnconstrained(proto::Schedule* out) const {
    std::vector<int> issue(gathers_.size(), kKeep);
    for (size_t k = 0; k < gathers_.size(); ++k) {
      if (gathers_[k].movable) issue[k] = kUnconstrained;
    }
    return Emit(issue, out);
  }

  // The timing and memory the plan works against: of the unconstrained stream.
  void SetTiming(const SimResult& sim, const LiveCurve& curve) {
    sim_ = &sim;
    base_ = &curve;
    const std::vector<int64_t> bytes = rewriter_internal::TensorBytes(schedule_.program());
    compute_end_.clear();
    for (int c : index_.compute_stream) compute_end_.push_back(sim.end_seconds[c]);
    for (Gather& g : gathers_) {
      g.seconds = sim.end_seconds[g.instr] - sim.start_seconds[g.instr];
      g.releases.clear();
      for (const auto& [param, span] : index_.opened[g.instr]) {
        const int release = index_.spans_by_param[param][span].release;
        g.releases.emplace_back(release >= 0 ? curve.PointOf(release) : curve.size(), bytes[param]);
      }
      std::sort(g.releases.begin(), g.releases.end());
    }
    // The latest finish of each gather that delays neither its use nor the gathers queued
    // after it on its stream.
    std::vector<double> next_latest_start(proto::Stream_MAX + 1,
                                          std::numeric_limits<double>::infinity());
    for (auto it = gathers_.rbegin(); it != gathers_.rend(); ++it) {
      const int stream = schedule_.instructions(it->instr).stream();
      double latest_end = next_latest_start[stream];
      if (it->first_use >= 0) latest_end = std::min(latest_end, sim.start_seconds[it->first_use]);
      it->latest_end_seconds = latest_end;
      next_latest_start[stream] = latest_end - it->seconds;
    }
  }

  // Chooses an issue position for every gather (-2: kept where it is).
  std::vector<int> Plan(double slack, int max_in_flight, int64_t limit) const {
    LiveCurve curve = *base_;
    // Every movable gather starts out issued as late as possible.
    for (const Gather& g : gathers_) {
      if (!g.movable) continue;
      for (const auto& [release, bytes] : g.releases) {
        curve.Add(curve.PointOf(g.instr), release, -bytes);
        curve.Add(LiveFrom(g.hi_pos), release, bytes);
      }
    }
    std::vector<int> issue(gathers_.size(), kKeep);
    std::vector<int> last_pos(proto::Stream_MAX + 1, -1);  // queue order per stream
    for (size_t k = 0; k < gathers_.size(); ++k) {
      const Gather& g = gathers_[k];
      const int stream = schedule_.instructions(g.instr).stream();
      int lo = std::max(g.lo_pos, last_pos[stream]);
      if (max_in_flight > 0 && static_cast<int>(k) >= max_in_flight) {
        const int ahead = gathers_[k - max_in_flight].first_use;
        if (ahead >= 0) lo = std::max(lo, index_.compute_stream_before[ahead]);
      }
      if (!g.movable || lo > g.hi_pos) {
        // Stays in place: what comes after it on its stream goes after it.
        if (g.movable) {
          for (const auto& [release, bytes] : g.releases) {
            curve.Add(LiveFrom(g.hi_pos), release, -bytes);
            curve.Add(curve.PointOf(g.instr), release, bytes);
          }
        }
        last_pos[stream] = std::max(last_pos[stream], index_.compute_stream_before[g.instr] - 1);
        continue;
      }
      int desired = lo;
      if (slack > 0) {
        const double issue_by = g.latest_end_seconds - slack * g.seconds;
        const int at_or_before =
            static_cast<int>(std::upper_bound(compute_end_.begin(), compute_end_.end(), issue_by) -
                             compute_end_.begin()) -
            1;
        desired = std::clamp(at_or_before, lo, g.hi_pos);
      }
      for (const auto& [release, bytes] : g.releases) {
        curve.Add(LiveFrom(g.hi_pos), release, -bytes);
      }
      const int pos = EarliestFitting(curve, g, desired, limit);
      for (const auto& [release, bytes] : g.releases) curve.Add(LiveFrom(pos), release, bytes);
      issue[k] = pos;
      last_pos[stream] = pos;
    }
    return issue;
  }

  // The input with every movable gather depending on its chosen compute-stream instruction
  // instead of its old issue point (kUnconstrained: on nothing but its kept deps and its
  // params' previous copies' releases). Gathers keep their places in the stream (right before
  // their uses, in the order the gather stream runs them): what moves is when they start.
  Status Emit(const std::vector<int>& issue, proto::Schedule* out) const {
    ScheduleEditor editor(schedule_, out);
    std::vector<int> gather_of(schedule_.instructions_size(), -1);
    for (size_t k = 0; k < gathers_.size(); ++k) {
      if (issue[k] != kKeep) gather_of[gathers_[k].instr] = static_cast<int>(k);
    }
    for (int i = 0; i < schedule_.instructions_size(); ++i) {
      proto::Instruction* instr = editor.Keep(i);
      const int k = gather_of[i];
      if (k < 0) continue;
      const Gather& g = gathers_[k];
      instr->clear_deps();
      if (issue[k] >= 0) instr->add_deps(index_.compute_stream[issue[k]]);
      if (issue[k] == kUnconstrained) {
        for (int d : g.copy_releases) instr->add_deps(d);
      }
      for (int d : g.kept_deps) instr->add_deps(d);
    }
    return editor.Finish();
  }

  static constexpr int kKeep = -2;
  static constexpr int kUnconstrained = -3;

 private:
  // The first point at which a gather issued after compute-stream position `pos` may be live.
  int LiveFrom(int pos) const {
    if (pos < 0) return 0;
    const int c = index_.compute_stream[pos];
    return std::max(base_->PointOf(c) + 1, base_->FirstPointAtOrAfter(sim_->end_seconds[c]));
  }

  // The earliest position in [desired, hi_pos] from which the gather fits under `limit` until
  // its releases; hi_pos when none does (the input is over the budget there already).
  int EarliestFitting(const LiveCurve& curve, const Gather& g, int desired, int64_t limit) const {
    int64_t total = 0;
    for (const auto& [release, bytes] : g.releases) total += bytes;
    const int first_release = g.releases.front().first;
    const int from = LiveFrom(desired);
    if (from >= first_release) return g.hi_pos;
    // Points from which the whole gather is live (until its first release) must fit with all
    // of its bytes.
    const int fitting_point = curve.LeftmostFitting(from, first_release, limit - total);
    int a = desired, b = g.hi_pos;
    if (LiveFrom(b) < fitting_point) return g.hi_pos;
    while (a < b) {
      const int mid = a + (b - a) / 2;
      if (LiveFrom(mid) >= fitting_point) {
        b = mid;
      } else {
        a = mid + 1;
      }
    }
    return a;
  }

  const proto::Schedule& schedule_;
  const GatherIndex& index_;
  const SimResult* sim_ = nullptr;
  const LiveCurve* base_ = nullptr;
  std::vector<double> compute_end_;
  std::vector<Gather> gathers_;
};

}  // namespace

std::string PrefetchPass::OptionsText() const {
  char text[256];
  std::snprintf(text, sizeof(text),
                "hide_slack=%.9g unlimited_hide_slack=%.9g max_gathers_in_flight=%d "
                "max_attempts=%d slowdown_tolerance=%.9g",
                options_.hide_slack, options_.unlimited_hide_slack, options_.max_gathers_in_flight,
                options_.max_attempts, options_.slowdown_tolerance);
  return text;
}

StatusOr<bool> PrefetchPass::Run(proto::Schedule* schedule, const PassContext& context) {
  if (!context.costs) return Status::Error("prefetch needs a cost model");
  // One instruction at a time: nothing can hide behind anything.
  if (context.costs->serial_streams) return false;
  SimOptions quick;
  quick.memory_timeline = false;
  const GatherIndex index = rewriter_internal::IndexGathers(*schedule);
  Planner planner(*schedule, index);
  // Plan against the timing of the fastest the gathers could go: the input's own timing would
  // carry its late issue points into the plan.
  google::protobuf::Arena arena;
  proto::Schedule* unconstrained = rewriter_internal::ScheduleShell(schedule, &arena);
  DC_RETURN_IF_ERROR(planner.EmitUnconstrained(unconstrained));
  DC_ASSIGN_OR_RETURN(SimResult fastest, SimulateIn(context, *unconstrained, quick));
  DC_ASSIGN_OR_RETURN(LiveCurve curve, LiveCurve::Build(*unconstrained, fastest));
  planner.SetTiming(fastest, curve);

  // The input's own simulation, when needed: a plan no slower than the unconstrained stream
  // is no slower than the input.
  std::optional<SimResult> input;
  auto acceptable = [&](const SimResult& output) -> StatusOr<bool> {
    const int64_t budget = context.budget_bytes;
    if (budget > 0 && output.peak_device_bytes > budget) return false;
    if (output.step_seconds <= fastest.step_seconds * (1 + options_.slowdown_tolerance)) {
      return true;
    }
    if (!input) {
      // Judge against what the input means: gathers after their previous copies' release.
      proto::Schedule* ordered = rewriter_internal::ScheduleShell(schedule, &arena);
      *ordered->mutable_instructions() = schedule->instructions();
      rewriter_internal::OrderGathersAfterReleases(index, ordered);
      DC_ASSIGN_OR_RETURN(input, SimulateIn(context, *ordered, quick));
    }
    return rewriter_internal::Acceptable(*input, output, budget, options_.slowdown_tolerance);
  };

  const int64_t budget = context.budget_bytes;
  int64_t limit = budget > 0 ? budget : kUnlimitedBytes;
  double slack = options_.hide_slack;
  if (slack <= 0 && budget <= 0) slack = options_.unlimited_hide_slack;
  proto::Schedule* candidate = unconstrained;  // reused: its instructions are rebuilt
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    const std::vector<int> issue = planner.Plan(slack, options_.max_gathers_in_flight, limit);
    DC_RETURN_IF_ERROR(planner.Emit(issue, candidate));
    DC_ASSIGN_OR_RETURN(SimResult output, SimulateIn(context, *candidate, quick));
    DC_ASSIGN_OR_RETURN(bool accept, acceptable(output));
    if (accept) {
      const bool changed = !rewriter_internal::SameInstructions(*schedule, *candidate);
      *schedule->mutable_instructions() = candidate->instructions();
      return changed;
    }
    if (budget > 0 && output.peak_device_bytes > budget) {
      limit -= output.peak_device_bytes - budget;
    } else {
      slack = slack > 0 ? 2 * slack : options_.unlimited_hide_slack;
    }
  }
  return false;
}

}  // namespace dc
