// The planners' allocator setting. A plan builds and drops large vectors and messages many times
// a second (lifetimes, packings, simulations, candidate schedules); mimalloc 2.0 gives the pages
// of freed memory back to the OS 25 ms after a free, so the next allocation faults them in
// again: 600k page faults in planning Llama-3 405B's shapes, 120k with a delay of a second
// (bench/results/plan_bench-2026-11-27c.md). dc-plan and the planning benchmarks keep freed pages
// that long; the executors keep mimalloc's defaults. Without mimalloc (DC_HAVE_MIMALLOC unset:
// not installed, the static bundle, the sanitizers) it does nothing.
#pragma once

#ifdef DC_HAVE_MIMALLOC
#include <mimalloc.h>
#endif

namespace dc::cli {

inline void KeepFreedPagesWhilePlanning() {
#ifdef DC_HAVE_MIMALLOC
  constexpr long kDecommitDelayMilliseconds = 1000;
  mi_option_set(mi_option_decommit_delay, kDecommitDelayMilliseconds);
#endif
}

}  // namespace dc::cli
