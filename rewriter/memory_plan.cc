#include "rewriter/memory_plan.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>

#include "machine/simulator.h"
#include "rewriter/arena_occupancy.h"
#include "schemas/digest.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc {
namespace {

using rewriter_internal::ArenaOccupancy;
using rewriter_internal::ArenaOccupancy32;

// The buffer effects (schemas/effects.h) as lifetimes over instruction indices: a buffer is
// held from the instruction that allocates it to the one that frees it (the instruction count
// if none does). Handles number the allocations, so they index the lifetimes.
class Lifetimes : public BufferListener {
 public:
  explicit Lifetimes(int num_instructions) : n_(num_instructions) {}
  void Allocated(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind /*kind*/,
                 bool /*at_end*/, int /*handle*/) override {
    BufferLifetime b;
    b.instruction = instruction;
    b.tensor = key.tensor;
    b.micro_step = key.placement_micro_step();
    b.alloc_index = instruction;
    b.free_index = n_;
    b.size_bytes = size_bytes;
    buffers_.push_back(b);
  }
  void Freed(int instruction, const BufferKey& /*key*/, int64_t /*size_bytes*/, BufferKind /*kind*/,
             bool /*at_end*/, int handle) override {
    buffers_[handle].free_index = instruction;
  }
  std::vector<BufferLifetime> Take() { return std::move(buffers_); }

 private:
  const int n_;
  std::vector<BufferLifetime> buffers_;
};

int64_t AlignUp(int64_t bytes, int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

const char* OrderName(MemoryPlanOptions::Order order) {
  switch (order) {
    case MemoryPlanOptions::Order::kSizeDescending:
      return "size-descending";
    case MemoryPlanOptions::Order::kAreaDescending:
      return "area-descending";
  }
  return "?";
}

struct Packing {
  std::vector<int64_t> offsets;  // per buffer
  int64_t arena_bytes = 0;
  int spilled = 0;  // buffers placed in a gap free in instruction order only
};

// Lifetimes on one axis: each buffer's alloc_index / free_index are positions in [-1, length].
struct Axis {
  const std::vector<BufferLifetime>* buffers = nullptr;
  int length = 0;
};

// Places the buffers `rest`, in that order, each where Occupancy's best fit puts it above
// `base_bytes` (and over `spill` lifetimes where that ends lower; see Pack), into
// packing->offsets. False, with offsets half written, when an offset would not fit Occupancy's
// offsets (counted in units of unit_bytes, which every reserve and base_bytes is a multiple of).
template <typename Occupancy>
bool PlaceInOrder(const Axis& primary, const Axis* spill, int64_t spill_above_bytes,
                  int64_t unit_bytes, const std::vector<int>& rest,
                  const std::vector<int64_t>& reserve, int64_t base_bytes, Packing* packing) {
  using Offset = typename Occupancy::Range::first_type;
  constexpr int64_t kMaxUnits = static_cast<int64_t>(std::numeric_limits<Offset>::max());
  const std::vector<BufferLifetime>& buffers = *primary.buffers;
  const int64_t base = base_bytes / unit_bytes;
  if (base > kMaxUnits) return false;
  Occupancy occupancy(primary.length);
  std::optional<Occupancy> spill_occupancy;
  if (spill && spill_above_bytes > 0) spill_occupancy.emplace(spill->length);
  packing->spilled = 0;
  for (int b : rest) {
    if (reserve[b] == 0) {
      packing->offsets[b] = base_bytes;  // empty: overlaps nothing
      continue;
    }
    const BufferLifetime& life = buffers[b];
    const int64_t size = reserve[b] / unit_bytes;
    int64_t offset = occupancy.BestFit(life.alloc_index, life.free_index, base, size);
    if (spill_occupancy && offset * unit_bytes + life.size_bytes > spill_above_bytes) {
      const BufferLifetime& spill_life = (*spill->buffers)[b];
      const int64_t spilled =
          spill_occupancy->BestFit(spill_life.alloc_index, spill_life.free_index, base, size);
      if (spilled < offset) {
        offset = spilled;
        ++packing->spilled;
      }
    }
    if (offset + size > kMaxUnits) return false;
    packing->offsets[b] = offset * unit_bytes;
    const typename Occupancy::Range range{static_cast<Offset>(offset),
                                          static_cast<Offset>(offset + size)};
    occupancy.Add(life.alloc_index, life.free_index, range);
    if (spill_occupancy) {
      spill_occupancy->Add((*spill->buffers)[b].alloc_index, (*spill->buffers)[b].free_index,
                           range);
    }
  }
  return true;
}

// Best-fit decreasing in `order` over `primary` lifetimes. With `spill` and spill_above_bytes
// > 0, a buffer whose best place over `primary` ends above spill_above_bytes may take a gap that
// is free over the `spill` lifetimes (which conflict less) if that place ends lower.
Packing Pack(const Axis& primary, const Axis* spill, int64_t spill_above_bytes,
             int64_t alignment_bytes, MemoryPlanOptions::Order order) {
  const std::vector<BufferLifetime>& buffers = *primary.buffers;
  const int n = static_cast<int>(buffers.size());
  Packing packing;
  packing.offsets.assign(n, 0);
  std::vector<int64_t> reserve(n);
  for (int b = 0; b < n; ++b) reserve[b] = AlignUp(buffers[b].size_bytes, alignment_bytes);
  auto whole_step = [&](int b) {
    return buffers[b].alloc_index < 0 && buffers[b].free_index >= primary.length;
  };
  // Ties after the order's keys: the placement key, for determinism.
  auto key_less = [&](int a, int b) {
    const BufferLifetime& x = buffers[a];
    const BufferLifetime& y = buffers[b];
    return std::tie(x.instruction, x.tensor, x.micro_step) <
           std::tie(y.instruction, y.tensor, y.micro_step);
  };

  // Whole-step buffers stacked at the bottom, largest first.
  std::vector<int> stacked, rest;
  for (int b = 0; b < n; ++b) (whole_step(b) ? stacked : rest).push_back(b);
  std::sort(stacked.begin(), stacked.end(), [&](int a, int b) {
    return reserve[a] != reserve[b] ? reserve[a] > reserve[b] : key_less(a, b);
  });
  int64_t base = 0;
  for (int b : stacked) {
    packing.offsets[b] = base;
    base += reserve[b];
  }

  // The order's keys, then earlier allocation, then the placement key (unique per buffer, so
  // the order is total), gathered next to each other so the sort does not chase indices.
  struct RestKey {
    int64_t area;  // reserve x lifetime for kAreaDescending; 0 (no key) otherwise
    int64_t reserve;
    int alloc_index, instruction, tensor, micro_step, buffer;
  };
  std::vector<RestKey> keys;
  keys.reserve(rest.size());
  for (int b : rest) {
    const BufferLifetime& x = buffers[b];
    // Below 2^63: sizes are under 2^40 bytes and lifetimes under 2^23 positions.
    const int64_t lifetime = static_cast<int64_t>(x.free_index) - x.alloc_index + 1;
    const int64_t area =
        order == MemoryPlanOptions::Order::kAreaDescending ? reserve[b] * lifetime : 0;
    keys.push_back({area, reserve[b], x.alloc_index, x.instruction, x.tensor, x.micro_step, b});
  }
  std::sort(keys.begin(), keys.end(), [](const RestKey& x, const RestKey& y) {
    return std::tie(y.area, y.reserve, x.alloc_index, x.instruction, x.tensor, x.micro_step) <
           std::tie(x.area, x.reserve, y.alloc_index, y.instruction, y.tensor, y.micro_step);
  });
  for (size_t k = 0; k < keys.size(); ++k) rest[k] = keys[k].buffer;

  // In units of the alignment (every offset and reserve is a multiple of it): 32 bits hold
  // arenas up to 4 Gi units, 1 TiB at 256-byte alignment; past that, 64.
  if (!PlaceInOrder<ArenaOccupancy32>(primary, spill, spill_above_bytes, alignment_bytes, rest,
                                      reserve, base, &packing)) {
    PlaceInOrder<ArenaOccupancy>(primary, spill, spill_above_bytes, alignment_bytes, rest, reserve,
                                 base, &packing);
  }
  for (int b = 0; b < n; ++b) {
    if (buffers[b].size_bytes > 0) {
      packing.arena_bytes =
          std::max(packing.arena_bytes, packing.offsets[b] + buffers[b].size_bytes);
    }
  }
  return packing;
}

// Most bytes live at once in instruction order, and the first instruction where that happens
// (-1: before the first instruction).
std::pair<int64_t, int> LivePeak(const std::vector<BufferLifetime>& buffers, int num_instructions) {
  // delta[i + 1]: change when instruction i starts (i = -1: start-up).
  std::vector<int64_t> delta(num_instructions + 2, 0);
  for (const BufferLifetime& b : buffers) {
    delta[b.alloc_index + 1] += b.size_bytes;
    if (b.free_index + 2 < static_cast<int>(delta.size())) delta[b.free_index + 2] -= b.size_bytes;
  }
  int64_t live = 0, peak = 0;
  int at = -1;
  for (int i = 0; i < static_cast<int>(delta.size()); ++i) {
    live += delta[i];
    if (live > peak) {
      peak = live;
      at = i - 1;
    }
  }
  return {peak, at};
}

}  // namespace

StatusOr<std::vector<BufferLifetime>> BufferLifetimes(const proto::Schedule& schedule) {
  DC_RETURN_IF_ERROR(CheckReferences(schedule));
  Lifetimes lifetimes(schedule.instructions_size());
  DC_RETURN_IF_ERROR(BufferReplay(schedule, &lifetimes).Run());
  return lifetimes.Take();
}

// Moves lifetimes onto an axis that orders events by simulated time, then instruction index.
// A buffer is freed when its freeing instruction ends, and allocated when its allocating
// instruction starts or, if sooner, when any instruction issued after it frees something (so a
// buffer freed later in issue order never hands its bytes to one allocated earlier: that wait
// would point forwards). Two buffers then share bytes only if one is freed, in time and in issue
// order, before the other is allocated. Positions are ranks of those keys (-1 and the axis
// length keep meaning start-up and end of step); `instruction_at` maps a rank back. `sim` is
// the schedule's simulation.
Status ToSimulatedTimeAxis(const proto::Schedule& schedule, const SimResult& sim,
                           std::vector<BufferLifetime>* buffers, int* axis_length,
                           std::vector<int>* instruction_at) {
  const int n = schedule.instructions_size();
  std::vector<bool> allocates(n, false), frees(n, false);
  for (const BufferLifetime& b : *buffers) {
    if (b.alloc_index >= 0) allocates[b.alloc_index] = true;
    if (b.free_index >= 0 && b.free_index < n) frees[b.free_index] = true;
  }
  // first_free_after[i]: the earliest end of a freeing instruction issued after i.
  std::vector<double> first_free_after(n + 1, std::numeric_limits<double>::infinity());
  for (int i = n - 2; i >= 0; --i) {
    first_free_after[i] = first_free_after[i + 1];
    if (frees[i + 1]) first_free_after[i] = std::min(first_free_after[i], sim.end_seconds[i + 1]);
  }
  // One key per allocating and per freeing instruction (every buffer of an instruction has
  // its key), ranked in one sort: equal keys share a rank.
  struct Key {
    double time_seconds;
    int instruction;
    int* rank;  // where the rank goes
  };
  std::vector<int> alloc_rank(n, -1), free_rank(n, -1);
  std::vector<Key> keys;
  for (int i = 0; i < n; ++i) {
    if (allocates[i]) {
      keys.push_back({std::min(sim.start_seconds[i], first_free_after[i]), i, &alloc_rank[i]});
    }
    if (frees[i]) keys.push_back({sim.end_seconds[i], i, &free_rank[i]});
  }
  auto less = [](const Key& a, const Key& b) {
    return std::tie(a.time_seconds, a.instruction) < std::tie(b.time_seconds, b.instruction);
  };
  std::sort(keys.begin(), keys.end(), less);
  instruction_at->clear();
  for (size_t k = 0; k < keys.size(); ++k) {
    if (k == 0 || less(keys[k - 1], keys[k])) instruction_at->push_back(keys[k].instruction);
    *keys[k].rank = static_cast<int>(instruction_at->size()) - 1;
  }
  const int length = static_cast<int>(instruction_at->size());
  for (BufferLifetime& b : *buffers) {
    b.alloc_index = b.alloc_index >= 0 ? alloc_rank[b.alloc_index] : -1;
    b.free_index = b.free_index < n ? free_rank[b.free_index] : length;
  }
  *axis_length = length;
  return Status::Ok();
}

StatusOr<proto::MemoryPlan> PlanMemory(const proto::Schedule& schedule,
                                       const MemoryPlanOptions& options, int64_t budget_bytes,
                                       const CostModel* costs, MemoryPlanStats* stats,
                                       const SimResult* simulation) {
  if (options.alignment_bytes <= 0 ||
      (options.alignment_bytes & (options.alignment_bytes - 1)) != 0) {
    return Status::Error("memory plan alignment must be a power of two, not " +
                         std::to_string(options.alignment_bytes));
  }
  if (options.orders.empty()) return Status::Error("memory plan: no packing order to try");
  DC_ASSIGN_OR_RETURN(const std::vector<BufferLifetime> in_order, BufferLifetimes(schedule));
  // Lifetimes are positions on an axis of length n: instruction indices, or ranks of simulated
  // times (then `in_order` is the axis a buffer may spill to).
  std::vector<BufferLifetime> buffers = in_order;
  int n = schedule.instructions_size();
  const Axis instruction_axis{&in_order, n};
  std::vector<int> instruction_at;
  const bool in_time =
      options.lifetimes == MemoryPlanOptions::Lifetimes::kInstructionAndSimulatedTime && costs;
  if (in_time) {
    SimResult simulated;
    if (!simulation) {
      SimOptions sim_options;
      sim_options.memory_timeline = false;
      DC_ASSIGN_OR_RETURN(simulated, Simulate(schedule, *costs, sim_options));
      simulation = &simulated;
    }
    DC_RETURN_IF_ERROR(ToSimulatedTimeAxis(schedule, *simulation, &buffers, &n, &instruction_at));
  }
  const Axis primary{&buffers, n};
  const Axis* spill = in_time && options.spill_to_instruction_order ? &instruction_axis : nullptr;

  MemoryPlanStats local;
  MemoryPlanStats& s = stats ? *stats : local;
  s = MemoryPlanStats();
  s.lifetimes = options.lifetimes;
  if (!costs) s.lifetimes = MemoryPlanOptions::Lifetimes::kInstructionOrder;
  s.buffers = static_cast<int>(buffers.size());
  std::tie(s.instruction_order_peak_bytes, s.instruction_order_peak_instruction) =
      LivePeak(in_order, schedule.instructions_size());
  std::tie(s.live_peak_bytes, s.live_peak_instruction) = LivePeak(buffers, n);
  if (!instruction_at.empty() && s.live_peak_instruction >= 0) {
    s.live_peak_instruction = instruction_at[s.live_peak_instruction];
  }

  // Attempts in turn until one fits the budget: every order over the primary lifetimes
  // (spilling only what would end above the budget); then spilling from a lower mark, with the
  // first order; then every order in instruction order alone.
  struct Attempt {
    const Axis* axis;
    const Axis* spill;
    double headroom_fraction;
    MemoryPlanOptions::Order order;
  };
  std::vector<Attempt> attempts;
  for (MemoryPlanOptions::Order order : options.orders) {
    attempts.push_back({&primary, spill, 0.0, order});
  }
  if (spill) {
    for (double fraction : options.spill_headroom_fractions) {
      if (fraction > 0) attempts.push_back({&primary, spill, fraction, options.orders.front()});
    }
  }
  if (in_time && options.fall_back_to_instruction_order) {
    for (MemoryPlanOptions::Order order : options.orders) {
      attempts.push_back({&instruction_axis, nullptr, 0.0, order});
    }
  }
  Packing best;
  best.arena_bytes = -1;
  for (const Attempt& attempt : attempts) {
    ++s.orders_tried;
    const int64_t spill_above =
        budget_bytes -
        static_cast<int64_t>(static_cast<double>(budget_bytes) * attempt.headroom_fraction);
    Packing packing =
        Pack(*attempt.axis, attempt.spill, spill_above, options.alignment_bytes, attempt.order);
    if (best.arena_bytes < 0 || packing.arena_bytes < best.arena_bytes) {
      best = std::move(packing);
      s.order = OrderName(attempt.order);
      if (attempt.axis == &instruction_axis && in_time) {
        s.lifetimes = MemoryPlanOptions::Lifetimes::kInstructionOrder;
        s.live_peak_bytes = s.instruction_order_peak_bytes;
        s.live_peak_instruction = s.instruction_order_peak_instruction;
      }
    }
    if (budget_bytes <= 0 || best.arena_bytes <= budget_bytes) break;
  }
  s.arena_bytes = best.arena_bytes;
  s.spilled_buffers = best.spilled;

  std::vector<int> sorted(buffers.size());
  std::iota(sorted.begin(), sorted.end(), 0);
  std::sort(sorted.begin(), sorted.end(), [&](int a, int b) {
    const BufferLifetime& x = buffers[a];
    const BufferLifetime& y = buffers[b];
    return std::tie(x.instruction, x.tensor, x.micro_step) <
           std::tie(y.instruction, y.tensor, y.micro_step);
  });
  proto::MemoryPlan plan;
  plan.set_arena_bytes(best.arena_bytes);
  plan.mutable_placements()->Reserve(static_cast<int>(buffers.size()));
  for (int b : sorted) {
    proto::BufferPlacement* p = plan.add_placements();
    p->set_instruction(buffers[b].instruction);
    p->set_tensor(buffers[b].tensor);
    p->set_micro_step(buffers[b].micro_step);
    p->set_offset_bytes(best.offsets[b]);
    p->set_size_bytes(buffers[b].size_bytes);
  }
  return plan;
}

std::string PackingMemo::Key(const proto::Schedule& schedule, const MemoryPlanOptions& options,
                             int64_t budget_bytes) {
  // Every instruction's bytes, length-prefixed, written into one buffer.
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream out(&stream);
    for (const proto::Instruction& instr : schedule.instructions()) {
      out.WriteVarint64(instr.ByteSizeLong());
      instr.SerializeWithCachedSizes(&out);
    }
  }
  return Sha256Hex(bytes) + "/" + std::to_string(budget_bytes) + "/" +
         std::to_string(static_cast<int>(options.lifetimes)) + "/" +
         std::to_string(options.alignment_bytes) + "/" +
         (options.orders.empty() ? "none" : OrderName(options.orders.front()));
}

void PackingMemo::Store(const proto::Schedule& schedule, const MemoryPlanOptions& options,
                        int64_t budget_bytes, proto::MemoryPlan plan,
                        const MemoryPlanStats& stats) {
  key_ = Key(schedule, options, budget_bytes);
  entry_.plan = std::move(plan);
  entry_.stats = stats;
}

const PackingMemo::Entry* PackingMemo::FindFitting(const proto::Schedule& schedule,
                                                   const MemoryPlanOptions& options,
                                                   int64_t budget_bytes) const {
  if (key_.empty() || budget_bytes <= 0 || entry_.stats.arena_bytes > budget_bytes) return nullptr;
  return Key(schedule, options, budget_bytes) == key_ ? &entry_ : nullptr;
}

std::optional<PackingMemo::Entry> PackingMemo::TakeFitting(const proto::Schedule& schedule,
                                                           const MemoryPlanOptions& options,
                                                           int64_t budget_bytes) {
  if (!FindFitting(schedule, options, budget_bytes)) return std::nullopt;
  key_.clear();
  return std::move(entry_);
}

StatusOr<std::vector<std::pair<int, int>>> ReuseDependencies(const proto::Schedule& schedule) {
  DC_ASSIGN_OR_RETURN(std::vector<BufferLifetime> buffers, BufferLifetimes(schedule));
  const proto::MemoryPlan& plan = schedule.memory_plan();
  if (static_cast<size_t>(plan.placements_size()) != buffers.size()) {
    return Status::Error("the memory plan places " + std::to_string(plan.placements_size()) +
                         " buffers but the schedule has " + std::to_string(buffers.size()) +
                         "; run the memory-plan pass again");
  }
  // Offsets by placement key, the last placement of a key winning (as assigning into a map
  // would): sorted once, then looked up per buffer.
  using Key = std::tuple<int, int, int>;
  std::vector<std::pair<Key, int64_t>> offset_of;
  offset_of.reserve(plan.placements_size());
  for (const proto::BufferPlacement& p : plan.placements()) {
    offset_of.push_back({{p.instruction(), p.tensor(), p.micro_step()}, p.offset_bytes()});
  }
  auto key_less = [](const std::pair<Key, int64_t>& a, const std::pair<Key, int64_t>& b) {
    return a.first < b.first;
  };
  if (!std::is_sorted(offset_of.begin(), offset_of.end(), key_less)) {
    std::stable_sort(offset_of.begin(), offset_of.end(), key_less);
  }
  auto find_offset = [&](const Key& key) -> const int64_t* {
    auto it = std::upper_bound(offset_of.begin(), offset_of.end(), std::make_pair(key, int64_t{0}),
                               key_less);
    return it != offset_of.begin() && std::prev(it)->first == key ? &std::prev(it)->second
                                                                  : nullptr;
  };
  std::vector<int> order(buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return buffers[a].alloc_index < buffers[b].alloc_index; });
  // Address segments [start, end) -> the buffer that last occupied them.
  using Segments = std::map<int64_t, std::pair<int64_t, int>>;
  Segments last;
  // The first segment at or after `cut`, splitting the one that straddles it.
  auto split_at = [&](int64_t cut) -> Segments::iterator {
    auto it = last.upper_bound(cut);
    if (it == last.begin()) return it;
    const auto previous = std::prev(it);
    if (previous->first == cut) return previous;
    if (previous->second.first <= cut) return it;
    it = last.emplace_hint(it, cut, previous->second);
    previous->second.first = cut;
    return it;
  };
  std::vector<std::pair<int, int>> deps;
  const int n = schedule.instructions_size();
  for (int b : order) {
    const BufferLifetime& buffer = buffers[b];
    const int64_t* offset = find_offset({buffer.instruction, buffer.tensor, buffer.micro_step});
    if (!offset) {
      return Status::Error("the memory plan has no placement for " +
                           schedule.program().tensors(buffer.tensor).name() + " of instruction " +
                           std::to_string(buffer.instruction) + "; run the memory-plan pass again");
    }
    if (buffer.size_bytes == 0) continue;
    const int64_t start = *offset, end = start + buffer.size_bytes;
    // Split the segments straddling the ends, then take over everything in between.
    const Segments::iterator first = split_at(start);
    const Segments::iterator stop = split_at(end);
    for (auto it = first; it != stop; ++it) {
      const BufferLifetime& previous = buffers[it->second.second];
      if (previous.free_index >= buffer.alloc_index) {
        return Status::Error("the memory plan overlaps two live buffers (" +
                             schedule.program().tensors(previous.tensor).name() + " and " +
                             schedule.program().tensors(buffer.tensor).name() +
                             "); run the memory-plan pass again");
      }
      const int freed_by = previous.free_index;
      const int allocated_by = buffer.alloc_index;
      if (freed_by >= 0 && freed_by < n && allocated_by >= 0 &&
          schedule.instructions(freed_by).stream() !=
              schedule.instructions(allocated_by).stream()) {
        deps.emplace_back(allocated_by, freed_by);
      }
    }
    last.erase(first, stop);
    last.emplace_hint(stop, start, std::make_pair(end, b));
  }
  std::sort(deps.begin(), deps.end());
  deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
  return deps;
}

Status AddReuseDependencies(proto::Schedule* schedule, int* added) {
  DC_ASSIGN_OR_RETURN(auto deps, ReuseDependencies(*schedule));
  int count = 0;
  for (size_t i = 0; i < deps.size();) {
    const int instruction = deps[i].first;
    proto::Instruction* instr = schedule->mutable_instructions(instruction);
    std::vector<int> all(instr->deps().begin(), instr->deps().end());
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    const size_t before = all.size();
    for (; i < deps.size() && deps[i].first == instruction; ++i) all.push_back(deps[i].second);
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    count += static_cast<int>(all.size() - before);
    instr->clear_deps();
    for (int d : all) instr->add_deps(d);
  }
  if (added) *added = count;
  return Status::Ok();
}

std::string MemoryPlanPass::OptionsText() const {
  std::string text = "alignment=" + std::to_string(options_.alignment_bytes) + ",orders=";
  for (size_t i = 0; i < options_.orders.size(); ++i) {
    text += std::string(i ? "+" : "") + OrderName(options_.orders[i]);
  }
  text += std::string(",lifetimes=") +
          (options_.lifetimes == MemoryPlanOptions::Lifetimes::kInstructionOrder
               ? "instruction-order"
               : "instruction-and-simulated-time");
  text += std::string(",spill=") + (options_.spill_to_instruction_order ? "1" : "0");
  for (double fraction : options_.spill_headroom_fractions) {
    text += "," + std::to_string(fraction);
  }
  text += std::string(",fall_back=") + (options_.fall_back_to_instruction_order ? "1" : "0");
  text += std::string(",reuse_dependencies=") + (options_.add_reuse_dependencies ? "1" : "0");
  return text;
}

StatusOr<bool> MemoryPlanPass::Run(proto::Schedule* schedule, const PassContext& context) {
  summary_.clear();
  reuse_dependencies_added_ = 0;
  const int64_t budget = context.budget_bytes;
  proto::MemoryPlan plan;
  std::optional<PackingMemo::Entry> packed =
      context.packings ? context.packings->TakeFitting(*schedule, options_, budget) : std::nullopt;
  if (packed) {
    plan = std::move(packed->plan);
    stats_ = packed->stats;
  } else {
    DC_ASSIGN_OR_RETURN(plan, PlanMemory(*schedule, options_, budget, context.costs, &stats_,
                                         context.input_simulation));
  }
  static const CostModel kFallback;
  const CostModel& costs = context.costs ? *context.costs : kFallback;
  SimOptions sim_options;
  sim_options.memory_timeline = false;
  SimResult sim;
  if (context.input_simulation) {
    sim = *context.input_simulation;
  } else {
    DC_ASSIGN_OR_RETURN(sim, Simulate(*schedule, costs, sim_options));
  }
  simulated_peak_bytes_ = sim.peak_device_bytes;
  const bool in_order = stats_.lifetimes == MemoryPlanOptions::Lifetimes::kInstructionOrder;
  const double fragmentation =
      stats_.live_peak_bytes > 0
          ? 100.0 * static_cast<double>(stats_.arena_bytes - stats_.live_peak_bytes) /
                static_cast<double>(stats_.live_peak_bytes)
          : 0.0;
  char text[512];
  std::snprintf(text, sizeof(text),
                "arena %s for %d buffers (%s lifetimes, %s order, %d tried, %d buffers reuse "
                "bytes in instruction order only); live peak %s (%+.2f%% fragmentation); "
                "simulated peak %s; budget %s",
                FormatBytes(stats_.arena_bytes).c_str(), stats_.buffers,
                in_order ? "instruction-order" : "simulated-time", stats_.order.c_str(),
                stats_.orders_tried, stats_.spilled_buffers,
                FormatBytes(stats_.live_peak_bytes).c_str(), fragmentation,
                FormatBytes(simulated_peak_bytes_).c_str(),
                budget > 0 ? FormatBytes(budget).c_str() : "none");
  summary_ = text;
  if (budget > 0 && stats_.arena_bytes > budget) {
    std::string why;
    if (stats_.instruction_order_peak_bytes > budget) {
      why = "; " + FormatBytes(stats_.instruction_order_peak_bytes) +
            " are held at once at instruction " +
            std::to_string(stats_.instruction_order_peak_instruction) + ", so no packing fits";
    } else {
      why = "; at most " + FormatBytes(stats_.live_peak_bytes) + " are held at once (" +
            (in_order ? "instruction order" : "simulated time") + ")";
    }
    return Status::Error("the memory plan's arena needs " + FormatBytes(stats_.arena_bytes) +
                         " (best of " + std::to_string(stats_.orders_tried) +
                         " packing orders), over the budget of " + FormatBytes(budget) + why +
                         " (simulated peak " + FormatBytes(simulated_peak_bytes_) +
                         "); raise --budget");
  }
  bool changed = schedule->memory_plan().SerializeAsString() != plan.SerializeAsString();
  *schedule->mutable_memory_plan() = std::move(plan);
  // Reuse in instruction order only is safe on asynchronous streams only with its waits.
  if (options_.add_reuse_dependencies || in_order || stats_.spilled_buffers > 0) {
    DC_RETURN_IF_ERROR(AddReuseDependencies(schedule, &reuse_dependencies_added_));
    changed |= reuse_dependencies_added_ > 0;
    DC_ASSIGN_OR_RETURN(SimResult ordered, Simulate(*schedule, costs, sim_options));
    std::snprintf(text, sizeof(text), "; %d reuse dependencies: step %.4f s -> %.4f s",
                  reuse_dependencies_added_, sim.step_seconds, ordered.step_seconds);
    summary_ += text;
  }
  return changed;
}

std::unique_ptr<Pass> MakeMemoryPlanPass(MemoryPlanOptions options) {
  return std::make_unique<MemoryPlanPass>(std::move(options));
}

}  // namespace dc
