#include "analyzer/profile.h"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include "analyzer/limits.h"
#include "machine/intervals.h"
#include "schemas/digest.h"

namespace dc {
namespace {

using analyzer_internal::IntersectionLength;
using analyzer_internal::Median;
using analyzer_internal::TotalLength;
using analyzer_internal::UnionOf;
using NsInterval = analyzer_internal::Interval<int64_t>;

constexpr double kSecondsPerNs = 1e-9;

double Seconds(int64_t ns) { return static_cast<double>(ns) * kSecondsPerNs; }

// A rank's step window.
struct Window {
  int step = 0;
  int64_t start_ns = 0, end_ns = 0;
};

// Which (rank, step) pairs are warm-up, and the measured windows of each rank.
class StepIndex {
 public:
  explicit StepIndex(const std::vector<Trace::StepRow>& steps) {
    for (const Trace::StepRow& s : steps) {
      if (s.warmup) {
        warmup_.insert({s.global_pid, s.step});
      } else {
        measured_[s.global_pid].push_back({s.step, s.start_ns, s.end_ns});
      }
    }
    for (auto& [pid, windows] : measured_) {
      std::sort(windows.begin(), windows.end(),
                [](const Window& a, const Window& b) { return a.start_ns < b.start_ns; });
    }
  }
  bool IsWarmup(int64_t global_pid, int step) const { return warmup_.contains({global_pid, step}); }
  bool empty() const { return warmup_.empty() && measured_.empty(); }
  const std::map<int64_t, std::vector<Window>>& measured() const { return measured_; }

 private:
  std::set<std::pair<int64_t, int>> warmup_;
  std::map<int64_t, std::vector<Window>> measured_;
};

// ----- costs -----

StatusOr<CostSamples> CollectSamples(const Trace& trace, const proto::Schedule& schedule,
                                     const StepIndex& steps) {
  CostSamples samples;
  samples.op_seconds.resize(schedule.program().ops_size());
  Status bad = Status::Ok();
  DC_RETURN_IF_ERROR(trace.ForEachInstructionSample([&](const Trace::InstructionSample& s) {
    if (steps.IsWarmup(s.global_pid, s.step) || !bad.ok()) return;
    if (s.instruction < 0 || s.instruction >= schedule.instructions_size()) {
      bad = Status::Error(trace.path() + ": TC_INSTRUCTION_MAP names instruction " +
                          std::to_string(s.instruction) + ", beyond the embedded schedule's " +
                          std::to_string(schedule.instructions_size()));
      return;
    }
    const proto::Instruction& instr = schedule.instructions(s.instruction);
    const double seconds = Seconds(s.end_ns - s.start_ns);
    switch (instr.kind()) {
      case proto::INSTR_COMPUTE:
        if (instr.op() >= 0 && instr.op() < schedule.program().ops_size()) {
          samples.op_seconds[instr.op()].push_back(seconds);
        }
        break;
      case proto::INSTR_ALL_GATHER:
        samples.all_gather.push_back({s.bytes, seconds});
        break;
      case proto::INSTR_REDUCE_SCATTER:
        samples.reduce_scatter.push_back({s.bytes, seconds});
        break;
      case proto::INSTR_RELOAD:
        samples.host_to_device.push_back({s.bytes, seconds});
        break;
      case proto::INSTR_OFFLOAD:
        samples.device_to_host.push_back({s.bytes, seconds});
        break;
      default:
        break;
    }
  }));
  DC_RETURN_IF_ERROR(bad);
  return samples;
}

// The flops rate of the measured ops, for the roofline of unmeasured ones.
void EstimateFlopsRate(const proto::Program& program, CostModel* costs) {
  double flops = 0, seconds = 0;
  for (int op = 0; op < program.ops_size(); ++op) {
    if (costs->op_seconds[op] <= 0 || program.ops(op).flops() <= 0) continue;
    flops += program.ops(op).flops();
    seconds += costs->op_seconds[op];
  }
  if (flops > 0 && seconds > 0) costs->flops_per_second = flops / seconds;
}

void Fit(const char* name, const std::vector<CostSample>& samples, LinearCost* cost,
         std::vector<std::string>* notes) {
  if (samples.empty()) {
    notes->push_back(std::string("no ") + name + " samples: its cost keeps the default");
    return;
  }
  *cost = FitLinearCost(samples);
}

void FitCollectives(const CostSamples& samples, CostModel* costs, std::vector<std::string>* notes) {
  const CollectiveCosts fit = FitCollectiveCosts(samples.all_gather, samples.reduce_scatter);
  auto take = [&](const char* name, const std::vector<CostSample>& kind_samples,
                  const LinearCost& cost, bool pooled, LinearCost* out) {
    if (kind_samples.empty()) {
      notes->push_back(std::string("no ") + name + " samples: its cost keeps the default");
      return;
    }
    *out = cost;
    if (pooled) {
      notes->push_back(std::string(name) +
                       " samples all move the same bytes: its latency is the fit's over "
                       "all-gathers and reduce-scatters together");
    }
  };
  take("all_gather", samples.all_gather, fit.all_gather, fit.all_gather_pooled, &costs->all_gather);
  take("reduce_scatter", samples.reduce_scatter, fit.reduce_scatter, fit.reduce_scatter_pooled,
       &costs->reduce_scatter);
}

Status FitCosts(const Trace& trace, const StepIndex& steps, Profile* profile) {
  const proto::Schedule& schedule = *trace.schedule();
  DC_ASSIGN_OR_RETURN(CostSamples samples, CollectSamples(trace, schedule, steps));
  CostModel& costs = profile->costs;
  costs.op_seconds.assign(schedule.program().ops_size(), -1);
  int unmeasured = 0;
  for (size_t op = 0; op < samples.op_seconds.size(); ++op) {
    if (samples.op_seconds[op].empty()) {
      ++unmeasured;
    } else {
      costs.op_seconds[op] = Median(samples.op_seconds[op]);
    }
  }
  if (unmeasured > 0) {
    profile->notes.push_back(std::to_string(unmeasured) +
                             " ops never ran in a measured step: their time is a roofline "
                             "estimate");
  }
  EstimateFlopsRate(schedule.program(), &costs);
  FitCollectives(samples, &costs, &profile->notes);
  Fit("reload", samples.host_to_device, &costs.host_to_device, &profile->notes);
  Fit("offload", samples.device_to_host, &costs.device_to_host, &profile->notes);
  return Status::Ok();
}

}  // namespace

StatusOr<CostSamples> CollectCostSamples(const Trace& trace) {
  if (!trace.schedule()) return Status::Error(trace.path() + ": no schedule: not a dc trace");
  return CollectSamples(trace, *trace.schedule(), StepIndex(trace.Steps()));
}

namespace {

// ----- overlap -----

struct RankActivities {
  std::vector<NsInterval> compute, communication, copy;
  int64_t first_ns = 0, last_ns = 0;
  bool any = false;
};

StatusOr<std::map<int64_t, RankActivities>> ActivitiesByRank(const Trace& trace) {
  std::map<int64_t, RankActivities> by_rank;
  DC_RETURN_IF_ERROR(trace.ForEachActivity([&](const Activity& a) {
    RankActivities& r = by_rank[a.global_pid];
    const NsInterval span{a.start_ns, a.end_ns};
    if (a.type == Activity::Type::kMemcpy || a.type == Activity::Type::kMemset) {
      r.copy.push_back(span);
    } else if (a.communication) {
      r.communication.push_back(span);
    } else {
      r.compute.push_back(span);
    }
    r.first_ns = r.any ? std::min(r.first_ns, a.start_ns) : a.start_ns;
    r.last_ns = r.any ? std::max(r.last_ns, a.end_ns) : a.end_ns;
    r.any = true;
  }));
  return by_rank;
}

std::vector<NsInterval> Clip(const std::vector<NsInterval>& disjoint, const Window& w) {
  std::vector<NsInterval> clipped;
  for (const NsInterval& i : disjoint) {
    const int64_t lo = std::max(i.start, w.start_ns), hi = std::min(i.end, w.end_ns);
    if (hi > lo) clipped.push_back({lo, hi});
  }
  return clipped;
}

StepOverlap OverlapIn(int64_t global_pid, const Window& w, const std::vector<NsInterval>& compute,
                      const std::vector<NsInterval>& communication,
                      const std::vector<NsInterval>& copy) {
  const std::vector<NsInterval> c = Clip(compute, w), n = Clip(communication, w), m = Clip(copy, w);
  std::vector<NsInterval> all = c;
  all.insert(all.end(), n.begin(), n.end());
  all.insert(all.end(), m.begin(), m.end());
  const int64_t overlap_ns = IntersectionLength(c, n);
  StepOverlap o;
  o.global_pid = global_pid;
  o.step = w.step;
  o.span_seconds = Seconds(w.end_ns - w.start_ns);
  o.compute_seconds = Seconds(TotalLength(c));
  o.communication_seconds = Seconds(TotalLength(n));
  o.overlap_seconds = Seconds(overlap_ns);
  o.exposed_communication_seconds = Seconds(TotalLength(n) - overlap_ns);
  o.copy_seconds = Seconds(TotalLength(m));
  o.idle_seconds = Seconds(w.end_ns - w.start_ns - TotalLength(UnionOf(std::move(all))));
  return o;
}

Status ComputeOverlap(const Trace& trace, const StepIndex& steps, Profile* profile) {
  DC_ASSIGN_OR_RETURN(auto by_rank, ActivitiesByRank(trace));
  for (auto& [pid, r] : by_rank) {
    std::vector<Window> windows;
    if (steps.empty()) {
      windows.push_back({0, r.first_ns, r.last_ns});  // no steps: the whole capture
    } else if (auto it = steps.measured().find(pid); it != steps.measured().end()) {
      windows = it->second;
    }
    const std::vector<NsInterval> compute = UnionOf(std::move(r.compute));
    const std::vector<NsInterval> communication = UnionOf(std::move(r.communication));
    const std::vector<NsInterval> copy = UnionOf(std::move(r.copy));
    for (const Window& w : windows) {
      profile->overlap.push_back(OverlapIn(pid, w, compute, communication, copy));
    }
  }
  std::sort(profile->overlap.begin(), profile->overlap.end(),
            [](const StepOverlap& a, const StepOverlap& b) {
              return a.global_pid < b.global_pid ||
                     (a.global_pid == b.global_pid && a.step < b.step);
            });
  return Status::Ok();
}

// ----- memory -----

std::vector<std::string> MemoryKinds(const Trace& trace, const std::vector<MemoryEvent>& events) {
  std::vector<std::string> kinds;
  if (trace.source() == TraceSource::kDc) {
    for (int k = 0; k < kNumBufferKinds; ++k) {
      kinds.push_back(BufferKindName(static_cast<BufferKind>(k)));
    }
  }
  std::set<std::string> extra;
  for (const MemoryEvent& e : events) {
    if (std::find(kinds.begin(), kinds.end(), e.kind) == kinds.end()) extra.insert(e.kind);
  }
  kinds.insert(kinds.end(), extra.begin(), extra.end());
  return kinds;
}

struct LiveBuffer {
  int64_t bytes = 0;
  size_t kind = 0;
};

StatusOr<MemoryTimeline> BuildTimeline(const Trace& trace, const std::vector<MemoryEvent>& events) {
  const Status overflow = Status::Error(
      trace.path() +
      ": live device memory passes 4 EiB; the trace's byte counts are corrupt, record it again");
  MemoryTimeline timeline;
  timeline.kinds = MemoryKinds(trace, events);
  std::map<std::string, size_t> kind_index;
  for (size_t k = 0; k < timeline.kinds.size(); ++k) kind_index[timeline.kinds[k]] = k;

  // Buffers freed but never seen allocated were live before the capture.
  std::vector<int64_t> level(timeline.kinds.size(), 0);
  {
    std::set<int64_t> live;
    for (const MemoryEvent& e : events) {
      if (e.alloc) {
        live.insert(e.address);
      } else if (live.erase(e.address) == 0 && !AddLiveBytes(&level[kind_index[e.kind]], e.bytes)) {
        return overflow;
      }
    }
  }
  MemoryTimeline::Point point{0, 0, level};
  for (int64_t bytes : level) {
    if (!AddLiveBytes(&point.total_bytes, bytes)) return overflow;
  }
  timeline.peak_by_kind = point.bytes_by_kind;
  timeline.peak_bytes = point.total_bytes;
  std::unordered_map<int64_t, LiveBuffer> live;
  bool overflowed = false;
  auto apply = [&](size_t kind, int64_t delta) {
    overflowed = overflowed || !AddLiveBytes(&point.bytes_by_kind[kind], delta) ||
                 !AddLiveBytes(&point.total_bytes, delta);
  };
  for (size_t i = 0; i < events.size();) {
    point.ts_ns = events[i].ts_ns;
    for (; i < events.size() && events[i].ts_ns == point.ts_ns; ++i) {
      const MemoryEvent& e = events[i];
      auto it = live.find(e.address);
      if (it != live.end()) {  // a free, or a new buffer at a live address: the old one is gone
        apply(it->second.kind, -it->second.bytes);
        live.erase(it);
      } else if (!e.alloc) {
        apply(kind_index[e.kind], -e.bytes);  // made before the capture
      }
      if (e.alloc) {
        live[e.address] = {e.bytes, kind_index[e.kind]};
        apply(kind_index[e.kind], e.bytes);
      }
    }
    if (overflowed) return overflow;
    timeline.points.push_back(point);
    if (point.total_bytes > timeline.peak_bytes) {
      timeline.peak_bytes = point.total_bytes;
      timeline.peak_ts_ns = point.ts_ns;
      timeline.peak_by_kind = point.bytes_by_kind;
    }
  }
  return timeline;
}

Status ComputeMemory(const Trace& trace, Profile* profile) {
  if (trace.ranks().empty()) return Status::Ok();
  const int64_t first_pid = trace.ranks().front().global_pid;
  std::vector<MemoryEvent> events;
  DC_RETURN_IF_ERROR(trace.ForEachMemoryEvent([&](const MemoryEvent& e) {
    if (e.global_pid == first_pid) events.push_back(e);
  }));
  DC_ASSIGN_OR_RETURN(profile->memory, BuildTimeline(trace, events));
  return Status::Ok();
}

// ----- steps -----

void ComputeStepTimes(const Trace& trace, Profile* profile) {
  std::map<int, std::pair<int64_t, int64_t>> span_by_step;  // step -> (first start, last end)
  for (const Trace::StepRow& s : trace.Steps()) {
    if (s.warmup) continue;
    auto [it, inserted] = span_by_step.try_emplace(s.step, s.start_ns, s.end_ns);
    if (!inserted) {
      it->second.first = std::min(it->second.first, s.start_ns);
      it->second.second = std::max(it->second.second, s.end_ns);
    }
  }
  std::vector<double> seconds;
  for (const auto& [step, span] : span_by_step)
    seconds.push_back(Seconds(span.second - span.first));
  profile->steps_measured = static_cast<int>(seconds.size());
  profile->step_seconds_median = Median(seconds);
}

}  // namespace

StatusOr<Profile> BuildProfile(const Trace& trace) {
  Profile profile;
  profile.trace_path = trace.path();
  if (!trace.ranks().empty()) profile.world_size = trace.ranks().front().world_size;
  profile.costs.serial_streams = !trace.ranks().empty() && trace.ranks().front().backend == "cpu";
  const StepIndex steps(trace.Steps());
  if (trace.schedule() && steps.measured().empty()) {
    // Without a measured step there are no costs and no step time: a plan from it would be a
    // guess that looks like a measurement.
    return Status::Error(trace.path() + ": no measured step in TC_STEP (" +
                         std::to_string(trace.Steps().size()) +
                         " usable step row(s), all warm-up or none); the recording did not "
                         "finish a step, re-record it with dc-collect (more --steps than "
                         "--warmup)");
  }
  if (trace.schedule()) {
    DC_RETURN_IF_ERROR(FitCosts(trace, steps, &profile));
  } else {
    profile.notes.push_back("no program in the trace (an nsys export): no per-op costs");
  }
  DC_RETURN_IF_ERROR(ComputeOverlap(trace, steps, &profile));
  DC_RETURN_IF_ERROR(ComputeMemory(trace, &profile));
  ComputeStepTimes(trace, &profile);
  for (const std::string& note : trace.notes()) profile.notes.push_back(note);
  for (const SkippedRecords& skipped : trace.skipped()) profile.skipped.push_back(skipped);
  profile.digest = Sha256Hex(CostModelText(profile.costs));
  return profile;
}

}  // namespace dc
