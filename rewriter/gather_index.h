// Which instruction gathers and which releases each param: a param's gathered spans in stream
// order (GatherIndex), the bytes each gather makes live (TensorBytes), and the order the spans
// imply made explicit (OrderGathersAfterReleases). The gather-moving passes (prefetch, bucket,
// unshard and DeepCompile's rules) plan on it. Private to rewriter/: the passes' headers are the
// public surface.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "schemas/program.h"

namespace dc::rewriter_internal {

// Each param's gathered spans in stream order: the all-gather that makes it live, the first
// compute that reads it, and the release that frees it (-1 where absent). Optimizer-phase
// computes read shards, not gathered params, so they are not uses.
struct GatheredSpan {
  int gather = -1;
  int first_use = -1;
  int release = -1;
};

struct GatherIndex {
  std::vector<std::vector<GatheredSpan>> spans_by_param;  // by tensor id; empty for non-params
  std::vector<int> compute_stream;         // indices of compute-stream instructions, in order
  std::vector<int> compute_stream_before;  // by instruction: count of compute-stream ones before it
  // By instruction, for all-gathers: the span each of its tensors opens, as (param, span index).
  std::vector<std::vector<std::pair<int, int>>> opened;

  // The last compute-stream instruction before `instruction`; -1 if none.
  int ComputeStreamBefore(int instruction) const {
    const int n = compute_stream_before[instruction];
    return n == 0 ? -1 : compute_stream[n - 1];
  }
  // The earliest first use of the spans `gather` opens; -1 if none of them is used.
  int FirstUse(int gather) const;
};

GatherIndex IndexGathers(const proto::Schedule& schedule);

// Whole bytes of each tensor as the executor allocates it (TransientBytes), by tensor id.
std::vector<int64_t> TensorBytes(const proto::Program& program);

// Makes explicit that every all-gather waits for the release of its param's previous gathered
// copy, adding that dep where nothing implies it: the zero3 stream leaves gathers without deps,
// so on parallel streams one could start before the release and hold two copies at once,
// which is not what the stream means. Passes plan on (and compare with) the ordered stream.
// Returns whether a dep was added. REQUIRES: `index` is IndexGathers(*schedule).
bool OrderGathersAfterReleases(const GatherIndex& index, proto::Schedule* schedule);

}  // namespace dc::rewriter_internal
