// The simulations one MakePlan makes, kept for the schedules it meets again: every candidate
// pipeline starts from the same zero3 schedule, and a pass's chosen candidate is the schedule the
// verifier then checks. Simulate is a function of the schedule's instructions, its program and
// world size (fixed within a plan), the costs and the options, so a schedule with the same
// instructions (verifier.h's fingerprint, and their count) under the same costs and options takes
// the kept result: the same numbers, not simulated again. Thread-safe (candidates run at once).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>

#include "machine/cost_model.h"
#include "machine/simulator.h"
#include "rewriter/pass.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

class SimulationCache {
 public:
  // Keeps the last `capacity` simulations (a plan meets a schedule again soon after, if at all;
  // each holds two doubles per instruction).
  explicit SimulationCache(size_t capacity = 8) : capacity_(capacity) {}
  SimulationCache(const SimulationCache&) = delete;
  SimulationCache& operator=(const SimulationCache&) = delete;

  // Simulate(schedule, costs, options), from what is kept where it can be (never with
  // `options.also_listening`: a kept result tells no listener). Errors are not kept.
  // `fingerprint`: the schedule's InstructionsFingerprint where the caller has it already.
  StatusOr<SimResult> Simulate(const proto::Schedule& schedule, const CostModel& costs,
                               const SimOptions& options,
                               std::optional<uint64_t> fingerprint = std::nullopt);
  // Simulations taken from what was kept, for tests and figures.
  int64_t hits() const;
  // Simulate, and CheckHappensBefore(schedule) (schemas/happens_before.h): the verifier's two
  // checks. The order check is a function of the instructions and the memory plan's placements
  // (the program is the plan's): Ok at once for a schedule that passed it before in this plan
  // (every candidate verifies the same zero3 schedule, and a pass that changes nothing hands the
  // verifier the schedule it checked last). Where neither is kept, one replay of the buffer
  // effects serves both. The simulation's errors come first, then the order's. Failures are not
  // kept. `options.also_listening` must be null.
  StatusOr<SimResult> SimulateAndCheckOrder(const proto::Schedule& schedule, const CostModel& costs,
                                            const SimOptions& options,
                                            std::optional<uint64_t> fingerprint = std::nullopt);
  // Checks taken from what was kept, for tests.
  int64_t order_hits() const;

 private:
  struct Entry {
    uint64_t fingerprint = 0;
    int instructions = 0, world_size = 0;
    const CostModel* costs = nullptr;
    bool memory_timeline = false;
    std::shared_ptr<const SimResult> result;
  };
  struct Checked {
    uint64_t fingerprint = 0;
    int instructions = 0;
    uint64_t placements = 0;  // the memory plan's
  };
  // The kept simulation of the schedule (a hit counted), or null.
  std::shared_ptr<const SimResult> Kept(const proto::Schedule& schedule, const CostModel& costs,
                                        const SimOptions& options, uint64_t fingerprint);
  void Keep(const proto::Schedule& schedule, const CostModel& costs, const SimOptions& options,
            uint64_t fingerprint, const SimResult& result);
  const size_t capacity_;
  mutable std::mutex mutex_;
  std::deque<Entry> entries_;
  std::deque<Checked> checked_;  // the last `capacity_` that passed the order check
  int64_t hits_ = 0, order_hits_ = 0;
};

// Simulate(schedule, *context.costs, options) through context.simulations where there is one.
StatusOr<SimResult> SimulateIn(const PassContext& context, const proto::Schedule& schedule,
                               const SimOptions& options);

// The simulation of the schedule a pass was given, memory timeline off: the verifier's
// (PassContext::input_simulation) where there is one and `changed` is false, else SimulateIn's.
// A pass that edits the schedule before it plans (bucket and unshard order gathers after their
// params' releases) passes `changed` = true.
StatusOr<SimResult> InputSimulation(const PassContext& context, const proto::Schedule& schedule,
                                    bool changed = false);

}  // namespace dc
