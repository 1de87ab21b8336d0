// The plan-simulate-repair loop of the `offload` and `offload-all` passes (rewriter/offload.h,
// rewriter/offload_all.h): chooses the fragments to move (the fewest bytes that cover the
// excess, or all), reloads them as late as the backward allows, simulates the result and
// repairs it (waits on offload copies, more fragments, later reloads) until its peak fits the
// budget. Private to rewriter/. Not thread-safe; distinct instances are independent.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "machine/cost_model.h"
#include "machine/simulator.h"
#include "rewriter/offload.h"
#include "rewriter/offload_plan.h"

namespace dc::rewriter_internal {

class OffloadPlanner {
 public:
  struct Mode {
    bool minimal = true;        // choose the fewest bytes (else every fragment)
    bool early_reloads = true;  // reload inside the last backward (else all at its end)
    OffloadOptions options;
  };

  OffloadPlanner(const proto::Schedule& input, const Layout& layout, const CostModel& costs,
                 int64_t budget_bytes, Mode mode, OffloadStats* stats);

  // `base` is the simulation of the input schedule (with its memory timeline).
  StatusOr<proto::Schedule> Run(const SimResult& base);

  // The simulation of the schedule the last successful Run returned.
  const SimResult& output_simulation() const { return output_simulation_; }

 private:
  // Every fragment, but masters only while their compute-dtype shards fit `headroom_bytes`
  // (list order).
  std::vector<int> All(int64_t headroom_bytes) const;

  // The fewest bytes (in the options' order, then pruned) that cover `target_bytes`. Masters
  // come after every optimizer state: one moves its whole fp32 shard to free what its compute
  // shard does not hold (half of it in bf16), so it is the dearest byte to free; and only while
  // their compute shards fit `headroom_bytes`.
  StatusOr<std::vector<int>> Choose(int64_t target_bytes, int64_t peak_bytes,
                                    int64_t headroom_bytes) const;

  // Per old instruction: the bytes the offloads (cumulative, in d2h order) must have freed
  // before it starts. Kept in bytes so it survives a change of the chosen fragments.
  using Waits = std::map<int, int64_t>;

  std::vector<std::pair<int, int>> WaitOrdinals(const Waits& waits,
                                                const std::vector<int>& offloads) const;

  // `late` (every reload after the backward) is over the budget. Inside the offload window
  // (before the last offload copy ends) every instruction that starts at an instant over the
  // budget waits for as many copies as cover its excess, all in one round; past the window, or
  // if the waits are already there, more bytes must go.
  Status Repair(const Plan& plan, const Built& late, const SimResult& sim, Waits* waits,
                int64_t* target_bytes) const;

  // Moves each reload (deadline order) to the earliest backward compute of the last micro-step
  // after which the device can hold it and everything reloaded before it at every instant up to
  // the end of backward; the h2d stream copies one at a time, so a reload that queues behind
  // others is issued after the last compute that ends before its copy starts.
  void PlaceReloads(const Built& late, const SimResult& sim, int64_t ceiling_bytes,
                    Plan* plan) const;

  // Fills the "after" half of the stats from `plan` and `sim`; returns `built`'s schedule.
  StatusOr<proto::Schedule> Finish(const Plan& plan, Built built, const SimResult& sim);

  const proto::Schedule& input_;
  const Layout& layout_;
  const CostModel& costs_;
  const int64_t budget_bytes_;
  const Mode mode_;
  OffloadStats* stats_;
  SimResult output_simulation_;
};

}  // namespace dc::rewriter_internal
