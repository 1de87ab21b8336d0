#include "rewriter/simulation_cache.h"

#include <utility>

#include "rewriter/verifier.h"
#include "schemas/happens_before.h"

namespace dc {

namespace {

// The memory plan's placements and arena, which the order check reads beside the instructions.
uint64_t PlacementsFingerprint(const proto::MemoryPlan& plan) {
  constexpr uint64_t kPrime = 0x100000001b3ull;
  uint64_t hash = static_cast<uint64_t>(plan.arena_bytes()) * kPrime;
  for (const proto::BufferPlacement& p : plan.placements()) {
    hash = (hash ^ static_cast<uint64_t>(p.instruction())) * kPrime;
    hash = (hash ^ static_cast<uint64_t>(p.tensor())) * kPrime;
    hash = (hash ^ static_cast<uint64_t>(p.micro_step())) * kPrime;
    hash = (hash ^ static_cast<uint64_t>(p.offset_bytes())) * kPrime;
  }
  return hash;
}

}  // namespace

std::shared_ptr<const SimResult> SimulationCache::Kept(const proto::Schedule& schedule,
                                                       const CostModel& costs,
                                                       const SimOptions& options,
                                                       uint64_t fingerprint) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Entry& e : entries_) {
    if (e.fingerprint == fingerprint && e.instructions == schedule.instructions_size() &&
        e.world_size == schedule.world_size() && e.costs == &costs &&
        e.memory_timeline == options.memory_timeline) {
      ++hits_;
      return e.result;
    }
  }
  return nullptr;
}

void SimulationCache::Keep(const proto::Schedule& schedule, const CostModel& costs,
                           const SimOptions& options, uint64_t fingerprint,
                           const SimResult& result) {
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
}

StatusOr<SimResult> SimulationCache::Simulate(const proto::Schedule& schedule,
                                              const CostModel& costs, const SimOptions& options,
                                              std::optional<uint64_t> given) {
  // A kept result tells no listener: a replay with one is the caller's own.
  if (options.also_listening) return dc::Simulate(schedule, costs, options);
  const uint64_t fingerprint = given ? *given : InstructionsFingerprint(schedule);
  if (auto kept = Kept(schedule, costs, options, fingerprint)) return *kept;
  DC_ASSIGN_OR_RETURN(SimResult result, dc::Simulate(schedule, costs, options));
  Keep(schedule, costs, options, fingerprint, result);
  return result;
}

int64_t SimulationCache::hits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hits_;
}

StatusOr<SimResult> SimulationCache::SimulateAndCheckOrder(const proto::Schedule& schedule,
                                                           const CostModel& costs,
                                                           const SimOptions& options,
                                                           std::optional<uint64_t> given) {
  if (options.also_listening) {
    return Status::Error("SimulateAndCheckOrder takes no listener of its own");
  }
  const uint64_t fingerprint = given ? *given : InstructionsFingerprint(schedule);
  const Checked key{fingerprint, schedule.instructions_size(),
                    PlacementsFingerprint(schedule.memory_plan())};
  bool checked = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Checked& c : checked_) {
      if (c.fingerprint == key.fingerprint && c.instructions == key.instructions &&
          c.placements == key.placements) {
        ++order_hits_;
        checked = true;
        break;
      }
    }
  }
  if (checked) return Simulate(schedule, costs, options, fingerprint);
  std::shared_ptr<const SimResult> kept = Kept(schedule, costs, options, fingerprint);
  SimResult result;
  if (kept) {
    // The kept simulation checked the references of identical instructions.
    DC_RETURN_IF_ERROR(dc::CheckHappensBefore(schedule));
    result = *kept;
  } else {
    // Neither kept: one replay for both.
    HappensBeforeCheck order(schedule);
    SimOptions both = options;
    both.also_listening = &order;
    DC_ASSIGN_OR_RETURN(result, dc::Simulate(schedule, costs, both));
    Keep(schedule, costs, options, fingerprint, result);
    DC_RETURN_IF_ERROR(order.status());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  checked_.push_back(key);
  if (checked_.size() > capacity_) checked_.pop_front();
  return result;
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
