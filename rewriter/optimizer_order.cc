#include "rewriter/optimizer_order.h"

#include <algorithm>
#include <cstdio>
#include <queue>
#include <tuple>
#include <vector>

#include "rewriter/schedule_editor.h"
#include "rewriter/simulation_cache.h"

namespace dc {
namespace {

using rewriter_internal::ScheduleEditor;

// Whether `instr` may be in a run of optimizer-phase instructions on `stream`: the compute
// stream's, or the host's where Adam runs there.
bool InOptimizerRun(const proto::Instruction& instr, proto::Stream stream) {
  return instr.micro_step() == -1 && instr.stream() == stream &&
         (stream == proto::STREAM_COMPUTE || stream == proto::STREAM_HOST);
}

// The new order of the instructions [begin, end) (a run of optimizer-phase instructions on one
// stream): list-scheduled by when their deps before `begin` end in `sim`.
std::vector<int> RunOrder(const proto::Schedule& schedule, const SimResult& sim, int begin,
                          int end) {
  const int size = end - begin;
  std::vector<double> ready(size, 0);
  std::vector<int> waiting(size, 0);               // deps inside the run not yet taken
  std::vector<std::vector<int>> dependents(size);  // inside the run
  for (int k = 0; k < size; ++k) {
    for (int d : schedule.instructions(begin + k).deps()) {
      if (d >= begin && d < end) {
        ++waiting[k];
        dependents[d - begin].push_back(k);
      } else {
        ready[k] = std::max(ready[k], sim.end_seconds[d]);
      }
    }
  }
  using Entry = std::pair<double, int>;  // (ready, position in the run)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
  for (int k = 0; k < size; ++k) {
    if (waiting[k] == 0) queue.push({ready[k], k});
  }
  std::vector<int> order;
  order.reserve(size);
  while (!queue.empty()) {
    const int k = queue.top().second;
    queue.pop();
    order.push_back(begin + k);
    for (int after : dependents[k]) {
      if (--waiting[after] == 0) queue.push({ready[after], after});
    }
  }
  return order;
}

}  // namespace

StatusOr<bool> OptimizerOrderPass::Run(proto::Schedule* schedule, const PassContext& context) {
  summary_.clear();
  if (!context.costs) return Status::Error("optimizer-order needs a cost model");
  DC_ASSIGN_OR_RETURN(const SimResult input, InputSimulation(context, *schedule));
  if (context.final_budget_bytes > 0 && input.peak_device_bytes > context.final_budget_bytes) {
    summary_ =
        "kept the optimizer phase's order: the step is over the budget, and offload plans "
        "its reloads around that order";
    return false;
  }
  const int n = schedule->instructions_size();
  std::vector<int> order;
  order.reserve(n);
  int moved = 0;
  for (int i = 0; i < n;) {
    const proto::Stream stream = schedule->instructions(i).stream();
    if (!InOptimizerRun(schedule->instructions(i), stream)) {
      order.push_back(i++);
      continue;
    }
    int end = i;
    while (end < n && InOptimizerRun(schedule->instructions(end), stream)) ++end;
    const std::vector<int> run = RunOrder(*schedule, input, i, end);
    for (size_t k = 0; k < run.size(); ++k) moved += run[k] != i + static_cast<int>(k);
    order.insert(order.end(), run.begin(), run.end());
    i = end;
  }
  if (moved == 0) {
    summary_ = "the optimizer phase already runs in the order its inputs are ready";
    return false;
  }
  google::protobuf::Arena arena;
  proto::Schedule* candidate = rewriter_internal::ScheduleShell(schedule, &arena);
  ScheduleEditor editor(*schedule, candidate);
  for (int old : order) editor.Keep(old);
  DC_RETURN_IF_ERROR(editor.Finish());
  SimOptions quick;
  quick.memory_timeline = false;
  DC_ASSIGN_OR_RETURN(const SimResult output, SimulateIn(context, *candidate, quick));
  const bool fits = context.budget_bytes <= 0 || output.peak_device_bytes <= context.budget_bytes;
  char text[200];
  if (!fits || output.step_seconds >= input.step_seconds) {
    std::snprintf(text, sizeof(text),
                  "kept the optimizer phase's order: the order its inputs are ready (%d moved) "
                  "was no faster",
                  moved);
    summary_ = text;
    return false;
  }
  std::snprintf(text, sizeof(text),
                "%d optimizer-phase instructions reordered as their inputs are ready; step %.6f s "
                "-> %.6f s",
                moved, input.step_seconds, output.step_seconds);
  summary_ = text;
  *schedule->mutable_instructions() = candidate->instructions();
  return true;
}

}  // namespace dc
