#include "rewriter/bridges.h"

#include <algorithm>
#include <string>

#include "rewriter/schedule_editor.h"

namespace dc::rewriter_internal {

Status ApplyBridges(const proto::Schedule& in, const GatherIndex& index,
                    const std::vector<Bridge>& bridges, proto::Schedule* out) {
  const int n = in.instructions_size();
  // Per instruction: the params it loses.
  std::vector<std::vector<int>> lose(n);
  // The gather that keeps each bridged param live, by the gather instruction it replaces.
  std::vector<std::vector<std::pair<int, int>>> kept_by(n);  // removed gather -> (param, keeper)
  std::vector<std::vector<char>> bridged(index.spans_by_param.size());
  for (const Bridge& b : bridges) {
    auto& flags = bridged[b.param];
    if (flags.empty()) flags.assign(index.spans_by_param[b.param].size(), 0);
    flags[b.span] = 1;
  }
  for (size_t param = 0; param < bridged.size(); ++param) {
    const auto& flags = bridged[param];
    if (flags.empty()) continue;
    const auto& spans = index.spans_by_param[param];
    int keeper = spans[0].gather;
    for (size_t s = 0; s + 1 < spans.size(); ++s) {
      if (!flags[s]) {
        keeper = spans[s + 1].gather;
        continue;
      }
      if (spans[s].release < 0) {
        return Status::Error("internal: bridging a span of tensor " + std::to_string(param) +
                             " that is never released");
      }
      lose[spans[s].release].push_back(static_cast<int>(param));
      lose[spans[s + 1].gather].push_back(static_cast<int>(param));
      kept_by[spans[s + 1].gather].emplace_back(static_cast<int>(param), keeper);
    }
  }
  ScheduleEditor editor(in, out);
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = in.instructions(i);
    if (lose[i].empty()) {
      editor.Keep(i);
      continue;
    }
    std::vector<int> remaining;
    for (int t : instr.tensors()) {
      if (std::find(lose[i].begin(), lose[i].end(), t) == lose[i].end()) remaining.push_back(t);
    }
    // Dependents of a removed gather wait for the gathers that keep its params instead (and
    // for what the gather waited for); of a removed release, for what the release waited for.
    std::vector<int> targets(instr.deps().begin(), instr.deps().end());
    for (const auto& [param, keeper] : kept_by[i]) targets.push_back(keeper);
    if (remaining.empty()) {
      editor.Drop(i, std::move(targets));
      continue;
    }
    // A gather that keeps other params still runs after its keepers (same stream, earlier),
    // so computes that wait for it wait for them too.
    proto::Instruction* kept = editor.Keep(i);
    kept->clear_tensors();
    for (int t : remaining) kept->add_tensors(t);
  }
  return editor.Finish();
}

}  // namespace dc::rewriter_internal
