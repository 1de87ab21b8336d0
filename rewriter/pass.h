// The pass interface and the pipeline that runs passes over a schedule: one readable sequence,
// the verifier before the first pass and after every pass, each pass timed, any pass switchable
// off by name, and the schedule dumpable after any pass.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "machine/cost_model.h"
#include "machine/simulator.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// What a pass may consult besides the schedule itself.
class PackingMemo;
class SimulationCache;
namespace rewriter_internal {
class ThreadShare;
}  // namespace rewriter_internal

struct PassContext {
  const CostModel* costs = nullptr;
  int64_t budget_bytes = 0;  // 0 = unlimited
  // The budget the passes before the first memory-freeing pass (offload) plan against: they
  // may spend memory that offloading will give back. 0 = budget_bytes.
  int64_t relaxed_budget_bytes = 0;
  // The budget the plan must meet in the end: budget_bytes, also where a pass before the first
  // memory-freeing pass sees the relaxed one there. 0 = unlimited.
  int64_t final_budget_bytes = 0;
  // The last arena packing of this plan (rewriter/memory_packer.h), shared so that the
  // memory-plan pass does not pack again what the offload pass's arena check just packed.
  // Optional; one per plan (the costs and program must not change while it lives).
  PackingMemo* packings = nullptr;
  // For a pass: the verifier's Simulate(schedule, *costs) of the schedule it receives (memory
  // timeline off), when there is one; a pass that would simulate its input takes it instead.
  // The verifier never takes one: it checks what it simulates itself. Null otherwise.
  const SimResult* input_simulation = nullptr;
  // The step of a plan in hand, for a candidate that is kept only if strictly faster: where the
  // schedule's verified step is at least this before the pipeline's last passes and each of them
  // never speeds it up (Pass::NeverSpeedsUp), the pipeline stops there with Status::CannotWin
  // (the memory plan's packings of 200k instructions take seconds). 0: none. Read it through
  // StepToBeatSeconds.
  double step_to_beat_seconds = 0;
  // A candidate planned while the ones before it still are (PlanRequest::threads > 1) does not
  // know that step yet: this, where set, waits until the planner knows it and returns it (0:
  // none), giving the candidate's thread slot back meanwhile, so that a candidate that could
  // only lose stops where it would have stopped planned after them, and lends its thread to them
  // while it waits. Called only from the candidate's own thread.
  std::shared_ptr<const std::function<double()>> step_to_beat_later = nullptr;
  // Threads a pass may use for work whose result does not depend on their number
  // (PlanRequest::threads): at most `threads` at once, or, with a share, its idle ones.
  int threads = 1;
  rewriter_internal::ThreadShare* thread_share = nullptr;
  // The plan's simulations, for the schedules it meets again (rewriter/simulation_cache.h);
  // SimulateIn and the verifier go through it. Optional; one per plan, for `costs` (where a
  // plan has none, a pipeline run keeps the verifier's last simulation in one of its own).
  SimulationCache* simulations = nullptr;
};

// context.step_to_beat_seconds, or what context.step_to_beat_later waits for.
double StepToBeatSeconds(const PassContext& context);

class Pass {
 public:
  virtual ~Pass() = default;
  // kebab-case, as used by --passes and --dump-after.
  virtual std::string_view name() const = 0;
  // The pass's options as stable text (part of the plan cache key).
  virtual std::string OptionsText() const { return ""; }
  // Rewrites `schedule`; returns whether anything changed, or why it could not run.
  virtual StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) = 0;
  // True for passes that free device memory (offload): the passes before the first of them plan
  // against PassContext::relaxed_budget_bytes, and the budget is enforced from it on.
  virtual bool FreesMemory() const { return false; }
  // True for a pass that lowers the program into a schedule (zero3): the only pass that may be
  // given a schedule with no instructions.
  virtual bool BuildsSchedule() const { return false; }
  // True for a pass whose output never simulates a faster step than its input (memory-plan:
  // its reuse dependencies wait for nothing in the simulated step, its spills only delay;
  // offload: its copies only add work and waits). The property tests hold every such pass to
  // it.
  virtual bool NeverSpeedsUp() const { return false; }
  // What the last Run changed, for --explain ("moved 80 gathers earlier by 3.1 ops on average").
  virtual std::string Summary() const { return ""; }
};

class Pipeline {
 public:
  using DumpFn = std::function<void(std::string_view pass_name, const proto::Schedule&)>;
  // Checks a schedule; fills the simulation it made (for the pass record) when given one:
  // Simulate(schedule, the context's costs) with the memory timeline off. It must simulate the
  // schedule itself (never take PassContext::input_simulation).
  using VerifyFn = std::function<Status(const proto::Schedule&, const PassContext&, SimResult*)>;

  explicit Pipeline(VerifyFn verifier) : verifier_(std::move(verifier)) {}

  void Add(std::unique_ptr<Pass> pass) { passes_.push_back(std::move(pass)); }
  // Whether a pass of this name is in the pipeline.
  bool Has(const std::string& name) const;
  // Switches off every pass of this name; an error, naming the pipeline's passes, if it has none.
  Status Disable(const std::string& name);
  // Calls `fn` with the schedule after every pass of this name; an error, naming the pipeline's
  // passes, if it has none.
  Status DumpAfter(const std::string& name, DumpFn fn);
  // Called after every pass with its record (progress for people on long plans).
  using ProgressFn = std::function<void(const proto::PassRecord&)>;
  void OnPass(ProgressFn fn) { progress_ = std::move(fn); }
  // Called after every pass with its record and the verifier's simulation of its output.
  using VerifiedFn = std::function<void(const proto::PassRecord&, const SimResult&)>;
  void OnVerified(VerifiedFn fn) { verified_ = std::move(fn); }
  std::vector<std::string> PassNames() const;
  // The names of the passes Run runs (the disabled ones left out), in order.
  std::vector<std::string> EnabledPassNames() const;
  // Whether this pipeline, run on the input `ended` was given in the same context (a step to
  // beat no larger), can do no better than `ended`'s run, which ended with `how` at its enabled
  // pass `ended_at` (Run's `ended_at`):
  // - stopped for the plan in hand (Status::CannotWin) before that pass: this one makes the
  //   same schedule there (the same passes and options, each under the same budget) and then
  //   runs only passes that never speed the step up. A fallback that drops a rule's memory plan,
  //   where the rule's pipeline stopped before it, is such a pipeline.
  // - failed over the budget in that pass (the pass, or the verifier after it): this one makes
  //   the same schedule up to it and runs it, so it fails there too.
  // Other failures (a pass's defect) are never taken as another pipeline's.
  bool CannotDoBetterThan(const Pipeline& ended, const Status& how, size_t ended_at) const;
  // Names and options of the enabled passes, for the cache key.
  std::string OptionsText() const;

  // Runs every enabled pass in order, the verifier before the first (on a schedule with
  // instructions; an empty one only a schedule-building pass may take) and after each. Records
  // go to schedule->passes. An error names the pass. `last_simulation` (optional) receives the
  // verifier's simulation of the final schedule (memory timeline off), or nothing when no pass
  // ran.
  // `ended_at` (optional) receives the index among the enabled passes where the run stopped
  // or failed (their count when every pass ran).
  Status Run(proto::Schedule* schedule, const PassContext& context,
             std::optional<SimResult>* last_simulation = nullptr, size_t* ended_at = nullptr) const;

 private:
  // The enabled passes in order: each with whether it plans against the relaxed budget (it runs
  // before the first pass that frees memory), and the index of the first of the tail of passes
  // that never speed the step up (their count where there is none).
  struct Enabled {
    std::vector<Pass*> passes;
    std::vector<bool> relaxed;
    size_t slowing_tail = 0;
  };
  Enabled EnabledPasses() const;
  // Whether the first `count` enabled passes of two pipelines are the same passes with the
  // same options, each under the same budget.
  static bool SameUpTo(const Enabled& a, const Enabled& b, size_t count);

  VerifyFn verifier_;
  std::vector<std::unique_ptr<Pass>> passes_;
  std::set<std::string> disabled_;
  std::string dump_after_;
  DumpFn dump_;
  ProgressFn progress_;
  VerifiedFn verified_;
};

}  // namespace dc
