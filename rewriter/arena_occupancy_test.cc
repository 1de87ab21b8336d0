#include "rewriter/arena_occupancy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <vector>

namespace dc::rewriter_internal {
namespace {

using Range = std::pair<int64_t, int64_t>;

struct Placed {
  int alloc_index, free_index;
  Range range;
};

// What BestFit promises, by scanning every placed range that overlaps the lifetime.
int64_t BruteForceBestFit(const std::vector<Placed>& placed, int alloc_index, int free_index,
                          int64_t floor_bytes, int64_t size_bytes) {
  std::vector<Range> taken;
  for (const Placed& p : placed) {
    if (p.alloc_index <= free_index && p.free_index >= alloc_index) taken.push_back(p.range);
  }
  std::sort(taken.begin(), taken.end());
  int64_t cursor = floor_bytes, best_offset = -1;
  int64_t best_gap = std::numeric_limits<int64_t>::max();
  for (const auto& [start, end] : taken) {
    const int64_t gap = start - cursor;
    if (gap >= size_bytes && gap < best_gap) {
      best_gap = gap;
      best_offset = cursor;
    }
    cursor = std::max(cursor, end);
  }
  return best_offset >= 0 ? best_offset : cursor;
}

// What LowestFit promises: the lowest offset at or above floor_bytes free of every placed range
// that overlaps the lifetime. It is the floor or the end of some range; each is tried.
int64_t BruteForceLowestFit(const std::vector<Placed>& placed, int alloc_index, int free_index,
                            int64_t floor_bytes, int64_t size_bytes) {
  auto overlaps = [&](const Placed& p, int64_t offset) {
    return p.alloc_index <= free_index && p.free_index >= alloc_index &&
           p.range.first < offset + size_bytes && offset < p.range.second;
  };
  std::vector<int64_t> candidates = {floor_bytes};
  for (const Placed& p : placed) {
    if (p.range.second > floor_bytes) candidates.push_back(p.range.second);
  }
  int64_t lowest = std::numeric_limits<int64_t>::max();
  for (int64_t offset : candidates) {
    if (std::none_of(placed.begin(), placed.end(),
                     [&](const Placed& p) { return overlaps(p, offset); })) {
      lowest = std::min(lowest, offset);
    }
  }
  return lowest;
}

// What HighestFit promises: the highest offset in [floor_bytes, ceiling_bytes - size_bytes] free
// of every placed range that overlaps the lifetime, tried offset by offset; -1 if none.
int64_t BruteForceHighestFit(const std::vector<Placed>& placed, int alloc_index, int free_index,
                             int64_t floor_bytes, int64_t ceiling_bytes, int64_t size_bytes) {
  for (int64_t offset = ceiling_bytes - size_bytes; offset >= floor_bytes; --offset) {
    const bool free = std::none_of(placed.begin(), placed.end(), [&](const Placed& p) {
      return p.alloc_index <= free_index && p.free_index >= alloc_index &&
             p.range.first < offset + size_bytes && offset < p.range.second;
    });
    if (free) return offset;
  }
  return -1;
}

// Random lifetimes and sizes, placed where BestFit says (as the packer does) or, now and then,
// anywhere (overlapping what is there: the index must not assume a packing). `reuse`
// (optional): an occupancy used before, reset to the axis instead of a new one.
template <typename Occupancy>
void CheckAgainstBruteForce(unsigned seed, int axis_length, int buffers, int64_t max_size,
                            Occupancy* reuse = nullptr) {
  using Offset = typename Occupancy::Range::first_type;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> position(-1, axis_length);
  std::uniform_int_distribution<int64_t> size(1, max_size);
  std::uniform_int_distribution<int> percent(0, 99);
  Occupancy fresh(reuse ? 0 : axis_length);
  if (reuse) reuse->Reset(axis_length);
  Occupancy& occupancy = reuse ? *reuse : fresh;
  std::vector<Placed> placed;
  for (int b = 0; b < buffers; ++b) {
    int alloc_index = position(rng), free_index = position(rng);
    if (alloc_index > free_index) std::swap(alloc_index, free_index);
    const int64_t size_bytes = size(rng);
    const int64_t floor_bytes = percent(rng) < 10 ? size(rng) : 0;
    const int64_t offset = occupancy.BestFit(alloc_index, free_index, floor_bytes, size_bytes);
    ASSERT_EQ(offset, BruteForceBestFit(placed, alloc_index, free_index, floor_bytes, size_bytes))
        << "seed " << seed << ", buffer " << b << ": [" << alloc_index << ", " << free_index
        << "] of " << size_bytes << " bytes above " << floor_bytes;
    ASSERT_EQ(occupancy.LowestFit(alloc_index, free_index, floor_bytes, size_bytes),
              BruteForceLowestFit(placed, alloc_index, free_index, floor_bytes, size_bytes))
        << "seed " << seed << ", buffer " << b << ": [" << alloc_index << ", " << free_index
        << "] of " << size_bytes << " bytes above " << floor_bytes;
    const int64_t ceiling_bytes = floor_bytes + size(rng) * 4;
    ASSERT_EQ(occupancy.HighestFit(alloc_index, free_index, floor_bytes, ceiling_bytes, size_bytes),
              BruteForceHighestFit(placed, alloc_index, free_index, floor_bytes, ceiling_bytes,
                                   size_bytes))
        << "seed " << seed << ", buffer " << b << ": [" << alloc_index << ", " << free_index
        << "] of " << size_bytes << " bytes in [" << floor_bytes << ", " << ceiling_bytes << ")";
    const int64_t at = percent(rng) < 5 ? size(rng) * 3 : offset;
    const Range range{at, at + size_bytes};
    occupancy.Add(alloc_index, free_index,
                  {static_cast<Offset>(at), static_cast<Offset>(at + size_bytes)});
    placed.push_back({alloc_index, free_index, range});
  }
}

TEST(ArenaOccupancy, MatchesBruteForceOnShortAxes) {
  for (unsigned seed = 1; seed <= 200; ++seed) {
    CheckAgainstBruteForce<ArenaOccupancy>(seed, 1 + seed % 17, 60, 40);
    CheckAgainstBruteForce<ArenaOccupancy32>(seed, 1 + seed % 17, 60, 40);
  }
}

// Reset keeps the unions' memory and forgets their runs and cached path unions: one occupancy
// reset between packings on longer and shorter axes answers as new ones do.
TEST(ArenaOccupancy, ResetAnswersAsNew) {
  ArenaOccupancy32 reused(0);
  for (unsigned seed = 1; seed <= 60; ++seed) {
    const int axis_length = seed % 3 == 0 ? 300 + seed : 1 + seed % 17;
    CheckAgainstBruteForce<ArenaOccupancy32>(seed, axis_length, seed % 3 == 0 ? 400 : 60,
                                             seed % 3 == 0 ? 1000 : 40, &reused);
  }
}

TEST(ArenaOccupancy, MatchesBruteForceOnLongAxes) {
  for (unsigned seed = 1; seed <= 20; ++seed) {
    CheckAgainstBruteForce<ArenaOccupancy>(seed, 300 + seed, 400, 1000);
    CheckAgainstBruteForce<ArenaOccupancy32>(seed, 300 + seed, 400, 1000);
  }
}

TEST(ArenaOccupancy, EmptyFitsAtTheFloor) {
  ArenaOccupancy occupancy(10);
  EXPECT_EQ(occupancy.BestFit(-1, 10, 256, 100), 256);
}

TEST(ArenaOccupancy, HighestFitTakesTheHighestGapUnderTheCeiling) {
  ArenaOccupancy occupancy(4);
  // Free during [1, 2]: [0, 10), [20, 25), [35, 40), [50, ...).
  occupancy.Add(0, 1, {10, 20});
  occupancy.Add(2, 3, {25, 35});
  occupancy.Add(1, 1, {40, 50});
  EXPECT_EQ(occupancy.HighestFit(1, 2, 0, 100, 5), 95);
  EXPECT_EQ(occupancy.HighestFit(1, 2, 0, 48, 5), 35);  // [40, 50) is taken
  EXPECT_EQ(occupancy.HighestFit(1, 2, 0, 48, 6), 4);   // only [0, 10) holds 6 below 48
  EXPECT_EQ(occupancy.HighestFit(1, 2, 5, 48, 6), -1);  // above the floor 5, nothing does
  EXPECT_EQ(occupancy.HighestFit(3, 3, 0, 30, 5), 20);  // [25, 35) alone at 3
}

TEST(ArenaOccupancy, PrefersTheSmallestGapThenTheLowest) {
  ArenaOccupancy occupancy(4);
  // Gaps during [1, 2]: [0, 10) of 10, [20, 25) of 5, [35, 40) of 5, then the top at 50.
  occupancy.Add(0, 1, {10, 20});
  occupancy.Add(2, 3, {25, 35});
  occupancy.Add(1, 1, {40, 50});
  EXPECT_EQ(occupancy.BestFit(1, 2, 0, 5), 20);
  EXPECT_EQ(occupancy.BestFit(1, 2, 0, 6), 0);
  EXPECT_EQ(occupancy.BestFit(1, 2, 0, 11), 50);
  // Outside [1, 2] the ranges it saw do not count.
  EXPECT_EQ(occupancy.BestFit(4, 4, 0, 11), 0);
}

}  // namespace
}  // namespace dc::rewriter_internal
