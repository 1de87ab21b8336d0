#include "rewriter/pass.h"

#include <chrono>
#include <cstdio>
#include <optional>
#include <utility>

#include "rewriter/simulation_cache.h"
#include "rewriter/verifier.h"
#include "schemas/units.h"

namespace dc {

double StepToBeatSeconds(const PassContext& context) {
  return context.step_to_beat_later ? (*context.step_to_beat_later)()
                                    : context.step_to_beat_seconds;
}

std::vector<std::string> Pipeline::PassNames() const {
  std::vector<std::string> names;
  for (const auto& pass : passes_) names.emplace_back(pass->name());
  return names;
}

std::vector<std::string> Pipeline::EnabledPassNames() const {
  std::vector<std::string> names;
  for (const Pass* pass : EnabledPasses().passes) names.emplace_back(pass->name());
  return names;
}

auto Pipeline::EnabledPasses() const -> Enabled {
  Enabled enabled;
  for (const auto& pass : passes_) {
    if (!disabled_.count(std::string(pass->name()))) enabled.passes.push_back(pass.get());
  }
  const size_t count = enabled.passes.size();
  size_t first_freeing = count;
  for (size_t i = 0; i < count && first_freeing == count; ++i) {
    if (enabled.passes[i]->FreesMemory()) first_freeing = i;
  }
  for (size_t i = 0; i < count; ++i) {
    enabled.relaxed.push_back(i < first_freeing && first_freeing < count);
  }
  enabled.slowing_tail = count;
  while (enabled.slowing_tail > 0 && enabled.passes[enabled.slowing_tail - 1]->NeverSpeedsUp()) {
    --enabled.slowing_tail;
  }
  return enabled;
}

bool Pipeline::SameUpTo(const Enabled& a, const Enabled& b, size_t count) {
  if (a.passes.size() < count || b.passes.size() < count) return false;
  for (size_t i = 0; i < count; ++i) {
    if (a.passes[i]->name() != b.passes[i]->name() ||
        a.passes[i]->OptionsText() != b.passes[i]->OptionsText() || a.relaxed[i] != b.relaxed[i]) {
      return false;
    }
  }
  return true;
}

bool Pipeline::CannotDoBetterThan(const Pipeline& ended, const Status& how, size_t ended_at) const {
  const Enabled mine = EnabledPasses();
  const Enabled theirs = ended.EnabledPasses();
  if (how.over_budget()) return SameUpTo(mine, theirs, ended_at + 1);
  if (!how.cannot_win() || !SameUpTo(mine, theirs, ended_at)) return false;
  for (size_t i = ended_at; i < mine.passes.size(); ++i) {
    if (!mine.passes[i]->NeverSpeedsUp()) return false;
  }
  return true;
}

bool Pipeline::Has(const std::string& name) const {
  for (const auto& pass : passes_) {
    if (pass->name() == name) return true;
  }
  return false;
}

Status Pipeline::Disable(const std::string& name) {
  if (!Has(name)) {
    return Status::Error("no pass '" + name + "' to disable; this pipeline runs " +
                         Join(PassNames(), ", "));
  }
  disabled_.insert(name);
  return Status::Ok();
}

Status Pipeline::DumpAfter(const std::string& name, DumpFn fn) {
  if (!Has(name)) {
    return Status::Error("no pass '" + name + "' to dump after; this pipeline runs " +
                         Join(PassNames(), ", "));
  }
  dump_after_ = name;
  dump_ = std::move(fn);
  return Status::Ok();
}

std::string Pipeline::OptionsText() const {
  std::string text;
  for (const auto& pass : passes_) {
    if (disabled_.count(std::string(pass->name()))) continue;
    text += std::string(pass->name()) + "{" + pass->OptionsText() + "};";
  }
  return text;
}

Status Pipeline::Run(proto::Schedule* schedule, const PassContext& context,
                     std::optional<SimResult>* last_simulation, size_t* ended_at) const {
  // Before the first enabled memory-freeing pass, passes plan against the relaxed budget and
  // the verifier checks structure only; from it on, the real budget holds. From the first of
  // the slowing tail on, every enabled pass never speeds the step up.
  const Enabled enabled = EnabledPasses();
  size_t ended_here = 0;
  if (!ended_at) ended_at = &ended_here;
  *ended_at = 0;
  PassContext enforced = context;
  enforced.final_budget_bytes = context.budget_bytes;
  PassContext relaxed = enforced;
  if (context.relaxed_budget_bytes > 0) relaxed.budget_bytes = context.relaxed_budget_bytes;
  // Where the plan keeps no simulations, the run keeps the verifier's last one: a pass that
  // changes nothing is not simulated again.
  SimulationCache run_simulations(/*capacity=*/1);
  PassContext checked = context;
  if (!checked.simulations) checked.simulations = &run_simulations;
  PassContext structural = checked;
  structural.budget_bytes = 0;
  // The verifier's last simulation: of the schedule the next pass receives.
  std::optional<SimResult> verified_sim;
  // Before the first pass: the schedule given must hold, or be empty for a pass that builds one.
  if (schedule->instructions_size() == 0) {
    const Pass* first = enabled.passes.empty() ? nullptr : enabled.passes.front();
    if (!first) {
      return Status::Error(
          "the schedule is empty and every pass is disabled; enable a pass that "
          "lowers the program (zero3)");
    }
    if (!first->BuildsSchedule()) {
      return Status::Error("pass " + std::string(first->name()) +
                           " is the first to run, but the schedule is empty and it does not " +
                           "build one; enable a pass that lowers the program (zero3) first");
    }
  } else {
    SimResult sim;
    DC_RETURN_IF_ERROR(verifier_(*schedule, structural, &sim).Prefixed("before the first pass: "));
    if (sim.start_seconds.size() == static_cast<size_t>(schedule->instructions_size())) {
      verified_sim = std::move(sim);
    }
  }
  for (size_t i = 0; i < enabled.passes.size(); ++i) {
    Pass* pass = enabled.passes[i];
    const std::string name(pass->name());
    *ended_at = i;
    if (i == enabled.slowing_tail && verified_sim && context.costs) {
      const double to_beat = StepToBeatSeconds(context);
      if (to_beat > 0 && verified_sim->step_seconds >= to_beat) {
        char text[160];
        std::snprintf(text, sizeof(text),
                      "its step before %s is %.6g s, no faster than the plan in hand's %.6g s",
                      name.c_str(), verified_sim->step_seconds, to_beat);
        return Status::CannotWin(text);
      }
    }
    const bool before_freeing = enabled.relaxed[i];
    PassContext pass_context = before_freeing ? relaxed : enforced;
    // Only with a cost model: without one the verifier simulates with a default model.
    if (verified_sim && context.costs) pass_context.input_simulation = &*verified_sim;
    const auto start = std::chrono::steady_clock::now();
    StatusOr<bool> changed = pass->Run(schedule, pass_context);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!changed.ok()) return changed.status().Prefixed("pass " + name + ": ");
    PassContext verify_context = before_freeing ? structural : checked;
    verify_context.input_simulation = nullptr;
    SimResult sim;
    if (Status verified = verifier_(*schedule, verify_context, &sim); !verified.ok()) {
      return verified.Prefixed("after pass " + name + ": ");
    }
    sim.memory_timeline = {};  // passes are given simulations without it
    auto* record = schedule->add_passes();
    record->set_name(name);
    record->set_changed(*changed);
    record->set_seconds(seconds);
    record->set_summary(pass->Summary());
    record->set_instructions(schedule->instructions_size());
    if (context.costs) {
      record->set_predicted_step_seconds(sim.step_seconds);
      record->set_predicted_peak_bytes(sim.peak_device_bytes);
    }
    if (dump_ && dump_after_ == name) dump_(name, *schedule);
    if (progress_) progress_(*record);
    if (verified_) verified_(*record, sim);
    // A verifier that made no simulation leaves none for the next pass.
    if (sim.start_seconds.size() == static_cast<size_t>(schedule->instructions_size())) {
      verified_sim = std::move(sim);
    } else {
      verified_sim.reset();
    }
  }
  *ended_at = enabled.passes.size();
  if (last_simulation) *last_simulation = std::move(verified_sim);
  return Status::Ok();
}

}  // namespace dc
