// Optimizer-state offload: when a schedule's simulated peak exceeds the budget, move fragments of
// the optimizer's state (the rank's fp32 shards of Adam's m and v, ROLE_OPTIMIZER_STATE tensors,
// and of the fp32 master weights, ROLE_PARAM tensors) to pinned host memory at the start of the
// step and bring them back before the optimizer step, which stays on the device. A master on the
// host leaves its shard in the compute dtype on the device for the gathers (schemas/program.h's
// ComputeShardParams), so it frees 4 - 2 bytes per element in bf16 while moving 4: masters move
// only where their compute shards also fit beside the optimizer step, and never in fp32 programs
// (they would free nothing). Three policies over the same machinery, so they compare on equal
// terms:
//
// - `offload` (OffloadPass): ours. Frees only what the time-resolved memory timeline says must
//   go (or, when the peak fits but its packed arena does not, what the arena's excess needs):
//   the excess is the most the forward and backward hold over the budget; fragments are
//   chosen in a documented order (every m and v before any master) until they cover it, then
//   pruned. Each reload (earliest
//   optimizer op first) starts after the earliest backward compute of the last micro-step from
//   which the device can hold it, and everything reloaded before it, at every instant up to the
//   end of backward, so the copies hide behind backward compute. The result is simulated again
//   and repaired (waits on offload copies, more fragments, later reloads) until its peak fits;
//   then its static memory plan is packed and, while the arena is over the budget, everything
//   is planned again against a budget lowered by the excess.
// - `offload-all` (ZeroOffloadPass): ZeRO-3 offload with the step on the GPU (the `zero3-offload`
//   policy runs Adam on the host instead: rewriter/host_optimizer.h). Every fragment leaves; every
//   reload waits for the end of backward.
// - `dc-offload` (DcOffloadPass): DeepCompile's adaptive rule (offload_adam_states.py) with its
//   fixed margin, on a profile without optimizer state, as the paper runs it, over Adam's m
//   and v (why not the masters too: DcOffloadPass::Run).
//
// Every policy emits, per fragment, one OFFLOAD (stream d2h, micro-step 0) at the very start of
// the step and one RELOAD (stream h2d, the last micro-step) that depends on the instruction it
// follows; each optimizer op that reads a fragment depends on the fragment's RELOAD. Where the
// forward would run out of memory before an offload's copy ends, the allocating instruction
// waits for that copy (a dependency on the OFFLOAD). Fragments already offloaded by an earlier
// pass are left alone. Passes are not thread-safe; distinct instances are independent.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "rewriter/memory_packer.h"
#include "rewriter/pass.h"

namespace dc {

// What one run of an offload pass did (for tests, --explain and benchmarks).
struct OffloadStats {
  int fragments = 0;                  // optimizer-state fragments that could move
  int64_t fragment_bytes = 0;         // their bytes
  int offloaded = 0;                  // fragments moved to the host
  int64_t offloaded_bytes = 0;        // their bytes
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

struct OffloadOptions {
  // The order in which fragments are chosen until the freed bytes cover the excess.
  enum class Order {
    // Fragments whose optimizer op runs last first: their reloads have the most time to hide
    // (the optimizer ops before theirs run while they copy). Ties: larger first.
    kLastOptimizerOpFirst,
    // Largest first: the fewest fragments (and copies) for the bytes. Ties: later op first.
    kLargestFirst,
  };
  Order order = Order::kLastOptimizerOpFirst;
  // After choosing, drop chosen fragments (largest first) whose bytes the excess does not need,
  // so the fewest bytes move.
  bool prune = true;
  // Plan-simulate-repair rounds before giving up (each round fixes the highest violation).
  int max_iterations = 64;
  // Also make the static arena fit (the input's too, when its peak fits without offloading):
  // once a plan's simulated peak fits, pack its memory plan
  // (with `memory_plan`'s lifetimes and first order, no reuse that waits) and, while the arena
  // is over the budget (fragmentation, lifetimes in simulated time), plan again against a
  // budget lowered by the difference, at most max_arena_rounds times; if no such plan exists,
  // keep the last one (the memory-plan pass then spills). Off: only the simulated peak is held
  // to the budget.
  bool fit_memory_plan = true;
  MemoryPlanOptions memory_plan;
  int max_arena_rounds = 4;
  // Each round lowers the planning budget by this many times the arena's excess (more than 1:
  // fragmentation moves a little between rounds).
  double arena_overshoot_factor = 1.25;
};

class OffloadPass : public Pass {
 public:
  bool FreesMemory() const override { return true; }
  explicit OffloadPass(OffloadOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "offload"; }
  std::string OptionsText() const override;
  // No change without a budget (PassContext::budget_bytes == 0) or when the peak fits and, with
  // fit_memory_plan, so does its arena (a peak just under the budget can leave no room for
  // fragmentation: then it offloads what the arena needs, or, if no plan frees that, changes
  // nothing). Errors when the budget cannot be met even with every fragment offloaded (saying
  // how many bytes are still missing) or when the optimizer step alone does not fit.
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override;
  const OffloadStats& stats() const { return stats_; }

 private:
  OffloadOptions options_;
  OffloadStats stats_;
  int64_t budget_bytes_ = 0;  // of the last Run
  std::string arena_note_;    // why the last Run's arena stays over the budget, if it does
};

// ZeRO-3 offload: every fragment leaves at the start of the step and comes back after the last
// backward, whatever the budget (a budget only adds the waits on offload copies it needs).
class ZeroOffloadPass : public Pass {
 public:
  bool FreesMemory() const override { return true; }
  std::string_view name() const override { return "offload-all"; }
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override;
  const OffloadStats& stats() const { return stats_; }

 private:
  OffloadStats stats_;
  int64_t budget_bytes_ = 0;  // of the last Run
};

struct DcOffloadOptions {
  // DeepCompile's MARGIN: it plans against total_mem = budget × (1 − margin).
  double margin = 0.2;
};

// DeepCompile's rule, on this schedule's memory timeline without optimizer state (the profile
// DeepCompile takes after evicting all of it):
// - Forward (micro-step 0): peak_mem[node] = running max of the profiled peak from the start;
//   at each forward compute, while total_mem − peak_mem[node] − (bytes of fragments still
//   resident) < 0, the next fragment in list order (optimizer op order, m before v) is chosen;
//   the node waits for its offload copy. All chosen offloads start at the head of the step.
// - Backward (last micro-step): peak_mem[node] = running max from the node to the end of
//   backward; after each backward compute, while total_mem > peak_mem[node] + reloaded + next,
//   the next fragment is reloaded there. The rest reload after the last backward.
// No change without a budget. The verifier judges whether the result fits (DeepCompile's rule
// does not look at the whole backward).
class DcOffloadPass : public Pass {
 public:
  bool FreesMemory() const override { return true; }
  explicit DcOffloadPass(DcOffloadOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "dc-offload"; }
  std::string OptionsText() const override;
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override;
  const OffloadStats& stats() const { return stats_; }

 private:
  DcOffloadOptions options_;
  OffloadStats stats_;
  int64_t budget_bytes_ = 0;  // of the last Run
};

std::unique_ptr<Pass> MakeOffloadPass(OffloadOptions options = {});
std::unique_ptr<Pass> MakeZeroOffloadPass();
std::unique_ptr<Pass> MakeDcOffloadPass(DcOffloadOptions options = {});

}  // namespace dc
