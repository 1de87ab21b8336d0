#include "tracetools/report.h"

#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "analyzer/kineto.h"
#include "analyzer/limits.h"
#include "analyzer/profile.h"
#include "analyzer/trace.h"
#include "machine/estimate.h"
#include "machine/hardware.h"
#include "machine/intervals.h"
#include "schemas/digest.h"
#include "schemas/plan_file.h"
#include "schemas/units.h"

namespace dc {

using analyzer_internal::IntersectionLength;
using analyzer_internal::Median;
using analyzer_internal::TotalLength;
using analyzer_internal::UnionOf;
using NsInterval = analyzer_internal::Interval<int64_t>;

namespace {

constexpr double kSecondsPerNs = 1e-9;
constexpr int64_t kNsPerSecond = 1000000000;
constexpr int64_t kProgressEvery = 100000;  // records between progress calls
constexpr int64_t kMinNs = std::numeric_limits<int64_t>::min();
constexpr int64_t kMaxNs = std::numeric_limits<int64_t>::max();

double Seconds(int64_t ns) { return static_cast<double>(ns) * kSecondsPerNs; }
int64_t Nanoseconds(double seconds) { return std::llround(seconds * kNsPerSecond); }

std::string Format(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

}  // namespace

// ===== timelines =====

namespace {

ActivityClass InstructionClass(proto::InstrKind kind) {
  switch (kind) {
    case proto::INSTR_ALL_GATHER:
    case proto::INSTR_REDUCE_SCATTER:
    case proto::INSTR_ALL_REDUCE:
      return ActivityClass::kCommunication;
    case proto::INSTR_OFFLOAD:
    case proto::INSTR_RELOAD:
      return ActivityClass::kCopy;
    default:
      return ActivityClass::kCompute;
  }
}

// The activity name a dc trace gives the instruction's record.
std::string PlanActivityName(const proto::Schedule& plan, const proto::Instruction& instr) {
  switch (instr.kind()) {
    case proto::INSTR_COMPUTE:
      return plan.program().ops(instr.op()).name();
    case proto::INSTR_OFFLOAD:
      return "[CUDA memcpy Device-to-Host]";
    case proto::INSTR_RELOAD:
      return "[CUDA memcpy Host-to-Device]";
    default:
      return InstrKindName(instr.kind());
  }
}

int64_t PlanActivityBytes(const proto::Schedule& plan, const proto::Instruction& instr) {
  if (instr.kind() == proto::INSTR_OFFLOAD || instr.kind() == proto::INSTR_RELOAD) {
    return CopyBytes(plan.program(), std::max(1, plan.world_size()), instr);
  }
  return InstructionBytes(plan.program(), instr);
}

void AddPlanMemory(const SimResult& sim, TimelineData* data) {
  std::array<int64_t, kNumBufferKinds> previous{};
  for (const MemoryPoint& point : sim.memory_timeline) {
    for (int k = 0; k < kNumBufferKinds; ++k) {
      const int64_t delta = point.bytes_by_kind[k] - previous[k];
      if (delta == 0) continue;
      TimelineMemoryEvent e;
      e.ts_ns = Nanoseconds(point.time_seconds);
      e.bytes = std::abs(delta);
      e.alloc = delta > 0;
      e.tracked = false;
      e.kind = BufferKindName(static_cast<BufferKind>(k));
      data->memory_events.push_back(e);
    }
    previous = point.bytes_by_kind;
  }
}

}  // namespace

namespace {

TimelineData PlanData(const std::string& path, const proto::Schedule& plan, const SimResult& sim) {
  TimelineData data;
  data.path = path;
  data.format = TimelineFormat::kPlan;
  data.ranks.push_back({0, 0, plan.device().empty() ? plan.backend() : plan.device(), 0});
  data.steps.push_back({0, 0, 0, Nanoseconds(sim.step_seconds), false});
  data.schedule = plan;
  for (int s = proto::Stream_MIN; s <= proto::Stream_MAX; ++s) {
    if (s == proto::STREAM_UNSPECIFIED) continue;
    data.stream_names.push_back({0, s, StreamName(static_cast<proto::Stream>(s))});
  }
  const int n = std::min<int>(plan.instructions_size(), sim.start_seconds.size());
  for (int i = 0; i < n && i < static_cast<int>(sim.end_seconds.size()); ++i) {
    const proto::Instruction& instr = plan.instructions(i);
    if (instr.kind() == proto::INSTR_RELEASE) continue;
    TimelineActivity a;
    a.stream_id = instr.stream();
    a.kind = InstructionClass(instr.kind());
    a.name = PlanActivityName(plan, instr);
    a.start_ns = Nanoseconds(sim.start_seconds[i]);
    a.end_ns = Nanoseconds(sim.end_seconds[i]);
    a.bytes = PlanActivityBytes(plan, instr);
    a.instruction = i;
    a.step = 0;
    data.activities.push_back(std::move(a));
  }
  AddPlanMemory(sim, &data);
  return data;
}

// The costs a synthetic plan was made with, where a built-in hardware profile on some node
// shape of the plan's world gives its profile digest: dc-trace diff run.db plan.dcplan then
// compares with the plan's own prediction without being told the --hardware. nullopt for a plan
// made from a trace or a profile file.
std::optional<PlanCosts> BuiltinCostsOf(const proto::Schedule& plan, int gpus_per_node) {
  if (plan.profile_digest().empty()) return std::nullopt;
  StatusOr<std::vector<HardwareProfile>> profiles = HardwareProfiles();
  if (!profiles.ok()) return std::nullopt;
  std::vector<int> shapes = {gpus_per_node};
  for (int per_node : {8, 4, 2, 1, 16}) {
    if (per_node != gpus_per_node) shapes.push_back(per_node);
  }
  for (const HardwareProfile& hw : *profiles) {
    for (int per_node : shapes) {
      StatusOr<ClusterShape> cluster = MakeCluster(plan.world_size(), per_node);
      if (!cluster.ok() || !ValidateCluster(hw, *cluster).ok()) continue;
      PlanCosts result;
      result.costs = EstimateCostModel(plan.program(), hw, *cluster);
      if (Sha256Hex(CostModelText(result.costs)) != plan.profile_digest()) continue;
      result.note = "re-simulated with " + hw.name + " on " + std::to_string(cluster->nodes) +
                    " node(s) of " + std::to_string(cluster->gpus_per_node) +
                    " rank(s): the costs the plan was made with (found by its profile digest)";
      return result;
    }
  }
  return std::nullopt;
}

}  // namespace

std::unique_ptr<Timeline> PlanTimeline(const std::string& path, const proto::Schedule& plan,
                                       const SimResult& sim) {
  return MakeTimeline(PlanData(path, plan, sim));
}

StatusOr<PlanCosts> CostsForPlan(const proto::Schedule& plan, const PlanCostSource& source) {
  PlanCosts result;
  const std::string& profile_trace = source.profile_trace;
  if (!profile_trace.empty() && !source.hardware.empty()) {
    return Status::Error("--profile " + profile_trace + " and --hardware " + source.hardware +
                         " both give a plan's costs; pass one");
  }
  if (!source.hardware.empty()) {
    DC_ASSIGN_OR_RETURN(HardwareProfile hw, ResolveHardware(source.hardware));
    DC_ASSIGN_OR_RETURN(ClusterShape cluster, MakeCluster(plan.world_size(), source.gpus_per_node));
    DC_RETURN_IF_ERROR(ValidateCluster(hw, cluster));
    result.costs = EstimateCostModel(plan.program(), hw, cluster);
    const std::string on = hw.name + " on " + std::to_string(cluster.nodes) + " node(s) of " +
                           std::to_string(cluster.gpus_per_node) + " rank(s)";
    if (Sha256Hex(CostModelText(result.costs)) == plan.profile_digest()) {
      result.note = "re-simulated with " + on + ": the costs the plan was made with";
    } else {
      result.note = "re-simulated with " + on +
                    ": not the costs the plan was made with (its profile digest differs: another "
                    "profile, --gpus-per-node, or a plan made from a trace)";
    }
    return result;
  }
  if (profile_trace.empty()) {
    if (std::optional<PlanCosts> own = BuiltinCostsOf(plan, source.gpus_per_node)) return *own;
    if (plan.backend() == "cpu") {
      DC_ASSIGN_OR_RETURN(HardwareProfile cpu, FindHardware("cpu"));
      ApplyConcurrency(cpu, &result.costs);
    }
    result.note =
        "re-simulated with the default cost model (pass --hardware for the profile the plan was "
        "made with, --profile TRACE for measured costs); its times are rough estimates";
    return result;
  }
  DC_ASSIGN_OR_RETURN(std::unique_ptr<Trace> trace, Trace::Open(profile_trace));
  if (!trace->program()) {
    return Status::Error(profile_trace +
                         ": a foreign trace has no per-op costs; pass a dc trace as --profile");
  }
  if (trace->program_digest() != DigestOf(plan.program())) {
    return Status::Error(profile_trace + ": recorded under another program than the plan (digest " +
                         trace->program_digest().substr(0, 12) + " vs " +
                         DigestOf(plan.program()).substr(0, 12) +
                         "); pass a trace of the plan's program");
  }
  DC_ASSIGN_OR_RETURN(Profile profile, BuildProfile(*trace));
  result.costs = profile.costs;
  result.note = "re-simulated with the costs profiled from " + profile_trace;
  return result;
}

StatusOr<InputKind> DetectInput(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::Error(path + ": cannot open (" + std::strerror(errno) +
                         "); pass a dc trace, an nsys SQLite export, a PyTorch profiler trace "
                         "(.json, .json.gz) or a plan");
  }
  if (S_ISDIR(st.st_mode)) return InputKind::kKineto;
  char head[16] = {};
  std::ifstream in(path, std::ios::binary);
  in.read(head, sizeof(head));
  const std::streamsize n = in.gcount();
  if (n >= 8 && std::memcmp(head, "DCPLAN\r\n", 8) == 0) return InputKind::kPlan;
  if (n >= 16 && std::memcmp(head, "SQLite format 3", 16) == 0) return InputKind::kTrace;
  if (n >= 2 && static_cast<unsigned char>(head[0]) == 0x1f &&
      static_cast<unsigned char>(head[1]) == 0x8b) {
    return InputKind::kKineto;
  }
  for (std::streamsize i = 0; i < n; ++i) {
    if (std::isspace(static_cast<unsigned char>(head[i]))) continue;
    if (head[i] == '{' || head[i] == '[') return InputKind::kKineto;
    break;
  }
  if (path.ends_with(".json") || path.ends_with(".json.gz") || path.ends_with(".gz")) {
    return InputKind::kKineto;
  }
  if (path.ends_with(".dcplan")) return InputKind::kPlan;
  return InputKind::kTrace;  // Trace::Open says what is wrong with it
}

StatusOr<std::unique_ptr<Timeline>> OpenTimeline(const std::vector<std::string>& paths,
                                                 const OpenOptions& options) {
  if (paths.empty()) return Status::Error("no input given");
  if (paths.size() > 1) {
    for (const std::string& path : paths) {
      DC_ASSIGN_OR_RETURN(InputKind kind, DetectInput(path));
      if (kind != InputKind::kKineto) {
        return Status::Error(path +
                             ": several inputs are read as one run only for PyTorch profiler "
                             "traces (one per rank); pass one trace or plan");
      }
    }
    return OpenKinetoTimeline(paths, options.progress);
  }
  const std::string& path = paths.front();
  DC_ASSIGN_OR_RETURN(InputKind kind, DetectInput(path));
  switch (kind) {
    case InputKind::kKineto:
      return OpenKinetoTimeline(paths, options.progress);
    case InputKind::kTrace:
      return OpenTraceTimeline(path);
    case InputKind::kPlan:
      break;
  }
  DC_ASSIGN_OR_RETURN(proto::Schedule plan, LoadPlan(path));
  DC_ASSIGN_OR_RETURN(PlanCosts costs, CostsForPlan(plan, options.plan_costs));
  StatusOr<SimResult> sim = Simulate(plan, costs.costs);
  if (!sim.ok()) return sim.status().Prefixed(path + ": cannot simulate the plan: ");
  // Its times become nanoseconds under the range rules (analyzer/limits.h).
  if (!(sim->step_seconds >= 0) ||
      !TraceLimits::Scaled(sim->step_seconds, kNsPerSecond, 0, TraceLimits::kMaxAbsTimeNs)) {
    return Status::Error(path + ": the simulated step takes " + Format("%g", sim->step_seconds) +
                         " s, out of range; the plan or its costs are corrupt, re-plan");
  }
  TimelineData data = PlanData(path, plan, *sim);
  data.notes.push_back(costs.note);
  return MakeTimeline(std::move(data));
}

// ===== schedule helpers =====

std::string InstructionName(const proto::Schedule& schedule, int index) {
  if (index < 0 || index >= schedule.instructions_size())
    return "instruction " + std::to_string(index);
  const proto::Instruction& instr = schedule.instructions(index);
  const proto::Program& program = schedule.program();
  if (instr.kind() == proto::INSTR_COMPUTE && instr.op() >= 0 && instr.op() < program.ops_size()) {
    return program.ops(instr.op()).name();
  }
  std::string name = InstrKindName(instr.kind());
  if (instr.tensors_size() > 0) {
    const int t = instr.tensors(0);
    name += " " + (t >= 0 && t < program.tensors_size() ? program.tensors(t).name()
                                                        : "tensor " + std::to_string(t));
    if (instr.tensors_size() > 1) name += " +" + std::to_string(instr.tensors_size() - 1);
  }
  return name;
}

std::vector<InstructionPart> InstructionParts(const proto::Schedule& schedule, int index) {
  if (index < 0 || index >= schedule.instructions_size())
    return {{InstructionName(schedule, index), 1}};
  const proto::Instruction& instr = schedule.instructions(index);
  const proto::Program& program = schedule.program();
  if (instr.kind() == proto::INSTR_COMPUTE || instr.tensors_size() <= 1) {
    return {{InstructionName(schedule, index), 1}};
  }
  std::vector<InstructionPart> parts;
  std::vector<double> bytes;
  double total = 0;
  for (int t : instr.tensors()) {
    const bool known = t >= 0 && t < program.tensors_size();
    parts.push_back({std::string(InstrKindName(instr.kind())) + " " +
                         (known ? program.tensors(t).name() : "tensor " + std::to_string(t)),
                     0});
    bytes.push_back(known ? static_cast<double>(TransientBytes(program, program.tensors(t))) : 0);
    total += bytes.back();
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i].share = total > 0 ? bytes[i] / total : 1.0 / static_cast<double>(parts.size());
  }
  return parts;
}

std::vector<std::pair<int, int>> GatherConsumers(const proto::Schedule& schedule) {
  std::map<int, int> first_consumer;
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    if (instr.kind() != proto::INSTR_COMPUTE) continue;
    for (int d : instr.deps()) {
      if (d < 0 || d >= i || schedule.instructions(d).kind() != proto::INSTR_ALL_GATHER) continue;
      first_consumer.try_emplace(d, i);
    }
  }
  return {first_consumer.begin(), first_consumer.end()};
}

// ===== memory replay =====

namespace {

constexpr std::array<BufferKind, kNumBufferKinds> kBufferKinds = {
    BufferKind::kGathered,       BufferKind::kShard,      BufferKind::kGrad, BufferKind::kGradShard,
    BufferKind::kOptimizerState, BufferKind::kActivation, BufferKind::kInput};

std::vector<std::string> OrderKinds(const std::set<std::string>& seen) {
  std::vector<std::string> kinds;
  std::set<std::string> rest = seen;
  for (BufferKind k : kBufferKinds) {
    if (rest.erase(BufferKindName(k)) > 0) kinds.push_back(BufferKindName(k));
  }
  kinds.insert(kinds.end(), rest.begin(), rest.end());
  return kinds;
}

Status LiveBytesError(const Timeline& timeline) {
  return Status::Error(timeline.path() +
                       ": live device memory passes 4 EiB; the trace's byte counts are corrupt, "
                       "record it again");
}

size_t KindIndex(const std::vector<std::string>& kinds, const std::string& kind) {
  return static_cast<size_t>(std::find(kinds.begin(), kinds.end(), kind) - kinds.begin());
}

}  // namespace

StatusOr<MemoryReplay> MemoryReplay::Prepare(const Timeline& timeline) {
  MemoryReplay replay;
  std::set<std::string> seen;
  // Frees of buffers never seen allocated, by rank and kind name.
  std::map<std::pair<int, std::string>, int64_t> before_capture;
  std::map<int, std::unordered_set<int64_t>> live;
  bool overflow = false;
  DC_RETURN_IF_ERROR(timeline.ForEachMemoryEvent([&](const TimelineMemoryEvent& e) {
    ++replay.events_;
    seen.insert(e.kind);
    if (!e.tracked) return;
    std::unordered_set<int64_t>& addresses = live[e.rank_index];
    if (e.alloc) {
      addresses.insert(e.address);
    } else if (addresses.erase(e.address) == 0 &&
               !AddLiveBytes(&before_capture[{e.rank_index, e.kind}], e.bytes)) {
      overflow = true;
    }
  }));
  replay.kinds_ = OrderKinds(seen);
  replay.preexisting_.assign(timeline.ranks().size(),
                             std::vector<int64_t>(replay.kinds_.size(), 0));
  for (const auto& [key, bytes] : before_capture) {
    if (key.first < 0 || key.first >= static_cast<int>(replay.preexisting_.size())) continue;
    replay.preexisting_[key.first][KindIndex(replay.kinds_, key.second)] = bytes;
  }
  for (const std::vector<int64_t>& level : replay.preexisting_) {
    int64_t total = 0;
    for (int64_t bytes : level) overflow = overflow || !AddLiveBytes(&total, bytes);
  }
  if (overflow) return LiveBytesError(timeline);
  return replay;
}

const std::vector<int64_t>& MemoryReplay::preexisting(int rank_index) const {
  static const std::vector<int64_t> kNone;
  return rank_index >= 0 && rank_index < static_cast<int>(preexisting_.size())
             ? preexisting_[rank_index]
             : kNone;
}

Status MemoryReplay::Run(const Timeline& timeline,
                         const std::function<void(const MemoryLevel&)>& fn) const {
  struct Live {
    int64_t bytes = 0;
    size_t kind = 0;
  };
  int rank = -1;
  std::vector<int64_t> level;
  int64_t total = 0;
  std::unordered_map<int64_t, Live> live;
  std::optional<int64_t> pending_ts;  // a timestamp whose events are applied but not reported
  auto report = [&] {
    if (pending_ts) fn({rank, *pending_ts, total, &level});
    pending_ts.reset();
  };
  bool overflow = false;
  auto apply = [&](size_t kind, int64_t delta) {
    overflow = overflow || !AddLiveBytes(&level[kind], delta) || !AddLiveBytes(&total, delta);
  };
  DC_RETURN_IF_ERROR(timeline.ForEachMemoryEvent([&](const TimelineMemoryEvent& e) {
    if (overflow) return;
    if (e.rank_index != rank) {
      report();
      rank = e.rank_index;
      level = preexisting(rank);
      level.resize(kinds_.size(), 0);
      total = 0;
      for (int64_t bytes : level) total += bytes;  // Prepare checked the sum
      live.clear();
    }
    if (pending_ts && *pending_ts != e.ts_ns) report();
    pending_ts = e.ts_ns;
    const size_t kind = KindIndex(kinds_, e.kind);
    if (!e.tracked) {
      apply(kind, e.alloc ? e.bytes : -e.bytes);
      return;
    }
    auto it = live.find(e.address);
    if (it != live.end()) {  // a free, or a new buffer at a live address: the old one is gone
      apply(it->second.kind, -it->second.bytes);
      live.erase(it);
    } else if (!e.alloc) {
      apply(kind, -e.bytes);  // made before the capture (counted in preexisting)
    }
    if (e.alloc) {
      live[e.address] = {e.bytes, kind};
      apply(kind, e.bytes);
    }
  }));
  if (overflow) return LiveBytesError(timeline);
  report();
  return Status::Ok();
}

// ===== summary =====

namespace {

// A rank's measured window. `whole_span` windows (sources without step markers) cover every
// activity and memory event; their bounds become the first start and last end.
struct Window {
  int step = 0;
  int64_t start_ns = kMinNs, end_ns = kMaxNs;
  bool whole_span = false;
  bool Contains(int64_t ts) const { return whole_span || (ts >= start_ns && ts < end_ns); }
};

struct WindowTotals {
  int64_t compute_ns = 0, communication_ns = 0, copy_ns = 0, overlap_ns = 0, busy_ns = 0;
};

std::vector<NsInterval> Clip(const std::vector<NsInterval>& disjoint, int64_t lo, int64_t hi) {
  std::vector<NsInterval> clipped;
  for (const NsInterval& i : disjoint) {
    const int64_t a = std::max(i.start, lo), b = std::min(i.end, hi);
    if (b > a) clipped.push_back({a, b});
  }
  return clipped;
}

// HTA's unions over step windows, streaming: activities come in start order, so everything
// before the latest start is final. Merged intervals are accounted into the windows and
// dropped every kMaxPending intervals, which bounds memory whatever the trace's length.
class OverlapSweep {
 public:
  explicit OverlapSweep(std::vector<Window> windows)
      : windows_(std::move(windows)), totals_(windows_.size()) {}

  Status Add(ActivityClass kind, int64_t start_ns, int64_t end_ns) {
    if (start_ns < watermark_) return Status::Error("activities out of start order");
    watermark_ = start_ns;
    if (end_ns <= start_ns) return Status::Ok();
    std::vector<NsInterval>& merged = merged_[static_cast<int>(kind)];
    if (!merged.empty() && start_ns <= merged.back().end) {
      merged.back().end = std::max(merged.back().end, end_ns);
    } else {
      merged.push_back({start_ns, end_ns});
      ++pending_;
    }
    if (pending_ >= kMaxPending) Flush(watermark_);
    return Status::Ok();
  }

  const std::vector<WindowTotals>& Finish() {
    Flush(kMaxNs);
    return totals_;
  }

 private:
  static constexpr int kMaxPending = 4096;

  void Flush(int64_t upto) {
    for (size_t w = 0; w < windows_.size(); ++w) {
      const int64_t lo = std::max(windows_[w].start_ns, flushed_);
      const int64_t hi = std::min(windows_[w].end_ns, upto);
      if (hi > lo) Account(lo, hi, &totals_[w]);
    }
    pending_ = 0;
    for (std::vector<NsInterval>& merged : merged_) {
      std::erase_if(merged, [&](const NsInterval& i) { return i.end <= upto; });
      for (NsInterval& i : merged) i.start = std::max(i.start, upto);
      pending_ += static_cast<int>(merged.size());
    }
    flushed_ = upto;
  }

  void Account(int64_t lo, int64_t hi, WindowTotals* totals) const {
    const std::vector<NsInterval> c = Clip(merged_[0], lo, hi);
    const std::vector<NsInterval> n = Clip(merged_[1], lo, hi);
    const std::vector<NsInterval> m = Clip(merged_[2], lo, hi);
    std::vector<NsInterval> all = c;
    all.insert(all.end(), n.begin(), n.end());
    all.insert(all.end(), m.begin(), m.end());
    totals->compute_ns += TotalLength(c);
    totals->communication_ns += TotalLength(n);
    totals->copy_ns += TotalLength(m);
    totals->overlap_ns += IntersectionLength(c, n);
    totals->busy_ns += TotalLength(UnionOf(std::move(all)));
  }

  std::vector<Window> windows_;
  std::vector<WindowTotals> totals_;
  std::array<std::vector<NsInterval>, 3> merged_;  // by ActivityClass, disjoint, sorted
  int pending_ = 0;
  int64_t watermark_ = kMinNs, flushed_ = kMinNs;
};

struct StreamAccumulator {
  int64_t activities = 0, busy_ns = 0;
  std::optional<NsInterval> open;  // the union's current interval
  void Add(int64_t start_ns, int64_t end_ns) {
    ++activities;
    if (open && start_ns <= open->end) {
      open->end = std::max(open->end, end_ns);
      return;
    }
    Close();
    open = NsInterval{start_ns, end_ns};
  }
  void Close() {
    if (open) busy_ns += std::max<int64_t>(0, open->end - open->start);
    open.reset();
  }
};

// False where a sum would leave 64 bits (only corrupt times or byte counts get there).
bool AddName(std::map<std::string, NameStat>* stats, const std::string& name, ActivityClass kind,
             int64_t duration_ns, int64_t bytes) {
  NameStat& s = (*stats)[name];
  s.name = name;
  s.kind = kind;
  ++s.count;
  return CheckedAdd(s.total_ns, duration_ns, &s.total_ns) && CheckedAdd(s.bytes, bytes, &s.bytes);
}

Status SumError(const std::string& name) {
  return Status::Error("the summed times or bytes of " + name +
                       " pass 64 bits; the trace's times or byte counts are corrupt, record it "
                       "again");
}

// By total time (then name), at most `top` (all when top < 0).
std::vector<NameStat> Ranked(const std::map<std::string, NameStat>& stats, int top) {
  std::vector<NameStat> ranked;
  for (const auto& [name, s] : stats) ranked.push_back(s);
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const NameStat& a, const NameStat& b) { return a.total_ns > b.total_ns; });
  if (top >= 0 && static_cast<int>(ranked.size()) > top) ranked.resize(top);
  return ranked;
}

struct WindowPeak {
  bool started = false;
  PeakMemory peak;
};

class RankAccumulator {
 public:
  explicit RankAccumulator(std::vector<Window> windows)
      : windows_(windows), sweep_(std::move(windows)), peaks_(windows_.size()) {}

  const std::vector<Window>& windows() const { return windows_; }

  // Returns whether the activity starts inside a measured window.
  StatusOr<bool> Add(const TimelineActivity& a) {
    first_ns_ = std::min(first_ns_, a.start_ns);
    last_ns_ = std::max(last_ns_, a.end_ns);
    DC_RETURN_IF_ERROR(sweep_.Add(a.kind, a.start_ns, a.end_ns));
    while (next_window_ < windows_.size() && windows_[next_window_].end_ns <= a.start_ns &&
           !windows_[next_window_].whole_span) {
      ++next_window_;
    }
    if (next_window_ >= windows_.size() || !windows_[next_window_].Contains(a.start_ns)) {
      return false;
    }
    ++activities_;
    const int64_t duration_ns = std::max<int64_t>(0, a.end_ns - a.start_ns);
    streams_[a.stream_id].Add(a.start_ns, a.end_ns);
    if (!AddName(a.kind == ActivityClass::kCopy ? &copies_ : &kernels_, a.name, a.kind, duration_ns,
                 a.bytes)) {
      return SumError(a.name);
    }
    return true;
  }

  // One memory level of this rank, in time order; `before` is the level before it.
  void AddMemory(const MemoryLevel& level, const std::vector<int64_t>& before,
                 const std::vector<std::string>& kinds) {
    for (size_t w = 0; w < windows_.size(); ++w) {
      WindowPeak& p = peaks_[w];
      if (!p.started && (windows_[w].whole_span || level.ts_ns >= windows_[w].start_ns)) {
        p.started = true;
        p.peak = PeakAt(windows_[w].whole_span ? level.ts_ns : windows_[w].start_ns, before, kinds);
      }
      if (windows_[w].Contains(level.ts_ns) && level.total_bytes > p.peak.bytes) {
        p.peak = PeakAt(level.ts_ns, *level.bytes_by_kind, kinds);
      }
    }
  }

  void FinishMemory(const std::vector<int64_t>& last, const std::vector<std::string>& kinds) {
    for (size_t w = 0; w < windows_.size(); ++w) {
      if (peaks_[w].started) continue;
      peaks_[w].started = true;
      peaks_[w].peak = PeakAt(windows_[w].whole_span ? 0 : windows_[w].start_ns, last, kinds);
    }
  }

  RankSummary Finish(const TimelineRank& rank, const Timeline& timeline, int rank_index,
                     bool with_memory, int top) {
    RankSummary r;
    r.rank = rank;
    r.activities = activities_;
    const std::vector<WindowTotals>& totals = sweep_.Finish();
    for (size_t w = 0; w < windows_.size(); ++w) {
      StepSummary s = StepOf(windows_[w], totals[w]);
      if (with_memory) s.peak_memory = peaks_[w].peak;
      if (with_memory && (!r.peak_memory || s.peak_memory->bytes > r.peak_memory->bytes)) {
        r.peak_memory = s.peak_memory;
      }
      r.steps.push_back(std::move(s));
    }
    for (auto& [stream_id, acc] : streams_) {
      acc.Close();
      r.streams.push_back(
          {stream_id, timeline.StreamName(rank_index, stream_id), acc.activities, acc.busy_ns});
    }
    r.top_kernels = Ranked(kernels_, top);
    r.copies = Ranked(copies_, -1);
    return r;
  }

 private:
  static PeakMemory PeakAt(int64_t ts_ns, const std::vector<int64_t>& level,
                           const std::vector<std::string>& kinds) {
    PeakMemory peak;
    peak.at_ns = ts_ns;
    for (size_t k = 0; k < level.size() && k < kinds.size(); ++k) {
      peak.bytes += level[k];
      if (level[k] != 0) peak.by_kind.push_back({kinds[k], level[k]});
    }
    return peak;
  }

  StepSummary StepOf(const Window& w, const WindowTotals& t) const {
    StepSummary s;
    s.step = w.step;
    s.start_ns = w.whole_span ? (activities_seen() ? first_ns_ : 0) : w.start_ns;
    s.end_ns = w.whole_span ? (activities_seen() ? last_ns_ : 0) : w.end_ns;
    const int64_t span_ns = s.end_ns - s.start_ns;
    s.step_seconds = Seconds(span_ns);
    s.compute_seconds = Seconds(t.compute_ns);
    s.communication_seconds = Seconds(t.communication_ns);
    s.copy_seconds = Seconds(t.copy_ns);
    s.overlap_seconds = Seconds(t.overlap_ns);
    s.overlap_ratio = t.communication_ns > 0 ? static_cast<double>(t.overlap_ns) /
                                                   static_cast<double>(t.communication_ns)
                                             : 0;
    s.exposed_communication_seconds = Seconds(t.communication_ns - t.overlap_ns);
    s.idle_seconds = Seconds(span_ns - t.busy_ns);
    return s;
  }
  bool activities_seen() const { return first_ns_ <= last_ns_; }

  std::vector<Window> windows_;
  OverlapSweep sweep_;
  std::vector<WindowPeak> peaks_;
  size_t next_window_ = 0;
  int64_t first_ns_ = kMaxNs, last_ns_ = kMinNs;
  int64_t activities_ = 0;
  std::map<int64_t, StreamAccumulator> streams_;
  std::map<std::string, NameStat> kernels_, copies_;
};

// Measured windows per rank: its non-warm-up steps, or the whole span where it has none.
std::vector<std::vector<Window>> WindowsOf(const Timeline& timeline, int* warmup_excluded) {
  std::vector<std::vector<Window>> windows(timeline.ranks().size());
  std::vector<bool> has_steps(timeline.ranks().size(), false);
  for (const TimelineStep& s : timeline.steps()) {
    if (s.rank_index < 0 || s.rank_index >= static_cast<int>(windows.size())) continue;
    has_steps[s.rank_index] = true;
    if (s.warmup) {
      ++*warmup_excluded;
    } else {
      windows[s.rank_index].push_back({s.step, s.start_ns, s.end_ns, false});
    }
  }
  for (size_t r = 0; r < windows.size(); ++r) {
    if (!has_steps[r]) windows[r].push_back({0, kMinNs, kMaxNs, true});
  }
  return windows;
}

Status SummarizeMemory(const Timeline& timeline, std::vector<RankAccumulator>* ranks,
                       bool* with_memory) {
  DC_ASSIGN_OR_RETURN(MemoryReplay replay, MemoryReplay::Prepare(timeline));
  *with_memory = !replay.empty();
  if (replay.empty()) return Status::Ok();
  std::vector<std::vector<int64_t>> level(ranks->size());
  for (size_t r = 0; r < ranks->size(); ++r) {
    level[r] = replay.preexisting(static_cast<int>(r));
    level[r].resize(replay.kinds().size(), 0);
  }
  DC_RETURN_IF_ERROR(replay.Run(timeline, [&](const MemoryLevel& m) {
    if (m.rank_index < 0 || m.rank_index >= static_cast<int>(ranks->size())) return;
    (*ranks)[m.rank_index].AddMemory(m, level[m.rank_index], replay.kinds());
    level[m.rank_index] = *m.bytes_by_kind;
  }));
  for (size_t r = 0; r < ranks->size(); ++r) (*ranks)[r].FinishMemory(level[r], replay.kinds());
  return Status::Ok();
}

// InstructionParts of each instruction, computed once.
class PartsCache {
 public:
  explicit PartsCache(const proto::Schedule* schedule) : schedule_(schedule) {
    if (schedule_) parts_.resize(schedule_->instructions_size());
  }
  const std::vector<InstructionPart>& Of(int index) {
    if (index < 0 || index >= static_cast<int>(parts_.size())) {
      scratch_ = InstructionParts(*schedule_, index);
      return scratch_;
    }
    if (parts_[index].empty()) parts_[index] = InstructionParts(*schedule_, index);
    return parts_[index];
  }

 private:
  const proto::Schedule* schedule_;
  std::vector<std::vector<InstructionPart>> parts_;
  std::vector<InstructionPart> scratch_;
};

void AddTotals(Summary* summary) {
  std::vector<double> step_seconds, exposed_seconds;
  for (const RankSummary& r : summary->ranks) {
    for (const StepSummary& s : r.steps) {
      step_seconds.push_back(s.step_seconds);
      exposed_seconds.push_back(s.exposed_communication_seconds);
    }
    if (r.peak_memory)
      summary->peak_memory_bytes = std::max(summary->peak_memory_bytes, r.peak_memory->bytes);
  }
  summary->measured_windows = static_cast<int>(step_seconds.size());
  summary->step_seconds_median = Median(step_seconds);
  summary->exposed_communication_seconds_median = Median(exposed_seconds);
}

}  // namespace

StatusOr<Summary> Summarize(const Timeline& timeline, const SummaryOptions& options) {
  Summary summary;
  summary.path = timeline.path();
  summary.format = timeline.format();
  summary.report_only = timeline.schedule() == nullptr;
  summary.dropped_records = timeline.dropped_records();
  std::vector<RankAccumulator> ranks;
  for (std::vector<Window>& w : WindowsOf(timeline, &summary.warmup_steps_excluded)) {
    ranks.emplace_back(std::move(w));
  }
  std::map<std::string, NameStat> by_instruction;
  const proto::Schedule* schedule = timeline.schedule();
  PartsCache parts(schedule);
  ActivityOptions activity_options;
  activity_options.with_instructions = options.by_instruction;
  activity_options.progress = options.progress;
  Status bad = Status::Ok();
  DC_RETURN_IF_ERROR(timeline.ForEachActivity(activity_options, [&](const TimelineActivity& a) {
    if (!bad.ok() || a.rank_index < 0 || a.rank_index >= static_cast<int>(ranks.size())) return;
    StatusOr<bool> measured = ranks[a.rank_index].Add(a);
    if (!measured.ok()) {
      bad = measured.status().Prefixed(timeline.path() + ": ");
      return;
    }
    if (!*measured || !options.by_instruction) return;
    const int64_t duration_ns = std::max<int64_t>(0, a.end_ns - a.start_ns);
    if (!schedule || a.instruction < 0) {
      if (!AddName(&by_instruction, a.name, a.kind, duration_ns, a.bytes)) {
        bad = SumError(a.name).Prefixed(timeline.path() + ": ");
      }
      return;
    }
    for (const InstructionPart& part : parts.Of(a.instruction)) {
      if (!AddName(&by_instruction, part.name, a.kind,
                   std::llround(static_cast<double>(duration_ns) * part.share),
                   std::llround(static_cast<double>(a.bytes) * part.share))) {
        bad = SumError(part.name).Prefixed(timeline.path() + ": ");
        return;
      }
    }
  }));
  DC_RETURN_IF_ERROR(bad);
  bool with_memory = false;
  DC_RETURN_IF_ERROR(SummarizeMemory(timeline, &ranks, &with_memory));
  for (size_t r = 0; r < ranks.size(); ++r) {
    summary.ranks.push_back(ranks[r].Finish(timeline.ranks()[r], timeline, static_cast<int>(r),
                                            with_memory, options.top_kernels));
  }
  for (const auto& [name, stat] : by_instruction) summary.by_instruction.push_back(stat);
  AddTotals(&summary);
  summary.notes = timeline.notes();
  summary.skipped = timeline.skipped();
  summary.incomplete = timeline.incomplete();
  for (const TimelineStep& step : timeline.steps()) {
    summary.last_step = std::max(summary.last_step, static_cast<int>(step.step));
  }
  if (summary.report_only) {
    summary.notes.push_back(std::string("a foreign (") + TimelineFormatName(timeline.format()) +
                            ") trace: the analysis is report-only; there is no program to re-plan");
  }
  if (timeline.steps().empty()) {
    summary.notes.push_back("no step markers: one window per rank over its whole span");
  }
  if (!with_memory) summary.notes.push_back("no memory events: no peak memory");
  return summary;
}

// ----- summary output -----

namespace {

int64_t SkippedRecordsOf(const Summary& s) {
  int64_t total = 0;
  for (const SkippedRecords& r : s.skipped) total += r.count;  // table row counts: the sum fits
  return total;
}

nlohmann::json PeakJson(const PeakMemory& peak, int64_t window_start_ns) {
  nlohmann::json by_kind = nlohmann::json::object();
  for (const auto& [kind, bytes] : peak.by_kind) by_kind[kind] = bytes;
  return {{"bytes", peak.bytes},
          {"at_ns", peak.at_ns},
          {"into_window_seconds", Seconds(peak.at_ns - window_start_ns)},
          {"by_kind", by_kind}};
}

nlohmann::json NameStatJson(const NameStat& s) {
  return {{"name", s.name},
          {"kind", ActivityClassName(s.kind)},
          {"count", s.count},
          {"total_seconds", Seconds(s.total_ns)},
          {"mean_seconds", s.count > 0 ? Seconds(s.total_ns) / static_cast<double>(s.count) : 0.0},
          {"bytes", s.bytes}};
}

nlohmann::json StepJson(const StepSummary& s) {
  nlohmann::json j = {{"step", s.step},
                      {"start_ns", s.start_ns},
                      {"end_ns", s.end_ns},
                      {"step_seconds", s.step_seconds},
                      {"compute_seconds", s.compute_seconds},
                      {"communication_seconds", s.communication_seconds},
                      {"copy_seconds", s.copy_seconds},
                      {"idle_seconds", s.idle_seconds},
                      {"overlap_seconds", s.overlap_seconds},
                      {"overlap_ratio", s.overlap_ratio},
                      {"exposed_communication_seconds", s.exposed_communication_seconds}};
  j["peak_memory"] = s.peak_memory ? PeakJson(*s.peak_memory, s.start_ns) : nlohmann::json();
  return j;
}

nlohmann::json RankJson(const RankSummary& r) {
  nlohmann::json j = {{"rank", r.rank.rank},
                      {"global_pid", r.rank.global_pid},
                      {"device", r.rank.device},
                      {"activities", r.activities}};
  j["steps"] = nlohmann::json::array();
  for (const StepSummary& s : r.steps) j["steps"].push_back(StepJson(s));
  j["streams"] = nlohmann::json::array();
  for (const StreamStat& s : r.streams) {
    j["streams"].push_back({{"stream_id", s.stream_id},
                            {"name", s.name},
                            {"activities", s.activities},
                            {"busy_seconds", Seconds(s.busy_ns)}});
  }
  j["top_kernels"] = nlohmann::json::array();
  for (const NameStat& s : r.top_kernels) j["top_kernels"].push_back(NameStatJson(s));
  j["copies"] = nlohmann::json::array();
  for (const NameStat& s : r.copies) j["copies"].push_back(NameStatJson(s));
  const int64_t start_ns = r.steps.empty() ? 0 : r.steps.front().start_ns;
  j["peak_memory"] = r.peak_memory ? PeakJson(*r.peak_memory, start_ns) : nlohmann::json();
  return j;
}

std::string Ms(double seconds) { return Format("%.3f", seconds * 1e3); }

std::string PeakText(const PeakMemory& peak, int64_t window_start_ns) {
  std::string text =
      FormatBytes(peak.bytes) + " at +" + Ms(Seconds(peak.at_ns - window_start_ns)) + " ms";
  std::string kinds;
  for (const auto& [kind, bytes] : peak.by_kind) {
    kinds += (kinds.empty() ? "" : ", ") + kind + " " + FormatBytes(bytes);
  }
  return kinds.empty() ? text : text + " (" + kinds + ")";
}

void AppendLine(std::string* out, const char* format, ...) __attribute__((format(printf, 2, 3)));
void AppendLine(std::string* out, const char* format, ...) {
  char line[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof(line), format, args);
  va_end(args);
  *out += line;
  *out += "\n";
}

void RankText(const RankSummary& r, std::string* out) {
  AppendLine(out, "rank %d (%s): %" PRId64 " activities in measured windows", r.rank.rank,
             r.rank.device.empty() ? "?" : r.rank.device.c_str(), r.activities);
  AppendLine(out, "  %5s %10s %10s %10s %10s %10s %10s %6s %10s  %s", "step", "time ms", "compute",
             "comm", "copy", "idle", "overlap", "ratio", "exposed", "peak memory");
  for (const StepSummary& s : r.steps) {
    AppendLine(out, "  %5d %10s %10s %10s %10s %10s %10s %6.3f %10s  %s", s.step,
               Ms(s.step_seconds).c_str(), Ms(s.compute_seconds).c_str(),
               Ms(s.communication_seconds).c_str(), Ms(s.copy_seconds).c_str(),
               Ms(s.idle_seconds).c_str(), Ms(s.overlap_seconds).c_str(), s.overlap_ratio,
               Ms(s.exposed_communication_seconds).c_str(),
               s.peak_memory ? FormatBytes(s.peak_memory->bytes).c_str() : "-");
  }
  AppendLine(out, "  streams:");
  for (const StreamStat& s : r.streams) {
    AppendLine(out, "    %-12s (id %" PRId64 ") %8" PRId64 " activities, busy %s ms",
               s.name.c_str(), s.stream_id, s.activities, Ms(Seconds(s.busy_ns)).c_str());
  }
  AppendLine(out, "  top kernels:  %8s %12s %12s  %s", "count", "total ms", "mean us", "name");
  for (const NameStat& s : r.top_kernels) {
    AppendLine(out, "                %8" PRId64 " %12s %12s  %s", s.count,
               Ms(Seconds(s.total_ns)).c_str(),
               Format("%.3f", Seconds(s.total_ns) * 1e6 / static_cast<double>(s.count)).c_str(),
               s.name.c_str());
  }
  for (const NameStat& s : r.copies) {
    AppendLine(out, "  copies: %s: %" PRId64 " x, %s, %s ms", s.name.c_str(), s.count,
               FormatBytes(s.bytes).c_str(), Ms(Seconds(s.total_ns)).c_str());
  }
  if (r.peak_memory) {
    const int64_t start_ns = r.steps.empty() ? 0 : r.steps.front().start_ns;
    AppendLine(out, "  peak memory: %s", PeakText(*r.peak_memory, start_ns).c_str());
  }
}

}  // namespace

nlohmann::json SummaryJson(const Summary& summary) {
  nlohmann::json j = {
      {"path", summary.path},
      {"format", TimelineFormatName(summary.format)},
      {"report_only", summary.report_only},
      {"dropped_records", summary.dropped_records},
      {"warmup_steps_excluded", summary.warmup_steps_excluded},
      {"measured_windows", summary.measured_windows},
      {"step_seconds_median", summary.step_seconds_median},
      {"exposed_communication_seconds_median", summary.exposed_communication_seconds_median},
      {"peak_memory_bytes", summary.peak_memory_bytes},
      {"incomplete", !summary.incomplete.empty()},
      {"notes", summary.notes}};
  if (!summary.incomplete.empty()) {
    j["incomplete_reason"] = summary.incomplete;
    j["last_complete_step"] = summary.last_step;
  }
  nlohmann::json skipped = nlohmann::json::array();
  for (const SkippedRecords& s : summary.skipped) {
    skipped.push_back({{"source", s.source}, {"problem", s.problem}, {"count", s.count}});
  }
  j["skipped_records"] = SkippedRecordsOf(summary);
  j["skipped"] = skipped;
  j["ranks"] = nlohmann::json::array();
  for (const RankSummary& r : summary.ranks) j["ranks"].push_back(RankJson(r));
  return j;
}

std::string SummaryText(const Summary& summary) {
  std::string out;
  AppendLine(&out,
             "%s (%s): %zu rank(s), %d measured window(s) (%d warm-up excluded), %" PRId64
             " dropped record(s)",
             summary.path.c_str(), TimelineFormatName(summary.format), summary.ranks.size(),
             summary.measured_windows, summary.warmup_steps_excluded, summary.dropped_records);
  AppendLine(&out, "median step %s ms, median exposed communication %s ms, peak memory %s",
             Ms(summary.step_seconds_median).c_str(),
             Ms(summary.exposed_communication_seconds_median).c_str(),
             FormatBytes(summary.peak_memory_bytes).c_str());
  if (!summary.incomplete.empty()) {
    AppendLine(&out, "incomplete: %s; last complete step %d", summary.incomplete.c_str(),
               summary.last_step);
  }
  for (const SkippedRecords& s : summary.skipped) {
    AppendLine(&out, "warning: %s", s.Text().c_str());
  }
  for (const RankSummary& r : summary.ranks) RankText(r, &out);
  for (const std::string& note : summary.notes) AppendLine(&out, "note: %s", note.c_str());
  return out;
}

// ===== diff =====

namespace {

// Seconds per measured window of every name.
std::map<std::string, std::pair<ActivityClass, double>> PerWindow(const Summary& s) {
  std::map<std::string, std::pair<ActivityClass, double>> seconds;
  const double windows = std::max(1, s.measured_windows);
  for (const NameStat& n : s.by_instruction) {
    seconds[n.name] = {n.kind, Seconds(n.total_ns) / windows};
  }
  return seconds;
}

nlohmann::json SideJson(const Summary& s) {
  return {{"path", s.path},
          {"skipped_records", SkippedRecordsOf(s)},
          {"format", TimelineFormatName(s.format)},
          {"measured_windows", s.measured_windows},
          {"step_seconds", s.step_seconds_median},
          {"exposed_communication_seconds", s.exposed_communication_seconds_median},
          {"peak_memory_bytes", s.peak_memory_bytes}};
}

}  // namespace

StatusOr<Diff> DiffTimelines(const Timeline& a, const Timeline& b, int top,
                             const ProgressFn& progress) {
  SummaryOptions options;
  options.by_instruction = true;
  options.progress = progress;
  Diff diff;
  DC_ASSIGN_OR_RETURN(diff.a, Summarize(a, options));
  DC_ASSIGN_OR_RETURN(diff.b, Summarize(b, options));
  const auto per_a = PerWindow(diff.a), per_b = PerWindow(diff.b);
  std::set<std::string> names;
  for (const auto& [name, v] : per_a) names.insert(name);
  for (const auto& [name, v] : per_b) names.insert(name);
  std::vector<DiffRow> rows;
  for (const std::string& name : names) {
    DiffRow row;
    row.name = name;
    auto in_a = per_a.find(name), in_b = per_b.find(name);
    if (in_a != per_a.end()) {
      row.kind = in_a->second.first;
      row.a_seconds = in_a->second.second;
    } else {
      ++diff.only_b;
    }
    if (in_b != per_b.end()) {
      row.kind = in_b->second.first;
      row.b_seconds = in_b->second.second;
    } else {
      ++diff.only_a;
    }
    row.change_seconds = std::max(0.0, row.b_seconds) - std::max(0.0, row.a_seconds);
    if (row.change_seconds != 0) ++diff.changed;
    rows.push_back(std::move(row));
  }
  std::stable_sort(rows.begin(), rows.end(), [](const DiffRow& x, const DiffRow& y) {
    return std::fabs(x.change_seconds) > std::fabs(y.change_seconds);
  });
  std::erase_if(rows, [](const DiffRow& r) { return r.change_seconds == 0; });
  if (top >= 0 && static_cast<int>(rows.size()) > top) rows.resize(top);
  diff.rows = std::move(rows);
  return diff;
}

nlohmann::json DiffJson(const Diff& diff) {
  nlohmann::json j;
  j["a"] = SideJson(diff.a);
  j["b"] = SideJson(diff.b);
  j["change"] = {{"step_seconds", diff.b.step_seconds_median - diff.a.step_seconds_median},
                 {"exposed_communication_seconds", diff.b.exposed_communication_seconds_median -
                                                       diff.a.exposed_communication_seconds_median},
                 {"peak_memory_bytes", diff.b.peak_memory_bytes - diff.a.peak_memory_bytes}};
  j["changed"] = diff.changed;
  j["only_a"] = diff.only_a;
  j["only_b"] = diff.only_b;
  j["instructions"] = nlohmann::json::array();
  for (const DiffRow& r : diff.rows) {
    j["instructions"].push_back(
        {{"name", r.name},
         {"kind", ActivityClassName(r.kind)},
         {"a_seconds", r.a_seconds >= 0 ? nlohmann::json(r.a_seconds) : nlohmann::json()},
         {"b_seconds", r.b_seconds >= 0 ? nlohmann::json(r.b_seconds) : nlohmann::json()},
         {"change_seconds", r.change_seconds}});
  }
  nlohmann::json notes = nlohmann::json::array();
  for (const std::string& n : diff.a.notes) notes.push_back("A: " + n);
  for (const std::string& n : diff.b.notes) notes.push_back("B: " + n);
  j["notes"] = notes;
  return j;
}

std::string DiffText(const Diff& diff) {
  std::string out;
  AppendLine(&out, "A: %s (%s, %d window(s))", diff.a.path.c_str(),
             TimelineFormatName(diff.a.format), diff.a.measured_windows);
  AppendLine(&out, "B: %s (%s, %d window(s))", diff.b.path.c_str(),
             TimelineFormatName(diff.b.format), diff.b.measured_windows);
  AppendLine(&out, "%-32s %14s %14s %14s", "", "A", "B", "B - A");
  auto row = [&](const char* what, double a, double b) {
    AppendLine(&out, "%-32s %14s %14s %14s", what, Ms(a).c_str(), Ms(b).c_str(), Ms(b - a).c_str());
  };
  row("step (ms, median)", diff.a.step_seconds_median, diff.b.step_seconds_median);
  row("exposed communication (ms)", diff.a.exposed_communication_seconds_median,
      diff.b.exposed_communication_seconds_median);
  AppendLine(&out, "%-32s %14s %14s %14s", "peak memory",
             FormatBytes(diff.a.peak_memory_bytes).c_str(),
             FormatBytes(diff.b.peak_memory_bytes).c_str(),
             FormatBytes(diff.b.peak_memory_bytes - diff.a.peak_memory_bytes).c_str());
  AppendLine(&out, "%d name(s) changed (%d only in A, %d only in B); largest changes, ms per step:",
             diff.changed, diff.only_a, diff.only_b);
  for (const DiffRow& r : diff.rows) {
    AppendLine(&out, "  %10s %10s %+10.3f  %s", r.a_seconds >= 0 ? Ms(r.a_seconds).c_str() : "-",
               r.b_seconds >= 0 ? Ms(r.b_seconds).c_str() : "-", r.change_seconds * 1e3,
               r.name.c_str());
  }
  for (const SkippedRecords& r : diff.a.skipped) {
    AppendLine(&out, "warning: A: %s", r.Text().c_str());
  }
  for (const SkippedRecords& r : diff.b.skipped) {
    AppendLine(&out, "warning: B: %s", r.Text().c_str());
  }
  for (const std::string& n : diff.a.notes) AppendLine(&out, "note: A: %s", n.c_str());
  for (const std::string& n : diff.b.notes) AppendLine(&out, "note: B: %s", n.c_str());
  return out;
}

}  // namespace dc
