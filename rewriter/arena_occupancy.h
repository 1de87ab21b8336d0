// The memory-plan packer's index: the arena address ranges taken over time as buffers are placed,
// and the best-fitting free gap for a new buffer during its lifetime. Private to rewriter/.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace dc::rewriter_internal {

// Address ranges taken during lifetimes on an axis of positions -1 .. axis_length (start-up to
// end of step), both ends of a lifetime inclusive.
//
// A buffer alive at some instant of [a, f] is either alive at a or allocated in (a, f], so the
// bytes taken during [a, f] are the union of two sets, each kept as sorted disjoint runs (a dense
// packing has few holes, so a union is short where the buffers behind it are many):
// - taken at an instant: a segment tree over the axis whose nodes each hold the union of the
//   buffers whose lifetime's canonical cover includes the node; the bytes taken at a are the
//   union along leaf a's root path. The upper part of every path is cached per node and built
//   again only when a union on it changes, so a query merges a few short lists.
// - allocated in a span: a second segment tree over allocating positions whose nodes hold the
//   union of the buffers allocated in their span (a buffer joins its position's leaf and the
//   ancestors up to the first that holds its range already).
// Offsets are in units of the caller's choosing, held as `Offset` (uint32_t or int64_t): the
// packer counts in its alignment, so 32 bits cover a TiB and every run costs half the bytes to
// walk (queries are bound by memory traffic). Not thread-safe: queries use scratch and fill
// caches.
template <typename Offset>
class BasicArenaOccupancy {
 public:
  using Range = std::pair<Offset, Offset>;  // [offset, end)

  explicit BasicArenaOccupancy(int axis_length);

  // Empty again, on an axis of `axis_length`, keeping the memory of the unions (a packer that
  // packs one schedule in several orders allocates it once).
  void Reset(int axis_length);

  // Takes `range` (non-empty) during [alloc_index, free_index], where -1 <= alloc_index <=
  // free_index <= axis_length.
  void Add(int alloc_index, int free_index, Range range);

  // Best fit for size > 0 during [alloc_index, free_index]: the offset of the smallest gap of at
  // least `size` at or above `floor` between the ranges taken at some instant of it (the lowest
  // such offset on ties); else the end of the highest of them, or `floor` if that is higher.
  int64_t BestFit(int alloc_index, int free_index, int64_t floor, int64_t size) const;

  // First fit for size > 0 during [alloc_index, free_index]: the lowest offset at or above
  // `floor` of a gap of at least `size` between the ranges taken at some instant of it; else the
  // end of the highest of them, or `floor` if that is higher.
  int64_t LowestFit(int alloc_index, int free_index, int64_t floor, int64_t size) const;

  // The highest offset o, floor <= o and o + size <= ceiling, where `size` > 0 is free during
  // [alloc_index, free_index]; -1 if there is none.
  int64_t HighestFit(int alloc_index, int free_index, int64_t floor, int64_t ceiling,
                     int64_t size) const;

 private:
  int Leaf(int position) const { return position + 1 + leaves_; }
  // Calls fn(run) for the runs taken at some instant of [alloc_index, free_index], in order of
  // offset (runs may overlap or touch).
  template <typename Fn>
  void ForEachTakenRun(int alloc_index, int free_index, Fn&& fn) const;
  // The union of the `taken_` unions of `node` and its ancestors, from the cache.
  const std::vector<Range>& PathUnion(int node) const;

  int leaves_ = 1;
  // Segment tree nodes 1 .. 2 * leaves_ - 1 (leaf of position p: p + 1 + leaves_).
  std::vector<std::vector<Range>> taken_;      // by lifetime cover
  std::vector<std::vector<Range>> allocated_;  // by allocating position
  // The clock orders changes of `taken_` unions and builds of cached path unions: a node's
  // cached union is current if it was built after every change at or above the node.
  mutable uint64_t clock_ = 0;
  std::vector<uint64_t> changed_;
  mutable std::vector<uint64_t> built_;
  mutable std::vector<std::vector<Range>> path_;
  // Scratch of the queries.
  mutable std::vector<const std::vector<Range>*> lists_;
  mutable std::vector<Range> merged_, spare_;
  mutable std::vector<int> nodes_;
};

using ArenaOccupancy = BasicArenaOccupancy<int64_t>;
using ArenaOccupancy32 = BasicArenaOccupancy<uint32_t>;

}  // namespace dc::rewriter_internal
