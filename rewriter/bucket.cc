#include "rewriter/bucket.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <vector>

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

// Runs of collectives to fuse, each by its members' instruction indices (in stream order).
struct Grouping {
  std::vector<std::vector<int>> gathers;
  std::vector<std::vector<int>> reductions;
  // Runs of more than one.
  int fused_gathers = 0, fused_reductions = 0;
};

// The largest bytes of one fused collective, by kind; 0: that kind is not fused.
struct Caps {
  int64_t gather_bytes = 0, reduction_bytes = 0;
};

class Planner {
 public:
  Planner(const proto::Schedule& schedule, const CostModel& costs, const SimResult& sim,
          const GatherIndex& index, const LiveCurve& curve)
      : schedule_(schedule),
        costs_(costs),
        sim_(sim),
        index_(index),
        base_(curve),
        bytes_(rewriter_internal::TensorBytes(schedule.program())) {
    const int n = schedule.instructions_size();
    instr_bytes_.assign(n, 0);
    dependents_.resize(n);
    int lowest_micro_step = 0, highest_micro_step = 0;
    for (int i = 0; i < n; ++i) {
      const proto::Instruction& instr = schedule.instructions(i);
      for (int t : instr.tensors()) instr_bytes_[i] += bytes_[t];
      for (int d : instr.deps()) dependents_[d].push_back(i);
      lowest_micro_step = std::min(lowest_micro_step, instr.micro_step());
      highest_micro_step = std::max(highest_micro_step, instr.micro_step());
    }
    // Bytes of gathers and of reduce-scatters by micro-step, for LargestRunBytes.
    std::vector<int64_t> gathered(highest_micro_step - lowest_micro_step + 1, 0);
    std::vector<int64_t> reduced(gathered.size(), 0);
    for (int i = 0; i < n; ++i) {
      const proto::Instruction& instr = schedule.instructions(i);
      const size_t m = static_cast<size_t>(instr.micro_step() - lowest_micro_step);
      if (instr.kind() == proto::INSTR_ALL_GATHER) gathered[m] += instr_bytes_[i];
      if (instr.kind() == proto::INSTR_REDUCE_SCATTER) reduced[m] += instr_bytes_[i];
    }
    largest_gather_run_ = *std::max_element(gathered.begin(), gathered.end());
    largest_reduction_run_ = *std::max_element(reduced.begin(), reduced.end());
    // Every candidate cap asks for them again.
    releases_.resize(n);
    first_waiter_.assign(n, std::numeric_limits<int>::max());
    for (int i = 0; i < n; ++i) {
      if (schedule.instructions(i).kind() != proto::INSTR_REDUCE_SCATTER) continue;
      for (int d : dependents_[i]) {
        if (schedule.instructions(d).kind() == proto::INSTR_RELEASE) {
          releases_[i].push_back(d);
          for (int after : dependents_[d]) first_waiter_[i] = std::min(first_waiter_[i], after);
        } else {
          first_waiter_[i] = std::min(first_waiter_[i], d);
        }
      }
    }
    // Compute-stream idle time, cumulative by compute-stream instruction.
    double busy_until = 0, idle = 0;
    for (int c : index.compute_stream) {
      idle += std::max(0.0, sim.start_seconds[c] - busy_until);
      busy_until = std::max(busy_until, sim.end_seconds[c]);
      compute_start_.push_back(sim.start_seconds[c]);
      idle_through_.push_back(idle);
    }
  }

  // The most bytes one run of gathers (reduce-scatters) could fuse: their bytes in the micro-step
  // (or the optimizer phase) that has the most. A larger cap fuses the same runs.
  int64_t LargestRunBytes(proto::InstrKind kind) const {
    return kind == proto::INSTR_ALL_GATHER ? largest_gather_run_ : largest_reduction_run_;
  }

  Grouping Plan(const Caps& caps, int64_t limit, const BucketOptions& options) const {
    scratch_curve_ = base_;  // assigned, not constructed: each candidate reuses its buffers
    Grouping grouping;
    PlanGathers(caps.gather_bytes, limit, options, &scratch_curve_, &grouping);
    PlanReductions(caps.reduction_bytes, limit, &scratch_curve_, &grouping);
    return grouping;
  }

  Status Emit(const Grouping& grouping, proto::Schedule* out) const {
    const int n = schedule_.instructions_size();
    int next_bucket = 1;
    for (const auto& instr : schedule_.instructions()) {
      next_bucket = std::max(next_bucket, instr.bucket() + 1);
    }
    // What to do at each old instruction: lead a gather run, close a reduction run, or skip.
    std::vector<int> gather_run(n, -1), reduction_run(n, -1);
    std::vector<char> skip(n, 0);
    for (size_t r = 0; r < grouping.gathers.size(); ++r) {
      const auto& run = grouping.gathers[r];
      if (run.size() < 2) continue;
      gather_run[run.front()] = static_cast<int>(r);
      for (size_t m = 1; m < run.size(); ++m) skip[run[m]] = 1;
    }
    for (size_t r = 0; r < grouping.reductions.size(); ++r) {
      const auto& run = grouping.reductions[r];
      if (run.size() < 2) continue;
      reduction_run[run.back()] = static_cast<int>(r);
      for (int member : run) {
        skip[member] = 1;
        for (int release : Releases(member)) skip[release] = 1;
      }
    }
    ScheduleEditor editor(schedule_, out);
    for (int i = 0; i < n; ++i) {
      if (gather_run[i] >= 0) {
        EmitRun(grouping.gathers[gather_run[i]], next_bucket++, &editor);
        continue;
      }
      if (reduction_run[i] >= 0) {
        const auto& run = grouping.reductions[reduction_run[i]];
        EmitRun(run, next_bucket++, &editor);
        for (int member : run) {
          for (int release : Releases(member)) editor.Keep(release);
        }
        continue;
      }
      if (!skip[i]) editor.Keep(i);
    }
    return editor.Finish();
  }

 private:
  // One multi-tensor instruction for `run`, at the current end of the new stream.
  void EmitRun(const std::vector<int>& run, int bucket, ScheduleEditor* editor) const {
    const proto::Instruction& first = schedule_.instructions(run.front());
    const proto::Instruction& last = schedule_.instructions(run.back());
    proto::Instruction* fused = editor->AddMerged(run);
    fused->set_kind(first.kind());
    fused->set_stream(first.stream());
    // A gather run is issued where its first member was, a reduction run where its last was.
    const proto::Instruction& anchor = first.kind() == proto::INSTR_ALL_GATHER ? first : last;
    fused->set_micro_step(anchor.micro_step());
    fused->set_op(-1);
    fused->set_bucket(bucket);
    const bool gathers = first.kind() == proto::INSTR_ALL_GATHER;
    for (int member : run) {
      const proto::Instruction& instr = schedule_.instructions(member);
      for (int t : instr.tensors()) fused->add_tensors(t);
      for (int d : instr.deps()) {
        // Later gathers of a run drop their issue points: the run is issued at the first's.
        const bool issue_point = gathers && member != run.front() &&
                                 schedule_.instructions(d).stream() == proto::STREAM_COMPUTE;
        if (!issue_point) fused->add_deps(d);
      }
      if (!gathers) continue;
      // But never before their params' previous copies are released.
      for (const auto& [param, span] : index_.opened[member]) {
        if (span == 0) continue;
        const int release = index_.spans_by_param[param][span - 1].release;
        if (release >= 0) fused->add_deps(release);
      }
    }
  }

  // The releases that wait for reduce-scatter `rs` (its grads' releases).
  const std::vector<int>& Releases(int rs) const { return releases_[rs]; }

  // Compute-stream idle time among instructions starting in (from, to].
  double IdleIn(double from, double to) const {
    auto at = [&](double t) {
      const int k =
          static_cast<int>(std::upper_bound(compute_start_.begin(), compute_start_.end(), t) -
                           compute_start_.begin());
      return k == 0 ? 0.0 : idle_through_[k - 1];
    };
    return at(to) - at(from);
  }

  // Whether gather `g` may join the run that starts at `first`.
  bool CanJoinGathers(int first, int g) const {
    const proto::Instruction& lead = schedule_.instructions(first);
    const proto::Instruction& instr = schedule_.instructions(g);
    if ((lead.micro_step() < 0) != (instr.micro_step() < 0)) return false;
    for (int d : instr.deps()) {
      if (schedule_.instructions(d).stream() != proto::STREAM_COMPUTE && d >= first) return false;
    }
    for (const auto& [param, span] : index_.opened[g]) {
      if (span == 0) continue;
      if (index_.spans_by_param[param][span - 1].release >= first) return false;
    }
    return true;
  }

  void PlanGathers(int64_t cap_bytes, int64_t limit, const BucketOptions& options, LiveCurve* curve,
                   Grouping* grouping) const {
    std::vector<int> last_run(proto::Stream_MAX + 1, -1);  // open run per stream
    std::vector<int64_t> run_bytes(proto::Stream_MAX + 1, 0);
    std::vector<int> run_first_use(proto::Stream_MAX + 1, -1);
    for (int g = 0; g < schedule_.instructions_size(); ++g) {
      const proto::Instruction& instr = schedule_.instructions(g);
      if (instr.kind() != proto::INSTR_ALL_GATHER) continue;
      const int stream = instr.stream();
      const int use = index_.FirstUse(g);
      int& run = last_run[stream];
      if (run >= 0) {
        const int first = grouping->gathers[run].front();
        const int64_t bytes = run_bytes[stream] + instr_bytes_[g];
        int earliest_use = run_first_use[stream];
        if (use >= 0 && (earliest_use < 0 || use < earliest_use)) earliest_use = use;
        // Fusing pays off only through the latency paid once instead of twice.
        bool join =
            costs_.all_gather.latency_seconds > 0 && bytes <= cap_bytes && CanJoinGathers(first, g);
        if (join) {
          const int from = curve->PointOf(first), to = curve->PointOf(g);
          join = curve->Max(from, to) + instr_bytes_[g] <= limit;
        }
        if (join && earliest_use >= 0) {
          const double seconds = costs_.all_gather.Seconds(bytes);
          const double use_at = sim_.start_seconds[earliest_use];
          const double delay = sim_.start_seconds[first] + seconds - use_at;
          join =
              delay <= 0 || delay <= IdleIn(use_at, use_at + options.idle_window_factor * seconds);
        }
        if (join) {
          curve->Add(curve->PointOf(first), curve->PointOf(g), instr_bytes_[g]);
          grouping->gathers[run].push_back(g);
          if (grouping->gathers[run].size() == 2) ++grouping->fused_gathers;
          run_bytes[stream] = bytes;
          run_first_use[stream] = earliest_use;
          continue;
        }
      }
      grouping->gathers.push_back({g});
      run = static_cast<int>(grouping->gathers.size()) - 1;
      run_bytes[stream] = instr_bytes_[g];
      run_first_use[stream] = use;
    }
  }

  void PlanReductions(int64_t cap_bytes, int64_t limit, LiveCurve* curve,
                      Grouping* grouping) const {
    std::vector<int> last_run(proto::Stream_MAX + 1, -1);
    std::vector<int64_t> run_bytes(proto::Stream_MAX + 1, 0);
    std::vector<int> run_release_point(proto::Stream_MAX + 1, 0);
    std::vector<int> run_first_waiter(proto::Stream_MAX + 1, 0);
    for (int rs = 0; rs < schedule_.instructions_size(); ++rs) {
      const proto::Instruction& instr = schedule_.instructions(rs);
      if (instr.kind() != proto::INSTR_REDUCE_SCATTER) continue;
      const int stream = instr.stream();
      const std::vector<int>& releases = Releases(rs);
      int release_point = curve->size();
      for (int r : releases) release_point = std::min(release_point, curve->PointOf(r));
      int& run = last_run[stream];
      if (run >= 0 && !releases.empty()) {
        const std::vector<int>& members = grouping->reductions[run];
        const int64_t bytes = run_bytes[stream] + instr_bytes_[rs];
        // Whatever waits for a member or for its releases (besides those releases) must come
        // after this one, where they move.
        bool join = costs_.reduce_scatter.latency_seconds > 0 && bytes <= cap_bytes &&
                    schedule_.instructions(members.front()).micro_step() == instr.micro_step() &&
                    run_first_waiter[stream] > rs;
        // The run's grads live on until this one's releases.
        const int from = run_release_point[stream];
        if (join) join = curve->Max(from, release_point) + run_bytes[stream] <= limit;
        if (join) {
          curve->Add(from, release_point, run_bytes[stream]);
          grouping->reductions[run].push_back(rs);
          if (grouping->reductions[run].size() == 2) ++grouping->fused_reductions;
          run_bytes[stream] = bytes;
          run_release_point[stream] = release_point;
          run_first_waiter[stream] = std::min(run_first_waiter[stream], first_waiter_[rs]);
          continue;
        }
      }
      grouping->reductions.push_back({rs});
      run = releases.empty() ? -1 : static_cast<int>(grouping->reductions.size()) - 1;
      run_bytes[stream] = instr_bytes_[rs];
      run_release_point[stream] = release_point;
      run_first_waiter[stream] = first_waiter_[rs];
    }
  }

  const proto::Schedule& schedule_;
  const CostModel& costs_;
  const SimResult& sim_;
  const GatherIndex& index_;
  const LiveCurve& base_;
  mutable LiveCurve scratch_curve_;   // what Plan edits
  std::vector<int64_t> bytes_;        // by tensor
  std::vector<int64_t> instr_bytes_;  // by instruction: bytes of its tensors
  int64_t largest_gather_run_ = 0, largest_reduction_run_ = 0;  // LargestRunBytes
  std::vector<std::vector<int>> dependents_;
  std::vector<std::vector<int>> releases_;  // by reduce-scatter: the releases that wait for it
  // By reduce-scatter: the first instruction that waits for it or for its releases (besides
  // the releases); INT_MAX if none.
  std::vector<int> first_waiter_;
  std::vector<double> compute_start_, idle_through_;  // by compute-stream instruction
};

}  // namespace

std::string BucketPass::OptionsText() const {
  char text[256];
  std::snprintf(text, sizeof(text),
                "max_bucket_bytes=%lld candidate_caps=%d cap_ratio=%.9g idle_window_factor=%.9g "
                "all_gathers=%d reduce_scatters=%d",
                static_cast<long long>(options_.max_bucket_bytes), options_.candidate_caps,
                options_.cap_ratio, options_.idle_window_factor, options_.all_gathers ? 1 : 0,
                options_.reduce_scatters ? 1 : 0);
  return text;
}

StatusOr<bool> BucketPass::Run(proto::Schedule* schedule, const PassContext& context) {
  if (!context.costs) return Status::Error("bucket needs a cost model");
  if (options_.cap_ratio <= 1) return Status::Error("bucket: cap_ratio must be above 1");
  SimOptions quick;
  quick.memory_timeline = false;
  const GatherIndex index = rewriter_internal::IndexGathers(*schedule);
  const bool ordered = rewriter_internal::OrderGathersAfterReleases(index, schedule);
  DC_ASSIGN_OR_RETURN(const SimResult input, InputSimulation(context, *schedule, ordered));
  DC_ASSIGN_OR_RETURN(LiveCurve curve, LiveCurve::Build(*schedule, input));
  const Planner planner(*schedule, *context.costs, input, index, curve);

  const int64_t budget = context.budget_bytes;
  const int64_t limit = budget > 0 ? budget : kUnlimitedBytes;
  google::protobuf::Arena arena;
  proto::Schedule* best = nullptr;
  proto::Schedule* candidate = rewriter_internal::ScheduleShell(schedule, &arena);
  proto::Schedule* spare = rewriter_internal::ScheduleShell(schedule, &arena);
  SimResult best_sim = input;
  Caps best_caps;
  // Tries the caps of one kind from max_bucket_bytes (or, where less, the most bytes one run of
  // the kind could fuse, so a model smaller than the cap still tries buckets smaller than
  // itself) down, the other kind's cap as best_caps has it, keeping the fastest plan within the
  // budget that beats best_sim.
  auto search = [&](int64_t Caps::*cap_of_kind, int Grouping::*fused_of_kind,
                    proto::InstrKind kind) -> Status {
    const Caps start = best_caps;
    const double start_seconds = best_sim.step_seconds;
    const int64_t largest = planner.LargestRunBytes(kind);
    if (largest <= 0) return Status::Ok();
    double cap = static_cast<double>(std::min(options_.max_bucket_bytes, largest));
    bool improved = false;
    for (int c = 0; c < options_.candidate_caps; ++c, cap /= options_.cap_ratio) {
      Caps caps = start;
      caps.*cap_of_kind = static_cast<int64_t>(cap);
      const Grouping grouping = planner.Plan(caps, limit, options_);
      if (grouping.*fused_of_kind == 0) break;  // smaller caps fuse no more
      DC_RETURN_IF_ERROR(planner.Emit(grouping, candidate));
      DC_ASSIGN_OR_RETURN(SimResult output, SimulateIn(context, *candidate, quick));
      // Fusing is worth its longer lives only when it makes the step faster.
      const bool fits = budget <= 0 || output.peak_device_bytes <= budget;
      if (!fits || output.step_seconds >= start_seconds) continue;
      // Step time against the cap has one best: past it, smaller caps only get slower.
      if (improved && output.step_seconds >= best_sim.step_seconds) break;
      // Keep this one; build the next in the other shell.
      if (!best) {
        best = candidate;
        candidate = spare;
      } else {
        std::swap(best, candidate);
      }
      best_sim = output;
      best_caps = caps;
      improved = true;
    }
    return Status::Ok();
  };
  // Each kind's cap on its own, gathers first: fused gathers gain by latency on the critical
  // path, fused reduce-scatters hold grads longer and, sharing the links with the gathers,
  // slow those, so the caps that suit one rarely suit the other.
  if (options_.all_gathers) {
    DC_RETURN_IF_ERROR(
        search(&Caps::gather_bytes, &Grouping::fused_gathers, proto::INSTR_ALL_GATHER));
  }
  if (options_.reduce_scatters) {
    DC_RETURN_IF_ERROR(
        search(&Caps::reduction_bytes, &Grouping::fused_reductions, proto::INSTR_REDUCE_SCATTER));
  }
  if (!best) {
    return ordered;
  }
  *schedule->mutable_instructions() = best->instructions();
  return true;
}

}  // namespace dc
