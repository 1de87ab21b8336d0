// The pass interface and the pipeline that runs passes over a schedule: one readable sequence,
// the verifier after every pass, each pass timed, any pass switchable off by name, and the
// schedule dumpable after any pass.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "analyzer/cost_model.h"
#include "analyzer/simulator.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// What a pass may consult besides the schedule itself.
class PackingMemo;

struct PassContext {
  const CostModel* costs = nullptr;
  int64_t budget_bytes = 0;  // 0 = unlimited
  // The budget the passes before the first memory-freeing pass (offload) plan against: they
  // may spend memory that offloading will give back. 0 = budget_bytes.
  int64_t relaxed_budget_bytes = 0;
  // The budget the plan must meet in the end: budget_bytes, also where a pass before the first
  // memory-freeing pass sees the relaxed one there. 0 = unlimited.
  int64_t final_budget_bytes = 0;
  // The last arena packing of this plan (rewriter/memory_plan.h), shared so that the
  // memory-plan pass does not pack again what the offload pass's arena check just packed.
  // Optional; one per plan (the costs and program must not change while it lives).
  PackingMemo* packings = nullptr;
  // Simulate(schedule, *costs) of the schedule as the call receives it, when the caller has it
  // (memory timeline off unless said otherwise): for a pass, the verifier's after the previous
  // pass; for the verifier, the pass's own of its output. Whoever would simulate that schedule
  // again may take it instead. Null otherwise.
  const SimResult* input_simulation = nullptr;
};

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
  // What the last Run changed, for --explain ("moved 80 gathers earlier by 3.1 ops on average").
  virtual std::string Summary() const { return ""; }
  // Simulate(schedule, *context.costs) of the schedule the last Run left, if Run made it (the
  // memory timeline may be there or not): the pipeline's verifier checks it instead of
  // simulating the same instructions again. Null if Run made none.
  virtual const SimResult* OutputSimulation() const { return nullptr; }
};

class Pipeline {
 public:
  using DumpFn = std::function<void(std::string_view pass_name, const proto::Schedule&)>;
  // Checks a schedule; fills the simulation it made (for the pass record) when given one:
  // Simulate(schedule, the context's costs) with the memory timeline off.
  using VerifyFn = std::function<Status(const proto::Schedule&, const PassContext&, SimResult*)>;

  explicit Pipeline(VerifyFn verifier) : verifier_(std::move(verifier)) {}

  void Add(std::unique_ptr<Pass> pass) { passes_.push_back(std::move(pass)); }
  void Disable(const std::string& name) { disabled_.insert(name); }
  void DumpAfter(const std::string& name, DumpFn fn) {
    dump_after_ = name;
    dump_ = std::move(fn);
  }
  // Called after every pass with its record (progress for people on long plans).
  using ProgressFn = std::function<void(const proto::PassRecord&)>;
  void OnPass(ProgressFn fn) { progress_ = std::move(fn); }
  // Called after every pass with its record and the verifier's simulation of its output.
  using VerifiedFn = std::function<void(const proto::PassRecord&, const SimResult&)>;
  void OnVerified(VerifiedFn fn) { verified_ = std::move(fn); }
  std::vector<std::string> PassNames() const;
  // Names and options of the enabled passes, for the cache key.
  std::string OptionsText() const;

  // Runs every enabled pass in order, the verifier after each. Records go to
  // schedule->passes. An error names the pass. `last_simulation` (optional) receives the
  // verifier's simulation of the final schedule (memory timeline off), or nothing when no pass
  // ran.
  Status Run(proto::Schedule* schedule, const PassContext& context,
             std::optional<SimResult>* last_simulation = nullptr) const;

 private:
  VerifyFn verifier_;
  std::vector<std::unique_ptr<Pass>> passes_;
  std::set<std::string> disabled_;
  std::string dump_after_;
  DumpFn dump_;
  ProgressFn progress_;
  VerifiedFn verified_;
};

}  // namespace dc
