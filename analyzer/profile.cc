#include "analyzer/profile.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <unordered_map>

#include "analyzer/limits.h"
#include "machine/estimate.h"
#include "machine/hardware.h"
#include "machine/intervals.h"
#include "machine/simulator.h"
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

// A measured step that took more than this many times the median step stalled (the host ran
// something else: a first step after warm-up on a busy machine took 52.9 ms where the others took
// 9-11): its instructions are left out of the costs, as its time is out of the median.
constexpr double kStalledStepFactor = 2;

// Which (rank, step) pairs are warm-up, the measured windows of each rank, and each measured
// step's span over every rank (first start to last end).
class StepIndex {
 public:
  explicit StepIndex(const std::vector<Trace::StepRow>& steps) {
    std::map<int, std::pair<int64_t, int64_t>> span_by_step;  // step -> (first start, last end)
    for (const Trace::StepRow& s : steps) {
      if (s.warmup) {
        warmup_.insert({s.global_pid, s.step});
        continue;
      }
      measured_[s.global_pid].push_back({s.step, s.start_ns, s.end_ns});
      auto [it, inserted] = span_by_step.try_emplace(s.step, s.start_ns, s.end_ns);
      if (!inserted) {
        it->second.first = std::min(it->second.first, s.start_ns);
        it->second.second = std::max(it->second.second, s.end_ns);
      }
    }
    for (auto& [pid, windows] : measured_) {
      std::sort(windows.begin(), windows.end(),
                [](const Window& a, const Window& b) { return a.start_ns < b.start_ns; });
    }
    for (const auto& [step, span] : span_by_step) {
      step_seconds_.emplace_back(step, Seconds(span.second - span.first));
    }
    std::vector<double> seconds;
    for (const auto& [step, s] : step_seconds_) seconds.push_back(s);
    median_step_seconds_ = seconds.empty() ? 0 : Median(seconds);
    for (const auto& [step, s] : step_seconds_) {
      if (s > kStalledStepFactor * median_step_seconds_) stalled_.insert(step);
    }
  }
  bool IsWarmup(int64_t global_pid, int step) const { return warmup_.contains({global_pid, step}); }
  // Whether a sample of this (rank, step) goes into the costs: measured and not stalled.
  bool Costs(int64_t global_pid, int step) const {
    return !IsWarmup(global_pid, step) && !stalled_.contains(step);
  }
  bool empty() const { return warmup_.empty() && measured_.empty(); }
  const std::map<int64_t, std::vector<Window>>& measured() const { return measured_; }
  // Each measured step's span, by step number.
  const std::vector<std::pair<int, double>>& step_seconds() const { return step_seconds_; }
  double median_step_seconds() const { return median_step_seconds_; }
  const std::set<int>& stalled() const { return stalled_; }

 private:
  std::set<std::pair<int64_t, int>> warmup_;
  std::map<int64_t, std::vector<Window>> measured_;
  std::vector<std::pair<int, double>> step_seconds_;
  double median_step_seconds_ = 0;
  std::set<int> stalled_;
};

// ----- costs -----

// One instruction as a measured step ran it, with how much of it ran beside the other class of
// work on its rank (compute beside collectives, a collective beside compute).
struct TimedSample {
  int64_t global_pid = 0;
  int step = 0;
  int instruction = 0;
  int64_t start_ns = 0, end_ns = 0, bytes = 0;
  double beside_fraction = 0;  // of its span, in [0, 1]
};

StatusOr<std::vector<TimedSample>> ReadSamples(const Trace& trace, const proto::Schedule& schedule,
                                               const StepIndex& steps) {
  std::vector<TimedSample> samples;
  Status bad = Status::Ok();
  DC_RETURN_IF_ERROR(trace.ForEachInstructionSample([&](const Trace::InstructionSample& s) {
    if (!steps.Costs(s.global_pid, s.step) || !bad.ok()) return;
    if (s.instruction < 0 || s.instruction >= schedule.instructions_size()) {
      bad = Status::Error(trace.path() + ": TC_INSTRUCTION_MAP names instruction " +
                          std::to_string(s.instruction) + ", beyond the embedded schedule's " +
                          std::to_string(schedule.instructions_size()));
      return;
    }
    samples.push_back({s.global_pid, s.step, s.instruction, s.start_ns, s.end_ns, s.bytes, 0});
  }));
  DC_RETURN_IF_ERROR(bad);
  return samples;
}

// Compute on the device, as the simulator slows it (the host's optimizer steps are not).
bool IsDeviceCompute(const proto::Instruction& instr) {
  return instr.kind() == proto::INSTR_COMPUTE && instr.stream() != proto::STREAM_HOST;
}

// |[start, end) ∩ disjoint| for a union sorted by start.
int64_t OverlapWith(int64_t start_ns, int64_t end_ns, const std::vector<NsInterval>& disjoint) {
  auto it = std::lower_bound(disjoint.begin(), disjoint.end(), start_ns,
                             [](const NsInterval& i, int64_t t) { return i.end <= t; });
  int64_t total = 0;
  for (; it != disjoint.end() && it->start < end_ns; ++it) {
    total += std::min(end_ns, it->end) - std::max(start_ns, it->start);
  }
  return total;
}

// Fills every sample's beside_fraction; returns whether any two instructions of one rank ran at
// once (false: the run was serial, as DC_CPU_STREAMS=serial runs the cpu backend).
bool MarkOverlaps(const proto::Schedule& schedule, std::vector<TimedSample>* samples) {
  std::map<int64_t, std::vector<NsInterval>> compute, collectives, all;
  std::map<int64_t, int64_t> busy_ns;
  for (const TimedSample& s : *samples) {
    const proto::Instruction& instr = schedule.instructions(s.instruction);
    if (IsDeviceCompute(instr)) compute[s.global_pid].push_back({s.start_ns, s.end_ns});
    if (IsCollective(instr.kind())) collectives[s.global_pid].push_back({s.start_ns, s.end_ns});
    all[s.global_pid].push_back({s.start_ns, s.end_ns});
    busy_ns[s.global_pid] += std::max<int64_t>(0, s.end_ns - s.start_ns);
  }
  bool concurrent = false;
  for (auto& [pid, spans] : all) {
    concurrent = concurrent || TotalLength(UnionOf(std::move(spans))) < busy_ns[pid];
  }
  for (auto& [pid, spans] : compute) spans = UnionOf(std::move(spans));
  for (auto& [pid, spans] : collectives) spans = UnionOf(std::move(spans));
  for (TimedSample& s : *samples) {
    if (s.end_ns <= s.start_ns) continue;
    const proto::Instruction& instr = schedule.instructions(s.instruction);
    if (!IsDeviceCompute(instr) && !IsCollective(instr.kind())) continue;
    const auto& others = IsDeviceCompute(instr) ? collectives[s.global_pid] : compute[s.global_pid];
    s.beside_fraction = static_cast<double>(OverlapWith(s.start_ns, s.end_ns, others)) /
                        static_cast<double>(s.end_ns - s.start_ns);
  }
  return concurrent;
}

double SampleSeconds(const TimedSample& s) { return Seconds(s.end_ns - s.start_ns); }

// The work in a sample that ran `beside_fraction` of its span at 1 / slowdown of its rate: the
// simulator's rule (machine/simulator.h) run backwards, so that the simulator, slowing it again
// where its plan overlaps, does not count the slowdown twice.
double WorkSeconds(const TimedSample& s, double slowdown) {
  return SampleSeconds(s) * (1 - s.beside_fraction + s.beside_fraction / slowdown);
}

// Compute beside collectives: per op with samples both alone and beside, the median of each.
std::vector<BesidePair> ComputePairs(const proto::Schedule& schedule,
                                     const std::vector<TimedSample>& samples,
                                     const ConcurrencyFitOptions& options) {
  std::map<int, std::pair<std::vector<double>, std::vector<double>>> by_op;  // alone, beside
  for (const TimedSample& s : samples) {
    const proto::Instruction& instr = schedule.instructions(s.instruction);
    if (!IsDeviceCompute(instr)) continue;
    if (s.beside_fraction <= 0) by_op[instr.op()].first.push_back(SampleSeconds(s));
    if (s.beside_fraction >= options.beside_min_fraction) {
      by_op[instr.op()].second.push_back(SampleSeconds(s));
    }
  }
  std::vector<BesidePair> pairs;
  for (const auto& [op, split] : by_op) {
    if (split.first.empty() || split.second.empty()) continue;
    pairs.push_back({Median(split.first), Median(split.second)});
  }
  return pairs;
}

// Collectives beside compute: each one's seconds, and what the line fitted to the samples alone
// (per kind) says for its bytes; none where either side has fewer than options.min_collectives.
std::vector<BesidePair> CollectivePairs(const proto::Schedule& schedule,
                                        const std::vector<TimedSample>& samples,
                                        const ConcurrencyFitOptions& options) {
  std::vector<CostSample> alone[2];
  std::vector<const TimedSample*> beside;
  for (const TimedSample& s : samples) {
    const proto::InstrKind kind = schedule.instructions(s.instruction).kind();
    // The lines fitted are the all-gather's and the reduce-scatter's.
    if (kind != proto::INSTR_ALL_GATHER && kind != proto::INSTR_REDUCE_SCATTER) continue;
    if (s.beside_fraction <= 0) {
      alone[kind == proto::INSTR_REDUCE_SCATTER].push_back({s.bytes, SampleSeconds(s)});
    }
    if (s.beside_fraction >= options.beside_min_fraction) beside.push_back(&s);
  }
  if (static_cast<int>(alone[0].size() + alone[1].size()) < options.min_collectives ||
      static_cast<int>(beside.size()) < options.min_collectives) {
    return {};
  }
  const CollectiveCosts line = FitCollectiveCosts(alone[0], alone[1]);
  std::vector<BesidePair> pairs;
  for (const TimedSample* s : beside) {
    const bool reduce = schedule.instructions(s->instruction).kind() == proto::INSTR_REDUCE_SCATTER;
    // A kind never seen alone takes the other kind's line.
    const bool own = !alone[reduce].empty();
    const LinearCost& cost = (reduce == own) ? line.reduce_scatter : line.all_gather;
    pairs.push_back({cost.Seconds(s->bytes), SampleSeconds(*s)});
  }
  return pairs;
}

// A slowdown from its pairs: the seconds beside over the seconds alone, summed (so the long ones
// weigh most), at least 1; 0 where fewer than `min_pairs` pairs.
double SlowdownOf(const std::vector<BesidePair>& pairs, int min_pairs) {
  double alone = 0, beside = 0;
  for (const BesidePair& p : pairs) {
    alone += p.alone_seconds;
    beside += p.beside_seconds;
  }
  return static_cast<int>(pairs.size()) >= min_pairs && alone > 0 ? std::max(1.0, beside / alone)
                                                                  : 0;
}

// serial_streams and the overlap slowdowns from the run itself; where a slowdown cannot be
// measured, a cpu trace takes the cpu profile's (machine/hardware_profiles.json) and others keep
// none. A serial run's slowdowns stay 1: nothing of it ran beside anything.
Status FitConcurrency(const Trace& trace, const proto::Schedule& schedule,
                      std::vector<TimedSample>* samples, Profile* profile,
                      CostSamples* pairs = nullptr) {
  const ConcurrencyFitOptions options;
  const bool concurrent = MarkOverlaps(schedule, samples);
  const bool cpu = !trace.ranks().empty() && trace.ranks().front().backend == "cpu";
  CostModel& costs = profile->costs;
  costs.serial_streams = cpu && !concurrent;
  if (costs.serial_streams) {
    profile->notes.push_back(
        "no two instructions of a rank overlap: the run's streams were "
        "serial (DC_CPU_STREAMS=serial), and so is the plan's model");
    return Status::Ok();
  }
  CostModel fallback;
  if (cpu) {
    DC_ASSIGN_OR_RETURN(HardwareProfile hw, FindHardware("cpu"));
    ApplyConcurrency(hw, &fallback);
  }
  std::vector<BesidePair> compute_pairs = ComputePairs(schedule, *samples, options);
  std::vector<BesidePair> collective_pairs = CollectivePairs(schedule, *samples, options);
  const double compute = SlowdownOf(compute_pairs, options.min_ops);
  const double collective = SlowdownOf(collective_pairs, options.min_collectives);
  if (pairs) {
    pairs->compute_beside = std::move(compute_pairs);
    pairs->collectives_beside = std::move(collective_pairs);
  }
  costs.overlap_compute_slowdown = compute > 0 ? compute : fallback.overlap_compute_slowdown;
  costs.overlap_collective_slowdown =
      collective > 0 ? collective : fallback.overlap_collective_slowdown;
  if (!(compute > 0)) {
    profile->notes.push_back(
        "too few ops ran both alone and beside a collective to measure "
        "overlap_compute_slowdown: it is the hardware profile's");
  }
  if (!(collective > 0)) {
    profile->notes.push_back(
        "too few collectives ran both alone and beside compute to measure "
        "overlap_collective_slowdown: it is the hardware profile's");
  }
  return Status::Ok();
}

// The cost samples, each compute and collective as the work it would take alone.
CostSamples CollectSamples(const proto::Schedule& schedule, const std::vector<TimedSample>& timed,
                           const CostModel& costs) {
  CostSamples samples;
  samples.op_seconds.resize(schedule.program().ops_size());
  for (const TimedSample& s : timed) {
    const proto::Instruction& instr = schedule.instructions(s.instruction);
    switch (instr.kind()) {
      case proto::INSTR_COMPUTE:
        if (instr.op() >= 0 && instr.op() < schedule.program().ops_size()) {
          samples.op_seconds[instr.op()].push_back(
              WorkSeconds(s, IsDeviceCompute(instr) ? costs.overlap_compute_slowdown : 1));
        }
        break;
      case proto::INSTR_ALL_GATHER:
        samples.all_gather.push_back({s.bytes, WorkSeconds(s, costs.overlap_collective_slowdown)});
        break;
      case proto::INSTR_REDUCE_SCATTER:
        samples.reduce_scatter.push_back(
            {s.bytes, WorkSeconds(s, costs.overlap_collective_slowdown)});
        break;
      case proto::INSTR_RELOAD:
        samples.host_to_device.push_back({s.bytes, SampleSeconds(s)});
        break;
      case proto::INSTR_OFFLOAD:
        samples.device_to_host.push_back({s.bytes, SampleSeconds(s)});
        break;
      default:
        break;
    }
  }
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
  DC_ASSIGN_OR_RETURN(std::vector<TimedSample> timed, ReadSamples(trace, schedule, steps));
  DC_RETURN_IF_ERROR(FitConcurrency(trace, schedule, &timed, profile));
  CostModel& costs = profile->costs;
  const CostSamples samples = CollectSamples(schedule, timed, costs);
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

namespace {

// CostSamples::collective_skews from the measured steps' samples (ReadSamples'): the ranks'
// starts of each collective instruction of each step, against the same ranks' starts of the
// previous collective on its stream.
std::vector<SkewSample> CollectiveSkews(const Trace& trace, const proto::Schedule& schedule,
                                        const std::vector<TimedSample>& timed) {
  std::set<std::string> hosts;
  std::map<int64_t, int> rank_of;
  for (const TraceRank& r : trace.ranks()) {
    hosts.insert(r.hostname);
    rank_of.emplace(r.global_pid, static_cast<int>(rank_of.size()));
  }
  const int ranks = static_cast<int>(rank_of.size());
  std::vector<SkewSample> skews;
  if (ranks < 2 || hosts.size() != 1) return skews;
  // The previous collective on each collective's stream, in schedule order (-1: the first).
  const int n = schedule.instructions_size();
  std::vector<int> previous(n, -1);
  std::map<int, int> last_on_stream;
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& in = schedule.instructions(i);
    if (!IsCollective(in.kind())) continue;
    const auto it = last_on_stream.find(in.stream());
    if (it != last_on_stream.end()) previous[i] = it->second;
    last_on_stream[in.stream()] = i;
  }
  // Each rank's earliest start of each (step, collective instruction).
  std::map<std::pair<int, int>, std::vector<int64_t>> starts;
  for (const TimedSample& s : timed) {
    if (!IsCollective(schedule.instructions(s.instruction).kind())) continue;
    const auto rank = rank_of.find(s.global_pid);
    if (rank == rank_of.end()) continue;
    std::vector<int64_t>& at = starts[{s.step, s.instruction}];
    if (at.empty()) at.assign(ranks, -1);
    int64_t& start = at[rank->second];
    start = start < 0 ? s.start_ns : std::min(start, s.start_ns);
  }
  auto complete = [](const std::vector<int64_t>& at) {
    return std::none_of(at.begin(), at.end(), [](int64_t t) { return t < 0; });
  };
  for (const auto& [key, at] : starts) {
    const int before = previous[key.second];
    if (before < 0 || !complete(at)) continue;
    const auto prior = starts.find({key.first, before});
    if (prior == starts.end() || !complete(prior->second)) continue;
    double gap_ns = 0, mean_ns = 0;
    int64_t last_ns = at.front();
    for (int r = 0; r < ranks; ++r) {
      gap_ns += static_cast<double>(at[r] - prior->second[r]);
      mean_ns += static_cast<double>(at[r] - at.front());
      last_ns = std::max(last_ns, at[r]);
    }
    gap_ns /= ranks;
    mean_ns /= ranks;
    if (!(gap_ns > 0)) continue;
    const double wait_ns = static_cast<double>(last_ns - at.front()) - mean_ns;
    skews.push_back({gap_ns * kSecondsPerNs, wait_ns * kSecondsPerNs});
  }
  return skews;
}

}  // namespace

StatusOr<CostSamples> CollectCostSamples(const Trace& trace) {
  if (!trace.schedule()) return Status::Error(trace.path() + ": no schedule: not a dc trace");
  const proto::Schedule& schedule = *trace.schedule();
  const StepIndex steps(trace.Steps());
  DC_ASSIGN_OR_RETURN(std::vector<TimedSample> timed, ReadSamples(trace, schedule, steps));
  std::vector<SkewSample> skews = CollectiveSkews(trace, schedule, timed);
  // The samples as BuildProfile fits them: each as the work it would take alone.
  Profile concurrency;
  CostSamples pairs;
  DC_RETURN_IF_ERROR(FitConcurrency(trace, schedule, &timed, &concurrency, &pairs));
  CostSamples samples = CollectSamples(schedule, timed, concurrency.costs);
  samples.compute_beside = std::move(pairs.compute_beside);
  samples.collectives_beside = std::move(pairs.collectives_beside);
  samples.collective_skews = std::move(skews);
  return samples;
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

void ComputeStepTimes(const StepIndex& steps, Profile* profile) {
  profile->steps_measured = static_cast<int>(steps.step_seconds().size());
  profile->step_seconds_median = steps.median_step_seconds();
  for (const auto& [step, seconds] : steps.step_seconds()) {
    if (!steps.stalled().contains(step)) continue;
    char note[200];
    std::snprintf(note, sizeof(note),
                  "step %d took %.3f ms, more than %.0fx the median step (%.3f ms): a stall, its "
                  "instructions are left out of the costs",
                  step, 1e3 * seconds, kStalledStepFactor, 1e3 * steps.median_step_seconds());
    profile->notes.push_back(note);
  }
}

// A cpu run's communication threads take the compute thread's core between ops: fits
// CostModel::collective_compute_seconds so that the trace's own schedule, simulated on the
// profile's costs, takes its measured median step (0 where it already takes as long). Only for
// cpu traces whose streams ran concurrently on two or more ranks.
Status FitCollectiveComputeSeconds(const Trace& trace, Profile* profile) {
  CostModel& costs = profile->costs;
  const std::optional<proto::Schedule>& schedule = trace.schedule();
  if (!schedule || costs.serial_streams || profile->world_size < 2 || trace.ranks().empty() ||
      trace.ranks().front().backend != "cpu" || !(profile->step_seconds_median > 0)) {
    return Status::Ok();
  }
  int collectives = 0;
  for (const proto::Instruction& instr : schedule->instructions()) {
    collectives += IsCollective(instr.kind());
  }
  if (collectives == 0) return Status::Ok();
  SimOptions options;
  options.memory_timeline = false;
  auto step_at = [&](double seconds) -> StatusOr<double> {
    costs.collective_compute_seconds = seconds;
    DC_ASSIGN_OR_RETURN(SimResult sim, Simulate(*schedule, costs, options));
    return sim.step_seconds;
  };
  const double measured = profile->step_seconds_median;
  const StatusOr<double> simulated = step_at(0);
  if (!simulated.ok()) {
    // A schedule the simulator refuses (a hand-made trace's): the profile stands without it.
    costs.collective_compute_seconds = 0;
    profile->notes.push_back(
        "collective_compute_seconds not fitted: the trace's schedule does "
        "not simulate (" +
        simulated.status().message() + ")");
    return Status::Ok();
  }
  const double without = *simulated;
  if (without >= measured) {
    costs.collective_compute_seconds = 0;
    return Status::Ok();
  }
  // The step grows with it (more work on one stream delays nothing less): double until the
  // step is reached, then halve the bracket.
  double lo = 0, hi = (measured - without) / collectives;
  constexpr int kDoublings = 20, kHalvings = 30;
  for (int i = 0; i < kDoublings; ++i) {
    DC_ASSIGN_OR_RETURN(const double step, step_at(hi));
    if (step >= measured) break;
    lo = hi;
    hi *= 2;
  }
  for (int i = 0; i < kHalvings; ++i) {
    const double mid = (lo + hi) / 2;
    DC_ASSIGN_OR_RETURN(const double step, step_at(mid));
    (step < measured ? lo : hi) = mid;
  }
  costs.collective_compute_seconds = hi;
  char note[256];
  std::snprintf(note, sizeof(note),
                "collective_compute_seconds %.3g s: each of the schedule's %d collectives takes "
                "that much of the compute stream, so that the trace's own schedule simulates to "
                "its measured step (%.4g s; %.4g s without it)",
                hi, collectives, measured, without);
  profile->notes.push_back(note);
  return Status::Ok();
}

}  // namespace

StatusOr<Profile> BuildProfile(const Trace& trace) {
  Profile profile;
  profile.trace_path = trace.path();
  if (!trace.ranks().empty()) profile.world_size = trace.ranks().front().world_size;
  // Until a trace with a schedule says otherwise (FitConcurrency), a cpu run is taken as serial.
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
  ComputeStepTimes(steps, &profile);
  DC_RETURN_IF_ERROR(FitCollectiveComputeSeconds(trace, &profile));
  for (const std::string& note : trace.notes()) profile.notes.push_back(note);
  for (const SkippedRecords& skipped : trace.skipped()) profile.skipped.push_back(skipped);
  profile.digest = Sha256Hex(CostModelText(profile.costs));
  return profile;
}

}  // namespace dc
