// What the optimizer-state offload passes share, so that the three policies compare on equal
// terms (`offload`: rewriter/offload.h, `offload-all`: rewriter/offload_all.h, `dc-offload`:
// rewriter/dc_offload.h).
//
// Optimizer-state offload: when a schedule's simulated peak exceeds the budget, move fragments of
// the optimizer's state (the rank's fp32 shards of Adam's m and v, ROLE_OPTIMIZER_STATE tensors,
// and of the fp32 master weights, ROLE_PARAM tensors) to pinned host memory at the start of the
// step and bring them back before the optimizer step, which stays on the device. A master on the
// host leaves its shard in the compute dtype on the device for the gathers (schemas/program.h's
// ComputeShardParams), so it frees 4 - 2 bytes per element in bf16 while moving 4: masters move
// only where their compute shards also fit beside the optimizer step, and never in fp32 programs
// (they would free nothing).
//
// Every policy emits, per fragment, one OFFLOAD (stream d2h, micro-step 0) at the very start of
// the step and one RELOAD (stream h2d, the last micro-step) that depends on the instruction it
// follows; each optimizer op that reads a fragment depends on the fragment's RELOAD. Where the
// forward would run out of memory before an offload's copy ends, the allocating instruction
// waits for that copy (a dependency on the OFFLOAD). Fragments already offloaded by an earlier
// pass are left alone. Passes are not thread-safe; distinct instances are independent.
//
// Here: the fragments of the input that may move (AnalyzeLayout), a plan of which go and where
// each comes back (Plan), the schedule that writes it (Build), and the passes' report
// (OffloadStats, public; the rest is private to rewriter/).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "machine/cost_model.h"
#include "machine/simulator.h"
#include "rewriter/pass.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// What one run of an offload pass did (for tests, --explain and benchmarks).
struct OffloadStats {
  int fragments = 0;                  // optimizer-state fragments that could move
  int64_t fragment_bytes = 0;         // their bytes
  int offloaded = 0;                  // fragments moved to the host
  int64_t offloaded_bytes = 0;        // their bytes
  int masters_offloaded = 0;          // of them, fp32 master weights
  int early_reloads = 0;              // reloads placed inside the last backward
  int end_reloads = 0;                // reloads placed after the last backward
  int offload_waits = 0;              // instructions made to wait for an offload's copy
  int iterations = 0;                 // plan-simulate rounds
  int64_t peak_before_bytes = 0;      // simulated peak of the input schedule
  int64_t peak_after_bytes = 0;       // simulated peak of the output schedule
  double step_before_seconds = 0;     // simulated step of the input schedule
  double step_after_seconds = 0;      // simulated step of the output schedule
  int64_t arena_bytes = 0;            // memory-plan arena of the output (0: not packed)
  int64_t planning_budget_bytes = 0;  // the budget the last round planned against
  int arena_rounds = 0;               // plans made to fit the arena
};

namespace rewriter_internal {

// One fragment that may move: the rank's fp32 shard of one optimizer-state tensor (Adam m or
// v), or of one param (its master weight). A master on the host leaves a compute-dtype shard on
// the device for the gathers (schemas/program.h's ComputeShardParams), for the whole step.
struct Fragment {
  int tensor = -1;
  bool master = false;
  int64_t bytes = 0;           // freed on the device while it is on the host
  int64_t copy_bytes = 0;      // moved by its offload and its reload (the fp32 shard)
  int64_t resident_bytes = 0;  // held on the device all the time once chosen (a compute shard)
  std::vector<int> readers;    // optimizer-phase computes that read it, in index order
};

// What the passes need to know about the input schedule.
struct Layout {
  int num_instructions = 0;
  int last_micro_step = 0;
  int first_optimizer = 0;  // index of the first optimizer-phase instruction (or the count)
  // In list order: by first reader, then the reader's optimizer states by position among its
  // inputs (m before v), then its param's master.
  std::vector<Fragment> fragments;
  std::vector<int> forward_computes;   // forward ops of micro-step 0, index order
  std::vector<int> backward_computes;  // backward ops of the last micro-step, index order
  // This rank's persistent shards: all of them, and by BufferKind.
  int64_t persistent_bytes = 0;
  std::vector<int64_t> persistent_by_kind;
};

// The fragments and computes of `schedule`; errors on a bad op id.
StatusOr<Layout> AnalyzeLayout(const proto::Schedule& schedule);

// Where everything goes. Fragments are indices into Layout::fragments; instructions are indices
// of the input schedule ("old" indices).
struct Plan {
  std::vector<int> offloads;      // in d2h order, all at the head of the step
  std::vector<int> reloads;       // in h2d order
  std::vector<int> reload_after;  // per reload: the backward compute it follows; -1 = the end
  std::vector<std::pair<int, int>> waits;  // (old instruction, offload ordinal it waits for)
};

// The rewritten schedule and where the old and new instructions landed.
struct Built {
  proto::Schedule schedule;
  std::vector<int> new_of_old;
  std::vector<int> old_of_new;  // -1 for inserted instructions
  std::vector<int> offload_at;  // new index of each offload ordinal
  std::vector<int> reload_at;   // new index of each reload ordinal
};

// `input` with `plan` written in: every OFFLOAD at the head of the step, every RELOAD after the
// compute it follows (or at the end of the backward), and the waits and optimizer ops' deps.
Built Build(const proto::Schedule& input, const Layout& layout, const Plan& plan);

// Simulates `schedule` and fills the "before" half of `stats`.
StatusOr<SimResult> SimulateInput(const proto::Schedule& schedule, const CostModel& costs,
                                  const Layout& layout, OffloadStats* stats);

// One line of what a run did, against `budget_bytes` (0: none), for the passes' Summary().
std::string StatsSummary(const OffloadStats& stats, int64_t budget_bytes);

// The context's cost model, or the default one when it has none.
const CostModel& CostsOf(const PassContext& context);

}  // namespace rewriter_internal
}  // namespace dc
