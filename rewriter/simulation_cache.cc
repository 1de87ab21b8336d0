#include "rewriter/simulation_cache.h"

#include <utility>

#include "rewriter/verifier.h"

namespace dc {

StatusOr<SimResult> SimulationCache::Simulate(const proto::Schedule& schedule,
                                              const CostModel& costs, const SimOptions& options) {
  const uint64_t fingerprint = InstructionsFingerprint(schedule);
  auto same = [&](const Entry& e) {
    return e.fingerprint == fingerprint && e.instructions == schedule.instructions_size() &&
           e.world_size == schedule.world_size() && e.costs == &costs &&
           e.memory_timeline == options.memory_timeline;
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Entry& e : entries_) {
      if (same(e)) {
        ++hits_;
        return *e.result;
      }
    }
  }
  DC_ASSIGN_OR_RETURN(SimResult result, dc::Simulate(schedule, costs, options));
  Entry entry;
  entry.fingerprint = fingerprint;
  entry.instructions = schedule.instructions_size();
  entry.world_size = schedule.world_size();
  entry.costs = &costs;
  entry.memory_timeline = options.memory_timeline;
  entry.result = std::make_shared<const SimResult>(result);
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back(std::move(entry));
  if (entries_.size() > capacity_) entries_.pop_front();
  return result;
}

int64_t SimulationCache::hits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hits_;
}

StatusOr<SimResult> SimulateIn(const PassContext& context, const proto::Schedule& schedule,
                               const SimOptions& options) {
  if (context.simulations) return context.simulations->Simulate(schedule, *context.costs, options);
  return Simulate(schedule, *context.costs, options);
}

StatusOr<SimResult> InputSimulation(const PassContext& context, const proto::Schedule& schedule,
                                    bool changed) {
  if (context.input_simulation && !changed) return *context.input_simulation;
  SimOptions quick;
  quick.memory_timeline = false;
  return SimulateIn(context, schedule, quick);
}

}  // namespace dc
