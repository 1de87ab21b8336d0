#include "rewriter/dc_prefetch.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <limits>

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

bool OnComputeStream(const proto::Schedule& schedule, int i) {
  return schedule.instructions(i).stream() == proto::STREAM_COMPUTE;
}

// Deps of gather `g` that are not issue points: on other streams.
std::vector<int> KeptDeps(const proto::Schedule& schedule, int g) {
  std::vector<int> kept;
  for (int d : schedule.instructions(g).deps()) {
    if (!OnComputeStream(schedule, d)) kept.push_back(d);
  }
  return kept;
}

// The input with every all-gather issued right before its place in the stream (after the
// compute-stream instruction before it): DeepCompile's profile of the graph before prefetch.
Status NoPrefetch(const proto::Schedule& in, const GatherIndex& index, proto::Schedule* out) {
  ScheduleEditor editor(in, out);
  for (int i = 0; i < in.instructions_size(); ++i) {
    proto::Instruction* instr = editor.Keep(i);
    if (instr->kind() != proto::INSTR_ALL_GATHER) continue;
    const std::vector<int> kept = KeptDeps(in, i);
    instr->clear_deps();
    const int issue = index.ComputeStreamBefore(i);
    if (issue >= 0) instr->add_deps(issue);
    for (int d : kept) instr->add_deps(d);
  }
  return editor.Finish();
}

// A fused all-gather group and where it is issued: after instruction `after` (a compute-stream
// instruction or an all-gather node of the walk), or at the start of its segment (after = -1,
// `segment_first` its first node).
struct Group {
  std::vector<int> gathers;
  int after = -1;
  int segment_first = -1;
};

class DcPrefetchPlanner {
 public:
  DcPrefetchPlanner(const proto::Schedule& schedule, const CostModel& costs,
                    const GatherIndex& index, const LiveCurve& profile,
                    const DcPrefetchOptions& options)
      : schedule_(schedule),
        costs_(costs),
        index_(index),
        options_(options),
        bytes_(rewriter_internal::TensorBytes(schedule.program())) {
    const int n = schedule.instructions_size();
    peak_.assign(n, 0);
    // Nodes: compute-stream instructions and consumed all-gathers, keyed by segment.
    int key_micro = 0, key_phase = 0;
    for (int i = 0; i < n; ++i) {
      const proto::Instruction& instr = schedule.instructions(i);
      int use = -1;
      if (instr.kind() == proto::INSTR_ALL_GATHER) {
        use = index.FirstUse(i);
        if (use < 0) continue;
      } else if (instr.stream() != proto::STREAM_COMPUTE) {
        continue;
      }
      const proto::Instruction& keyed = use >= 0 ? schedule.instructions(use) : instr;
      int micro = key_micro, phase = key_phase;
      if (keyed.kind() == proto::INSTR_COMPUTE) {
        micro = keyed.micro_step();
        phase = schedule.program().ops(keyed.op()).phase();
      }
      if (use < 0) key_micro = micro, key_phase = phase;  // releases inherit the last compute's
      if (segments_.empty() || micro != segment_micro_ || phase != segment_phase_) {
        segments_.emplace_back();
        segment_micro_ = micro;
        segment_phase_ = phase;
      }
      segments_.back().push_back(i);
      // Peak while the node runs: until the next compute-stream instruction starts.
      const int next_slot = index.compute_stream_before[i] + (OnComputeStream(schedule, i) ? 1 : 0);
      const int until = next_slot < static_cast<int>(index.compute_stream.size())
                            ? profile.PointOf(index.compute_stream[next_slot])
                            : profile.size();
      peak_[i] = profile.Max(profile.PointOf(i), std::max(until, profile.PointOf(i) + 1));
    }
  }

  std::vector<Group> Plan(int64_t max_mem) const {
    std::vector<Group> groups;
    for (const std::vector<int>& nodes : segments_) PlanSegment(nodes, max_mem, &groups);
    for (Group& group : groups) std::sort(group.gathers.begin(), group.gathers.end());
    return groups;
  }

  Status Emit(const std::vector<Group>& groups, proto::Schedule* out) const {
    const int n = schedule_.instructions_size();
    int next_bucket = 1;
    for (const auto& instr : schedule_.instructions()) {
      next_bucket = std::max(next_bucket, instr.bucket() + 1);
    }
    std::vector<int> group_at(n, -1);
    std::vector<char> member(n, 0);
    for (size_t g = 0; g < groups.size(); ++g) {
      group_at[groups[g].gathers.front()] = static_cast<int>(g);
      for (int m : groups[g].gathers) member[m] = 1;
    }
    ScheduleEditor editor(schedule_, out);
    for (int i = 0; i < n; ++i) {
      if (!member[i]) {
        editor.Keep(i);
        continue;
      }
      if (group_at[i] < 0) continue;  // merged into its group's instruction
      const Group& group = groups[group_at[i]];
      const proto::Instruction& first = schedule_.instructions(i);
      proto::Instruction* fused = editor.AddMerged(group.gathers);
      fused->set_kind(proto::INSTR_ALL_GATHER);
      fused->set_stream(first.stream());
      fused->set_micro_step(first.micro_step());
      fused->set_op(-1);
      if (group.gathers.size() > 1) fused->set_bucket(next_bucket++);
      int issue = -1;
      if (group.after >= 0) {
        issue = OnComputeStream(schedule_, group.after) ? group.after
                                                        : index_.ComputeStreamBefore(group.after);
      } else {
        issue = index_.ComputeStreamBefore(group.segment_first);
      }
      if (issue >= 0) fused->add_deps(issue);
      for (int m : group.gathers) {
        for (int t : schedule_.instructions(m).tensors()) fused->add_tensors(t);
        for (int d : KeptDeps(schedule_, m)) fused->add_deps(d);
        // Never before the params' previous copies are released.
        for (const auto& [param, span] : index_.opened[m]) {
          if (span == 0) continue;
          const int release = index_.spans_by_param[param][span - 1].release;
          if (release >= 0) fused->add_deps(release);
        }
      }
    }
    return editor.Finish();
  }

 private:
  int64_t GroupBytes(const std::vector<int>& gathers) const {
    int64_t total = 0;
    for (int g : gathers) {
      for (int t : schedule_.instructions(g).tensors()) total += bytes_[t];
    }
    return total;
  }
  double Predict(int64_t bytes) const { return costs_.all_gather.Seconds(bytes); }

  // prefetch.py's reverse walk over one graph.
  void PlanSegment(const std::vector<int>& nodes, int64_t max_mem,
                   std::vector<Group>* groups) const {
    std::vector<int> open;                // prefetch_ags
    std::deque<std::vector<int>> closed;  // prefetch_ag_groups, oldest first
    int64_t pending = 0;                  // ag_tensor_size_sum
    for (int i = static_cast<int>(nodes.size()) - 1; i >= 0; --i) {
      const int node = nodes[i];
      // Before the first node sit the graph's placeholders, whose profile is empty.
      const int64_t next_peak = i > 0 ? peak_[nodes[i - 1]] : 0;
      std::vector<std::vector<int>> launched_here;
      while (next_peak + pending > max_mem || pending > options_.max_buffered_bytes) {
        if (!closed.empty()) {
          pending -= GroupBytes(closed.front());
          launched_here.push_back(std::move(closed.front()));
          closed.pop_front();
        } else if (!open.empty()) {
          closed.push_back(std::move(open));
          open.clear();
        } else {
          break;
        }
      }
      // Launched in program order after `node`: the last launched (earliest used) first.
      for (auto it = launched_here.rbegin(); it != launched_here.rend(); ++it) {
        groups->push_back({std::move(*it), node, -1});
      }
      if (schedule_.instructions(node).kind() == proto::INSTR_ALL_GATHER) {
        const int64_t current = GroupBytes(open);
        const int64_t size = GroupBytes({node});
        const bool fuse = std::max(Predict(current), Predict(size)) * options_.fuse_factor >
                              Predict(current + size) &&
                          current + size < options_.max_fuse_bytes;
        if (!open.empty() && !fuse) {
          closed.push_back(std::move(open));
          open.clear();
        }
        open.push_back(node);
        pending += size;
      }
      if (i == 0) {
        // At the graph's start: the open group first, then the closed ones, newest first.
        if (!open.empty()) groups->push_back({std::move(open), -1, node});
        for (auto it = closed.rbegin(); it != closed.rend(); ++it) {
          groups->push_back({std::move(*it), -1, node});
        }
      }
    }
  }

  const proto::Schedule& schedule_;
  const CostModel& costs_;
  const GatherIndex& index_;
  const DcPrefetchOptions& options_;
  std::vector<int64_t> bytes_;
  std::vector<std::vector<int>> segments_;
  int segment_micro_ = 0, segment_phase_ = 0;
  std::vector<int64_t> peak_;  // by node
};

}  // namespace

std::string DcPrefetchPass::OptionsText() const {
  char text[256];
  std::snprintf(text, sizeof(text),
                "margin=%.9g max_fuse_bytes=%lld max_buffered_bytes=%lld fuse_factor=%.9g "
                "max_attempts=%d",
                options_.margin, static_cast<long long>(options_.max_fuse_bytes),
                static_cast<long long>(options_.max_buffered_bytes), options_.fuse_factor,
                options_.max_attempts);
  return text;
}

StatusOr<bool> DcPrefetchPass::Run(proto::Schedule* schedule, const PassContext& context) {
  if (!context.costs) return Status::Error("dc-prefetch needs a cost model");
  SimOptions quick;
  quick.memory_timeline = false;
  const GatherIndex index = rewriter_internal::IndexGathers(*schedule);
  google::protobuf::Arena arena;
  proto::Schedule* profiled = rewriter_internal::ScheduleShell(schedule, &arena);
  DC_RETURN_IF_ERROR(NoPrefetch(*schedule, index, profiled));
  DC_ASSIGN_OR_RETURN(SimResult profile_sim, SimulateIn(context, *profiled, quick));
  DC_ASSIGN_OR_RETURN(LiveCurve profile, LiveCurve::Build(*profiled, profile_sim));
  const DcPrefetchPlanner planner(*profiled, *context.costs, index, profile, options_);
  proto::Schedule* candidate = rewriter_internal::ScheduleShell(schedule, &arena);

  const int64_t budget = context.budget_bytes;
  int64_t max_mem = budget > 0
                        ? static_cast<int64_t>(static_cast<double>(budget) * (1 - options_.margin))
                        : kUnlimitedBytes;
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    DC_RETURN_IF_ERROR(planner.Emit(planner.Plan(max_mem), candidate));
    DC_ASSIGN_OR_RETURN(SimResult output, SimulateIn(context, *candidate, quick));
    if (budget <= 0 || output.peak_device_bytes <= budget) {
      *schedule->mutable_instructions() = candidate->instructions();
      return true;
    }
    max_mem -= output.peak_device_bytes - budget;
  }
  return false;
}

}  // namespace dc
