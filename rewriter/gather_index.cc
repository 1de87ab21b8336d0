#include "rewriter/gather_index.h"

#include "schemas/effects.h"

namespace dc::rewriter_internal {

int GatherIndex::FirstUse(int gather) const {
  int first = -1;
  for (const auto& [param, span] : opened[gather]) {
    const int use = spans_by_param[param][span].first_use;
    if (use >= 0 && (first < 0 || use < first)) first = use;
  }
  return first;
}

GatherIndex IndexGathers(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  const int n = schedule.instructions_size();
  GatherIndex index;
  index.spans_by_param.resize(program.tensors_size());
  index.compute_stream_before.resize(n);
  index.opened.resize(n);
  std::vector<int> open(program.tensors_size(), -1);  // span index of a live gathered param
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    index.compute_stream_before[i] = static_cast<int>(index.compute_stream.size());
    if (instr.stream() == proto::STREAM_COMPUTE) index.compute_stream.push_back(i);
    switch (instr.kind()) {
      case proto::INSTR_ALL_GATHER:
        for (int t : instr.tensors()) {
          auto& spans = index.spans_by_param[t];
          spans.push_back({i, -1, -1});
          open[t] = static_cast<int>(spans.size()) - 1;
          index.opened[i].emplace_back(t, open[t]);
        }
        break;
      case proto::INSTR_COMPUTE: {
        const proto::Op& op = program.ops(instr.op());
        if (op.phase() == proto::PHASE_OPTIMIZER) break;
        for (int t : op.inputs()) {
          if (program.tensors(t).role() != proto::ROLE_PARAM || open[t] < 0) continue;
          GatheredSpan& span = index.spans_by_param[t][open[t]];
          if (span.first_use < 0) span.first_use = i;
        }
        break;
      }
      case proto::INSTR_RELEASE:
        for (int t : instr.tensors()) {
          if (program.tensors(t).role() != proto::ROLE_PARAM || open[t] < 0) continue;
          index.spans_by_param[t][open[t]].release = i;
          open[t] = -1;
        }
        break;
      default:
        break;
    }
  }
  return index;
}

std::vector<int64_t> TensorBytes(const proto::Program& program) {
  std::vector<int64_t> bytes;
  bytes.reserve(program.tensors_size());
  for (const proto::Tensor& t : program.tensors()) bytes.push_back(TransientBytes(program, t));
  return bytes;
}
bool OrderGathersAfterReleases(const GatherIndex& index, proto::Schedule* schedule) {
  bool added = false;
  for (const auto& spans : index.spans_by_param) {
    for (size_t s = 1; s < spans.size(); ++s) {
      const int release = spans[s - 1].release;
      const int gather = spans[s].gather;
      if (release < 0 || gather < 0) continue;
      const bool release_on_compute =
          schedule->instructions(release).stream() == proto::STREAM_COMPUTE;
      bool ordered = false;
      for (int d : schedule->instructions(gather).deps()) {
        // A compute-stream dep at or after a compute-stream release implies the release.
        ordered |= d == release || (release_on_compute && d > release &&
                                    schedule->instructions(d).stream() == proto::STREAM_COMPUTE);
      }
      if (ordered) continue;
      schedule->mutable_instructions(gather)->add_deps(release);
      added = true;
    }
  }
  return added;
}
}  // namespace dc::rewriter_internal
