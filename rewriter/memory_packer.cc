#include "rewriter/memory_packer.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>

#include "rewriter/arena_occupancy.h"
#include "rewriter/memory_lifetimes.h"
#include "schemas/digest.h"
#include "schemas/units.h"

namespace dc {
namespace {

using rewriter_internal::ArenaOccupancy;
using rewriter_internal::ArenaOccupancy32;
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

// One packing PlanMemory tries: an order over the lifetimes of `axis`, spilling to `spill`
// (optional) from `headroom_fraction` below the budget.
struct Attempt {
  const Axis* axis;
  const Axis* spill;
  double headroom_fraction;
  MemoryPlanOptions::Order order;
};

// Attempts in turn until one fits the budget: every order over the primary lifetimes
// (spilling only what would end above the budget); then spilling from a lower mark, with the
// first order; then every order in instruction order alone (`fall_back`, where the primary
// lifetimes are in simulated time).
std::vector<Attempt> Attempts(const MemoryPlanOptions& options, const Axis& primary,
                              const Axis* spill, const Axis* fall_back) {
  std::vector<Attempt> attempts;
  for (MemoryPlanOptions::Order order : options.orders) {
    attempts.push_back({&primary, spill, 0.0, order});
  }
  if (spill) {
    for (double fraction : options.spill_headroom_fractions) {
      if (fraction > 0) attempts.push_back({&primary, spill, fraction, options.orders.front()});
    }
  }
  if (fall_back && options.fall_back_to_instruction_order) {
    for (MemoryPlanOptions::Order order : options.orders) {
      attempts.push_back({fall_back, nullptr, 0.0, order});
    }
  }
  return attempts;
}

// The plan of `packing`: placements sorted by (instruction, tensor, micro_step).
proto::MemoryPlan ToPlan(const std::vector<BufferLifetime>& buffers, const Packing& packing) {
  std::vector<int> sorted(buffers.size());
  std::iota(sorted.begin(), sorted.end(), 0);
  std::sort(sorted.begin(), sorted.end(), [&](int a, int b) {
    const BufferLifetime& x = buffers[a];
    const BufferLifetime& y = buffers[b];
    return std::tie(x.instruction, x.tensor, x.micro_step) <
           std::tie(y.instruction, y.tensor, y.micro_step);
  });
  proto::MemoryPlan plan;
  plan.set_arena_bytes(packing.arena_bytes);
  plan.mutable_placements()->Reserve(static_cast<int>(buffers.size()));
  for (int b : sorted) {
    proto::BufferPlacement* p = plan.add_placements();
    p->set_instruction(buffers[b].instruction);
    p->set_tensor(buffers[b].tensor);
    p->set_micro_step(buffers[b].micro_step);
    p->set_offset_bytes(packing.offsets[b]);
    p->set_size_bytes(buffers[b].size_bytes);
  }
  return plan;
}

}  // namespace

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

  const std::vector<Attempt> attempts =
      Attempts(options, primary, spill, in_time ? &instruction_axis : nullptr);
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

  return ToPlan(buffers, best);
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

StatusOr<int64_t> ArenaBytesWithoutWaits(const proto::Schedule& schedule,
                                         const MemoryPlanOptions& options, int64_t budget_bytes,
                                         const CostModel* costs, const SimResult* simulation,
                                         PackingMemo* memo) {
  MemoryPlanOptions first = options;
  first.orders.resize(1);
  first.spill_to_instruction_order = false;
  first.fall_back_to_instruction_order = false;
  MemoryPlanStats stats;
  DC_ASSIGN_OR_RETURN(proto::MemoryPlan plan,
                      PlanMemory(schedule, first, budget_bytes, costs, &stats, simulation));
  if (memo) memo->Store(schedule, first, budget_bytes, std::move(plan), stats);
  return stats.arena_bytes;
}

std::string MemoryPlanOptionsText(const MemoryPlanOptions& options) {
  std::vector<std::string> orders;
  for (MemoryPlanOptions::Order order : options.orders) orders.push_back(OrderName(order));
  std::string text =
      "alignment=" + std::to_string(options.alignment_bytes) + ",orders=" + Join(orders, "+");
  text += std::string(",lifetimes=") +
          (options.lifetimes == MemoryPlanOptions::Lifetimes::kInstructionOrder
               ? "instruction-order"
               : "instruction-and-simulated-time");
  text += std::string(",spill=") + (options.spill_to_instruction_order ? "1" : "0");
  for (double fraction : options.spill_headroom_fractions) {
    text += "," + std::to_string(fraction);
  }
  text += std::string(",fall_back=") + (options.fall_back_to_instruction_order ? "1" : "0");
  text += std::string(",reuse_dependencies=") + (options.add_reuse_dependencies ? "1" : "0");
  return text;
}

}  // namespace dc
