#include "rewriter/planner.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "machine/lower_bound.h"
#include "machine/simulator.h"
#include "rewriter/memory_plan.h"
#include "rewriter/plan_cache.h"
#include "rewriter/simulation_cache.h"
#include "rewriter/tasks.h"
#include "rewriter/zero3.h"
#include "schemas/digest.h"
#include "schemas/units.h"

namespace dc {

using rewriter_internal::ThreadShare;

namespace {

// The request's pipeline; `dumps`: with its --dump-after (the policy's own pipeline dumps, the
// other splits of it do not).
StatusOr<std::unique_ptr<Pipeline>> PipelineFor(const PlanRequest& request, bool dumps = true) {
  DC_ASSIGN_OR_RETURN(auto pipeline, request.passes.empty()
                                         ? MakePipeline(request.policy)
                                         : MakePipelineFromNames(request.passes));
  for (const auto& name : request.disabled_passes) {
    DC_RETURN_IF_ERROR(pipeline->Disable(name).Prefixed("--disable: "));
  }
  if (dumps && !request.dump_after.empty()) {
    DC_RETURN_IF_ERROR(
        pipeline->DumpAfter(request.dump_after, request.dump).Prefixed("--dump-after: "));
  }
  return pipeline;
}

// The pipeline of the rival policy `name` as `request` would run it: the passes it disables
// that the rival has are disabled there too.
StatusOr<std::unique_ptr<Pipeline>> RivalPipeline(const PlanRequest& request,
                                                  const std::string& name) {
  DC_ASSIGN_OR_RETURN(auto pipeline, MakePipeline(name));
  for (const auto& disabled : request.disabled_passes) {
    if (pipeline->Has(disabled)) DC_RETURN_IF_ERROR(pipeline->Disable(disabled));
  }
  return pipeline;
}

// The digest of `program` as a plan carries it: at this dc's program format version.
std::string ProgramDigest(const proto::Program& program) {
  if (program.format_version() == kProgramFormatVersion) return DigestOf(program);
  proto::Program versioned = program;
  versioned.set_format_version(kProgramFormatVersion);
  return DigestOf(versioned);
}

// `program_digest`: ProgramDigest(request.program), computed once per plan.
proto::Schedule EmptySchedule(const PlanRequest& request, const std::string& program_digest) {
  proto::Schedule schedule;
  schedule.set_world_size(request.world_size);
  schedule.set_budget_bytes(request.budget_bytes);
  schedule.set_backend(request.backend);
  schedule.set_device(request.device);
  schedule.set_policy(request.policy);
  *schedule.mutable_program() = request.program;
  schedule.mutable_program()->set_format_version(kProgramFormatVersion);
  schedule.set_program_digest(program_digest);
  schedule.set_profile_digest(request.profile_digest);
  return schedule;
}

StatusOr<std::string> KeyOf(const PlanRequest& request, const std::string& program_digest) {
  DC_ASSIGN_OR_RETURN(auto pipeline, PipelineFor(request));
  PlanKeyInputs inputs;
  inputs.program_digest = program_digest;
  inputs.world_size = request.world_size;
  inputs.backend = request.backend;
  inputs.device = request.device;
  inputs.budget_bytes = request.budget_bytes;
  inputs.policy = request.policy;
  inputs.pass_options = pipeline->OptionsText();
  // A policy that keeps a rival's plan where it is faster makes other plans than it did before
  // it had rivals: the rivals' pipelines are part of what decides its plan.
  if (request.passes.empty()) {
    DC_ASSIGN_OR_RETURN(const Policy* policy, FindPolicy(request.policy));
    for (const std::string& rival : policy->rivals) {
      DC_ASSIGN_OR_RETURN(auto rival_pipeline, RivalPipeline(request, rival));
      inputs.pass_options += "rival " + rival + "{" + rival_pipeline->OptionsText() + "};";
    }
  }
  inputs.profile_digest = request.profile_digest;
  return PlanCacheKey(inputs);
}

}  // namespace

StatusOr<std::string> PlanKey(const PlanRequest& request) {
  return KeyOf(request, ProgramDigest(request.program));
}

namespace {

// The candidates a policy plans (its splits, fallbacks and rivals) may fail only for the
// budget; any other failure is a pass's defect (a schedule the verifier refuses), which the
// planner must not pass over in silence: a candidate lost that way once cost a plan 45% of its
// step unnoticed. Collected here and written into the plan's notes. Of the failures over the
// budget, the least shortfall any candidate's check named is kept: the policy plans at no
// smaller budget that those checks know of, and a search for the smallest budget starts there.
class CandidateFailures {
 public:
  void Check(const StatusOr<proto::Schedule>& candidate, const std::string& label) {
    if (candidate.ok() || candidate.status().cannot_win()) return;
    if (candidate.status().over_budget()) {
      const int64_t shortfall = candidate.status().shortfall_bytes();
      if (shortfall > 0 && (least_shortfall_bytes_ == 0 || shortfall < least_shortfall_bytes_)) {
        least_shortfall_bytes_ = shortfall;
      }
      return;
    }
    messages_.push_back(label + ": " + candidate.status().message());
  }
  // The least shortfall named (0: none): the failure over the budget of a policy all of whose
  // candidates failed says it, whichever candidate's message it carries.
  Status WithLeastShortfall(const Status& failure) const {
    if (!failure.over_budget() || least_shortfall_bytes_ == 0) return failure;
    return Status::OverBudget(failure.message(), least_shortfall_bytes_);
  }
  // Notes them in `plan`; where there is no plan, the error says them too.
  void NoteIn(StatusOr<proto::Schedule>* plan) const {
    for (const std::string& message : messages_) {
      const std::string text =
          "a candidate plan failed a check only a dc defect explains and was passed over "
          "(please report it): " +
          message;
      if (plan->ok()) {
        (*plan)->add_notes(text);
      } else {
        *plan = Status::Error(plan->status().message() + "; " + text);
      }
    }
  }

 private:
  std::vector<std::string> messages_;
  int64_t least_shortfall_bytes_ = 0;
};

// Runs `pipeline` over a fresh schedule and fills its prediction. The run keeps its own memo of
// packings (candidates may run at once). `ended_at`: as Pipeline::Run's.
StatusOr<proto::Schedule> RunPipeline(const PlanRequest& request, const std::string& program_digest,
                                      const Pipeline& pipeline, const PassContext& context,
                                      size_t* ended_at = nullptr) {
  proto::Schedule schedule = EmptySchedule(request, program_digest);
  PackingMemo packings;
  PassContext run_context = context;
  run_context.packings = &packings;
  // The verifier's simulation of the final schedule is the prediction's (it has the same costs;
  // the prediction needs no memory timeline).
  std::optional<SimResult> sim;
  DC_RETURN_IF_ERROR(pipeline.Run(&schedule, run_context, &sim, ended_at));
  if (!sim || context.costs != &request.costs) {
    DC_ASSIGN_OR_RETURN(sim, Simulate(schedule, request.costs));
  }
  *schedule.mutable_prediction() = ToPrediction(*sim);
  return schedule;
}

// The step a candidate must beat to replace `best` (kept only if strictly faster): `best`'s, or
// none (0).
double StepToBeat(const StatusOr<proto::Schedule>& best) {
  return best.ok() ? best->prediction().step_seconds() : 0;
}

// The step a candidate must beat, as it gets it: known (planned after the candidates before it),
// or to wait for (planned at once with them).
struct CandidateStep {
  double seconds = 0;
  std::shared_ptr<const std::function<double()>> later;
  void Into(PassContext* context) const {
    context->step_to_beat_seconds = seconds;
    context->step_to_beat_later = later;
  }
};

// Candidates planned one by one or, with a share of more than one thread, all at once;
// run(i, step) plans candidate i against `step` (PassContext::step_to_beat_seconds). One by one,
// each is given the step of the best plan so far to beat (the caller's `best` at Take) and may
// stop early. All at once, each runs on a thread of its own, holding a slot of the share while it
// plans, and where it first needs that step (PassContext::step_to_beat_later) it waits, its slot
// lent to the others' packings, until the caller takes it with the step it would have been given
// one by one: the plan, and which candidates stop where, do not depend on the threads. One the
// caller never takes is given a step no plan beats (it stops where it first looks).
class Candidates {
 public:
  using Run = std::function<StatusOr<proto::Schedule>(int i, const CandidateStep& step)>;
  Candidates(int count, ThreadShare* share, Run run) : share_(share), run_(std::move(run)) {
    if (!share_ || share_->threads() < 2 || count < 2) return;
    share_->GiveBack(1);  // the caller only waits for them from here on
    for (int i = 0; i < count; ++i) {
      running_.push_back(std::make_unique<Running>());
      Running* r = running_.back().get();
      try {
        r->thread = std::thread([this, i, r] { Plan(i, r); });
        r->started = true;
      } catch (const std::system_error&) {
        // Where the system starts no more threads, the caller plans it at its Take.
      }
    }
  }
  Candidates(const Candidates&) = delete;
  Candidates& operator=(const Candidates&) = delete;
  ~Candidates() {
    for (auto& r : running_) Give(r.get(), kUnbeatable);
    for (auto& r : running_) {
      if (r->thread.joinable()) r->thread.join();
    }
    if (!running_.empty()) share_->Take(-1);
  }

  // Candidate i's plan, against `best`: made now, or the one made at once (given best's step
  // where it waits for it).
  StatusOr<proto::Schedule> Take(int i, const StatusOr<proto::Schedule>& best) {
    const CandidateStep step{StepToBeat(best), nullptr};
    if (running_.empty()) return run_(i, step);
    Running* r = running_[i].get();
    if (!r->started) {
      share_->Take(-1);
      StatusOr<proto::Schedule> made = run_(i, step);
      share_->GiveBack(1);
      return made;
    }
    Give(r, step.seconds);
    std::unique_lock<std::mutex> lock(r->mu);
    r->changed.wait(lock, [r] { return r->done; });
    return std::move(r->made);
  }

 private:
  // A step below every plan's: a candidate given it stops where it first looks.
  static constexpr double kUnbeatable = std::numeric_limits<double>::min();

  struct Running {
    std::thread thread;
    bool started = false;
    std::mutex mu;
    std::condition_variable changed;
    bool step_given = false;
    double step_seconds = 0;
    bool done = false;
    StatusOr<proto::Schedule> made = Status::Error("not planned");
  };

  // Candidate i on its own thread.
  void Plan(int i, Running* r) {
    share_->Take(i);
    CandidateStep step;
    if (i > 0) {
      step.later = std::make_shared<const std::function<double()>>([this, i, r] {
        std::unique_lock<std::mutex> lock(r->mu);
        if (!r->step_given) {
          share_->GiveBack(1);
          r->changed.wait(lock, [r] { return r->step_given; });
          lock.unlock();
          share_->Take(i);
          lock.lock();
        }
        return r->step_seconds;
      });
    }
    StatusOr<proto::Schedule> made = run_(i, step);
    share_->GiveBack(1);
    {
      std::lock_guard<std::mutex> lock(r->mu);
      r->made = std::move(made);
      r->done = true;
    }
    r->changed.notify_all();
  }

  void Give(Running* r, double step_seconds) {
    {
      std::lock_guard<std::mutex> lock(r->mu);
      if (r->step_given) return;
      r->step_given = true;
      r->step_seconds = step_seconds;
    }
    r->changed.notify_all();
  }

  ThreadShare* share_;
  Run run_;
  std::vector<std::unique_ptr<Running>> running_;  // empty: one by one
};

// The passes are greedy and decide in order: what an earlier one spends is not offered to a
// later one. Where another split may do better, an exploring policy plans that way too and
// keeps the fastest plan (ties: the first):
// - kept activations take memory before prefetch and unsharding: on a compute-bound step that
//   pays most, on a communication-bound one the memory may buy more as communication. Planned
//   without keep-activations too where the program recomputes.
// - before offload, passes may spend part of the bytes of Adam's m and v that offload can give
//   back, or all of them: more unsharding and kept activations against more reloads. Planned
//   with all of them too where the zero3 stream has at most
//   SearchOptions::max_instructions_to_explore instructions.
struct Split {
  bool keep_activations = true;
  int64_t relaxed_budget_bytes = 0;
};

// The policy's own split first, then, for an exploring policy, the others.
std::vector<Split> SplitsToPlan(const PlanRequest& request, const PassContext& context,
                                const Policy* policy, int64_t states,
                                int64_t baseline_instructions) {
  std::vector<Split> splits = {{true, context.relaxed_budget_bytes}};
  if (!policy || !policy->explores_splits) return splits;
  const bool recomputes = std::any_of(request.program.ops().begin(), request.program.ops().end(),
                                      [](const proto::Op& op) { return op.has_recompute_of(); });
  const bool keeps =
      recomputes && std::count(request.disabled_passes.begin(), request.disabled_passes.end(),
                               "keep-activations") == 0;
  if (keeps) splits.push_back({false, context.relaxed_budget_bytes});
  if (context.relaxed_budget_bytes > 0 &&
      baseline_instructions <= policy->search.max_instructions_to_explore) {
    splits.push_back({true, request.budget_bytes + states});
    if (keeps) splits.push_back({false, request.budget_bytes + states});
  }
  return splits;
}

// The step `plan` predicted before its offload pass where that pass made it slower (the passes
// before it spent more of the relaxed budget than offloading could give back without waiting
// for reloads); none where offload changed nothing or did not slow the step.
std::optional<double> StepBeforeASlowingOffload(const proto::Schedule& plan) {
  std::optional<double> before;
  for (const proto::PassRecord& record : plan.passes()) {
    if (record.name() == "offload") {
      if (before && record.changed() && record.predicted_step_seconds() > *before) return before;
      return std::nullopt;
    }
    before = record.predicted_step_seconds();
  }
  return std::nullopt;
}

// Plans `splits` and returns the fastest plan (ties: the first), or the own split's error. The
// first split is the policy's own pipeline: it reports progress, dumps (--dump-after), and gives
// *baseline_sim the verifier's simulation after its zero3 pass. `policy`: null for a pass list
// of the user's own (its error is the answer, no candidate's defect).
//
// A relaxed split whose offload slowed its step may have missed by a few megabytes: the passes
// before offload spend the relaxed budget to the byte, and offloading all it may still leaves
// them just over (Llama-3 70B on 32 H100s at GAS 1 and the H100's exact memory: unsharding to
// 96.06 GiB leaves offload 2.7 MB short, and its reloads slow the step from 1.106 s to 1.289 s,
// where 9 MB more budget plans 1.106 s). Where its step before offload beats the plan in hand,
// it is planned again with the relaxed budget lowered by each of `retry_shares` in turn (a share
// of the relaxed budget), while offload still slows it; one by one, each against the plan in
// hand.
StatusOr<proto::Schedule> PlanSplits(const PlanRequest& request, const std::string& program_digest,
                                     const PassContext& context, const Policy* policy,
                                     const std::vector<Split>& splits,
                                     const std::vector<double>& retry_shares,
                                     std::optional<SimResult>* baseline_sim,
                                     CandidateFailures* defects) {
  std::mutex progress_mutex;
  auto plan_split = [&](const Split& split, bool own,
                        const CandidateStep& step) -> StatusOr<proto::Schedule> {
    DC_ASSIGN_OR_RETURN(auto pipeline, PipelineFor(request, /*dumps=*/own));
    if (request.on_pass) {
      pipeline->OnPass([&](const proto::PassRecord& record) {
        std::lock_guard<std::mutex> lock(progress_mutex);
        request.on_pass(record);
      });
    }
    if (own) {
      pipeline->OnVerified([baseline_sim, first = true](const proto::PassRecord& record,
                                                        const SimResult& sim) mutable {
        if (first && record.name() == "zero3") *baseline_sim = sim;
        first = false;
      });
    }
    if (!split.keep_activations) DC_RETURN_IF_ERROR(pipeline->Disable("keep-activations"));
    PassContext split_context = context;
    split_context.relaxed_budget_bytes = split.relaxed_budget_bytes;
    step.Into(&split_context);
    return RunPipeline(request, program_digest, *pipeline, split_context);
  };
  auto run = [&](int i, const CandidateStep& step) {
    return plan_split(splits[static_cast<size_t>(i)], i == 0, step);
  };
  // Planned (or stopped) once `candidates` goes: the retries below then hold the caller's slot
  // of the thread share, as it does outside Candidates.
  auto candidates =
      std::make_unique<Candidates>(static_cast<int>(splits.size()), context.thread_share, run);
  StatusOr<proto::Schedule> planned = candidates->Take(0, Status::Error("none"));
  if (policy) defects->Check(planned, request.policy + "'s pipeline");
  // Where keep-activations kept nothing at a relaxed budget, the pipeline without it makes the
  // same schedule (every pass is a function of its input) and would only tie: not planned (or,
  // planned at once, not looked at).
  std::vector<int64_t> kept_nothing_at;
  auto note_kept_nothing = [&](const StatusOr<proto::Schedule>& plan, int64_t relaxed) {
    if (!plan.ok()) return;
    for (const proto::PassRecord& record : plan->passes()) {
      if (record.name() == "keep-activations" && !record.changed()) {
        kept_nothing_at.push_back(relaxed);
      }
    }
  };
  note_kept_nothing(planned, splits[0].relaxed_budget_bytes);
  // The relaxed splits whose offload slowed them, to plan again at a lower relaxed budget.
  std::vector<std::pair<Split, double>> to_retry;  // and the step before offload
  auto note_slowing_offload = [&](const StatusOr<proto::Schedule>& plan, const Split& split) {
    if (retry_shares.empty() || !plan.ok() || split.relaxed_budget_bytes <= request.budget_bytes) {
      return;
    }
    if (auto before = StepBeforeASlowingOffload(*plan)) to_retry.push_back({split, *before});
  };
  auto label_of = [](const Split& split) {
    return std::string("the split ") + (split.keep_activations ? "with" : "without") +
           " keep-activations at a relaxed budget of " + FormatBytes(split.relaxed_budget_bytes);
  };
  // Which split the plan in hand came from, where not the policy's own ("": its own).
  std::string planned_from;
  auto keep_faster = [&](StatusOr<proto::Schedule> other, const Split& split,
                         const std::string& how) {
    defects->Check(other, label_of(split));
    if (other.ok() && (!planned.ok() ||
                       other->prediction().step_seconds() < planned->prediction().step_seconds())) {
      planned = std::move(other);
      planned_from = "a relaxed budget of " + FormatBytes(split.relaxed_budget_bytes) + how +
                     (split.keep_activations ? "" : ", without keep-activations");
    }
  };
  note_slowing_offload(planned, splits[0]);
  for (size_t i = 1; i < splits.size(); ++i) {
    const Split& split = splits[i];
    if (!split.keep_activations && std::count(kept_nothing_at.begin(), kept_nothing_at.end(),
                                              split.relaxed_budget_bytes) > 0) {
      continue;
    }
    StatusOr<proto::Schedule> other = candidates->Take(static_cast<int>(i), planned);
    if (split.keep_activations) note_kept_nothing(other, split.relaxed_budget_bytes);
    note_slowing_offload(other, split);
    keep_faster(std::move(other), split, "");
  }
  candidates.reset();
  for (const auto& [slowed, before_offload_seconds] : to_retry) {
    if (before_offload_seconds >= StepToBeat(planned)) continue;
    for (double share : retry_shares) {
      Split lower = slowed;
      lower.relaxed_budget_bytes -=
          static_cast<int64_t>(static_cast<double>(slowed.relaxed_budget_bytes) * share);
      if (lower.relaxed_budget_bytes <= request.budget_bytes) break;
      StatusOr<proto::Schedule> again =
          plan_split(lower, /*own=*/false, CandidateStep{StepToBeat(planned), nullptr});
      // Stopped short of the plan in hand (its step before offload no longer beats it), or
      // offloaded without slowing: a lower budget only spends less.
      const bool still_slowed = again.ok() && StepBeforeASlowingOffload(*again).has_value();
      char how[160];
      std::snprintf(how, sizeof(how), " (%.0f%% under the split at %s, whose step offload slowed)",
                    share * 100, FormatBytes(slowed.relaxed_budget_bytes).c_str());
      keep_faster(std::move(again), lower, how);
      if (!still_slowed) break;
    }
  }
  // Said where it is not the policy's own split (dc-plan --explain prints it as the choice).
  if (planned.ok() && !planned_from.empty()) {
    planned->add_notes(request.policy + "'s own pipeline, planned with " + planned_from);
  }
  return planned;
}

// How a candidate pipeline's run ended short of its last pass, for Pipeline::CannotDoBetterThan.
struct Ended {
  const Pipeline* pipeline = nullptr;
  Status how;
  size_t at = 0;
  bool relaxed = false;  // planned against the relaxed budget
};

// A policy never settles for less than a simpler pipeline of its own passes achieves: replaces
// *planned (failed, or no faster than the baseline) with the fastest of the policy's fallbacks,
// noting which. Where context.step_to_beat_seconds is set, a fallback must beat it too. A
// fallback is not planned where a pipeline that ended short of its last pass (`ended`,
// optional: the rule's own pipeline, or an earlier fallback) shows it can do no better
// (Pipeline::CannotDoBetterThan: it would stop for the plan in hand, or fail over the budget, as
// that one did).
Status TryFallbacks(const PlanRequest& request, const std::string& program_digest,
                    const PassContext& context, const Policy& policy, const Ended* ended,
                    CandidateFailures* defects, StatusOr<proto::Schedule>* planned) {
  StatusOr<proto::Schedule> best = Status::Error("none");
  std::string chosen;
  if (planned->ok()) best = **planned;
  // Where the persistent shards alone exceed the budget, no optimizer step on the device fits:
  // only the fallbacks that run it on the host can plan.
  int64_t persistent = 0;
  for (int64_t b : PersistentBytesByKind(request.program, request.world_size)) persistent += b;
  const bool device_step_cannot_fit = request.budget_bytes > 0 && persistent > request.budget_bytes;
  std::vector<Ended> lost;  // runs that ended short, earlier ones first
  if (ended) lost.push_back(*ended);
  auto can_do_better = [&](const Pipeline& pipeline, bool relaxed) {
    return std::none_of(lost.begin(), lost.end(), [&](const Ended& e) {
      return e.relaxed == relaxed && pipeline.CannotDoBetterThan(*e.pipeline, e.how, e.at);
    });
  };
  std::vector<const FallbackPipeline*> fallbacks;
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  for (const FallbackPipeline& fallback : policy.fallbacks) {
    if (device_step_cannot_fit && !fallback.optimizer_on_host) continue;
    DC_ASSIGN_OR_RETURN(auto simpler, MakePipelineFromNames(fallback.passes));
    for (const auto& name : request.disabled_passes) {
      if (simpler->Has(name)) DC_RETURN_IF_ERROR(simpler->Disable(name));
    }
    // Against `ended` before any is made (planned at once, they would all be).
    if (!can_do_better(*simpler, fallback.relaxed && context.relaxed_budget_bytes > 0)) continue;
    fallbacks.push_back(&fallback);
    pipelines.push_back(std::move(simpler));
  }
  // The lesser of a fallback's step to beat and context's (known: the policy's or a rival's);
  // 0 for none.
  const double outer = context.step_to_beat_seconds;
  auto lesser = [outer](double step) {
    return step > 0 && (outer == 0 || step < outer) ? step : outer;
  };
  auto context_of = [&](int i, const CandidateStep& step) {
    PassContext fallback_context = context;
    if (!fallbacks[i]->relaxed) fallback_context.relaxed_budget_bytes = 0;
    fallback_context.step_to_beat_seconds = lesser(step.seconds);
    if (step.later) {
      fallback_context.step_to_beat_later = std::make_shared<const std::function<double()>>(
          [later = step.later, lesser] { return lesser((*later)()); });
    }
    return fallback_context;
  };
  // Where each fallback's run ended (read in order, after it ran).
  std::vector<size_t> ended_at(fallbacks.size(), 0);
  auto run = [&](int i, const CandidateStep& step) -> StatusOr<proto::Schedule> {
    return RunPipeline(request, program_digest, *pipelines[i], context_of(i, step), &ended_at[i]);
  };
  Candidates candidates(static_cast<int>(fallbacks.size()), context.thread_share, run);
  for (size_t i = 0; i < fallbacks.size(); ++i) {
    const bool relaxed = fallbacks[i]->relaxed && context.relaxed_budget_bytes > 0;
    if (!can_do_better(*pipelines[i], relaxed)) continue;
    StatusOr<proto::Schedule> candidate = candidates.Take(static_cast<int>(i), best);
    defects->Check(candidate, "the fallback " + Join(fallbacks[i]->passes, ","));
    if (!candidate.ok()) {
      lost.push_back({pipelines[i].get(), candidate.status(), ended_at[i], relaxed});
      continue;
    }
    if (!best.ok() || candidate->prediction().step_seconds() < best->prediction().step_seconds()) {
      best = std::move(candidate);
      chosen = Join(pipelines[i]->EnabledPassNames(), ",");  // --disable's passes left out
    }
  }
  if (best.ok()) {
    if (!chosen.empty()) {
      std::string why = "predicted a step no faster than the baseline's";
      if (!planned->ok()) {
        why = (planned->status().cannot_win() ? "could not beat the plan in hand ("
                                              : "did not fit the budget (") +
              planned->status().message() + ")";
      }
      best->add_notes(policy.name + "'s full pipeline " + why + "; planned with " + chosen);
    }
    *planned = std::move(best);
  }
  return Status::Ok();
}

// Never worse than a rule: plans each of `policy`'s rivals under the same budget (their own
// pipelines, unrelaxed) and replaces *planned (failed, or slower) with the fastest of them,
// noting which plan was kept and why. Ties keep the policy's own plan. A rival that cannot beat
// the plan in hand is not planned: the baseline (a pipeline of zero3 alone) is judged by the
// baseline's simulation, a policy with every optimizer step on the host by the host's optimizer
// time, and none is planned where the plan in hand meets the lower bound; a rival's pipeline
// stops before its memory plan where its step is no faster than the plan in hand's there.
Status KeepBestOfRivals(const PlanRequest& request, const std::string& program_digest,
                        const PassContext& context, const Policy& policy,
                        const SimResult& baseline_sim, CandidateFailures* defects,
                        StatusOr<proto::Schedule>* planned, std::vector<RunnerUp>* runners_up) {
  const std::string own_failure = planned->ok() ? "" : planned->status().message();
  std::string kept;  // the rival whose plan is in *planned, if any
  double own_step = planned->ok() ? (*planned)->prediction().step_seconds() : 0;
  const StepBound bound = StepLowerBound(request.program, request.world_size, request.costs);
  for (const std::string& rival : policy.rivals) {
    DC_ASSIGN_OR_RETURN(const Policy* rules, FindPolicy(rival));
    const bool baseline_only = rules->passes == std::vector<std::string>{"zero3"};
    if (baseline_only) {
      const bool fits =
          request.budget_bytes == 0 || baseline_sim.peak_device_bytes <= request.budget_bytes;
      if (!fits) continue;
      if (planned->ok() && baseline_sim.step_seconds >= (*planned)->prediction().step_seconds()) {
        continue;
      }
    }
    // A plan in hand at or below what the rival's plan must take (machine/lower_bound.h) cannot
    // lose to it.
    if (planned->ok()) {
      const double own = (*planned)->prediction().step_seconds();
      if (own <= bound.seconds) break;
      if (rules->optimizer_on_host &&
          own <= HostOptimizerSeconds(request.program, request.world_size, request.costs)) {
        continue;
      }
    }
    PassContext rival_context = context;
    rival_context.relaxed_budget_bytes = 0;
    rival_context.step_to_beat_seconds = StepToBeat(*planned);
    DC_ASSIGN_OR_RETURN(auto pipeline, RivalPipeline(request, rival));
    size_t ended_at = 0;
    StatusOr<proto::Schedule> candidate =
        RunPipeline(request, program_digest, *pipeline, rival_context, &ended_at);
    defects->Check(candidate, "the rival " + rival + "'s pipeline");
    // As the rival plans on its own: where its pipeline does not fit, its fallbacks (none that
    // can do no better than its pipeline did).
    if (!candidate.ok() && !rules->fallbacks.empty()) {
      const Ended ended{pipeline.get(), candidate.status(), ended_at, false};
      DC_RETURN_IF_ERROR(TryFallbacks(request, program_digest, rival_context, *rules, &ended,
                                      defects, &candidate));
    }
    if (!candidate.ok()) continue;
    if (planned->ok() &&
        candidate->prediction().step_seconds() >= (*planned)->prediction().step_seconds()) {
      if (runners_up) runners_up->push_back({rival + "'s plan", *std::move(candidate)});
      continue;
    }
    if (runners_up && planned->ok()) {
      runners_up->push_back(
          {kept.empty() ? policy.name + "'s own pipeline" : kept + "'s plan", **planned});
    }
    *planned = std::move(candidate);
    kept = rival;
  }
  if (kept.empty()) return Status::Ok();
  (*planned)->set_kept_rival(kept);
  if (own_failure.empty()) (*planned)->set_own_step_seconds(own_step);
  char text[256];
  if (own_failure.empty()) {
    std::snprintf(text, sizeof(text), "kept %s's plan: %.4f s < %s's %.4f s", kept.c_str(),
                  (*planned)->prediction().step_seconds(), policy.name.c_str(), own_step);
    (*planned)->add_notes(text);
  } else {
    std::snprintf(text, sizeof(text), "kept %s's plan (%.4f s): ", kept.c_str(),
                  (*planned)->prediction().step_seconds());
    (*planned)->add_notes(text + policy.name + "'s own pipelines did not fit the budget (" +
                          own_failure + ")");
  }
  return Status::Ok();
}

// The baseline's schedule: the program as zero3 lowers it.
StatusOr<proto::Schedule> LowerBaseline(const PlanRequest& request,
                                        const std::string& program_digest,
                                        const PassContext& context) {
  proto::Schedule baseline = EmptySchedule(request, program_digest);
  Zero3Pass zero3;
  DC_RETURN_IF_ERROR(zero3.Run(&baseline, context).status());
  return baseline;
}

}  // namespace

StatusOr<proto::Schedule> MakePlan(const PlanRequest& request) {
  if (request.world_size < 1) return Status::Error("world size must be at least 1");
  if (request.threads < 1) return Status::Error("planning threads must be at least 1");
  if (request.runners_up) request.runners_up->clear();
  const std::string program_digest = ProgramDigest(request.program);
  DC_ASSIGN_OR_RETURN(std::string key, KeyOf(request, program_digest));
  PassContext context{&request.costs, request.budget_bytes};
  context.threads = request.threads;
  ThreadShare threads(request.threads);
  context.thread_share = &threads;
  SimulationCache simulations;
  context.simulations = &simulations;
  // The policy's search, or none for a pass list of the user's own (--passes).
  const Policy* policy = nullptr;
  if (request.passes.empty()) {
    DC_ASSIGN_OR_RETURN(policy, FindPolicy(request.policy));
  }
  const SearchOptions search = policy ? policy->search : SearchOptions();
  // A relaxing policy's passes before offloading (and those of a pass list with offload) may
  // spend part of the optimizer-state bytes that offloading can give back; offload then frees
  // what must go. Other policies plan against the budget as it is (DeepCompile's rules have no
  // such give-back).
  const bool relaxes =
      policy ? policy->relaxes_budget
             : std::count(request.passes.begin(), request.passes.end(), "offload") > 0;
  const int64_t states = PersistentBytesByKind(
      request.program, request.world_size)[static_cast<int>(BufferKind::kOptimizerState)];
  if (request.budget_bytes > 0 && relaxes) {
    context.relaxed_budget_bytes =
        request.budget_bytes + states / search.relaxed_state_share_divisor;
  }
  // The baseline on the same simulator, for comparison: the zero3 schedule. zero3 depends on the
  // program and world size alone, so where the pipeline starts with it, the verifier's
  // simulation after it is the baseline's; otherwise the baseline is simulated on its own. An
  // exploring policy's splits depend on the baseline's size, known before any is planned.
  std::optional<proto::Schedule> baseline;
  if (policy && policy->explores_splits) {
    DC_ASSIGN_OR_RETURN(baseline, LowerBaseline(request, program_digest, context));
  }
  const std::vector<Split> splits =
      SplitsToPlan(request, context, policy, states, baseline ? baseline->instructions_size() : 0);
  std::optional<SimResult> baseline_sim;
  CandidateFailures defects;
  // Retries only where the splits are explored and the step is small enough to plan again.
  const bool retries = policy && policy->explores_splits && baseline &&
                       baseline->instructions_size() <= search.max_instructions_to_retry;
  StatusOr<proto::Schedule> planned =
      PlanSplits(request, program_digest, context, policy, splits,
                 retries ? search.retry_relaxed_budget_shares : std::vector<double>{},
                 &baseline_sim, &defects);
  if (!baseline_sim) {
    if (!baseline) {
      DC_ASSIGN_OR_RETURN(baseline, LowerBaseline(request, program_digest, context));
    }
    DC_ASSIGN_OR_RETURN(baseline_sim, Simulate(*baseline, request.costs));
  }
  // A plan no faster than the baseline gains nothing from its passes: a simpler pipeline may
  // (tiny on 2 cpu ranks at 75% of the baseline's peak: the full pipeline offloads room for
  // its arena at the baseline's 3.1 ms, Adam on the host with bucketing steps in 2.1 ms).
  auto no_faster_than_baseline = [&](const proto::Schedule& s) {
    return s.prediction().step_seconds() >=
           baseline_sim->step_seconds * (1 - search.slower_than_baseline_tolerance);
  };
  if (policy && !policy->fallbacks.empty() &&
      (!planned.ok() || no_faster_than_baseline(*planned))) {
    DC_RETURN_IF_ERROR(
        TryFallbacks(request, program_digest, context, *policy, nullptr, &defects, &planned));
  }
  if (policy && !policy->rivals.empty()) {
    DC_RETURN_IF_ERROR(KeepBestOfRivals(request, program_digest, context, *policy, *baseline_sim,
                                        &defects, &planned, request.runners_up));
  }
  if (!planned.ok()) planned = defects.WithLeastShortfall(planned.status());
  defects.NoteIn(&planned);
  if (!planned.ok()) return planned.status();
  proto::Schedule schedule = std::move(planned).value();
  *schedule.mutable_baseline() = ToPrediction(*baseline_sim);
  schedule.set_cache_key(key);
  if (request.runners_up) {
    for (RunnerUp& r : *request.runners_up) *r.plan.mutable_baseline() = schedule.baseline();
    std::stable_sort(request.runners_up->begin(), request.runners_up->end(),
                     [](const RunnerUp& a, const RunnerUp& b) {
                       return a.plan.prediction().step_seconds() <
                              b.plan.prediction().step_seconds();
                     });
  }
  return schedule;
}

}  // namespace dc
