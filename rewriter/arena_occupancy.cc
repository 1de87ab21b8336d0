#include "rewriter/arena_occupancy.h"

#include <algorithm>
#include <limits>

namespace dc::rewriter_internal {
namespace {

// Path unions are cached from this many levels above the leaves: below it a node's span is a
// handful of positions, its cache would be rebuilt for nearly every query that uses it, and
// merging the few short unions under it in the query costs less.
constexpr int kFirstCachedLevel = 4;

// Adds `range` to a sorted union of disjoint, non-touching runs; false if it held it already.
template <typename Range>
bool AddToUnion(std::vector<Range>* runs, Range range) {
  auto first = std::lower_bound(runs->begin(), runs->end(), range.first,
                                [](const Range& r, auto start) { return r.second < start; });
  if (first != runs->end() && first->first <= range.first && range.second <= first->second) {
    return false;
  }
  auto last = first;
  while (last != runs->end() && last->first <= range.second) {
    range.first = std::min(range.first, last->first);
    range.second = std::max(range.second, last->second);
    ++last;
  }
  if (first == last) {
    runs->insert(first, range);
  } else {
    *first = range;
    runs->erase(first + 1, last);
  }
  return true;
}

// Calls fn(node) for the canonical cover of the leaves [lo, hi) of a segment tree.
template <typename Fn>
void ForCover(int lo, int hi, Fn&& fn) {
  for (; lo < hi; lo /= 2, hi /= 2) {
    if (lo & 1) fn(lo++);
    if (hi & 1) fn(--hi);
  }
}

// Calls fn(run) for the runs of two unions in order of offset (ties: `a` first).
template <typename Range, typename Fn>
void ForEachMerged(const std::vector<Range>& a, const std::vector<Range>& b, Fn&& fn) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) fn(a[i].first <= b[j].first ? a[i++] : b[j++]);
  while (i < a.size()) fn(a[i++]);
  while (j < b.size()) fn(b[j++]);
}

// `out` = the union of two unions, as sorted disjoint non-touching runs.
template <typename Range>
void MergeUnions(const std::vector<Range>& a, const std::vector<Range>& b,
                 std::vector<Range>* out) {
  out->clear();
  ForEachMerged(a, b, [&](const Range& run) {
    if (!out->empty() && run.first <= out->back().second) {
      out->back().second = std::max(out->back().second, run.second);
    } else {
      out->push_back(run);
    }
  });
}

}  // namespace

template <typename Offset>
BasicArenaOccupancy<Offset>::BasicArenaOccupancy(int axis_length) {
  Reset(axis_length);
}

template <typename Offset>
void BasicArenaOccupancy<Offset>::Reset(int axis_length) {
  leaves_ = 1;
  while (leaves_ < axis_length + 2) leaves_ *= 2;
  const size_t nodes = 2 * static_cast<size_t>(leaves_);
  taken_.resize(nodes);
  allocated_.resize(nodes);
  path_.resize(nodes);
  for (std::vector<Range>& runs : taken_) runs.clear();
  for (std::vector<Range>& runs : allocated_) runs.clear();
  // Every cached path union is stale (built at 0); PathUnion rebuilds it before use.
  changed_.assign(nodes, 0);
  built_.assign(nodes, 0);
  clock_ = 0;
}

template <typename Offset>
void BasicArenaOccupancy<Offset>::Add(int alloc_index, int free_index, Range range) {
  ForCover(Leaf(alloc_index), Leaf(free_index) + 1, [&](int node) {
    if (AddToUnion(&taken_[node], range)) changed_[node] = ++clock_;
  });
  // An ancestor's union holds its descendants': once one holds the range, all above do.
  int node = Leaf(alloc_index);
  while (node >= 1 && AddToUnion(&allocated_[node], range)) node /= 2;
}

template <typename Offset>
auto BasicArenaOccupancy<Offset>::PathUnion(int node) const -> const std::vector<Range>& {
  static const std::vector<Range> kEmpty;
  nodes_.clear();
  for (int p = node; p >= 1; p /= 2) nodes_.push_back(p);
  // From the root down: a cache is current if built after every change at or above its node.
  uint64_t last_change = 0;
  int above = 0;  // the nearest node so far with a non-empty path union (0: none)
  for (auto it = nodes_.rbegin(); it != nodes_.rend(); ++it) {
    const int p = *it;
    last_change = std::max(last_change, changed_[p]);
    if (taken_[p].empty()) continue;  // its path union is the one above
    if (built_[p] <= last_change) {
      if (above == 0) {
        path_[p] = taken_[p];
      } else {
        MergeUnions(path_[above], taken_[p], &path_[p]);
      }
      built_[p] = ++clock_;
    }
    above = p;
  }
  return above == 0 ? kEmpty : path_[above];
}

template <typename Offset>
template <typename Fn>
void BasicArenaOccupancy<Offset>::ForEachTakenRun(int alloc_index, int free_index, Fn&& fn) const {
  lists_.clear();
  // Taken at alloc_index: the unions on the leaf's root path, the upper part from the cache.
  int node = Leaf(alloc_index);
  for (int level = 0; level < kFirstCachedLevel && node > 1; ++level, node /= 2) {
    if (!taken_[node].empty()) lists_.push_back(&taken_[node]);
  }
  if (const std::vector<Range>& path = PathUnion(node); !path.empty()) lists_.push_back(&path);
  // Allocated in (alloc_index, free_index]: the canonical cover of those positions.
  ForCover(Leaf(alloc_index) + 1, Leaf(free_index) + 1, [&](int n) {
    if (!allocated_[n].empty()) lists_.push_back(&allocated_[n]);
  });
  // Merge the shortest first (each merge costs the lengths of both), and scan the last merge
  // without writing it.
  std::sort(lists_.begin(), lists_.end(),
            [](const std::vector<Range>* x, const std::vector<Range>* y) {
              return x->size() < y->size();
            });
  static const std::vector<Range> kEmpty;
  const std::vector<Range>* merged = &kEmpty;
  for (size_t i = 0; i + 1 < lists_.size(); ++i) {
    MergeUnions(*merged, *lists_[i], &spare_);
    merged_.swap(spare_);
    merged = &merged_;
  }
  ForEachMerged(*merged, lists_.empty() ? kEmpty : *lists_.back(), fn);
}

template <typename Offset>
int64_t BasicArenaOccupancy<Offset>::BestFit(int alloc_index, int free_index, int64_t floor,
                                             int64_t size) const {
  int64_t cursor = floor, best_offset = -1;
  int64_t best_gap = std::numeric_limits<int64_t>::max();
  ForEachTakenRun(alloc_index, free_index, [&](const Range& run) {
    const int64_t gap = static_cast<int64_t>(run.first) - cursor;
    if (gap >= size && gap < best_gap) {
      best_gap = gap;
      best_offset = cursor;
    }
    cursor = std::max<int64_t>(cursor, run.second);
  });
  return best_offset >= 0 ? best_offset : cursor;
}

template <typename Offset>
int64_t BasicArenaOccupancy<Offset>::LowestFit(int alloc_index, int free_index, int64_t floor,
                                               int64_t size) const {
  int64_t cursor = floor;
  bool found = false;
  ForEachTakenRun(alloc_index, free_index, [&](const Range& run) {
    if (found) return;
    if (static_cast<int64_t>(run.first) - cursor >= size) {
      found = true;
      return;
    }
    cursor = std::max<int64_t>(cursor, run.second);
  });
  return cursor;
}

template <typename Offset>
int64_t BasicArenaOccupancy<Offset>::HighestFit(int alloc_index, int free_index, int64_t floor,
                                                int64_t ceiling, int64_t size) const {
  int64_t cursor = floor, highest = -1;
  // The gap [cursor, end) below `end`, cut at the ceiling.
  auto consider = [&](int64_t end) {
    end = std::min(end, ceiling);
    if (end - cursor >= size) highest = end - size;
  };
  ForEachTakenRun(alloc_index, free_index, [&](const Range& run) {
    if (cursor >= ceiling) return;
    consider(static_cast<int64_t>(run.first));
    cursor = std::max<int64_t>(cursor, run.second);
  });
  if (cursor < ceiling) consider(ceiling);
  return highest;
}

template class BasicArenaOccupancy<int64_t>;
template class BasicArenaOccupancy<uint32_t>;

}  // namespace dc::rewriter_internal
