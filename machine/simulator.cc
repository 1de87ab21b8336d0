#include "machine/simulator.h"

#include <algorithm>
#include <array>
#include <limits>
#include <string>

#include "machine/intervals.h"
#include "schemas/effects.h"

namespace dc {
namespace {

using analyzer_internal::IntersectionLength;
using analyzer_internal::TotalLength;
using analyzer_internal::UnionOf;
using Span = analyzer_internal::Interval<double>;

constexpr int kNumStreams = proto::Stream_MAX + 1;

// Per-tensor and per-op numbers the replay looks up many times, computed once.
struct Facts {
  Facts(const proto::Schedule& schedule, const CostModel& costs)
      : program_of_schedule(&schedule.program()), world(std::max(1, schedule.world_size())) {
    const proto::Program& program = schedule.program();
    for (const proto::Tensor& t : program.tensors()) {
      role.push_back(t.role());
      transient_bytes.push_back(TransientBytes(program, t));
      shard_bytes.push_back(ShardBytes(t, world));
    }
    for (int op = 0; op < program.ops_size(); ++op) {
      op_seconds.push_back(costs.OpSeconds(program, op));
    }
    // Each instruction's message read once here, for the sweeps that need only these two.
    const int n = schedule.instructions_size();
    kind.resize(n);
    stream.resize(n);
    for (int i = 0; i < n; ++i) {
      const proto::Instruction& instr = schedule.instructions(i);
      kind[i] = static_cast<uint8_t>(instr.kind());
      stream[i] = static_cast<uint8_t>(instr.stream());
    }
  }
  static_assert(proto::InstrKind_MAX < 256 && proto::Stream_MAX < 256);
  const proto::Program* program_of_schedule;
  int world;
  // Per instruction (CheckReferences bounds both).
  std::vector<uint8_t> kind, stream;
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
      case proto::INSTR_ALL_REDUCE:
        for (int t : instr.tensors()) bytes += transient_bytes[t];
        return costs.AllReduceSeconds(bytes);
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
      case proto::INSTR_ALL_REDUCE:
        return costs.reduce_scatter.latency_seconds + costs.all_gather.latency_seconds;
      default:
        return 0;
    }
  }

  std::vector<proto::Role> role;
  std::vector<int64_t> transient_bytes, shard_bytes;
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
//   collectives past their latency term at that instant (an all-gather and a reduce-scatter in
//   flight together share the rank's links by processor sharing, each getting an equal share of
//   the time), times CostModel::overlap_collective_slowdown while a compute runs beside it;
// - copies and releases: 1. PCIe is full duplex, so h2d and d2h each have a direction of their
//   own and never share (machine/HARDWARE.md).
// A collective that starts (streams concurrent) adds CostModel::collective_compute_seconds of
// work to the compute stream: to the compute running then, or else to the next to start. A
// collective also waits CostModel::collective_skew_fraction of the time since the previous
// collective on its stream started (the step's start for the first) for the last rank to arrive,
// at most CostModel::collective_skew_max_seconds where that is set: the wait is added to its
// latency term.
// Events are starts, ends and the end of a collective's latency term while another collective is
// in flight or a compute runs beside a slowed collective (the only times it can change a rate). An
// instruction whose rate never changed ends at exactly start + duration, as a plain list schedule
// would say. O(n * streams).
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
    for (int i = 0; i < n; ++i) by_stream_[facts.stream[i]].push_back(i);
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
        if (slot.collective && costs_.collective_skew_fraction > 0) {
          // The wait for the last rank: a fraction of the time since the stream's previous
          // collective started (the step's start for its first), at rate 1 like the latency.
          const double wait = costs_.SkewWaitSeconds(now - last_collective_start_[s]);
          slot.left += wait;
          slot.latency_left += wait;
        }
        if (slot.collective) last_collective_start_[s] = now;
        if (slot.collective && !costs_.serial_streams) {
          compute_debt_ += costs_.collective_compute_seconds;
        }
        ++busy_;
      }
    }
    if (compute_debt_ > 0) {
      for (Slot& slot : slots_) {
        if (!slot.busy() || !slot.compute) continue;
        if (!slot.fresh) slot.Progress(now);
        slot.left += compute_debt_;
        slot.fresh = true;  // its end is set again by Retime
        compute_debt_ = 0;
        break;
      }
    }
  }

  // Sets every running instruction's stretch for what is in flight at `now`.
  void Retime(double now) {
    in_flight_ = 0;
    computing_ = false;
    int transferring = 0;
    for (const Slot& slot : slots_) {
      computing_ = computing_ || (slot.busy() && slot.compute);
      if (!slot.busy() || !slot.collective) continue;
      ++in_flight_;
      transferring += slot.Transferring(now);
    }
    const double collective_slowdown = computing_ ? costs_.overlap_collective_slowdown : 1.0;
    for (Slot& slot : slots_) {
      if (!slot.busy()) continue;
      double stretch = 1;
      if (slot.compute && in_flight_ > 0) stretch = costs_.overlap_compute_slowdown;
      if (slot.collective && slot.Transferring(now)) {
        stretch = std::max(1, transferring) * collective_slowdown;
      }
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
      // The end of a latency term changes rates only when another collective is in flight or a
      // compute slows the transfer.
      const bool rate_changes =
          in_flight_ > 1 || (computing_ && costs_.overlap_collective_slowdown != 1);
      if (slot.collective && rate_changes && !slot.Transferring(now)) {
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
  // Compute-stream work the collectives started so far added and no compute has taken yet.
  double compute_debt_ = 0;
  std::array<double, kNumStreams> last_collective_start_{};  // by stream, for the skew wait
  bool computing_ = false;                                   // a compute runs (set by Retime)
};

void ComputeBusy(const Facts& facts, SimResult* result) {
  const int n = static_cast<int>(facts.kind.size());
  std::vector<Span> compute, communication;
  compute.reserve(n);
  communication.reserve(n);
  for (int i = 0; i < n; ++i) {
    const Span span{result->start_seconds[i], result->end_seconds[i]};
    const auto kind = static_cast<proto::InstrKind>(facts.kind[i]);
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
// are all at its start or all at its end), so this merges the streams' subsequences, split out
// in one pass: O(events * streams) compares, no sort and no copy of the events.
class TimeOrder {
 public:
  explicit TimeOrder(const std::vector<MemoryEvent>& events) : events_(events) {
    for (size_t k = 0; k < events.size(); ++k) {
      by_stream_[events[k].stream].push_back(static_cast<uint32_t>(k));
    }
    for (int s = 0; s < kNumStreams; ++s) {
      if (!by_stream_[s].empty()) active_.push_back(s);
    }
    ChooseBest();
  }
  // The earliest event not yet taken, or null.
  const MemoryEvent* Peek() const { return best_ < 0 ? nullptr : &Next(best_); }
  // Takes the event Peek returned.
  void Take() {
    if (++next_[best_] == by_stream_[best_].size()) std::erase(active_, best_);
    ChooseBest();
  }

 private:
  const MemoryEvent& Next(int stream) const { return events_[by_stream_[stream][next_[stream]]]; }
  void ChooseBest() {
    best_ = -1;
    for (int s : active_) {
      if (best_ < 0 || Earlier(Next(s), Next(best_))) best_ = s;
    }
  }
  const std::vector<MemoryEvent>& events_;
  std::array<std::vector<uint32_t>, kNumStreams> by_stream_;  // each stream's events, in order
  std::array<size_t, kNumStreams> next_{};                    // its next into by_stream_
  std::vector<int> active_;                                   // streams with events left
  int best_ = -1;
};

// The buffer effects (schemas/effects.h) as timed memory events: each allocation and free at its
// instruction's start or end; the persistent buffers of start-up summed by kind. Also the peak in
// issue order: the bytes live after each effect as the replay tells them, instruction by
// instruction, which is how the executor counts (it applies an instruction's effects when it
// issues it, whatever the streams' times).
class MemoryEvents : public BufferListener {
 public:
  MemoryEvents(const Facts& facts, const SimResult& times)
      : facts_(facts),
        times_(times),
        start_up_bytes_(kNumBufferKinds, 0),
        issue_bytes_by_kind_(kNumBufferKinds, 0) {
    events_.reserve(2 * facts.stream.size());
  }
  void Allocated(int instruction, const BufferKey& /*key*/, int64_t size_bytes, BufferKind kind,
                 bool at_end, int /*handle*/) override {
    Emit(instruction, at_end, size_bytes, kind);
  }
  void Freed(int instruction, const BufferKey& /*key*/, int64_t size_bytes, BufferKind kind,
             bool at_end, int /*handle*/) override {
    Emit(instruction, at_end, -size_bytes, kind);
  }
  const std::vector<MemoryEvent>& events() const { return events_; }
  const std::vector<int64_t>& start_up_bytes() const { return start_up_bytes_; }
  // The issue-order peak: its bytes, the instruction whose effect reached it (-1: start-up) and
  // the bytes by kind then.
  int64_t issue_peak_bytes() const { return issue_peak_bytes_; }
  int issue_peak_instruction() const { return issue_peak_instruction_; }
  const std::vector<int64_t>& issue_peak_by_kind() const { return issue_peak_by_kind_; }

 private:
  void Emit(int i, bool at_end, int64_t delta, BufferKind kind) {
    issue_bytes_ += delta;
    issue_bytes_by_kind_[static_cast<int>(kind)] += delta;
    if (issue_bytes_ > issue_peak_bytes_) {
      issue_peak_bytes_ = issue_bytes_;
      issue_peak_instruction_ = i;
      issue_peak_by_kind_ = issue_bytes_by_kind_;
    }
    if (i < 0) {
      start_up_bytes_[static_cast<int>(kind)] += delta;
      return;
    }
    const double time = at_end ? times_.end_seconds[i] : times_.start_seconds[i];
    events_.push_back({time, i, facts_.stream[i], delta, kind});
  }
  const Facts& facts_;
  const SimResult& times_;
  std::vector<MemoryEvent> events_;  // in instruction order
  std::vector<int64_t> start_up_bytes_;
  int64_t issue_bytes_ = 0, issue_peak_bytes_ = 0;
  int issue_peak_instruction_ = -1;
  std::vector<int64_t> issue_bytes_by_kind_, issue_peak_by_kind_;
};

// The promise a plan makes is the larger of the two peaks: the time-resolved one (what the
// device holds when the streams overlap as simulated) and the issue-order one (what the
// executor's accounting holds, and what a capacity check fails on). They differ only where an
// allocation issued before a free starts after it in time, or the other way round.
void TakeIssueOrderPeak(const MemoryEvents& events, SimResult* result) {
  if (events.issue_peak_bytes() <= result->peak_device_bytes) return;
  result->peak_device_bytes = events.issue_peak_bytes();
  result->peak_instruction = events.issue_peak_instruction();
  result->peak_at_seconds =
      result->peak_instruction < 0 ? 0 : result->start_seconds[result->peak_instruction];
  result->peak_by_kind = events.issue_peak_by_kind();
}

// Sweeps the events in time order (ties in instruction order); one timeline point per
// instruction's change, the peak the first instant the total is highest.
void SweepMemory(const std::vector<int64_t>& persistent, const std::vector<MemoryEvent>& events,
                 bool record_timeline, SimResult* result) {
  MemoryPoint now;
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
  MemoryEvents events(facts, result);
  BothListeners both(&events, options.also_listening);
  DC_RETURN_IF_ERROR(
      BufferReplay(schedule, options.also_listening ? &both : static_cast<BufferListener*>(&events))
          .Run());
  SweepMemory(events.start_up_bytes(), events.events(), options.memory_timeline, &result);
  TakeIssueOrderPeak(events, &result);
  ComputeBusy(facts, &result);
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
