#include "rewriter/memory_packer.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>

#include "rewriter/arena_occupancy.h"
#include "rewriter/memory_lifetimes.h"
#include "rewriter/tasks.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc {
namespace {

using rewriter_internal::ArenaOccupancy;
using rewriter_internal::ArenaOccupancy32;
using rewriter_internal::ThreadShare;
int64_t AlignUp(int64_t bytes, int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

const char* OrderName(MemoryPlanOptions::Order order) {
  switch (order) {
    case MemoryPlanOptions::Order::kSizeDescending:
      return "size-descending";
    case MemoryPlanOptions::Order::kAreaDescending:
      return "area-descending";
    case MemoryPlanOptions::Order::kBreadthDescending:
      return "breadth-descending";
    case MemoryPlanOptions::Order::kBreadthSizeDescending:
      return "breadth-size-descending";
    case MemoryPlanOptions::Order::kEdgesFromTheTop:
      return "edges-from-the-top";
  }
  return "?";
}

// "size-descending+breadth-descending"
std::string OrderNames(const std::vector<MemoryPlanOptions::Order>& orders) {
  std::vector<std::string> names;
  for (MemoryPlanOptions::Order order : orders) names.push_back(OrderName(order));
  return Join(names, "+");
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

// Places the buffers `from_top`, then `rest`, each in its list's order, into packing->offsets:
// one of `from_top` at the highest free place below `ceiling_bytes` where there is one, every
// other where Occupancy's best fit puts it above `base_bytes` (and over `spill` lifetimes where
// that ends lower; see Pack). False, with offsets half written, when an offset would not fit
// Occupancy's offsets (counted in units of unit_bytes, which every reserve and base_bytes is a
// multiple of). `reuse` (optional): an occupancy to reset and place in, keeping its memory.
// `fixed` (optional): buffers whose offsets packing->offsets holds already, taken before any is
// placed. `hints` (optional): per buffer of `rest` an offset to take if it is free (-1: none),
// tried in the list's order once `from_top` is placed, before the rest is placed otherwise.
template <typename Occupancy>
bool PlaceInOrder(const Axis& primary, const Axis* spill, int64_t spill_above_bytes,
                  int64_t unit_bytes, const std::vector<int>& from_top, int64_t ceiling_bytes,
                  const std::vector<int>& rest, const std::vector<int64_t>& reserve,
                  int64_t base_bytes, Packing* packing, Occupancy* reuse,
                  const std::vector<int>* fixed = nullptr,
                  const std::vector<int64_t>* hints = nullptr) {
  using Offset = typename Occupancy::Range::first_type;
  constexpr int64_t kMaxUnits = static_cast<int64_t>(std::numeric_limits<Offset>::max());
  const std::vector<BufferLifetime>& buffers = *primary.buffers;
  const int64_t base = base_bytes / unit_bytes;
  if (base > kMaxUnits) return false;
  std::optional<Occupancy> own;
  if (reuse) {
    reuse->Reset(primary.length);
  } else {
    own.emplace(primary.length);
  }
  Occupancy& occupancy = reuse ? *reuse : *own;
  std::optional<Occupancy> spill_occupancy;
  if (spill && spill_above_bytes > 0) spill_occupancy.emplace(spill->length);
  packing->spilled = 0;
  const int64_t ceiling = ceiling_bytes / unit_bytes;
  // Places buffer b: from the top, the highest place under the ceiling where there is room;
  // else the best fit (which may spill, see Pack).
  auto place = [&](int b, bool from_top_down) {
    if (reserve[b] == 0) {
      packing->offsets[b] = base_bytes;  // empty: overlaps nothing
      return true;
    }
    const BufferLifetime& life = buffers[b];
    const int64_t size = reserve[b] / unit_bytes;
    int64_t offset =
        from_top_down ? occupancy.HighestFit(life.alloc_index, life.free_index, base, ceiling, size)
                      : -1;
    if (offset < 0) {
      offset = occupancy.BestFit(life.alloc_index, life.free_index, base, size);
      if (spill_occupancy && offset * unit_bytes + life.size_bytes > spill_above_bytes) {
        const BufferLifetime& spill_life = (*spill->buffers)[b];
        const int64_t spilled =
            spill_occupancy->BestFit(spill_life.alloc_index, spill_life.free_index, base, size);
        if (spilled < offset) {
          offset = spilled;
          ++packing->spilled;
        }
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
    return true;
  };
  if (fixed) {
    for (int b : *fixed) {
      if (reserve[b] == 0) continue;
      const int64_t offset = packing->offsets[b] / unit_bytes;
      const int64_t size = reserve[b] / unit_bytes;
      if (offset + size > kMaxUnits) return false;
      occupancy.Add(buffers[b].alloc_index, buffers[b].free_index,
                    {static_cast<Offset>(offset), static_cast<Offset>(offset + size)});
    }
  }
  for (int b : from_top) {
    if (!place(b, true)) return false;
  }
  std::vector<char> hinted;
  if (hints) {
    hinted.assign(buffers.size(), 0);
    for (int b : rest) {
      if ((*hints)[b] < 0 || reserve[b] == 0) continue;
      const BufferLifetime& life = buffers[b];
      const int64_t offset = (*hints)[b] / unit_bytes;
      const int64_t size = reserve[b] / unit_bytes;
      if (offset + size > kMaxUnits ||
          occupancy.HighestFit(life.alloc_index, life.free_index, offset, offset + size, size) !=
              offset) {
        continue;
      }
      packing->offsets[b] = offset * unit_bytes;
      occupancy.Add(life.alloc_index, life.free_index,
                    {static_cast<Offset>(offset), static_cast<Offset>(offset + size)});
      hinted[b] = 1;
    }
  }
  for (int b : rest) {
    if (!hinted.empty() && hinted[b]) continue;
    if (!place(b, false)) return false;
  }
  return true;
}

// For each buffer, the most reserved bytes live at once at some position of its lifetime (the
// live curve's maximum over [alloc_index, free_index]), from a max segment tree over the curve.
std::vector<int64_t> BusiestLiveBytes(const Axis& axis, const std::vector<int64_t>& reserve) {
  const std::vector<BufferLifetime>& buffers = *axis.buffers;
  // Position p (-1 .. length) is leaf p + 1; delta[p + 1] is the change where p starts.
  const int positions = axis.length + 2;
  std::vector<int64_t> delta(positions + 1, 0);
  for (size_t b = 0; b < buffers.size(); ++b) {
    delta[buffers[b].alloc_index + 1] += reserve[b];
    delta[std::min(buffers[b].free_index + 2, positions)] -= reserve[b];
  }
  int leaves = 1;
  while (leaves < positions) leaves *= 2;
  std::vector<int64_t> tree(2 * static_cast<size_t>(leaves), 0);
  int64_t live = 0;
  for (int p = 0; p < positions; ++p) {
    live += delta[p];
    tree[leaves + p] = live;
  }
  for (int node = leaves - 1; node >= 1; --node) {
    tree[node] = std::max(tree[2 * node], tree[2 * node + 1]);
  }
  std::vector<int64_t> busiest(buffers.size(), 0);
  for (size_t b = 0; b < buffers.size(); ++b) {
    int lo = buffers[b].alloc_index + 1 + leaves;
    int hi = std::min(buffers[b].free_index + 1, positions - 1) + 1 + leaves;
    int64_t most = 0;
    for (; lo < hi; lo /= 2, hi /= 2) {
      if (lo & 1) most = std::max(most, tree[lo++]);
      if (hi & 1) most = std::max(most, tree[--hi]);
    }
    busiest[b] = most;
  }
  return busiest;
}

// The sequence a best fit in `order` over `primary` lifetimes places the buffers in: those
// alive the whole step stacked at the bottom first, largest first (they overlap every other
// buffer, so no packing does better), then the rest by the order's keys.
struct Sequence {
  std::vector<int64_t> reserve;  // per buffer: its size rounded up to the alignment
  std::vector<int> stacked;      // the whole-step buffers, bottom up
  // kEdgesFromTheTop's buffers alive at one edge of the step, top down from ceiling_bytes (the
  // most reserved bytes live at once); empty in the other orders.
  std::vector<int> from_top;
  int64_t ceiling_bytes = 0;
  std::vector<int> rest;  // the other buffers, in the order's sequence
};

Sequence SequenceOf(const Axis& primary, int64_t alignment_bytes, MemoryPlanOptions::Order order) {
  const std::vector<BufferLifetime>& buffers = *primary.buffers;
  const int n = static_cast<int>(buffers.size());
  Sequence sequence;
  std::vector<int64_t>& reserve = sequence.reserve;
  reserve.resize(n);
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
  std::vector<int>& stacked = sequence.stacked;
  std::vector<int>& rest = sequence.rest;
  const bool edges = order == MemoryPlanOptions::Order::kEdgesFromTheTop;
  std::vector<int> at_start, at_end;
  for (int b = 0; b < n; ++b) {
    if (whole_step(b)) {
      stacked.push_back(b);
    } else if (edges && buffers[b].alloc_index < 0) {
      at_start.push_back(b);
    } else if (edges && buffers[b].free_index >= primary.length) {
      at_end.push_back(b);
    } else {
      rest.push_back(b);
    }
  }
  std::sort(stacked.begin(), stacked.end(), [&](int a, int b) {
    return reserve[a] != reserve[b] ? reserve[a] > reserve[b] : key_less(a, b);
  });
  // Longest-lived first: from the top, so the bytes they leave are one run under them.
  std::sort(at_start.begin(), at_start.end(), [&](int a, int b) {
    return buffers[a].free_index != buffers[b].free_index
               ? buffers[a].free_index > buffers[b].free_index
               : key_less(a, b);
  });
  std::sort(at_end.begin(), at_end.end(), [&](int a, int b) {
    return buffers[a].alloc_index != buffers[b].alloc_index
               ? buffers[a].alloc_index < buffers[b].alloc_index
               : key_less(a, b);
  });
  sequence.from_top = std::move(at_start);
  sequence.from_top.insert(sequence.from_top.end(), at_end.begin(), at_end.end());

  // The order's keys, then earlier allocation, then the placement key (unique per buffer, so
  // the order is total), gathered next to each other so the sort does not chase indices.
  struct RestKey {
    // reserve x lifetime for kAreaDescending; the most bytes live at once during the lifetime
    // for the breadth orders; 0 (no key) otherwise
    int64_t area;
    int64_t lifetime;  // for kBreadthDescending and kEdgesFromTheTop; 0 (no key) otherwise
    int64_t reserve;
    int alloc_index, instruction, tensor, micro_step, buffer;
  };
  std::vector<RestKey> keys;
  keys.reserve(rest.size());
  const bool breadth = order == MemoryPlanOptions::Order::kBreadthDescending ||
                       order == MemoryPlanOptions::Order::kBreadthSizeDescending || edges;
  const bool by_lifetime = order == MemoryPlanOptions::Order::kBreadthDescending || edges;
  const std::vector<int64_t> busiest =
      breadth ? BusiestLiveBytes(primary, reserve) : std::vector<int64_t>();
  if (edges) {
    for (int b = 0; b < n; ++b)
      sequence.ceiling_bytes = std::max(sequence.ceiling_bytes, busiest[b]);
  }
  for (int b : rest) {
    const BufferLifetime& x = buffers[b];
    // Below 2^63: sizes are under 2^40 bytes and lifetimes under 2^23 positions.
    const int64_t lifetime = static_cast<int64_t>(x.free_index) - x.alloc_index + 1;
    int64_t area = 0, breadth_lifetime = 0;
    if (order == MemoryPlanOptions::Order::kAreaDescending) area = reserve[b] * lifetime;
    if (breadth) area = busiest[b];
    if (by_lifetime) breadth_lifetime = lifetime;
    keys.push_back({area, breadth_lifetime, reserve[b], x.alloc_index, x.instruction, x.tensor,
                    x.micro_step, b});
  }
  std::sort(keys.begin(), keys.end(), [](const RestKey& x, const RestKey& y) {
    return std::tie(y.area, y.lifetime, y.reserve, x.alloc_index, x.instruction, x.tensor,
                    x.micro_step) < std::tie(x.area, x.lifetime, x.reserve, y.alloc_index,
                                             y.instruction, y.tensor, y.micro_step);
  });
  for (size_t k = 0; k < keys.size(); ++k) rest[k] = keys[k].buffer;
  return sequence;
}

// The end of the highest buffer at `offsets`.
int64_t ArenaOf(const std::vector<BufferLifetime>& buffers, const std::vector<int64_t>& offsets) {
  int64_t arena_bytes = 0;
  for (size_t b = 0; b < buffers.size(); ++b) {
    if (buffers[b].size_bytes > 0) {
      arena_bytes = std::max(arena_bytes, offsets[b] + buffers[b].size_bytes);
    }
  }
  return arena_bytes;
}

// Up to `rounds` times: every buffer placed again, lowest offset first (ties by index), each at
// the lowest offset free during its lifetime among those placed again before it, until a round
// lowers the arena no further; buffers alive the whole step stay where they are. No buffer moves
// up: those that overlap it in time and were placed again before it lay below it and have only
// come down, so its old offset is still free. A best fit takes the smallest gap, not the lowest,
// and leaves bytes empty under a buffer that the buffers placed after it never needed; this
// takes them. `packing` must be valid over `axis` (no spills); `occupancy` counts in units of
// alignment_bytes (every offset and reserve is a multiple of it) and is reset and placed in.
template <typename Occupancy>
void Compact(const Axis& axis, int64_t alignment_bytes, int rounds, Packing* packing,
             Occupancy* occupancy) {
  using Offset = typename Occupancy::Range::first_type;
  const std::vector<BufferLifetime>& buffers = *axis.buffers;
  std::vector<int> movable, whole_step;
  for (int b = 0; b < static_cast<int>(buffers.size()); ++b) {
    if (buffers[b].size_bytes == 0) continue;
    const bool whole = buffers[b].alloc_index < 0 && buffers[b].free_index >= axis.length;
    (whole ? whole_step : movable).push_back(b);
  }
  auto add = [&](int b, int64_t offset) {
    const int64_t size = AlignUp(buffers[b].size_bytes, alignment_bytes) / alignment_bytes;
    occupancy->Add(buffers[b].alloc_index, buffers[b].free_index,
                   {static_cast<Offset>(offset), static_cast<Offset>(offset + size)});
  };
  for (int round = 0; round < rounds; ++round) {
    std::stable_sort(movable.begin(), movable.end(),
                     [&](int a, int b) { return packing->offsets[a] < packing->offsets[b]; });
    occupancy->Reset(axis.length);
    for (int b : whole_step) add(b, packing->offsets[b] / alignment_bytes);
    std::vector<int64_t> lowered = packing->offsets;
    for (int b : movable) {
      const BufferLifetime& life = buffers[b];
      const int64_t size = AlignUp(life.size_bytes, alignment_bytes) / alignment_bytes;
      const int64_t offset = occupancy->LowestFit(life.alloc_index, life.free_index, 0, size);
      lowered[b] = offset * alignment_bytes;
      add(b, offset);
    }
    const int64_t lowered_arena_bytes = ArenaOf(buffers, lowered);
    if (lowered_arena_bytes >= packing->arena_bytes) return;
    packing->offsets = std::move(lowered);
    packing->arena_bytes = lowered_arena_bytes;
  }
}

// Best fit over `primary` lifetimes in `sequence`; with `marks` (optional), the buffers placed by
// their marks descending (how many earlier packings put them above the live peak), ties in the
// sequence's order. With `spill` and spill_above_bytes > 0, a buffer whose best place over
// `primary` ends above spill_above_bytes may take a gap that is free over the `spill` lifetimes
// (which conflict less) if that place ends lower. `reuse` (optional): the occupancy to place in
// (reset first), so that packings one after another allocate it once.
Packing Pack(const Axis& primary, const Axis* spill, int64_t spill_above_bytes,
             int64_t alignment_bytes, const Sequence& sequence, const std::vector<int>* marks,
             ArenaOccupancy32* reuse) {
  const std::vector<BufferLifetime>& buffers = *primary.buffers;
  const int n = static_cast<int>(buffers.size());
  Packing packing;
  packing.offsets.assign(n, 0);
  int64_t base = 0;
  for (int b : sequence.stacked) {
    packing.offsets[b] = base;
    base += sequence.reserve[b];
  }
  const std::vector<int>* rest = &sequence.rest;
  std::vector<int> by_marks;
  if (marks) {
    by_marks = sequence.rest;
    std::stable_sort(by_marks.begin(), by_marks.end(),
                     [&](int a, int b) { return (*marks)[a] > (*marks)[b]; });
    rest = &by_marks;
  }

  // In units of the alignment (every offset and reserve is a multiple of it): 32 bits hold
  // arenas up to 4 Gi units, 1 TiB at 256-byte alignment; past that, 64.
  if (!PlaceInOrder<ArenaOccupancy32>(primary, spill, spill_above_bytes, alignment_bytes,
                                      sequence.from_top, sequence.ceiling_bytes, *rest,
                                      sequence.reserve, base, &packing, reuse)) {
    PlaceInOrder<ArenaOccupancy>(primary, spill, spill_above_bytes, alignment_bytes,
                                 sequence.from_top, sequence.ceiling_bytes, *rest, sequence.reserve,
                                 base, &packing, nullptr);
  }
  packing.arena_bytes = ArenaOf(buffers, packing.offsets);
  return packing;
}

// Micro-steps that repeat on the primary axis: `repeats` windows of `length` positions from
// `start`, each holding the same buffers (by tensor, size and lifetime relative to the window's
// start) as the first. Only buffers allocated and freed within the step and living fewer than
// `length` positions count (so no buffer overlaps its own copy in the next window); the others
// are the step's edges.
struct Period {
  int start = 0;
  int length = 0;
  int repeats = 0;
  int slots = 0;             // buffers per window
  std::vector<int> buffers;  // window j's slot t: buffers[j * slots + t]
};

// The longest run of at least `min_repeats` windows, one micro-step long each (the most common
// distance between consecutive micro-steps' first activations), that repeat; none where no run
// is that long.
std::optional<Period> FindPeriod(const Axis& primary, const std::vector<int64_t>& reserve,
                                 int min_repeats) {
  const std::vector<BufferLifetime>& buffers = *primary.buffers;
  std::map<int, int> first;  // micro-step -> its first activation's allocation
  for (const BufferLifetime& b : buffers) {
    if (b.micro_step < 0 || b.alloc_index < 0) continue;
    auto [it, inserted] = first.emplace(b.micro_step, b.alloc_index);
    if (!inserted) it->second = std::min(it->second, b.alloc_index);
  }
  if (static_cast<int>(first.size()) < min_repeats) return std::nullopt;
  std::map<int, int> distances;  // distance -> how many consecutive micro-steps are that far
  for (auto it = first.begin(), next = std::next(it); next != first.end(); ++it, ++next) {
    if (next->first == it->first + 1) ++distances[next->second - it->second];
  }
  int length = 0, most = 0;
  for (const auto& [distance, count] : distances) {
    if (count > most) std::tie(length, most) = std::tie(distance, count);
  }
  if (length <= 0 || most + 1 < min_repeats) return std::nullopt;
  int start = -1;
  for (auto it = first.begin(), next = std::next(it); next != first.end(); ++it, ++next) {
    if (next->first == it->first + 1 && next->second - it->second == length) {
      start = it->second;
      break;
    }
  }
  const int windows = (primary.length - start) / length;
  if (windows < min_repeats) return std::nullopt;
  // Each window's buffers by (relative allocation, lifetime, reserve, tensor), then index.
  struct Slot {
    int alloc, lifetime;
    int64_t reserve;
    int tensor, buffer;
    bool operator<(const Slot& o) const {
      return std::tie(alloc, lifetime, reserve, tensor, buffer) <
             std::tie(o.alloc, o.lifetime, o.reserve, o.tensor, o.buffer);
    }
    bool SameAs(const Slot& o) const {
      return std::tie(alloc, lifetime, reserve, tensor) ==
             std::tie(o.alloc, o.lifetime, o.reserve, o.tensor);
    }
  };
  std::vector<std::vector<Slot>> window(windows);
  for (size_t b = 0; b < buffers.size(); ++b) {
    const BufferLifetime& life = buffers[b];
    if (life.alloc_index < start || life.free_index >= primary.length || reserve[b] == 0 ||
        life.free_index - life.alloc_index >= length) {
      continue;
    }
    const int w = (life.alloc_index - start) / length;
    if (w >= windows) continue;
    window[w].push_back({life.alloc_index - start - w * length, life.free_index - life.alloc_index,
                         reserve[b], life.tensor, static_cast<int>(b)});
  }
  for (std::vector<Slot>& slots : window) std::sort(slots.begin(), slots.end());
  auto same = [&](int a, int b) {
    return window[a].size() == window[b].size() &&
           std::equal(window[a].begin(), window[a].end(), window[b].begin(),
                      [](const Slot& x, const Slot& y) { return x.SameAs(y); });
  };
  int best_first = 0, best_repeats = 0;
  for (int w = 0; w < windows;) {
    int end = w + 1;
    while (end < windows && same(w, end)) ++end;
    if (end - w > best_repeats && !window[w].empty()) {
      best_first = w;
      best_repeats = end - w;
    }
    w = end;
  }
  if (best_repeats < min_repeats) return std::nullopt;
  Period period;
  period.start = start + best_first * length;
  period.length = length;
  period.repeats = best_repeats;
  period.slots = static_cast<int>(window[best_first].size());
  period.buffers.reserve(static_cast<size_t>(period.slots) * best_repeats);
  for (int w = best_first; w < best_first + best_repeats; ++w) {
    for (const Slot& slot : window[w]) period.buffers.push_back(slot.buffer);
  }
  return period;
}

// One window of `period` packed on a circle: its slots' lifetimes taken modulo the window's
// length, so that the same offsets hold for every window of the run, each next to the one
// before and after it. Three copies of the window on an axis of three windows: a slot placed in
// the middle copy overlaps, there, every copy of every slot it meets on the circle.
struct Circle {
  std::vector<BufferLifetime> copies;  // copy k's slot t: copies[k * slots + t]
  int slots = 0;
  int length = 0;               // the axis: three windows
  int64_t live_peak_bytes = 0;  // most bytes live at once on the circle
};

Circle CircleOf(const Axis& primary, const Period& period) {
  const std::vector<BufferLifetime>& buffers = *primary.buffers;
  Circle circle;
  circle.slots = period.slots;
  circle.length = 3 * period.length;
  circle.copies.reserve(3 * static_cast<size_t>(period.slots));
  for (int copy = 0; copy < 3; ++copy) {
    for (int t = 0; t < period.slots; ++t) {
      BufferLifetime life = buffers[period.buffers[t]];
      const int shift = copy * period.length - period.start;
      life.alloc_index += shift;
      life.free_index = std::min(life.free_index + shift, circle.length - 1);
      circle.copies.push_back(life);
    }
  }
  // The middle and last windows hold every copy that is live there (a lifetime is shorter than
  // a window), so the axis' peak is the circle's.
  circle.live_peak_bytes = LivePeak(circle.copies, circle.length).first;
  return circle;
}

// The circle's slots placed in `sequence` (slots), each at its best fit in the middle copy and
// taken in all three: its offsets (in units, from 0) and top in bytes; false where an offset
// would not fit 32 bits.
bool PlaceOnCircle(const Circle& circle, const std::vector<int64_t>& slot_reserve,
                   int64_t unit_bytes, const std::vector<int>& sequence,
                   ArenaOccupancy32* occupancy, std::vector<int64_t>* offsets, int64_t* top_bytes) {
  constexpr int64_t kMaxUnits = std::numeric_limits<uint32_t>::max();
  occupancy->Reset(circle.length);
  offsets->assign(circle.slots, 0);
  *top_bytes = 0;
  for (int t : sequence) {
    const int64_t size = slot_reserve[t] / unit_bytes;
    const BufferLifetime& middle = circle.copies[circle.slots + t];
    const int64_t offset = occupancy->BestFit(middle.alloc_index, middle.free_index, 0, size);
    if (offset + size > kMaxUnits) return false;
    (*offsets)[t] = offset;
    const ArenaOccupancy32::Range range{static_cast<uint32_t>(offset),
                                        static_cast<uint32_t>(offset + size)};
    for (int copy = 0; copy < 3; ++copy) {
      const BufferLifetime& life = circle.copies[copy * circle.slots + t];
      occupancy->Add(life.alloc_index, life.free_index, range);
    }
    *top_bytes = std::max(*top_bytes, offset * unit_bytes + middle.size_bytes);
  }
  return true;
}

// A packing of a step with a period: one window packed on the circle in each of options.orders,
// each with up to options.periodic_repair_rounds repairs (the slots that ended above the circle's
// live peak placed first, the most often first, as PlanMemory's repairs do), the lowest top kept;
// every window's buffers at those offsets above the whole-step buffers and those alive over the
// whole run; then the other buffers (the step's edges, the windows outside the run) around them:
// first each at its twin's offset (the same buffer in the run's first window) where that is free,
// the rest by best fit, in the window's best order and then the others; then, in the best of
// those orders, with twins everywhere and with none. It stops at the first arena `good_enough`
// takes, else keeps the smallest. Placing the periodic buffers takes only those that overlap
// another buffer in time (nothing else is placed where the rest do not live). None where an
// offset would not fit 32-bit units. `description` gets how it packed.
std::optional<Packing> PackPeriodic(
    const Axis& primary, const MemoryPlanOptions& options, const Period& period,
    const std::function<const Sequence&(MemoryPlanOptions::Order)>& sequence_of,
    const std::function<bool(int64_t)>& good_enough, ArenaOccupancy32* occupancy,
    std::string* description) {
  const std::vector<BufferLifetime>& buffers = *primary.buffers;
  const int64_t unit = options.alignment_bytes;
  const Circle circle = CircleOf(primary, period);
  const Axis circle_axis{&circle.copies, circle.length};
  const int slots = period.slots;
  std::vector<int64_t> slot_reserve(slots);
  for (int t = 0; t < slots; ++t) {
    slot_reserve[t] = AlignUp(buffers[period.buffers[t]].size_bytes, unit);
  }
  std::vector<int64_t> best_offsets, offsets;
  int64_t best_top = std::numeric_limits<int64_t>::max();
  std::string best_name;
  MemoryPlanOptions::Order best_order = options.orders.front();
  for (MemoryPlanOptions::Order order : options.orders) {
    if (best_top <= circle.live_peak_bytes) break;
    const Sequence sequence = SequenceOf(circle_axis, unit, order);
    std::vector<int> in_order;
    in_order.reserve(slots);
    for (int c : sequence.rest) {
      if (c >= slots && c < 2 * slots) in_order.push_back(c - slots);
    }
    std::vector<int> marks(slots, 0);
    int64_t order_best = std::numeric_limits<int64_t>::max();
    int without_better = 0;
    for (int round = 0; round <= options.periodic_repair_rounds; ++round) {
      std::vector<int> placed = in_order;
      if (round > 0) {
        bool marked = false;
        for (int t = 0; t < slots; ++t) {
          if (offsets[t] * unit + buffers[period.buffers[t]].size_bytes > circle.live_peak_bytes) {
            ++marks[t];
            marked = true;
          }
        }
        if (!marked) break;
        std::stable_sort(placed.begin(), placed.end(),
                         [&](int a, int b) { return marks[a] > marks[b]; });
      }
      int64_t top = 0;
      if (!PlaceOnCircle(circle, slot_reserve, unit, placed, occupancy, &offsets, &top)) {
        return std::nullopt;
      }
      if (top < best_top) {
        best_top = top;
        best_offsets = offsets;
        best_name = OrderName(order);
        best_order = order;
        if (round > 0) best_name += ", repair round " + std::to_string(round);
      }
      if (top < order_best) {
        order_best = top;
        without_better = 0;
      } else if (++without_better >= options.periodic_repair_patience) {
        break;
      }
      if (top <= circle.live_peak_bytes) break;
    }
  }

  std::vector<char> periodic(buffers.size(), 0);
  for (int b : period.buffers) periodic[b] = 1;
  // The other buffers alive over the whole run (params kept gathered across micro-steps): under
  // the run's layout, on the whole-step buffers, largest first (no address is free under the
  // layout's top for the whole run).
  const int run_end = period.start + period.repeats * period.length;
  std::vector<int> spanning;
  for (size_t b = 0; b < buffers.size(); ++b) {
    const BufferLifetime& life = buffers[b];
    if (periodic[b] || (life.alloc_index < 0 && life.free_index >= primary.length)) continue;
    if (life.alloc_index <= period.start && life.free_index >= run_end - 1) {
      spanning.push_back(static_cast<int>(b));
    }
  }
  std::sort(spanning.begin(), spanning.end(), [&](int a, int b) {
    const int64_t x = AlignUp(buffers[a].size_bytes, unit),
                  y = AlignUp(buffers[b].size_bytes, unit);
    return x != y ? x > y : a < b;
  });
  std::vector<char> placed_first = periodic;
  for (int b : spanning) placed_first[b] = 1;
  // Positions where a buffer outside the run lives (index p + 1 for position p), as prefix
  // counts, so that a periodic buffer is taken only where one of them may meet it.
  std::vector<int> covered(primary.length + 3, 0);
  for (size_t b = 0; b < buffers.size(); ++b) {
    const bool whole_step = buffers[b].alloc_index < 0 && buffers[b].free_index >= primary.length;
    if (placed_first[b] || whole_step) continue;  // placed already, below them all
    ++covered[buffers[b].alloc_index + 1];
    --covered[std::min(buffers[b].free_index + 2, primary.length + 2)];
  }
  std::vector<int> before(primary.length + 4, 0);  // before[i]: covered positions under index i
  for (int i = 0, live = 0; i < primary.length + 3; ++i) {
    live += covered[i];
    before[i + 1] = before[i] + (live > 0 ? 1 : 0);
  }
  std::vector<int> fixed = spanning;
  for (int b : period.buffers) {
    if (before[buffers[b].free_index + 2] > before[buffers[b].alloc_index + 1]) fixed.push_back(b);
  }

  // The other buffers' twins: the run's first window's slot that holds the same tensor, kind
  // (gathered or not) and size, as often before it in its window (by allocation), as the buffer
  // does in its own; its offset is the buffer's hint, so that the micro-steps outside the run
  // take the run's layout where it is free.
  auto window_of = [&](int alloc) {
    const int shifted = alloc - period.start;
    return shifted >= 0 ? shifted / period.length : (shifted - period.length + 1) / period.length;
  };
  using TwinKey = std::tuple<int, int, int64_t, int, int>;  // window, tensor, reserve, kind, nth
  std::vector<int> by_alloc;
  for (size_t b = 0; b < buffers.size(); ++b) {
    if (buffers[b].alloc_index >= 0) by_alloc.push_back(static_cast<int>(b));
  }
  std::stable_sort(by_alloc.begin(), by_alloc.end(),
                   [&](int a, int b) { return buffers[a].alloc_index < buffers[b].alloc_index; });
  std::map<TwinKey, int> seen;
  std::vector<TwinKey> key_of(buffers.size());
  for (int b : by_alloc) {
    const BufferLifetime& life = buffers[b];
    TwinKey key{window_of(life.alloc_index), life.tensor, AlignUp(life.size_bytes, unit),
                life.micro_step == -2 ? -2 : 0, 0};
    std::get<4>(key) = seen[key]++;
    key_of[b] = key;
  }
  std::map<TwinKey, int64_t> twin_offset;  // by key with window 0: the slot's offset in bytes
  for (int t = 0; t < slots; ++t) twin_offset[key_of[period.buffers[t]]] = best_offsets[t] * unit;
  std::vector<int64_t> hints(buffers.size(), -1);
  for (int b : by_alloc) {
    if (placed_first[b]) continue;
    TwinKey key = key_of[b];
    std::get<0>(key) = 0;
    const auto twin = twin_offset.find(key);
    if (twin != twin_offset.end()) hints[b] = twin->second;
  }
  // Twins before the run only, everywhere, or none: after the run, the reloaded shards live to the
  // end of the step, and the last micro-step's buffers, placed first at their twins' offsets,
  // can leave them no address free that long (llama3-405b: 2.3% over the live peak with twins
  // there, 0.47% without); elsewhere the last micro-step is best at its twins' (llama-1b at GAS
  // 8: 4.3% over without, none with).
  enum class Hints { kBeforeTheRun, kEverywhere, kNone };
  auto hints_name = [](Hints h) {
    return h == Hints::kBeforeTheRun ? "twins before the run"
           : h == Hints::kEverywhere ? "twins everywhere"
                                     : "no twins";
  };

  // The other buffers in the window's best order first, then in the others; the other hint sets
  // in the best order found.
  std::vector<MemoryPlanOptions::Order> edge_orders = {best_order};
  for (const std::vector<MemoryPlanOptions::Order>* list :
       {&options.orders, &options.last_orders}) {
    for (MemoryPlanOptions::Order order : *list) {
      if (std::count(edge_orders.begin(), edge_orders.end(), order) == 0) {
        edge_orders.push_back(order);
      }
    }
  }
  std::optional<Packing> best;
  std::string edges_name;
  MemoryPlanOptions::Order best_edge_order = edge_orders.front();
  // Places the rest in `order` with `hint_set`'s twins; false where an offset would not fit.
  auto place_the_rest = [&](Hints hint_set, MemoryPlanOptions::Order order) {
    const Sequence& sequence = sequence_of(order);
    Packing packing;
    packing.offsets.assign(buffers.size(), 0);
    int64_t base = 0;
    for (int b : sequence.stacked) {
      packing.offsets[b] = base;
      base += sequence.reserve[b];
    }
    for (int b : spanning) {
      packing.offsets[b] = base;
      base += sequence.reserve[b];
    }
    for (int t = 0; t < slots; ++t) {
      for (int w = 0; w < period.repeats; ++w) {
        packing.offsets[period.buffers[w * slots + t]] = base + best_offsets[t] * unit;
      }
    }
    std::vector<int64_t> based_hints = hints;
    for (size_t b = 0; b < buffers.size(); ++b) {
      int64_t& hint = based_hints[b];
      const bool wanted = hint_set == Hints::kEverywhere ||
                          (hint_set == Hints::kBeforeTheRun && buffers[b].alloc_index < run_end);
      hint = hint >= 0 && wanted ? hint + base : -1;
    }
    auto outside = [&](const std::vector<int>& list) {
      std::vector<int> kept;
      for (int b : list) {
        if (!placed_first[b]) kept.push_back(b);
      }
      return kept;
    };
    if (!PlaceInOrder<ArenaOccupancy32>(primary, nullptr, 0, unit, outside(sequence.from_top),
                                        sequence.ceiling_bytes, outside(sequence.rest),
                                        sequence.reserve, base, &packing, occupancy, &fixed,
                                        &based_hints)) {
      return false;
    }
    packing.arena_bytes = std::max(packing.arena_bytes, ArenaOf(buffers, packing.offsets));
    if (!best || packing.arena_bytes < best->arena_bytes) {
      best = std::move(packing);
      edges_name = std::string(OrderName(order)) + ", " + hints_name(hint_set);
      best_edge_order = order;
    }
    return true;
  };
  auto done = [&] { return best && good_enough(best->arena_bytes); };
  for (MemoryPlanOptions::Order order : edge_orders) {
    if (done()) break;
    if (!place_the_rest(Hints::kBeforeTheRun, order)) return std::nullopt;
  }
  for (Hints hint_set : {Hints::kEverywhere, Hints::kNone}) {
    if (done()) break;
    if (!place_the_rest(hint_set, best_edge_order)) return std::nullopt;
  }
  *description = "periodic (" + std::to_string(period.repeats) + " repeats of " +
                 std::to_string(period.length) + " positions: " + best_name + "; the rest " +
                 edges_name + ")";
  return best;
}

// One packing PlanMemory tries: an order over the lifetimes of `axis`, spilling to `spill`
// (optional) from `headroom_fraction` below the budget; `repair`: a repair round of the order's
// packings before it (the buffers they put above the live peak placed first, the most often
// first).
struct Attempt {
  const Axis* axis;
  const Axis* spill;
  double headroom_fraction;
  MemoryPlanOptions::Order order;
  bool repair = false;
};

// `rounds` repair rounds, each a repair of every repaired order (those of options.orders).
void AddRepairRounds(const MemoryPlanOptions& options, const Axis& primary, int rounds,
                     std::vector<Attempt>* attempts) {
  for (int round = 0; round < rounds; ++round) {
    for (MemoryPlanOptions::Order order : options.repaired_orders) {
      if (std::count(options.orders.begin(), options.orders.end(), order) > 0) {
        attempts->push_back({&primary, nullptr, 0.0, order, /*repair=*/true});
      }
    }
  }
}

// The packings without waits, tried in turn until one is good enough: every order over the
// primary lifetimes, then round by round a repair of each repaired order (so that a short
// prefix, the offload pass's arena check, packs every order and repairs each once), then the
// last orders.
std::vector<Attempt> AttemptsWithoutWaits(const MemoryPlanOptions& options, const Axis& primary) {
  std::vector<Attempt> attempts;
  for (MemoryPlanOptions::Order order : options.orders) {
    attempts.push_back({&primary, nullptr, 0.0, order});
  }
  AddRepairRounds(options, primary, options.repair_rounds, &attempts);
  for (MemoryPlanOptions::Order order : options.last_orders) {
    attempts.push_back({&primary, nullptr, 0.0, order});
  }
  return attempts;
}

// Where those leave the arena over the budget, attempts in turn until one fits it: every order
// over the primary lifetimes spilling what would end above the budget; then spilling from a
// lower mark, with the first order; then every order in instruction order alone (`fall_back`,
// where the primary lifetimes are in simulated time).
std::vector<Attempt> AttemptsOverBudget(const MemoryPlanOptions& options, const Axis& primary,
                                        const Axis* spill, const Axis* fall_back) {
  std::vector<Attempt> attempts;
  if (spill) {
    for (MemoryPlanOptions::Order order : options.orders) {
      attempts.push_back({&primary, spill, 0.0, order});
    }
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

// The largest arena within `fragmentation` (a fraction) of `live_peak_bytes`.
int64_t TargetArenaBytes(int64_t live_peak_bytes, double fragmentation) {
  const double target = static_cast<double>(live_peak_bytes) * (1 + fragmentation);
  if (target >= static_cast<double>(kUnlimitedBytes)) return kUnlimitedBytes;
  return std::max(live_peak_bytes, static_cast<int64_t>(target));
}

// The periodic packing's options, as text (not periodic_ends_over_budget: where it stops, not
// what it packs).
std::string PeriodicText(const MemoryPlanOptions& options) {
  return "periodic=" + std::string(options.periodic ? "1" : "0") + "," +
         std::to_string(options.periodic_min_repeats) + "," +
         std::to_string(options.periodic_fragmentation) + "," +
         std::to_string(options.periodic_repair_rounds) + "," +
         std::to_string(options.periodic_repair_patience);
}

// The options that decide the packings without waits, as text.
std::string PackingsWithoutWaitsText(const MemoryPlanOptions& options) {
  return "orders=" + OrderNames(options.orders) +
         ",max_fragmentation=" + std::to_string(options.max_fragmentation) +
         ",repaired=" + OrderNames(options.repaired_orders) +
         ",repair_rounds=" + std::to_string(options.repair_rounds) +
         ",repair_patience=" + std::to_string(options.repair_patience) +
         ",over_budget_repair_rounds=" + std::to_string(options.over_budget_repair_rounds) +
         ",over_budget_repair_patience=" + std::to_string(options.over_budget_repair_patience) +
         ",last=" + OrderNames(options.last_orders) +
         ",compaction_rounds=" + std::to_string(options.compaction_rounds) +
         ",max_packings=" + std::to_string(options.max_packings) +
         ",budget_check_packings=" + std::to_string(options.budget_check_packings) + "," +
         PeriodicText(options) +
         ",periodic_ends_over_budget=" + (options.periodic_ends_over_budget ? "1" : "0");
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

// An order's repair rounds: each adds a mark to what that order's last packing put above the
// live peak.
struct Repairs {
  Packing last;            // the order's last packing (empty offsets: not packed)
  std::vector<int> marks;  // per buffer: how many of the order's packings put it above the peak
  int round = 0;
  int64_t best_arena_bytes = 0;  // the order's smallest arena so far
  int rounds_without_better = 0;
  bool done = false;
};

// The options that decide the sequence of packings without waits up to the over-budget repair
// rounds (not where it stops): what a PackingProgress holds.
std::string PackingSequenceText(const MemoryPlanOptions& options) {
  return std::to_string(options.alignment_bytes) + "/" + OrderNames(options.orders) + "/" +
         OrderNames(options.repaired_orders) + "/" + std::to_string(options.repair_rounds) + "/" +
         std::to_string(options.repair_patience) + "/" + OrderNames(options.last_orders) + "/" +
         PeriodicText(options);
}

}  // namespace

// Where PlanMemory's packings without waits stopped, with everything they decide on, so that a
// later PlanMemory of the same lifetimes and budget goes on from there (PackingMemo).
struct PackingProgress {
  std::string sequence;  // PackingSequenceText of the options packed with
  int64_t budget_bytes = 0;
  double max_fragmentation = 0;
  std::vector<BufferLifetime> buffers;  // the primary axis' lifetimes
  int axis_length = 0;
  size_t next_attempt = 0;  // of AttemptsWithoutWaits
  int packed = 0;
  Packing best;                 // of the packings of the whole step
  Packing periodic{{}, -1, 0};  // PackPeriodic's (arena_bytes -1: none)
  std::string periodic_name;    // how it packed
  MemoryPlanStats stats;
  std::map<MemoryPlanOptions::Order, Repairs> repairs;
};

namespace {

bool SameLifetimes(const std::vector<BufferLifetime>& a, const std::vector<BufferLifetime>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](const BufferLifetime& x, const BufferLifetime& y) {
                      return x.instruction == y.instruction && x.tensor == y.tensor &&
                             x.micro_step == y.micro_step && x.alloc_index == y.alloc_index &&
                             x.free_index == y.free_index && x.size_bytes == y.size_bytes;
                    });
}

// Whether PlanMemory with `options` over `buffers` goes through `progress`'s packings first and
// does not stop before their end: the same lifetimes, budget and sequence of packings, a
// fragmentation target no looser (a looser one may stop sooner) and room for as many packings.
bool GoesOnFrom(const PackingProgress& progress, const std::vector<BufferLifetime>& buffers,
                int axis_length, const MemoryPlanOptions& options, int64_t budget_bytes) {
  return progress.budget_bytes == budget_bytes && progress.axis_length == axis_length &&
         progress.sequence == PackingSequenceText(options) &&
         options.max_fragmentation <= progress.max_fragmentation &&
         (options.max_packings == 0 || options.max_packings >= progress.packed) &&
         SameLifetimes(progress.buffers, buffers);
}

// PlanMemory; `resume` (optional): packings without waits to go on from where GoesOnFrom holds;
// `save` (optional): receives where its packings without waits stopped.
StatusOr<proto::MemoryPlan> PlanMemoryFrom(const proto::Schedule& schedule,
                                           const MemoryPlanOptions& options, int64_t budget_bytes,
                                           const CostModel* costs, MemoryPlanStats* stats,
                                           const SimResult* simulation, int threads,
                                           ThreadShare* share, const PackingProgress* resume,
                                           PackingProgress* save) {
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

  const int64_t live_peak = s.live_peak_bytes;
  const int64_t target_bytes = TargetArenaBytes(live_peak, options.max_fragmentation);
  const bool has_budget = budget_bytes > 0;
  Packing best;
  best.arena_bytes = -1;
  // The axis `best` was packed over, and whether it has been compacted.
  const Axis* best_axis = &primary;
  bool best_compacted = false;
  auto keep_if_best = [&](Packing&& packing, const Attempt& attempt, int round) {
    if (best.arena_bytes >= 0 && packing.arena_bytes >= best.arena_bytes) return;
    best = std::move(packing);
    best_axis = attempt.axis;
    best_compacted = false;
    s.order = OrderName(attempt.order);
    if (round > 0) s.order += ", repair round " + std::to_string(round);
    if (attempt.axis == &instruction_axis && in_time) {
      s.lifetimes = MemoryPlanOptions::Lifetimes::kInstructionOrder;
      s.live_peak_bytes = s.instruction_order_peak_bytes;
      s.live_peak_instruction = s.instruction_order_peak_instruction;
    }
  };
  // Without waits, until the arena is within the fragmentation target and fits the budget.
  // Each repair round of an order adds a mark to what that order's last packing put above the
  // live peak, and places the buffers by their marks, most first; a round that would mark
  // nothing would repeat that packing, and is skipped. Repairs of an order stop after
  // repair_patience rounds in a row that pack no tighter than its best.
  std::map<MemoryPlanOptions::Order, Repairs> repairs;
  for (MemoryPlanOptions::Order order : options.repaired_orders) repairs[order];
  int packed = 0;
  size_t first_attempt = 0;
  Packing periodic{{}, -1, 0};  // PackPeriodic's, apart from the packings of the whole step
  std::string periodic_name;
  const bool resumed = resume && GoesOnFrom(*resume, buffers, n, options, budget_bytes);
  if (resumed) {
    // Its packings are this plan's first: their outcome as they left it.
    best = resume->best;
    periodic = resume->periodic;
    periodic_name = resume->periodic_name;
    repairs = resume->repairs;
    packed = resume->packed;
    first_attempt = resume->next_attempt;
    s.order = resume->stats.order;
    s.orders_tried = resume->stats.orders_tried;
    s.packings_reused = resume->stats.orders_tried;
  }
  // Packing k of a batch places in occupancies[k], reset each time (keeping its memory).
  std::vector<ArenaOccupancy32> occupancies;
  occupancies.emplace_back(0);
  // Each order's sequence over the primary lifetimes, computed at its first packing.
  std::map<MemoryPlanOptions::Order, Sequence> sequences;
  auto sequence_of = [&](MemoryPlanOptions::Order order) -> const Sequence& {
    auto found = sequences.find(order);
    if (found == sequences.end()) {
      found = sequences.emplace(order, SequenceOf(primary, options.alignment_bytes, order)).first;
    }
    return found->second;
  };
  const std::vector<Attempt> without_waits = AttemptsWithoutWaits(options, primary);
  size_t next_attempt = first_attempt;
  auto arena_good_enough = [&](int64_t arena_bytes) {
    return arena_bytes >= 0 && arena_bytes <= target_bytes &&
           (!has_budget || arena_bytes <= budget_bytes);
  };
  auto good_enough = [&] { return arena_good_enough(best.arena_bytes); };
  // First, where micro-steps repeat: one of them packed once for all (PackPeriodic), its ways of
  // placing the rest tried until one is within options.periodic_fragmentation of the live peak
  // (the budget aside, so that the offload pass's check and this pass pack it alike). There and
  // under the budget it is the plan; else the packings of the whole step go on as without it,
  // and the smaller arena wins (llama3-8b on 32 ranks at GAS 16: periodic 0.79% over the live
  // peak, size-descending 0.14%). With periodic_ends_over_budget, within it is enough.
  const int64_t periodic_target_bytes = TargetArenaBytes(live_peak, options.periodic_fragmentation);
  auto periodic_tight = [&](int64_t arena_bytes) {
    return arena_bytes >= 0 && arena_bytes <= periodic_target_bytes;
  };
  if (options.periodic && !resumed) {
    const std::optional<Period> period = FindPeriod(
        primary, sequence_of(options.orders.front()).reserve, options.periodic_min_repeats);
    std::optional<Packing> packing =
        period ? PackPeriodic(primary, options, *period, sequence_of, periodic_tight,
                              &occupancies[0], &periodic_name)
               : std::nullopt;
    if (packing) {
      ++s.orders_tried;
      periodic = std::move(*packing);
    }
  }
  auto enough_without_waits = [&] {
    return good_enough() ||
           (periodic_tight(periodic.arena_bytes) &&
            (options.periodic_ends_over_budget || arena_good_enough(periodic.arena_bytes)));
  };
  // With threads > 1, attempts are packed `threads` at a time: consecutive ones of different
  // orders (a repair depends only on its order's packings before it), each decided from the
  // state the ones before the batch left, and taken in turn as one by one (those after the
  // first good enough are dropped): the plan and its stats do not depend on the threads.
  struct Decided {
    size_t attempt = 0;
    bool pack = false;
    bool repairs_done = false;  // a repair that would mark nothing: its order's are done
    std::vector<int> marks;     // a repair's marks
    int round = 0;
    Packing packing;
  };
  // How many attempts the next batch may pack at once: `threads`, or 1 and the share's idle slots,
  // lent for the batch (given back when `lent` goes).
  struct Lent {
    ThreadShare* share;
    int borrowed = 0;
    ~Lent() {
      if (share) share->GiveBack(borrowed);
    }
  };
  const int most = share ? share->threads() : std::max(1, threads);
  auto lend = [&](Lent* lent) {
    if (!share) return most;
    lent->borrowed = share->Borrow(most - 1);
    return 1 + lent->borrowed;
  };
  // Packs `list` in turn from *next on until `enough()`: an order's repairs stop after
  // `patience` rounds in a row that pack no tighter than its best.
  auto pack_in_turn = [&](const std::vector<Attempt>& list, size_t* next, int patience,
                          const auto& enough) {
    while (*next < list.size() && !enough()) {
      Lent lent{share};
      const int batch = lend(&lent);
      std::vector<Decided> decided;
      std::vector<MemoryPlanOptions::Order> orders;
      int packings = 0;
      for (size_t i = *next; i < list.size() && packings < batch; ++i) {
        const Attempt& attempt = list[i];
        if (options.max_packings > 0 && packed + packings == options.max_packings) break;
        if (std::count(orders.begin(), orders.end(), attempt.order) > 0) break;
        orders.push_back(attempt.order);
        Decided d;
        d.attempt = i;
        if (attempt.repair) {
          const Repairs& state = repairs.at(attempt.order);
          if (state.done || state.last.offsets.empty()) {
            decided.push_back(std::move(d));
            continue;
          }
          d.marks = state.marks;
          bool marked = false;
          for (size_t b = 0; b < buffers.size(); ++b) {
            if (buffers[b].size_bytes > 0 &&
                state.last.offsets[b] + buffers[b].size_bytes > live_peak) {
              ++d.marks[b];
              marked = true;
            }
          }
          if (!marked) {
            d.repairs_done = true;
            d.marks.clear();
            decided.push_back(std::move(d));
            continue;
          }
          d.round = state.round + 1;
        }
        d.pack = true;
        sequence_of(attempt.order);
        ++packings;
        decided.push_back(std::move(d));
      }
      if (decided.empty()) break;  // at max_packings
      std::vector<Decided*> to_pack;
      for (Decided& d : decided) {
        if (d.pack) to_pack.push_back(&d);
      }
      while (occupancies.size() < to_pack.size()) occupancies.emplace_back(0);
      rewriter_internal::RunTasks(static_cast<int>(to_pack.size()), batch, [&](int k) {
        Decided& d = *to_pack[k];
        const Attempt& attempt = list[d.attempt];
        d.packing = Pack(primary, nullptr, 0, options.alignment_bytes, sequences.at(attempt.order),
                         attempt.repair ? &d.marks : nullptr, &occupancies[k]);
      });
      for (Decided& d : decided) {
        const Attempt& attempt = list[d.attempt];
        *next = d.attempt + 1;
        const auto repairing = repairs.find(attempt.order);
        Repairs* state = repairing == repairs.end() ? nullptr : &repairing->second;
        if (!d.pack) {
          if (d.repairs_done) state->done = true;
          continue;
        }
        ++s.orders_tried;
        ++packed;
        if (state) {
          if (attempt.repair) {
            state->marks = std::move(d.marks);
            state->round = d.round;
            if (d.packing.arena_bytes < state->best_arena_bytes) {
              state->best_arena_bytes = d.packing.arena_bytes;
              state->rounds_without_better = 0;
            } else if (++state->rounds_without_better >= patience) {
              state->done = true;
            }
          } else {
            state->marks.assign(buffers.size(), 0);
            state->best_arena_bytes = d.packing.arena_bytes;
          }
          state->last = d.packing;
        }
        keep_if_best(std::move(d.packing), attempt, d.round);
        if (enough()) break;
      }
    }
  };
  pack_in_turn(without_waits, &next_attempt, options.repair_patience, enough_without_waits);
  if (periodic.arena_bytes >= 0 &&
      (best.arena_bytes < 0 || periodic.arena_bytes < best.arena_bytes)) {
    best = periodic;  // a copy: the memo keeps it apart
    best_axis = &primary;
    best_compacted = false;
    s.order = periodic_name;
  }
  // The best packing placed again lowest first (Compact), once, unless it spills or is good
  // enough already (within the fragmentation target and the budget: the offload pass's check
  // only asks whether it fits): before any packing made for the budget, which it may spare, and
  // before the memo keeps it (so that the memory-plan pass goes on from the arena the check
  // found).
  auto compact_best = [&] {
    if (options.compaction_rounds <= 0 || best.arena_bytes < 0 || best.spilled > 0 ||
        best_compacted || good_enough()) {
      return;
    }
    best_compacted = true;
    const int64_t before = best.arena_bytes;
    if (best.arena_bytes / options.alignment_bytes <= std::numeric_limits<uint32_t>::max()) {
      Compact(*best_axis, options.alignment_bytes, options.compaction_rounds, &best,
              &occupancies[0]);
    } else {
      ArenaOccupancy occupancy(best_axis->length);
      Compact(*best_axis, options.alignment_bytes, options.compaction_rounds, &best, &occupancy);
    }
    if (best.arena_bytes < before) s.order = "compacted " + s.order;
  };
  compact_best();
  if (save) {
    save->sequence = PackingSequenceText(options);
    save->budget_bytes = budget_bytes;
    save->max_fragmentation = options.max_fragmentation;
    save->buffers = buffers;
    save->axis_length = n;
    save->next_attempt = next_attempt;
    save->packed = packed;
    save->best = best;
    save->periodic = periodic;
    save->periodic_name = periodic_name;
    save->stats = s;
    save->repairs = repairs;
  }
  // Over the budget: first more repair rounds, since a packing without waits costs the step
  // nothing and one that waits does.
  if (has_budget && best.arena_bytes > budget_bytes && options.over_budget_repair_rounds > 0) {
    for (auto& [order, state] : repairs) {
      state.rounds_without_better = 0;
      state.done = state.last.offsets.empty();
    }
    std::vector<Attempt> more;
    AddRepairRounds(options, primary, options.over_budget_repair_rounds, &more);
    size_t next = 0;
    pack_in_turn(more, &next, options.over_budget_repair_patience,
                 [&] { return best.arena_bytes <= budget_bytes; });
  }
  // Still over the budget: reuse that waits, as little as it takes. The attempts are independent:
  // with threads > 1 they are packed `threads` at a time and taken in turn as one by one.
  if (has_budget && best.arena_bytes > budget_bytes) {
    const std::vector<Attempt> attempts =
        AttemptsOverBudget(options, primary, spill, in_time ? &instruction_axis : nullptr);
    for (const Attempt& attempt : attempts) {
      if (attempt.axis == &primary) sequence_of(attempt.order);
    }
    std::vector<Packing> packed_batch;
    for (size_t start = 0, end = 0; start < attempts.size() && best.arena_bytes > budget_bytes;
         start = end) {
      Lent lent{share};
      const int batch = lend(&lent);
      // Task i of each batch places in occupancies[i] (one thread at a time).
      while (static_cast<int>(occupancies.size()) < batch) occupancies.emplace_back(0);
      end = std::min(attempts.size(), start + batch);
      packed_batch.assign(end - start, Packing());
      rewriter_internal::RunTasks(static_cast<int>(end - start), batch, [&](int i) {
        const Attempt& attempt = attempts[start + i];
        const int64_t spill_above =
            budget_bytes -
            static_cast<int64_t>(static_cast<double>(budget_bytes) * attempt.headroom_fraction);
        // The primary axis' sequences were computed before the tasks started (read only
        // here); another axis' (the fall-back to instruction order) is the task's own.
        const auto cached =
            attempt.axis == &primary ? sequences.find(attempt.order) : sequences.end();
        std::optional<Sequence> own;
        if (cached == sequences.end()) {
          own = SequenceOf(*attempt.axis, options.alignment_bytes, attempt.order);
        }
        packed_batch[i] = Pack(*attempt.axis, attempt.spill, spill_above, options.alignment_bytes,
                               own ? *own : cached->second, nullptr, &occupancies[i]);
      });
      for (size_t i = start; i < end; ++i) {
        ++s.orders_tried;
        keep_if_best(std::move(packed_batch[i - start]), attempts[i], 0);
        if (best.arena_bytes <= budget_bytes) break;
      }
    }
  }
  compact_best();
  s.arena_bytes = best.arena_bytes;
  s.spilled_buffers = best.spilled;

  return ToPlan(buffers, best);
}

}  // namespace

StatusOr<proto::MemoryPlan> PlanMemory(const proto::Schedule& schedule,
                                       const MemoryPlanOptions& options, int64_t budget_bytes,
                                       const CostModel* costs, MemoryPlanStats* stats,
                                       const SimResult* simulation, int threads,
                                       const PackingMemo* memo, ThreadShare* share) {
  return PlanMemoryFrom(schedule, options, budget_bytes, costs, stats, simulation, threads, share,
                        memo ? memo->last() : nullptr, nullptr);
}

PackingMemo::PackingMemo() = default;
PackingMemo::~PackingMemo() = default;

const PackingProgress* PackingMemo::last() const { return last_.get(); }

StatusOr<int64_t> ArenaBytesWithoutWaits(const proto::Schedule& schedule,
                                         const MemoryPlanOptions& options, int64_t budget_bytes,
                                         const CostModel* costs, const SimResult* simulation,
                                         PackingMemo* memo, int threads, ThreadShare* share) {
  MemoryPlanStats stats;
  auto progress = memo ? std::make_unique<PackingProgress>() : nullptr;
  DC_RETURN_IF_ERROR(PlanMemoryFrom(schedule, BudgetCheckOptions(options), budget_bytes, costs,
                                    &stats, simulation, threads, share, nullptr, progress.get())
                         .status());
  if (memo) memo->last_ = std::move(progress);
  return stats.arena_bytes;
}

MemoryPlanOptions BudgetCheckOptions(const MemoryPlanOptions& options) {
  MemoryPlanOptions check = options;
  check.spill_to_instruction_order = false;
  check.fall_back_to_instruction_order = false;
  check.max_fragmentation = std::numeric_limits<double>::infinity();
  check.max_packings = options.budget_check_packings;
  check.over_budget_repair_rounds = 0;
  check.periodic_ends_over_budget = true;
  return check;
}

std::string MemoryPlanOptionsText(const MemoryPlanOptions& options) {
  std::string text = "alignment=" + std::to_string(options.alignment_bytes) + "," +
                     PackingsWithoutWaitsText(options);
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
