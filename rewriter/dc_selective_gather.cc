#include "rewriter/dc_selective_gather.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "machine/simulator.h"
#include "rewriter/bridges.h"
#include "rewriter/gather_index.h"
#include "rewriter/schedule_editor.h"
#include "rewriter/simulation_cache.h"
#include "schemas/effects.h"

namespace dc {

using rewriter_internal::Bridge;
using rewriter_internal::GatherIndex;

std::string DcSelectiveGatherPass::OptionsText() const {
  char text[128];
  std::snprintf(text, sizeof(text), "margin=%.9g max_attempts=%d", options_.margin,
                options_.max_attempts);
  return text;
}

StatusOr<bool> DcSelectiveGatherPass::Run(proto::Schedule* schedule, const PassContext& context) {
  if (!context.costs) return Status::Error("dc-selective-gather needs a cost model");
  SimOptions quick;
  quick.memory_timeline = false;
  const GatherIndex index = rewriter_internal::IndexGathers(*schedule);
  const bool ordered = rewriter_internal::OrderGathersAfterReleases(index, schedule);
  DC_ASSIGN_OR_RETURN(SimResult input, SimulateIn(context, *schedule, quick));
  const std::vector<int64_t> bytes = rewriter_internal::TensorBytes(schedule->program());

  // Per param: its bytes and the seconds of one micro-step's gathers of it.
  struct Candidate {
    int param;
    int64_t bytes;
    double seconds;
  };
  std::vector<Candidate> candidates;
  for (size_t param = 0; param < index.spans_by_param.size(); ++param) {
    const auto& spans = index.spans_by_param[param];
    if (spans.empty() || bytes[param] <= 0) continue;
    const int first_micro = schedule->instructions(spans.front().gather).micro_step();
    int gathers = 0;
    for (const auto& span : spans) {
      gathers += schedule->instructions(span.gather).micro_step() == first_micro;
    }
    candidates.push_back({static_cast<int>(param), bytes[param],
                          gathers * context.costs->all_gather.Seconds(bytes[param])});
  }
  std::stable_sort(
      candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
        return a.seconds * static_cast<double>(b.bytes) > b.seconds * static_cast<double>(a.bytes);
      });

  const int64_t budget = context.budget_bytes;
  int64_t available =
      budget > 0 ? static_cast<int64_t>(static_cast<double>(budget) * (1 - options_.margin)) -
                       input.peak_device_bytes
                 : kUnlimitedBytes;
  google::protobuf::Arena arena;
  proto::Schedule* candidate = rewriter_internal::ScheduleShell(schedule, &arena);
  for (int attempt = 0; attempt < options_.max_attempts && available > 0; ++attempt) {
    std::vector<Bridge> bridges;
    int64_t persistent = 0;
    for (const Candidate& c : candidates) {
      if (persistent + c.bytes > available) break;
      persistent += c.bytes;
      const auto& spans = index.spans_by_param[c.param];
      for (size_t s = 0; s + 1 < spans.size(); ++s) {
        if (spans[s].release < 0 || schedule->instructions(spans[s].release).micro_step() < 0 ||
            schedule->instructions(spans[s + 1].gather).micro_step() < 0) {
          continue;
        }
        bridges.push_back({c.param, static_cast<int>(s)});
      }
    }
    if (bridges.empty()) return ordered;
    DC_RETURN_IF_ERROR(rewriter_internal::ApplyBridges(*schedule, index, bridges, candidate));
    DC_ASSIGN_OR_RETURN(SimResult output, SimulateIn(context, *candidate, quick));
    if (budget <= 0 || output.peak_device_bytes <= budget) {
      *schedule->mutable_instructions() = candidate->instructions();
      return true;
    }
    available -= output.peak_device_bytes - budget;
  }
  return ordered;
}

}  // namespace dc
