#include "analyzer/simulator.h"

#include <algorithm>
#include <array>
#include <limits>
#include <string>

#include "analyzer/intervals.h"

namespace dc {
namespace {

using analyzer_internal::IntersectionLength;
using analyzer_internal::TotalLength;
using analyzer_internal::UnionOf;
using Span = analyzer_internal::Interval<double>;

constexpr int kNumStreams = proto::Stream_MAX + 1;

std::string Where(int index, const proto::Instruction& instruction) {
  return "instruction " + std::to_string(index) + " (" + InstrKindName(instruction.kind()) + ")";
}

bool IsCollective(proto::InstrKind kind) {
  return kind == proto::INSTR_ALL_GATHER || kind == proto::INSTR_REDUCE_SCATTER;
}

bool IsPersistentRole(proto::Role role) {
  return role == proto::ROLE_PARAM || role == proto::ROLE_GRAD ||
         role == proto::ROLE_OPTIMIZER_STATE;
}

BufferKind PersistentKind(proto::Role role) {
  switch (role) {
    case proto::ROLE_PARAM:
      return BufferKind::kShard;
    case proto::ROLE_GRAD:
      return BufferKind::kGradShard;
    default:
      return BufferKind::kOptimizerState;
  }
}

// Ids and references the rest of the simulation relies on.
Status CheckReferences(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    if (instr.kind() == proto::INSTR_UNSPECIFIED || !proto::InstrKind_IsValid(instr.kind())) {
      return Status::Error("instruction " + std::to_string(i) + " has no valid kind");
    }
    if (instr.stream() < 0 || instr.stream() >= kNumStreams) {
      return Status::Error(Where(i, instr) + " has a bad stream");
    }
    for (int d : instr.deps()) {
      if (d < 0 || d >= i) {
        return Status::Error(Where(i, instr) + " depends on instruction " + std::to_string(d) +
                             ", which does not come before it");
      }
    }
    if ((instr.kind() == proto::INSTR_COMPUTE || instr.kind() == proto::INSTR_RENAME) &&
        (instr.op() < 0 || instr.op() >= program.ops_size())) {
      return Status::Error(Where(i, instr) + " computes a bad op id " + std::to_string(instr.op()));
    }
    if (instr.kind() == proto::INSTR_RENAME) {
      const proto::Op& op = program.ops(instr.op());
      bool same = op.outputs_size() == instr.tensors_size();
      for (int k = 0; same && k < op.outputs_size(); ++k) {
        const int from = instr.tensors(k), to = op.outputs(k);
        same = from >= 0 && from < program.tensors_size() &&
               TransientBytes(program, program.tensors(from)) ==
                   TransientBytes(program, program.tensors(to)) &&
               program.tensors(from).role() == proto::ROLE_ACTIVATION &&
               program.tensors(to).role() == proto::ROLE_ACTIVATION;
      }
      if (!same) {
        return Status::Error(Where(i, instr) + " renames tensors that are not, one for one, " +
                             "activations of the size of " + op.name() + "'s outputs");
      }
    }
    for (int t : instr.tensors()) {
      if (t < 0 || t >= program.tensors_size()) {
        return Status::Error(Where(i, instr) + " names a bad tensor id " + std::to_string(t));
      }
    }
  }
  return Status::Ok();
}

// Per-tensor and per-op numbers the replay looks up many times, computed once.
struct Facts {
  Facts(const proto::Schedule& schedule, const CostModel& costs)
      : program_of_schedule(&schedule.program()), world(std::max(1, schedule.world_size())) {
    const proto::Program& program = schedule.program();
    constexpr int64_t kF32Bytes = 4;  // persistent shards are fp32 (schemas/program.h)
    for (const proto::Tensor& t : program.tensors()) {
      role.push_back(t.role());
      transient_bytes.push_back(TransientBytes(program, t));
      transient_kind.push_back(TransientKind(t));
      shard_bytes.push_back(ShardElements(NumElements(t), world) * kF32Bytes);
    }
    for (int op = 0; op < program.ops_size(); ++op) {
      op_seconds.push_back(costs.OpSeconds(program, op));
    }
  }
  const proto::Program* program_of_schedule;
  int world;
  // Bytes an offload or reload moves (as CopyBytes counts them).
  int64_t CopyBytes(int tensor) const {
    return IsPersistentRole(role[tensor]) ? shard_bytes[tensor] : transient_bytes[tensor];
  }
  // CostModel::InstructionSeconds over the precomputed sizes.
  double Seconds(const CostModel& costs, const proto::Instruction& instr) const {
    int64_t bytes = 0;
    switch (instr.kind()) {
      case proto::INSTR_COMPUTE:
        if (instr.stream() == proto::STREAM_HOST && costs.host_optimizer_elements_per_second > 0) {
          // Rare (one per param, in the optimizer phase): the cost model's own count.
          return costs.InstructionSeconds(*program_of_schedule, world, instr);
        }
        return op_seconds[instr.op()];
      case proto::INSTR_ALL_GATHER:
        for (int t : instr.tensors()) bytes += transient_bytes[t];
        return costs.all_gather.Seconds(bytes);
      case proto::INSTR_REDUCE_SCATTER:
        for (int t : instr.tensors()) bytes += transient_bytes[t];
        return costs.reduce_scatter.Seconds(bytes);
      case proto::INSTR_OFFLOAD:
        for (int t : instr.tensors()) bytes += CopyBytes(t);
        return costs.device_to_host.Seconds(bytes);
      case proto::INSTR_RELOAD:
        for (int t : instr.tensors()) bytes += CopyBytes(t);
        return costs.host_to_device.Seconds(bytes);
      case proto::INSTR_RELEASE:
        return costs.release_seconds;
      default:
        return 0;
    }
  }
  // The latency term of a collective's Seconds (what fusing pays once); 0 for others.
  static double LatencySeconds(const CostModel& costs, const proto::Instruction& instr) {
    switch (instr.kind()) {
      case proto::INSTR_ALL_GATHER:
        return costs.all_gather.latency_seconds;
      case proto::INSTR_REDUCE_SCATTER:
        return costs.reduce_scatter.latency_seconds;
      default:
        return 0;
    }
  }

  std::vector<proto::Role> role;
  std::vector<int64_t> transient_bytes, shard_bytes;
  std::vector<BufferKind> transient_kind;
  std::vector<double> op_seconds;
};

// ----- timing -----

// Start and end of every instruction: an event-driven replay with rates that change only at
// events. An instruction starts once its deps have ended and the previous instruction on its
// stream (with CostModel::serial_streams, the previous instruction of all) has ended. Its work is
// its cost model duration, in seconds at full rate; while it runs it does one second of work per
// `stretch` seconds:
// - a compute: CostModel::overlap_compute_slowdown while any collective is in flight (issued
//   before or after it), else 1;
// - a collective: 1 during its latency term (the first latency_seconds of its work; the term
//   stands for per-step synchronization, which sharing does not slow), then the number of
//   collectives past their latency term at that instant: an all-gather and a reduce-scatter in
//   flight together share the rank's links by processor sharing, each getting an equal share of
//   the time;
// - copies and releases: 1. PCIe is full duplex, so h2d and d2h each have a direction of their
//   own and never share (analyzer/HARDWARE.md).
// Events are starts, ends and the end of a collective's latency term while another collective is
// in flight (the only time it can change a rate). An instruction whose rate never changed ends at
// exactly start + duration, as a plain list schedule would say. O(n * streams).
class TimeReplay {
 public:
  TimeReplay(const proto::Schedule& schedule, const CostModel& costs, const Facts& facts,
             SimResult* result)
      : schedule_(schedule),
        costs_(costs),
        facts_(facts),
        result_(result),
        done_(schedule.instructions_size(), 0) {
    const int n = schedule.instructions_size();
    result_->start_seconds.assign(n, 0);
    result_->end_seconds.assign(n, 0);
    for (int i = 0; i < n; ++i) by_stream_[schedule.instructions(i).stream()].push_back(i);
  }

  void Run() {
    const int n = schedule_.instructions_size();
    double now = 0;
    while (finished_ < n) {
      StartReady(now);
      Retime(now);
      // Progress is guaranteed: the lowest instruction not yet started heads its stream and its
      // deps come before it, so once the running ones end it can start.
      now = NextEvent(now);
      for (Slot& slot : slots_) {
        if (slot.busy() && slot.end <= now) Finish(&slot, now);
      }
    }
  }

 private:
  struct Slot {
    int instruction = -1;  // -1: the stream is idle
    bool compute = false, collective = false;
    bool fresh = false;       // started at `since`, rate not yet set
    double since = 0;         // when left and latency_left were last brought up to date
    double left = 0;          // work left, seconds at full rate
    double latency_left = 0;  // of which still latency (collectives)
    double stretch = 1;       // wall seconds per second of work
    double end = 0;           // since + left * stretch

    bool busy() const { return instruction >= 0; }
    // Whether a collective's latency term is over at `now`. The term runs at rate 1, so it ends
    // at since + latency_left (an event there if it mattered, else passed over unnoticed).
    bool Transferring(double now) const { return latency_left <= 0 || now >= since + latency_left; }
    // Brings left and latency_left up to `now` at the current stretch.
    void Progress(double now) {
      const double done = (now - since) / stretch;
      latency_left = Transferring(now) ? 0 : std::max(0.0, latency_left - done);
      left = std::max(0.0, left - done);
      since = now;
    }
  };

  bool DepsDone(int stream, int instruction) {
    const auto& deps = schedule_.instructions(instruction).deps();
    int& next = dep_cursor_[stream];
    while (next < deps.size() && done_[deps[next]]) ++next;
    return next == deps.size();
  }

  // Starts every stream head that may start at `now`. Zero-work instructions end at once, which
  // may let others start at the same instant.
  void StartReady(double now) {
    for (bool again = true; again;) {
      again = false;
      for (int s = 0; s < kNumStreams; ++s) {
        if (slots_[s].busy() || head_[s] >= by_stream_[s].size()) continue;
        const int i = by_stream_[s][head_[s]];
        if (costs_.serial_streams && (i != started_ || busy_ > 0)) continue;
        if (!DepsDone(s, i)) continue;
        ++started_;
        result_->start_seconds[i] = now;
        const proto::Instruction& instr = schedule_.instructions(i);
        const double work = facts_.Seconds(costs_, instr);
        if (!(work > 0)) {
          Done(s, i, now);
          again = true;
          continue;
        }
        Slot& slot = slots_[s];
        slot.instruction = i;
        // The host's cores are not the SMs a collective takes.
        slot.compute = instr.kind() == proto::INSTR_COMPUTE && instr.stream() != proto::STREAM_HOST;
        slot.collective = IsCollective(instr.kind());
        slot.fresh = true;
        slot.since = now;
        slot.left = work;
        slot.latency_left =
            slot.collective ? std::clamp(Facts::LatencySeconds(costs_, instr), 0.0, work) : 0;
        ++busy_;
      }
    }
  }

  // Sets every running instruction's stretch for what is in flight at `now`.
  void Retime(double now) {
    in_flight_ = 0;
    int transferring = 0;
    for (const Slot& slot : slots_) {
      if (!slot.busy() || !slot.collective) continue;
      ++in_flight_;
      transferring += slot.Transferring(now);
    }
    for (Slot& slot : slots_) {
      if (!slot.busy()) continue;
      double stretch = 1;
      if (slot.compute && in_flight_ > 0) stretch = costs_.overlap_compute_slowdown;
      if (slot.collective && slot.Transferring(now)) stretch = std::max(1, transferring);
      if (!slot.fresh && stretch == slot.stretch) continue;
      if (!slot.fresh) slot.Progress(now);
      slot.fresh = false;
      slot.stretch = stretch;
      slot.end = slot.since + slot.left * slot.stretch;
    }
  }

  double NextEvent(double now) const {
    double next = std::numeric_limits<double>::infinity();
    for (const Slot& slot : slots_) {
      if (!slot.busy()) continue;
      next = std::min(next, slot.end);
      // The end of a latency term changes rates only when another collective is in flight.
      if (slot.collective && in_flight_ > 1 && !slot.Transferring(now)) {
        next = std::min(next, slot.since + slot.latency_left);
      }
    }
    return next;
  }

  void Finish(Slot* slot, double now) {
    const int s = static_cast<int>(slot - slots_.data());
    Done(s, slot->instruction, now);
    slot->instruction = -1;
    --busy_;
  }

  void Done(int stream, int instruction, double now) {
    result_->end_seconds[instruction] = now;
    done_[instruction] = 1;
    ++finished_;
    ++head_[stream];
    dep_cursor_[stream] = 0;
  }

  const proto::Schedule& schedule_;
  const CostModel& costs_;
  const Facts& facts_;
  SimResult* result_;
  std::array<std::vector<int>, kNumStreams> by_stream_;  // instruction indices in order
  std::array<size_t, kNumStreams> head_{};               // next to start, into by_stream_
  std::array<int, kNumStreams> dep_cursor_{};            // the head's deps known done
  std::array<Slot, kNumStreams> slots_{};                // what runs on each stream
  std::vector<uint8_t> done_;                            // by instruction
  int started_ = 0, finished_ = 0, busy_ = 0, in_flight_ = 0;
};

void ComputeBusy(const proto::Schedule& schedule, SimResult* result) {
  std::vector<Span> compute, communication;
  compute.reserve(schedule.instructions_size());
  communication.reserve(schedule.instructions_size());
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const Span span{result->start_seconds[i], result->end_seconds[i]};
    const proto::InstrKind kind = schedule.instructions(i).kind();
    if (kind == proto::INSTR_COMPUTE) compute.push_back(span);
    if (IsCollective(kind)) communication.push_back(span);
    result->step_seconds = std::max(result->step_seconds, span.end);
  }
  const std::vector<Span> compute_union = UnionOf(std::move(compute));
  const std::vector<Span> communication_union = UnionOf(std::move(communication));
  result->compute_seconds = TotalLength(compute_union);
  result->communication_seconds = TotalLength(communication_union);
  result->exposed_communication_seconds =
      result->communication_seconds - IntersectionLength(communication_union, compute_union);
}

// ----- memory -----

struct MemoryEvent {
  double time_seconds;
  int instruction;
  int stream;
  int64_t delta_bytes;
  BufferKind kind;
};

// Events in time order, ties in instruction order (then emission order).
bool Earlier(const MemoryEvent& a, const MemoryEvent& b) {
  return a.time_seconds < b.time_seconds ||
         (a.time_seconds == b.time_seconds && a.instruction < b.instruction);
}

// Walks events kept in emission (instruction) order in time order. Each stream's events are
// already in time order (a stream runs one instruction at a time, and an instruction's events
// are all at its start or all at its end), so this merges the streams' subsequences:
// O(events * streams), no sort and no copy.
class TimeOrder {
 public:
  explicit TimeOrder(const std::vector<MemoryEvent>& events) : events_(events) {
    for (int s = 0; s < kNumStreams; ++s) {
      SkipOtherStreams(s);
      if (next_[s] < events_.size()) active_.push_back(s);
    }
    ChooseBest();
  }
  // The earliest event not yet taken, or null.
  const MemoryEvent* Peek() const { return best_ < 0 ? nullptr : &events_[next_[best_]]; }
  // Takes the event Peek returned.
  void Take() {
    ++next_[best_];
    SkipOtherStreams(best_);
    if (next_[best_] == events_.size()) std::erase(active_, best_);
    ChooseBest();
  }

 private:
  void SkipOtherStreams(int stream) {
    while (next_[stream] < events_.size() && events_[next_[stream]].stream != stream) {
      ++next_[stream];
    }
  }
  void ChooseBest() {
    best_ = -1;
    for (int s : active_) {
      if (best_ < 0 || Earlier(events_[next_[s]], events_[next_[best_]])) best_ = s;
    }
  }
  const std::vector<MemoryEvent>& events_;
  std::array<size_t, kNumStreams> next_{};
  std::vector<int> active_;  // streams with events left
  int best_ = -1;
};

// Which (tensor, micro-step) buffers exist: a flat bitmap, micro-steps -1 .. max.
class BufferSet {
 public:
  BufferSet(int num_tensors, int max_micro_step)
      : stride_(max_micro_step + 2), bits_(static_cast<size_t>(num_tensors) * stride_, 0) {}
  bool contains(int tensor, int micro_step) const { return bits_[Index(tensor, micro_step)]; }
  void insert(int tensor, int micro_step) { bits_[Index(tensor, micro_step)] = 1; }
  // Returns whether it was there.
  bool erase(int tensor, int micro_step) {
    const size_t i = Index(tensor, micro_step);
    const bool was = bits_[i];
    bits_[i] = 0;
    return was;
  }

 private:
  size_t Index(int tensor, int micro_step) const {
    return static_cast<size_t>(tensor) * stride_ + static_cast<size_t>(micro_step + 1);
  }
  size_t stride_;
  std::vector<uint8_t> bits_;
};

int MaxMicroStep(const proto::Schedule& schedule) {
  int max_micro_step = 0;
  for (const auto& instr : schedule.instructions()) {
    max_micro_step = std::max(max_micro_step, instr.micro_step());
  }
  return max_micro_step;
}

// Replays buffer lifetimes in instruction order, checking every use, and emits the allocation
// and free events with their times. Transients are keyed by (tensor, micro-step), gathered
// params by tensor alone (a param may stay gathered across micro-steps).
class MemoryReplay {
 public:
  MemoryReplay(const proto::Schedule& schedule, const Facts& facts, const SimResult& times)
      : MemoryReplay(schedule, facts, times, MaxMicroStep(schedule)) {}

  Status Run() {
    for (int i = 0; i < schedule_.instructions_size(); ++i) {
      DC_RETURN_IF_ERROR(Apply(i, schedule_.instructions(i)));
    }
    return Status::Ok();
  }
  const std::vector<MemoryEvent>& events() const { return events_; }

 private:
  MemoryReplay(const proto::Schedule& schedule, const Facts& facts, const SimResult& times,
               int max_micro_step)
      : schedule_(schedule),
        program_(schedule.program()),
        facts_(facts),
        times_(times),
        gathered_(program_.tensors_size(), false),
        offloaded_(HostResidentTensors(schedule)),
        live_(program_.tensors_size(), max_micro_step),
        offloaded_live_(program_.tensors_size(), max_micro_step) {
    events_.reserve(2 * static_cast<size_t>(schedule.instructions_size()));
  }

  std::string Name(int id) const { return program_.tensors(id).name(); }
  proto::Role Role(int id) const { return facts_.role[id]; }
  void Emit(int i, bool at_end, int64_t delta, BufferKind kind) {
    const double time = at_end ? times_.end_seconds[i] : times_.start_seconds[i];
    events_.push_back({time, i, schedule_.instructions(i).stream(), delta, kind});
  }
  void Allocate(int i, int tensor, int micro_step) {
    live_.insert(tensor, micro_step);
    Emit(i, false, facts_.transient_bytes[tensor], facts_.transient_kind[tensor]);
  }
  void Free(int i, bool at_end, int tensor) {
    Emit(i, at_end, -facts_.transient_bytes[tensor], facts_.transient_kind[tensor]);
  }

  Status Apply(int i, const proto::Instruction& instr);
  Status Gather(int i, const proto::Instruction& instr);
  Status Compute(int i, const proto::Instruction& instr);
  Status Release(int i, const proto::Instruction& instr);
  Status ReduceScatter(int i, const proto::Instruction& instr);
  Status Offload(int i, const proto::Instruction& instr);
  Status Reload(int i, const proto::Instruction& instr);
  Status Rename(int i, const proto::Instruction& instr);
  Status ReadInput(int i, const proto::Instruction& instr, bool optimizer, int tensor);

  const proto::Schedule& schedule_;
  const proto::Program& program_;
  const Facts& facts_;
  const SimResult& times_;
  std::vector<bool> gathered_;       // by param id
  std::vector<bool> offloaded_;      // persistent shards on the host, by tensor id
  BufferSet live_;                   // transients on the device
  BufferSet offloaded_live_;         // transients on the host
  std::vector<MemoryEvent> events_;  // in instruction order
};

Status MemoryReplay::Apply(int i, const proto::Instruction& instr) {
  switch (instr.kind()) {
    case proto::INSTR_ALL_GATHER:
      return Gather(i, instr);
    case proto::INSTR_COMPUTE:
      return Compute(i, instr);
    case proto::INSTR_RELEASE:
      return Release(i, instr);
    case proto::INSTR_REDUCE_SCATTER:
      return ReduceScatter(i, instr);
    case proto::INSTR_OFFLOAD:
      return Offload(i, instr);
    case proto::INSTR_RELOAD:
      return Reload(i, instr);
    case proto::INSTR_RENAME:
      return Rename(i, instr);
    default:
      return Status::Ok();
  }
}

// The kept buffers change name, not size: no memory event.
Status MemoryReplay::Rename(int i, const proto::Instruction& instr) {
  const proto::Op& op = program_.ops(instr.op());
  const int micro = instr.micro_step();
  for (int k = 0; k < instr.tensors_size(); ++k) {
    const int from = instr.tensors(k), to = op.outputs(k);
    if (!live_.erase(from, micro)) {
      return Status::Error(Where(i, instr) + " renames " + Name(from) + " (micro-step " +
                           std::to_string(micro) + "), which is not live");
    }
    if (live_.contains(to, micro)) {
      return Status::Error(Where(i, instr) + " renames into " + Name(to) +
                           ", which is still live from an earlier write");
    }
    live_.insert(to, micro);
  }
  return Status::Ok();
}

Status MemoryReplay::Gather(int i, const proto::Instruction& instr) {
  for (int t : instr.tensors()) {
    if (Role(t) != proto::ROLE_PARAM) {
      return Status::Error(Where(i, instr) + " gathers " + Name(t) + ", which is not a param");
    }
    if (gathered_[t]) {
      return Status::Error(Where(i, instr) + " gathers " + Name(t) +
                           ", which is already gathered and not released");
    }
    gathered_[t] = true;
    Emit(i, false, facts_.transient_bytes[t], BufferKind::kGathered);
  }
  return Status::Ok();
}

Status MemoryReplay::ReadInput(int i, const proto::Instruction& instr, bool optimizer, int tensor) {
  const proto::Role role = Role(tensor);
  const int micro = instr.micro_step();
  // The optimizer phase works on the rank's persistent shards, never on gathered buffers.
  if (IsPersistentRole(role) && (optimizer || role == proto::ROLE_OPTIMIZER_STATE)) {
    // A host optimizer op works on the host copies of the param's master and states (its grad
    // shard it copies from the device).
    if (instr.stream() == proto::STREAM_HOST && role != proto::ROLE_GRAD) {
      if (!offloaded_[tensor]) {
        return Status::Error(Where(i, instr) + " runs on the host but reads " + Name(tensor) +
                             ", which is on the device");
      }
      return Status::Ok();
    }
    if (offloaded_[tensor]) {
      return Status::Error(Where(i, instr) + " reads " + Name(tensor) +
                           ", which is offloaded to the host; reload it first");
    }
    return Status::Ok();
  }
  if (role == proto::ROLE_PARAM) {
    if (!gathered_[tensor]) {
      return Status::Error(Where(i, instr) + " reads param " + Name(tensor) +
                           ", which is not gathered");
    }
    return Status::Ok();
  }
  if (live_.contains(tensor, micro)) return Status::Ok();
  if (role == proto::ROLE_INPUT) {
    Allocate(i, tensor, micro);  // inputs arrive with the first compute that reads them
    return Status::Ok();
  }
  return Status::Error(Where(i, instr) + " reads " + Name(tensor) + " (micro-step " +
                       std::to_string(micro) + "), which is not live");
}

Status MemoryReplay::Compute(int i, const proto::Instruction& instr) {
  const proto::Op& op = program_.ops(instr.op());
  const bool optimizer = op.phase() == proto::PHASE_OPTIMIZER;
  for (int t : op.inputs()) DC_RETURN_IF_ERROR(ReadInput(i, instr, optimizer, t));
  for (int t : op.outputs()) {
    if (optimizer && IsPersistentRole(Role(t))) continue;  // updated in place
    if (live_.contains(t, instr.micro_step())) {
      return Status::Error(Where(i, instr) + " writes " + Name(t) +
                           ", which is still live from an earlier write");
    }
    Allocate(i, t, instr.micro_step());
  }
  return Status::Ok();
}

Status MemoryReplay::Release(int i, const proto::Instruction& instr) {
  for (int t : instr.tensors()) {
    if (Role(t) == proto::ROLE_PARAM) {
      if (!gathered_[t]) {
        return Status::Error(Where(i, instr) + " releases param " + Name(t) +
                             ", which is not gathered");
      }
      gathered_[t] = false;
    } else if (!live_.erase(t, instr.micro_step())) {
      return Status::Error(Where(i, instr) + " releases " + Name(t) + " (micro-step " +
                           std::to_string(instr.micro_step()) + "), which is not live");
    }
    Free(i, false, t);
  }
  return Status::Ok();
}

Status MemoryReplay::ReduceScatter(int i, const proto::Instruction& instr) {
  for (int t : instr.tensors()) {
    if (Role(t) != proto::ROLE_GRAD) {
      return Status::Error(Where(i, instr) + " reduce-scatters " + Name(t) +
                           ", which is not a grad");
    }
    if (!live_.contains(t, instr.micro_step())) {
      return Status::Error(Where(i, instr) + " reduce-scatters " + Name(t) + " (micro-step " +
                           std::to_string(instr.micro_step()) + "), which is not live");
    }
  }
  return Status::Ok();
}

// Persistent shards leave the device when their copy ends; transients likewise.
Status MemoryReplay::Offload(int i, const proto::Instruction& instr) {
  for (int t : instr.tensors()) {
    const proto::Role role = Role(t);
    if (IsPersistentRole(role)) {
      if (offloaded_[t]) {
        return Status::Error(Where(i, instr) + " offloads " + Name(t) +
                             ", which is already offloaded");
      }
      offloaded_[t] = true;
      Emit(i, true, -facts_.shard_bytes[t], PersistentKind(role));
      continue;
    }
    if (!live_.erase(t, instr.micro_step())) {
      return Status::Error(Where(i, instr) + " offloads " + Name(t) + ", which is not live");
    }
    offloaded_live_.insert(t, instr.micro_step());
    Free(i, true, t);
  }
  return Status::Ok();
}

// Reloaded buffers take device memory from the copy's start.
Status MemoryReplay::Reload(int i, const proto::Instruction& instr) {
  for (int t : instr.tensors()) {
    const proto::Role role = Role(t);
    if (IsPersistentRole(role)) {
      if (!offloaded_[t]) {
        return Status::Error(Where(i, instr) + " reloads " + Name(t) + ", which is not offloaded");
      }
      offloaded_[t] = false;
      Emit(i, false, facts_.shard_bytes[t], PersistentKind(role));
      continue;
    }
    if (!offloaded_live_.erase(t, instr.micro_step())) {
      return Status::Error(Where(i, instr) + " reloads " + Name(t) + ", which is not offloaded");
    }
    Allocate(i, t, instr.micro_step());
  }
  return Status::Ok();
}

// Sweeps the events in time order (ties in instruction order); one timeline point per
// instruction's change, the peak the first instant the total is highest.
void SweepMemory(const proto::Schedule& schedule, const std::vector<MemoryEvent>& events,
                 bool record_timeline, SimResult* result) {
  MemoryPoint now;
  const std::vector<int64_t> persistent = PersistentBytesByKind(schedule);
  for (int k = 0; k < kNumBufferKinds; ++k) {
    now.bytes_by_kind[k] = persistent[k];
    now.total_bytes += persistent[k];
  }
  if (record_timeline) {
    result->memory_timeline.reserve(events.size() + 1);
    result->memory_timeline.push_back(now);
  }
  result->peak_device_bytes = now.total_bytes;
  result->peak_by_kind = persistent;
  TimeOrder order(events);
  while (const MemoryEvent* first = order.Peek()) {
    const int instruction = first->instruction;
    now.time_seconds = first->time_seconds;
    for (const MemoryEvent* e = first;
         e && e->instruction == instruction && e->time_seconds == now.time_seconds;
         e = order.Peek()) {
      now.bytes_by_kind[static_cast<int>(e->kind)] += e->delta_bytes;
      now.total_bytes += e->delta_bytes;
      order.Take();
    }
    if (record_timeline) result->memory_timeline.push_back(now);
    if (now.total_bytes > result->peak_device_bytes) {
      result->peak_device_bytes = now.total_bytes;
      result->peak_at_seconds = now.time_seconds;
      result->peak_instruction = instruction;
      result->peak_by_kind.assign(now.bytes_by_kind.begin(), now.bytes_by_kind.end());
    }
  }
}

proto::Role RoleOfKind(BufferKind kind) {
  switch (kind) {
    case BufferKind::kGathered:
    case BufferKind::kShard:
      return proto::ROLE_PARAM;
    case BufferKind::kGrad:
    case BufferKind::kGradShard:
      return proto::ROLE_GRAD;
    case BufferKind::kOptimizerState:
      return proto::ROLE_OPTIMIZER_STATE;
    case BufferKind::kActivation:
      return proto::ROLE_ACTIVATION;
    case BufferKind::kInput:
      return proto::ROLE_INPUT;
  }
  return proto::ROLE_UNSPECIFIED;
}

}  // namespace

StatusOr<SimResult> Simulate(const proto::Schedule& schedule, const CostModel& costs) {
  return Simulate(schedule, costs, SimOptions());
}

StatusOr<SimResult> Simulate(const proto::Schedule& schedule, const CostModel& costs,
                             const SimOptions& options) {
  DC_RETURN_IF_ERROR(CheckReferences(schedule));
  SimResult result;
  const Facts facts(schedule, costs);
  TimeReplay(schedule, costs, facts, &result).Run();
  MemoryReplay replay(schedule, facts, result);
  DC_RETURN_IF_ERROR(replay.Run());
  SweepMemory(schedule, replay.events(), options.memory_timeline, &result);
  ComputeBusy(schedule, &result);
  return result;
}

proto::Prediction ToPrediction(const SimResult& result) {
  proto::Prediction prediction;
  prediction.set_step_seconds(result.step_seconds);
  prediction.set_peak_device_bytes(result.peak_device_bytes);
  prediction.set_peak_at_seconds(result.peak_at_seconds);
  for (int k = 0; k < static_cast<int>(result.peak_by_kind.size()) && k < kNumBufferKinds; ++k) {
    if (result.peak_by_kind[k] == 0) continue;
    const auto kind = static_cast<BufferKind>(k);
    proto::RoleBytes* entry = prediction.add_peak_by_kind();
    entry->set_role(RoleOfKind(kind));
    entry->set_kind(BufferKindName(kind));
    entry->set_bytes(result.peak_by_kind[k]);
  }
  prediction.set_compute_seconds(result.compute_seconds);
  prediction.set_communication_seconds(result.communication_seconds);
  prediction.set_exposed_communication_seconds(result.exposed_communication_seconds);
  return prediction;
}

}  // namespace dc
