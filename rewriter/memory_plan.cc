#include "rewriter/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>

#include "machine/simulator.h"
#include "rewriter/memory_lifetimes.h"
#include "schemas/units.h"

namespace dc {

StatusOr<std::vector<std::pair<int, int>>> ReuseDependencies(const proto::Schedule& schedule) {
  DC_ASSIGN_OR_RETURN(std::vector<BufferLifetime> buffers, BufferLifetimes(schedule));
  const proto::MemoryPlan& plan = schedule.memory_plan();
  if (static_cast<size_t>(plan.placements_size()) != buffers.size()) {
    return Status::Error("the memory plan places " + std::to_string(plan.placements_size()) +
                         " buffers but the schedule has " + std::to_string(buffers.size()) +
                         "; run the memory-plan pass again");
  }
  // Offsets by placement key, the last placement of a key winning (as assigning into a map
  // would): sorted once, then looked up per buffer.
  using Key = std::tuple<int, int, int>;
  std::vector<std::pair<Key, int64_t>> offset_of;
  offset_of.reserve(plan.placements_size());
  for (const proto::BufferPlacement& p : plan.placements()) {
    offset_of.push_back({{p.instruction(), p.tensor(), p.micro_step()}, p.offset_bytes()});
  }
  auto key_less = [](const std::pair<Key, int64_t>& a, const std::pair<Key, int64_t>& b) {
    return a.first < b.first;
  };
  if (!std::is_sorted(offset_of.begin(), offset_of.end(), key_less)) {
    std::stable_sort(offset_of.begin(), offset_of.end(), key_less);
  }
  auto find_offset = [&](const Key& key) -> const int64_t* {
    auto it = std::upper_bound(offset_of.begin(), offset_of.end(), std::make_pair(key, int64_t{0}),
                               key_less);
    return it != offset_of.begin() && std::prev(it)->first == key ? &std::prev(it)->second
                                                                  : nullptr;
  };
  std::vector<int> order(buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return buffers[a].alloc_index < buffers[b].alloc_index; });
  // Address segments [start, end) -> the buffer that last occupied them.
  using Segments = std::map<int64_t, std::pair<int64_t, int>>;
  Segments last;
  // The first segment at or after `cut`, splitting the one that straddles it.
  auto split_at = [&](int64_t cut) -> Segments::iterator {
    auto it = last.upper_bound(cut);
    if (it == last.begin()) return it;
    const auto previous = std::prev(it);
    if (previous->first == cut) return previous;
    if (previous->second.first <= cut) return it;
    it = last.emplace_hint(it, cut, previous->second);
    previous->second.first = cut;
    return it;
  };
  std::vector<std::pair<int, int>> deps;
  const int n = schedule.instructions_size();
  for (int b : order) {
    const BufferLifetime& buffer = buffers[b];
    const int64_t* offset = find_offset({buffer.instruction, buffer.tensor, buffer.micro_step});
    if (!offset) {
      return Status::Error("the memory plan has no placement for " +
                           schedule.program().tensors(buffer.tensor).name() + " of instruction " +
                           std::to_string(buffer.instruction) + "; run the memory-plan pass again");
    }
    if (buffer.size_bytes == 0) continue;
    const int64_t start = *offset, end = start + buffer.size_bytes;
    // Split the segments straddling the ends, then take over everything in between.
    const Segments::iterator first = split_at(start);
    const Segments::iterator stop = split_at(end);
    for (auto it = first; it != stop; ++it) {
      const BufferLifetime& previous = buffers[it->second.second];
      if (previous.free_index >= buffer.alloc_index) {
        return Status::Error("the memory plan overlaps two live buffers (" +
                             schedule.program().tensors(previous.tensor).name() + " and " +
                             schedule.program().tensors(buffer.tensor).name() +
                             "); run the memory-plan pass again");
      }
      const int freed_by = previous.free_index;
      const int allocated_by = buffer.alloc_index;
      if (freed_by >= 0 && freed_by < n && allocated_by >= 0 &&
          schedule.instructions(freed_by).stream() !=
              schedule.instructions(allocated_by).stream()) {
        deps.emplace_back(allocated_by, freed_by);
      }
    }
    last.erase(first, stop);
    last.emplace_hint(stop, start, std::make_pair(end, b));
  }
  std::sort(deps.begin(), deps.end());
  deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
  return deps;
}

Status AddReuseDependencies(proto::Schedule* schedule, int* added) {
  DC_ASSIGN_OR_RETURN(auto deps, ReuseDependencies(*schedule));
  int count = 0;
  for (size_t i = 0; i < deps.size();) {
    const int instruction = deps[i].first;
    proto::Instruction* instr = schedule->mutable_instructions(instruction);
    std::vector<int> all(instr->deps().begin(), instr->deps().end());
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    const size_t before = all.size();
    for (; i < deps.size() && deps[i].first == instruction; ++i) all.push_back(deps[i].second);
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    count += static_cast<int>(all.size() - before);
    instr->clear_deps();
    for (int d : all) instr->add_deps(d);
  }
  if (added) *added = count;
  return Status::Ok();
}
std::string MemoryPlanPass::OptionsText() const { return MemoryPlanOptionsText(options_); }

StatusOr<bool> MemoryPlanPass::Run(proto::Schedule* schedule, const PassContext& context) {
  summary_.clear();
  reuse_dependencies_added_ = 0;
  const int64_t budget = context.budget_bytes;
  // Where the offload pass's arena check packed these lifetimes, its packings are not made again.
  DC_ASSIGN_OR_RETURN(
      proto::MemoryPlan plan,
      PlanMemory(*schedule, options_, budget, context.costs, &stats_, context.input_simulation,
                 context.threads, context.packings, context.thread_share));
  static const CostModel kFallback;
  const CostModel& costs = context.costs ? *context.costs : kFallback;
  SimOptions sim_options;
  sim_options.memory_timeline = false;
  SimResult sim;
  if (context.input_simulation) {
    sim = *context.input_simulation;
  } else {
    DC_ASSIGN_OR_RETURN(sim, Simulate(*schedule, costs, sim_options));
  }
  simulated_peak_bytes_ = sim.peak_device_bytes;
  const bool in_order = stats_.lifetimes == MemoryPlanOptions::Lifetimes::kInstructionOrder;
  const double fragmentation =
      stats_.live_peak_bytes > 0
          ? 100.0 * static_cast<double>(stats_.arena_bytes - stats_.live_peak_bytes) /
                static_cast<double>(stats_.live_peak_bytes)
          : 0.0;
  const std::string reused =
      stats_.packings_reused > 0
          ? " (" + std::to_string(stats_.packings_reused) + " by the offload pass's arena check)"
          : "";
  char text[512];
  std::snprintf(text, sizeof(text),
                "arena %s for %d buffers (%s lifetimes, %s order, %d tried%s, %d buffers reuse "
                "bytes in instruction order only); live peak %s (%+.2f%% fragmentation); "
                "simulated peak %s; budget %s",
                FormatBytes(stats_.arena_bytes).c_str(), stats_.buffers,
                in_order ? "instruction-order" : "simulated-time", stats_.order.c_str(),
                stats_.orders_tried, reused.c_str(), stats_.spilled_buffers,
                FormatBytes(stats_.live_peak_bytes).c_str(), fragmentation,
                FormatBytes(simulated_peak_bytes_).c_str(),
                budget > 0 ? FormatBytes(budget).c_str() : "none");
  summary_ = text;
  if (budget > 0 && stats_.arena_bytes > budget) {
    std::string why;
    if (stats_.instruction_order_peak_bytes > budget) {
      why = "; " + FormatBytes(stats_.instruction_order_peak_bytes) +
            " are held at once at instruction " +
            std::to_string(stats_.instruction_order_peak_instruction) + ", so no packing fits";
    } else {
      why = "; at most " + FormatBytes(stats_.live_peak_bytes) + " are held at once (" +
            (in_order ? "instruction order" : "simulated time") + ")";
    }
    return Status::OverBudget("the memory plan's arena needs " + FormatBytes(stats_.arena_bytes) +
                                  " (best of " + std::to_string(stats_.orders_tried) +
                                  " packing orders), over the budget of " + FormatBytes(budget) +
                                  why + " (simulated peak " + FormatBytes(simulated_peak_bytes_) +
                                  "); raise --budget",
                              stats_.arena_bytes - budget);
  }
  bool changed = schedule->memory_plan().SerializeAsString() != plan.SerializeAsString();
  *schedule->mutable_memory_plan() = std::move(plan);
  // Reuse in instruction order only is safe on asynchronous streams only with its waits.
  if (options_.add_reuse_dependencies || in_order || stats_.spilled_buffers > 0) {
    DC_RETURN_IF_ERROR(AddReuseDependencies(schedule, &reuse_dependencies_added_));
    changed |= reuse_dependencies_added_ > 0;
    DC_ASSIGN_OR_RETURN(SimResult ordered, Simulate(*schedule, costs, sim_options));
    std::snprintf(text, sizeof(text), "; %d reuse dependencies: step %.4f s -> %.4f s",
                  reuse_dependencies_added_, sim.step_seconds, ordered.step_seconds);
    summary_ += text;
  }
  return changed;
}

std::unique_ptr<Pass> MakeMemoryPlanPass(MemoryPlanOptions options) {
  return std::make_unique<MemoryPlanPass>(std::move(options));
}

}  // namespace dc
