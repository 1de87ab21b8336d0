#include "schemas/happens_before.h"

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "schemas/effects.h"

namespace dc {

HappensBefore::HappensBefore(const proto::Schedule& schedule) {
  const int n = schedule.instructions_size();
  stream_.resize(n);
  position_.resize(n);
  // Every row is written whole below (copied or zeroed): no need to zero it first.
  clock_.reset(new int32_t[static_cast<size_t>(n) * kStreams]);
  std::array<int, kStreams> last_on_stream;
  last_on_stream.fill(-1);
  std::array<int32_t, kStreams> count{};
  std::vector<int> last_offload(schedule.program().tensors_size(), -1);
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    const int s = instr.stream();
    int32_t* row = &clock_[static_cast<size_t>(i) * kStreams];
    // What `d` saw before it started, and `d` itself.
    auto follow = [&](int d) {
      const int32_t* from = &clock_[static_cast<size_t>(d) * kStreams];
      for (int k = 0; k < kStreams; ++k) row[k] = std::max(row[k], from[k]);
      row[stream_[d]] = std::max(row[stream_[d]], position_[d]);
    };
    if (last_on_stream[s] >= 0) {
      const int previous = last_on_stream[s];
      std::copy_n(&clock_[static_cast<size_t>(previous) * kStreams], kStreams, row);
      row[s] = position_[previous];
    } else {
      std::fill_n(row, kStreams, 0);
    }
    for (int d : instr.deps()) follow(d);
    if (instr.kind() == proto::INSTR_RELOAD) {
      for (int t : instr.tensors()) {
        if (last_offload[t] >= 0) follow(last_offload[t]);
      }
    }
    if (instr.kind() == proto::INSTR_OFFLOAD) {
      for (int t : instr.tensors()) last_offload[t] = i;
    }
    stream_[i] = static_cast<uint8_t>(s);
    position_[i] = ++count[s];
    last_on_stream[s] = i;
  }
}

namespace {

constexpr int kNone = -2;  // no instruction (-1 is start-up)
constexpr int kStreams = proto::Stream_MAX + 1;
// How many of an instruction's tensors its description names.
constexpr int kNamedTensors = 3;

// "instruction 12 (all_gather on the gather stream, micro-step 0, of layers.0.attn.wq)".
std::string Describe(const proto::Schedule& schedule, int index) {
  if (index < 0) return "start-up";
  const proto::Instruction& instr = schedule.instructions(index);
  const proto::Program& program = schedule.program();
  std::string text = "instruction " + std::to_string(index) + " (" + InstrKindName(instr.kind()) +
                     " on the " + StreamName(instr.stream()) + " stream, " +
                     (instr.micro_step() < 0 ? std::string("optimizer phase")
                                             : "micro-step " + std::to_string(instr.micro_step()));
  if (instr.kind() == proto::INSTR_COMPUTE || instr.kind() == proto::INSTR_RENAME) {
    text += ", op " + program.ops(instr.op()).name();
  } else if (instr.tensors_size() > 0) {
    text += ", of ";
    for (int k = 0; k < instr.tensors_size() && k < kNamedTensors; ++k) {
      text += (k ? ", " : "") + program.tensors(instr.tensors(k)).name();
    }
    if (instr.tensors_size() > kNamedTensors) {
      text += " and " + std::to_string(instr.tensors_size() - kNamedTensors) + " more";
    }
  }
  return text + ")";
}

std::string BufferName(const proto::Program& program, const BufferKey& key) {
  const std::string& name = program.tensors(key.tensor).name();
  switch (key.slot) {
    case BufferSlot::kPersistent:
      return name + "'s shard";
    case BufferSlot::kComputeShard:
      return name + "'s compute-dtype shard";
    case BufferSlot::kGathered:
      return name + " (gathered)";
    case BufferSlot::kTransient:
      break;
  }
  return name + (key.micro_step < 0 ? std::string(" (optimizer phase)")
                                    : " (micro-step " + std::to_string(key.micro_step) + ")");
}

// Checks each buffer effect against the effects before it on the same buffer (and, with a
// memory plan, on the same arena bytes) as BufferReplay tells them. Keeps the first failure.
class OrderChecker : public BufferListener {
 public:
  OrderChecker(const proto::Schedule& schedule, const HappensBefore& order)
      : schedule_(schedule), order_(order) {
    const proto::MemoryPlan& plan = schedule.memory_plan();
    if (plan.arena_bytes() <= 0) return;
    offsets_.reserve(plan.placements_size());
    for (const proto::BufferPlacement& p : plan.placements()) {
      offsets_.push_back({{p.instruction(), p.tensor(), p.micro_step()}, p.offset_bytes()});
    }
    // The last placement of a key wins, as ReuseDependencies and the executor's layout read it.
    std::stable_sort(offsets_.begin(), offsets_.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
  }

  const Status& status() const { return status_; }

  void Allocated(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind, bool,
                 int handle) override {
    if (static_cast<size_t>(handle) >= buffers_.size()) buffers_.resize(handle + 1);
    Buffer& buffer = buffers_[handle];
    buffer.key = key;
    buffer.writer = instruction;  // its contents come from the allocating instruction
    if (status_.ok() && !offsets_.empty() && size_bytes > 0) {
      Place(instruction, key, size_bytes, handle);
    }
  }

  void Freed(int instruction, const BufferKey& key, int64_t, BufferKind, bool,
             int handle) override {
    Buffer& buffer = buffers_[handle];
    Require(buffer.writer, instruction, key, "writes", "frees");
    RequireReaders(buffer, instruction, key, "frees");
    buffer.freed_by = instruction;
  }

  void Renamed(int, const BufferKey&, const BufferKey& to, int handle) override {
    buffers_[handle].key = to;
  }

  void Accessed(int instruction, const BufferKey& key, BufferAccess access, int handle) override {
    Buffer& buffer = buffers_[handle];
    const bool write = access == BufferAccess::kWrite;
    Require(buffer.writer, instruction, key, "writes", write ? "writes" : "reads");
    if (!write) {
      // The latest reader on each stream stands for the earlier ones there: they end before it.
      const int stream = schedule_.instructions(instruction).stream();
      buffer.readers[stream] = instruction;
      buffer.read_streams |= 1u << stream;
      return;
    }
    RequireReaders(buffer, instruction, key, "overwrites");
    buffer.writer = instruction;
    buffer.read_streams = 0;
  }

 private:
  struct Buffer {
    BufferKey key;
    int writer = kNone;
    int freed_by = kNone;
    uint32_t read_streams = 0;            // bit s: readers[s] holds a read since the last write
    std::array<int, kStreams> readers{};  // the latest reader on each stream
  };

  // `earlier` (which `did` the buffer) must end before `later` (which `does` it) starts.
  void Require(int earlier, int later, const BufferKey& key, const char* did, const char* does) {
    if (earlier == kNone || earlier == later || order_.Ordered(earlier, later)) return;
    Fail(earlier, later, key, did, does);
  }

  void RequireReaders(const Buffer& buffer, int later, const BufferKey& key, const char* does) {
    for (uint32_t streams = buffer.read_streams; streams != 0; streams &= streams - 1) {
      Require(buffer.readers[__builtin_ctz(streams)], later, key, "reads", does);
    }
  }

  void Fail(int earlier, int later, const BufferKey& key, const char* did, const char* does) {
    if (!status_.ok()) return;
    const proto::Program& program = schedule_.program();
    status_ =
        Status::Error(Describe(schedule_, later) + " " + does + " " + BufferName(program, key) +
                      ", which " + Describe(schedule_, earlier) + " " + did +
                      ", but nothing orders the two: no chain of deps (or one stream's order) "
                      "leads from instruction " +
                      std::to_string(earlier) + " to instruction " + std::to_string(later) +
                      "; add a dependency of instruction " + std::to_string(later) +
                      " on instruction " + std::to_string(earlier));
  }

  // The arena bytes of the new buffer: whoever held them last must be freed, and freed before
  // this allocation starts.
  void Place(int instruction, const BufferKey& key, int64_t size_bytes, int handle) {
    const std::tuple<int, int, int> wanted{instruction, key.tensor, key.placement_micro_step()};
    // Allocations come in instruction order: search only this instruction's placements.
    if (instruction != range_instruction_) {
      range_instruction_ = instruction;
      range_begin_ = range_end_;
      while (range_begin_ < offsets_.size() &&
             std::get<0>(offsets_[range_begin_].first) < instruction) {
        ++range_begin_;
      }
      range_end_ = range_begin_;
      while (range_end_ < offsets_.size() &&
             std::get<0>(offsets_[range_end_].first) == instruction) {
        ++range_end_;
      }
    }
    const auto begin = offsets_.begin() + static_cast<std::ptrdiff_t>(range_begin_);
    const auto end_of_range = offsets_.begin() + static_cast<std::ptrdiff_t>(range_end_);
    auto it = std::upper_bound(begin, end_of_range, wanted,
                               [](const auto& k, const auto& entry) { return k < entry.first; });
    if (it == begin || std::prev(it)->first != wanted) return;
    const int64_t start = std::prev(it)->second;
    if (start < 0 || size_bytes > std::numeric_limits<int64_t>::max() - start) return;
    const int64_t end = start + size_bytes;
    // Most buffers take exactly the bytes of one earlier tenant: one lookup, no splitting.
    if (auto same = segments_.find(start); same != segments_.end() && same->second.first == end) {
      CheckTenant(same->second.second, instruction, key);
      same->second.second = handle;
      return;
    }
    const auto first = SplitAt(start);
    const auto stop = SplitAt(end);
    for (auto seg = first; seg != stop; ++seg) CheckTenant(seg->second.second, instruction, key);
    segments_.erase(first, stop);
    segments_.emplace_hint(stop, start, std::make_pair(end, handle));
  }

  // The buffer `tenant` held bytes that instruction `instruction` now allocates for `key`.
  void CheckTenant(int tenant, int instruction, const BufferKey& key) {
    const Buffer& previous = buffers_[tenant];
    const proto::Program& program = schedule_.program();
    if (!status_.ok()) return;
    if (previous.freed_by == kNone) {
      status_ = Status::Error("the memory plan places " + BufferName(program, key) + " of " +
                              Describe(schedule_, instruction) + " over " +
                              BufferName(program, previous.key) +
                              ", which is still live there; re-plan it");
    } else if (previous.freed_by != instruction &&
               !order_.Ordered(previous.freed_by, instruction)) {
      status_ = Status::Error(
          Describe(schedule_, instruction) + " allocates " + BufferName(program, key) +
          " in arena bytes that " + BufferName(program, previous.key) + " held until " +
          Describe(schedule_, previous.freed_by) +
          " freed it, but nothing orders the two: no chain of deps (or one stream's order) "
          "leads from instruction " +
          std::to_string(previous.freed_by) + " to instruction " + std::to_string(instruction) +
          "; add a dependency of instruction " + std::to_string(instruction) + " on instruction " +
          std::to_string(previous.freed_by));
    }
  }

  using Segments = std::map<int64_t, std::pair<int64_t, int>>;  // start -> (end, handle)
  // The first segment at or after `cut`, splitting the one that straddles it.
  Segments::iterator SplitAt(int64_t cut) {
    auto it = segments_.upper_bound(cut);
    if (it == segments_.begin()) return it;
    const auto previous = std::prev(it);
    if (previous->first == cut) return previous;
    if (previous->second.first <= cut) return it;
    it = segments_.emplace_hint(it, cut, previous->second);
    previous->second.first = cut;
    return it;
  }

  const proto::Schedule& schedule_;
  const HappensBefore& order_;
  std::vector<Buffer> buffers_;  // by handle
  // (instruction, tensor, placement micro-step) -> offset, sorted by key.
  std::vector<std::pair<std::tuple<int, int, int>, int64_t>> offsets_;
  // offsets_[range_begin_, range_end_): the placements of instruction range_instruction_, the
  // latest that allocated (allocations come in instruction order).
  int range_instruction_ = kNone;
  size_t range_begin_ = 0, range_end_ = 0;
  // Arena byte ranges -> the buffer that holds or last held them.
  Segments segments_;
  Status status_;
};

}  // namespace

class HappensBeforeCheck::Checker : public OrderChecker {
  using OrderChecker::OrderChecker;
};

HappensBeforeCheck::HappensBeforeCheck(const proto::Schedule& schedule) : schedule_(schedule) {}
HappensBeforeCheck::~HappensBeforeCheck() = default;

const Status& HappensBeforeCheck::status() const { return checker_ ? checker_->status() : ok_; }

HappensBeforeCheck::Checker& HappensBeforeCheck::checker() {
  if (!checker_) {
    order_ = std::make_unique<HappensBefore>(schedule_);
    checker_ = std::make_unique<Checker>(schedule_, *order_);
  }
  return *checker_;
}

void HappensBeforeCheck::Allocated(int instruction, const BufferKey& key, int64_t size_bytes,
                                   BufferKind kind, bool at_end, int handle) {
  checker().Allocated(instruction, key, size_bytes, kind, at_end, handle);
}

void HappensBeforeCheck::Freed(int instruction, const BufferKey& key, int64_t size_bytes,
                               BufferKind kind, bool at_end, int handle) {
  checker().Freed(instruction, key, size_bytes, kind, at_end, handle);
}

void HappensBeforeCheck::Renamed(int instruction, const BufferKey& from, const BufferKey& to,
                                 int handle) {
  checker().Renamed(instruction, from, to, handle);
}

void HappensBeforeCheck::Accessed(int instruction, const BufferKey& key, BufferAccess access,
                                  int handle) {
  checker().Accessed(instruction, key, access, handle);
}

// The listener on a replay of its own, stopping at the first effect found unordered.
Status CheckHappensBefore(const proto::Schedule& schedule) {
  HappensBeforeCheck check(schedule);
  BufferReplay replay(schedule, &check);
  replay.Start();
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    DC_RETURN_IF_ERROR(replay.Apply(i));
    if (!check.status().ok()) return check.status();
  }
  return check.status();
}

}  // namespace dc
