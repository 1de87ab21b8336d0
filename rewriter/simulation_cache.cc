#include "rewriter/simulation_cache.h"

#include <utility>

#include "rewriter/verifier.h"
#include "schemas/happens_before.h"

namespace dc {

StatusOr<SimResult> SimulationCache::Simulate(const proto::Schedule& schedule,
                                              const CostModel& costs, const SimOptions& options,
                                              std::optional<uint64_t> given) {
  const uint64_t fingerprint = given ? *given : InstructionsFingerprint(schedule);
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

Status SimulationCache::CheckHappensBefore(const proto::Schedule& schedule,
                                           std::optional<uint64_t> given) {
  const uint64_t fingerprint = given ? *given : InstructionsFingerprint(schedule);
  const int instructions = schedule.instructions_size();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Checked& c : checked_) {
      if (c.fingerprint == fingerprint && c.instructions == instructions) {
        ++order_hits_;
        return Status::Ok();
      }
    }
  }
  DC_RETURN_IF_ERROR(dc::CheckHappensBefore(schedule));
  std::lock_guard<std::mutex> lock(mutex_);
  checked_.push_back({fingerprint, instructions});
  if (checked_.size() > capacity_) checked_.pop_front();
  return Status::Ok();
}

int64_t SimulationCache::order_hits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return order_hits_;
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
