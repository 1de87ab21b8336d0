// Test fixtures for the trace readers: temp directories, dc traces written with the collector, and
// SQL run on them.
#pragma once

#include <string>
#include <vector>

#include "schemas/program.h"

namespace dc::testing {

// A fresh directory, removed with everything in it at destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string File(const std::string& name) const;

 private:
  std::string path_;
};

// An empty fp32 cpu schedule of `world_size` ranks, in the current formats: what the test traces
// build their programs and instructions on.
proto::Schedule CpuSchedule(int world_size);

// Tensors w0 (param), a0 (activation), g0 (grad of w0), m0 (optimizer state of w0); ops
// fwd0 (3500 flops), fwd1 (0 flops), bwd (1e4 flops, never run in the trace); instructions
// 0 all_gather w0 | 1 fwd0 | 2 fwd1 | 3 reduce_scatter g0 | 4 offload m0 | 5 bwd.
proto::Schedule ProfileSchedule();

// Two ranks (cpu backend), steps 0 (warm-up) to 3, step s in [10000 s, 10000 s + 10000) ns
// (rank 1's step 3 ends at 50000). In each step at W = 10000 s:
//   fwd0          [W, W + d]                d: warm-up 5000; rank 0 100, 300, 200;
//                                              rank 1 400, 500, 600
//   all_gather    [W + 1000, W + 2000 + b]  b = 1000 s bytes (warm-up 1000 bytes in 8000 ns)
//   fwd1          [W + 2000, W + 5000]
//   reduce_scatter[W + 6000, W + 6000 + r]  500 bytes, r = 100 s (warm-up 900)
//   offload       [W + 7000, W + 8000]      4000 bytes
// Rank 0's memory: alloc 1 (100 B gathered) at 10, alloc 2 (30 B activation) at 20, free 1 at
// 30, free 99 (50 B shard, never allocated) and alloc 3 (10 B input) at 40.
// Returns the merged trace's path in `dir`.
std::string WriteProfileTrace(const TempDir& dir);

// Runs `sql` on the SQLite file at `path` (a test's way to corrupt a copy of a good trace); a
// failure is a test failure naming SQLite's error.
void ExecSql(const std::string& path, const std::string& sql);

}  // namespace dc::testing
