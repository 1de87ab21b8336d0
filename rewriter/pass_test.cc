// The pipeline: disable by name, dump after a pass, unknown names refused, the verifier before
// the first pass and after every pass, on its own.
#include "rewriter/pass.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/memory_plan.h"
#include "rewriter/planner.h"
#include "rewriter/simulation_cache.h"
#include "rewriter/verifier.h"
#include "rewriter/zero3.h"
#include "schemas/happens_before.h"

namespace dc {
namespace {

proto::Program TinyProgram() {
  ModelOverrides overrides;
  overrides.gas = 2;
  auto config = MakeConfig("tiny", overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  return *program;
}

proto::Schedule EmptySchedule() {
  proto::Schedule s;
  s.set_world_size(2);
  s.set_backend("cpu");
  *s.mutable_program() = TinyProgram();
  return s;
}

std::unique_ptr<Pipeline> Make(const std::vector<std::string>& names) {
  auto pipeline = MakePipelineFromNames(names);
  EXPECT_TRUE(pipeline.ok()) << pipeline.status().message();
  return std::move(*pipeline);
}

std::vector<std::string> Records(const proto::Schedule& s) {
  std::vector<std::string> names;
  for (const auto& record : s.passes()) names.push_back(record.name());
  return names;
}

const CostModel kCosts;

TEST(Pipeline, DisableByNameSkipsEveryPassOfThatName) {
  proto::Schedule all = EmptySchedule();
  ASSERT_TRUE(Make({"zero3", "prefetch", "bucket", "prefetch"})->Run(&all, {&kCosts}).ok());
  EXPECT_EQ(Records(all), (std::vector<std::string>{"zero3", "prefetch", "bucket", "prefetch"}));

  auto pipeline = Make({"zero3", "prefetch", "bucket", "prefetch"});
  ASSERT_TRUE(pipeline->Disable("prefetch").ok());
  proto::Schedule some = EmptySchedule();
  ASSERT_TRUE(pipeline->Run(&some, {&kCosts}).ok());
  EXPECT_EQ(Records(some), (std::vector<std::string>{"zero3", "bucket"}));
  EXPECT_EQ(pipeline->OptionsText().find("prefetch"), std::string::npos);
  // What the planner's notes name as run (a fallback under --disable): the records' passes.
  EXPECT_EQ(pipeline->EnabledPassNames(), Records(some));
  EXPECT_EQ(pipeline->PassNames().size(), 4u);
}

TEST(Pipeline, UnknownNamesAreRefused) {
  auto pipeline = Make({"zero3", "prefetch"});
  Status disabled = pipeline->Disable("prefech");
  ASSERT_FALSE(disabled.ok());
  EXPECT_EQ(disabled.message(), "no pass 'prefech' to disable; this pipeline runs zero3, prefetch");
  // Known to dc, but not in this pipeline: as wrong.
  EXPECT_FALSE(pipeline->Disable("unshard").ok());
  Status dump = pipeline->DumpAfter("offload", [](std::string_view, const proto::Schedule&) {});
  ASSERT_FALSE(dump.ok());
  EXPECT_EQ(dump.message(), "no pass 'offload' to dump after; this pipeline runs zero3, prefetch");

  PlanRequest request;
  request.program = TinyProgram();
  request.world_size = 2;
  request.disabled_passes = {"no-such-pass"};
  auto plan = MakePlan(request);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("--disable: no pass 'no-such-pass' to disable"),
            std::string::npos)
      << plan.status().message();
  request.disabled_passes = {};
  request.dump_after = "no-such-pass";
  plan = MakePlan(request);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("--dump-after: no pass 'no-such-pass'"), std::string::npos)
      << plan.status().message();
}

TEST(Pipeline, DumpAfterGivesTheScheduleAfterThatPass) {
  auto pipeline = Make({"zero3", "prefetch"});
  std::vector<std::string> dumped;
  int instructions = 0;
  ASSERT_TRUE(pipeline
                  ->DumpAfter("zero3",
                              [&](std::string_view name, const proto::Schedule& s) {
                                dumped.emplace_back(name);
                                instructions = s.instructions_size();
                              })
                  .ok());
  proto::Schedule s = EmptySchedule();
  ASSERT_TRUE(pipeline->Run(&s, {&kCosts}).ok());
  EXPECT_EQ(dumped, std::vector<std::string>{"zero3"});
  EXPECT_GT(instructions, 0);
  EXPECT_EQ(instructions, s.passes(0).instructions());
}

// Without zero3 nothing lowers the program: the pipeline says so instead of planning nothing.
TEST(Pipeline, AnEmptyScheduleGoesOnlyToAPassThatBuildsOne) {
  auto pipeline = Make({"zero3", "prefetch", "memory-plan"});
  ASSERT_TRUE(pipeline->Disable("zero3").ok());
  proto::Schedule s = EmptySchedule();
  Status status = pipeline->Run(&s, {&kCosts});
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(),
            "pass prefetch is the first to run, but the schedule is empty and it does not build "
            "one; enable a pass that lowers the program (zero3) first");
  EXPECT_EQ(s.passes_size(), 0);

  auto only_zero3 = Make({"zero3"});
  ASSERT_TRUE(only_zero3->Disable("zero3").ok());
  status = only_zero3->Run(&s, {&kCosts});
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(),
            "the schedule is empty and every pass is disabled; enable a pass that lowers the "
            "program (zero3)");

  // dc's fallbacks keep the user's --disable: none of them plans without zero3 either.
  PlanRequest request;
  request.program = TinyProgram();
  request.world_size = 2;
  request.disabled_passes = {"zero3"};
  auto plan = MakePlan(request);
  ASSERT_FALSE(plan.ok()) << plan->instructions_size() << " instructions";
  EXPECT_NE(plan.status().message().find("enable a pass that lowers the program (zero3)"),
            std::string::npos)
      << plan.status().message();
}

TEST(Pipeline, TheVerifierChecksTheInputBeforeTheFirstPass) {
  proto::Schedule s = EmptySchedule();
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, {}).ok());
  // The first all-gather gathers nothing: the first compute reads a param that is not gathered.
  proto::Schedule broken = s;
  ASSERT_EQ(broken.instructions(0).kind(), proto::INSTR_ALL_GATHER);
  broken.mutable_instructions(0)->clear_tensors();
  auto pipeline = Make({"prefetch"});
  Status status = pipeline->Run(&broken, {&kCosts});
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message().rfind("before the first pass: instruction ", 0), 0u)
      << status.message();
  EXPECT_NE(status.message().find(", which is not gathered"), std::string::npos);
  EXPECT_EQ(broken.passes_size(), 0);  // prefetch never ran
}

// A candidate that must beat a plan in hand stops before its memory plan (which never makes the
// step faster) where its step there is already no faster; otherwise it runs to the end.
TEST(Pipeline, StopsBeforeTheMemoryPlanWhereItCannotBeatThePlanInHand) {
  auto pipeline = Make({"zero3", "prefetch", "memory-plan"});
  proto::Schedule full = EmptySchedule();
  ASSERT_TRUE(pipeline->Run(&full, {&kCosts}).ok());
  ASSERT_EQ(Records(full), (std::vector<std::string>{"zero3", "prefetch", "memory-plan"}));
  const double before_memory_plan = full.passes(1).predicted_step_seconds();
  ASSERT_GT(before_memory_plan, 0);
  EXPECT_GE(full.passes(2).predicted_step_seconds(), before_memory_plan);

  PassContext context{&kCosts};
  context.step_to_beat_seconds = before_memory_plan * 1.5;  // beatable: runs to the end
  proto::Schedule beats = EmptySchedule();
  ASSERT_TRUE(pipeline->Run(&beats, context).ok());
  EXPECT_EQ(Records(beats), Records(full));
  EXPECT_EQ(beats.memory_plan().SerializeAsString(), full.memory_plan().SerializeAsString());

  for (double bar : {before_memory_plan, before_memory_plan / 2}) {  // a tie cannot win either
    context.step_to_beat_seconds = bar;
    proto::Schedule stopped = EmptySchedule();
    Status status = pipeline->Run(&stopped, context);
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(status.cannot_win()) << status.message();
    EXPECT_FALSE(status.over_budget());
    EXPECT_NE(status.message().find("before memory-plan"), std::string::npos) << status.message();
    EXPECT_EQ(Records(stopped), (std::vector<std::string>{"zero3", "prefetch"}));
    EXPECT_FALSE(stopped.has_memory_plan());
  }

  // A pipeline that ends in a pass that may speed the step up has nothing to stop before.
  context.step_to_beat_seconds = before_memory_plan / 2;
  proto::Schedule no_tail = EmptySchedule();
  ASSERT_TRUE(Make({"zero3", "prefetch"})->Run(&no_tail, context).ok());
  EXPECT_EQ(Records(no_tail), (std::vector<std::string>{"zero3", "prefetch"}));
}

TEST(Pipeline, StopsBeforeOffloadAndTheMemoryPlanWhereItCannotBeatThePlanInHand) {
  auto pipeline = Make({"zero3", "prefetch", "offload", "memory-plan"});
  proto::Schedule full = EmptySchedule();
  ASSERT_TRUE(pipeline->Run(&full, {&kCosts}).ok());
  const double before_offload = full.passes(1).predicted_step_seconds();
  PassContext context{&kCosts};
  context.step_to_beat_seconds = before_offload;
  proto::Schedule stopped = EmptySchedule();
  const Status status = pipeline->Run(&stopped, context);
  EXPECT_TRUE(status.cannot_win()) << status.message();
  EXPECT_NE(status.message().find("before offload"), std::string::npos) << status.message();
  EXPECT_EQ(Records(stopped), (std::vector<std::string>{"zero3", "prefetch"}));
}

// A pipeline cannot win where another stopped for the plan in hand when it makes the schedule
// the other stopped at (the same passes, each under the same budget) and adds only passes that
// never speed the step up; it fails where another failed over the budget when it makes the same
// schedule up to that pass and runs it.
TEST(Pipeline, CanDoNoBetterThanAnotherThatEndedOnTheSameSchedule) {
  const Status stopped = Status::CannotWin("stopped");
  const auto deepcompile =
      Make({"zero3", "dc-prefetch", "dc-selective-gather", "dc-offload", "memory-plan"});
  const size_t before_memory_plan = 4;
  EXPECT_TRUE(Make({"zero3", "dc-prefetch", "dc-selective-gather", "dc-offload"})
                  ->CannotDoBetterThan(*deepcompile, stopped, before_memory_plan));
  EXPECT_TRUE(deepcompile->CannotDoBetterThan(*deepcompile, stopped, before_memory_plan));
  EXPECT_FALSE(Make({"zero3", "dc-prefetch", "dc-selective-gather"})
                   ->CannotDoBetterThan(*deepcompile, stopped, before_memory_plan))
      << "stops before a pass that may speed the step up";
  EXPECT_FALSE(Make({"zero3", "dc-prefetch", "dc-offload"})
                   ->CannotDoBetterThan(*deepcompile, stopped, before_memory_plan));

  const auto dc =
      Make({"zero3", "bucket", "prefetch", "unshard", "prefetch", "offload", "memory-plan"});
  const size_t before_offload = 5;
  EXPECT_TRUE(Make({"zero3", "bucket", "prefetch", "unshard", "prefetch", "offload"})
                  ->CannotDoBetterThan(*dc, stopped, before_offload));
  EXPECT_FALSE(Make({"zero3", "bucket", "prefetch", "offload", "memory-plan"})
                   ->CannotDoBetterThan(*dc, stopped, before_offload));
  // Without offload, the passes before it plan against the real budget, not the relaxed one:
  // another schedule.
  EXPECT_FALSE(Make({"zero3", "bucket", "prefetch", "unshard", "prefetch", "memory-plan"})
                   ->CannotDoBetterThan(*dc, stopped, before_offload));
  // Disabled passes count as absent.
  auto without_unshard = Make({"zero3", "bucket", "prefetch", "unshard", "prefetch", "offload"});
  ASSERT_TRUE(without_unshard->Disable("unshard").ok());
  EXPECT_FALSE(without_unshard->CannotDoBetterThan(*dc, stopped, before_offload));
  auto dc_without_unshard =
      Make({"zero3", "bucket", "prefetch", "unshard", "prefetch", "offload", "memory-plan"});
  ASSERT_TRUE(dc_without_unshard->Disable("unshard").ok());
  EXPECT_TRUE(without_unshard->CannotDoBetterThan(*dc_without_unshard, stopped, 4));

  // Failed over the budget in offload: what runs the same passes through offload fails there.
  const Status over = Status::OverBudget("over");
  EXPECT_TRUE(Make({"zero3", "bucket", "prefetch", "unshard", "prefetch", "offload"})
                  ->CannotDoBetterThan(*dc, over, before_offload));
  EXPECT_FALSE(Make({"zero3", "bucket", "prefetch", "unshard", "prefetch"})
                   ->CannotDoBetterThan(*dc, over, before_offload))
      << "ends before the pass that failed";
  EXPECT_FALSE(Make({"zero3", "bucket", "prefetch", "offload"})
                   ->CannotDoBetterThan(*dc, over, before_offload));
  // A failure that is not the budget's is a defect: never taken as another pipeline's.
  EXPECT_FALSE(dc->CannotDoBetterThan(*dc, Status::Error("defect"), before_offload));
}

// Run says where it ended: the pass it stopped before, the pass that failed, or the count.
TEST(Pipeline, SaysWhereItsRunEnded) {
  auto pipeline = Make({"zero3", "prefetch", "memory-plan"});
  proto::Schedule full = EmptySchedule();
  size_t ended_at = 99;
  ASSERT_TRUE(pipeline->Run(&full, {&kCosts}, nullptr, &ended_at).ok());
  EXPECT_EQ(ended_at, 3u);

  PassContext context{&kCosts};
  context.step_to_beat_seconds = full.passes(1).predicted_step_seconds();
  proto::Schedule stopped = EmptySchedule();
  const Status stop = pipeline->Run(&stopped, context, nullptr, &ended_at);
  ASSERT_TRUE(stop.cannot_win()) << stop.message();
  EXPECT_EQ(ended_at, 2u);

  // No pass frees memory, so the budget holds from the first pass: zero3's schedule is over it.
  const auto plain = Make({"zero3", "prefetch"});
  proto::Schedule over = EmptySchedule();
  const Status failed = plain->Run(&over, PassContext{&kCosts, 1024}, nullptr, &ended_at);
  ASSERT_TRUE(failed.over_budget()) << failed.message();
  EXPECT_EQ(ended_at, 0u);
  EXPECT_TRUE(Make({"zero3", "bucket"})->CannotDoBetterThan(*plain, failed, ended_at));
}

TEST(Verifier, RefusesAScheduleWithNoInstructions) {
  Status status = VerifySchedule(EmptySchedule(), PassContext{&kCosts});
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(),
            "the schedule has no instructions; plan it with a pipeline that starts with zero3");
}

TEST(Verifier, RefusesAScheduleWithAnOpMissing) {
  proto::Schedule s = EmptySchedule();
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, {}).ok());
  for (int i = s.instructions_size() - 1; i >= 0; --i) {
    if (s.instructions(i).kind() == proto::INSTR_COMPUTE) {
      s.mutable_instructions()->DeleteSubrange(i, 1);  // the last optimizer op
      break;
    }
  }
  Status status = VerifySchedule(s, PassContext{&kCosts});
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("runs 0 times in micro-step -1, expected 1"), std::string::npos)
      << status.message();
}

// A simulation handed in (by a pass, or a caller) is not taken on trust: the verifier simulates.
TEST(Verifier, RecomputesWhatItChecks) {
  proto::Schedule s = EmptySchedule();
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, {}).ok());
  auto real = Simulate(s, kCosts);
  ASSERT_TRUE(real.ok());
  SimResult flattering = *real;
  flattering.peak_device_bytes = 1;
  PassContext context{&kCosts, real->peak_device_bytes - 1};
  context.input_simulation = &flattering;
  SimResult simulated;
  Status status = VerifySchedule(s, context, &simulated);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("over the budget"), std::string::npos) << status.message();
  context.budget_bytes = 0;
  ASSERT_TRUE(VerifySchedule(s, context, &simulated).ok());
  EXPECT_EQ(simulated.peak_device_bytes, real->peak_device_bytes);
}

// The fingerprint that keys the plan's simulations moves with every field of every instruction,
// with the order of a list and with a value moved from one list to the other.
TEST(Verifier, FingerprintSeesEveryFieldOfEveryInstruction) {
  proto::Schedule s = EmptySchedule();
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, {}).ok());
  // An instruction with three tensors and three deps (the fingerprint reads, it checks nothing).
  const int with_lists = s.instructions_size() / 2;
  proto::Instruction* lists = s.mutable_instructions(with_lists);
  lists->clear_tensors();
  lists->clear_deps();
  for (int k = 0; k < 3; ++k) {
    lists->add_tensors(k);
    lists->add_deps(k);
  }
  const uint64_t original = InstructionsFingerprint(s);
  EXPECT_EQ(InstructionsFingerprint(s), original);
  const int last = s.instructions_size() - 1;
  const std::vector<std::function<void(proto::Schedule*)>> edits = {
      [&](proto::Schedule* e) { e->mutable_instructions(last)->set_kind(proto::INSTR_RELEASE); },
      [&](proto::Schedule* e) { e->mutable_instructions(0)->set_stream(proto::STREAM_D2H); },
      [&](proto::Schedule* e) { e->mutable_instructions(3)->set_micro_step(5); },
      [&](proto::Schedule* e) { e->mutable_instructions(3)->set_op(12345); },
      [&](proto::Schedule* e) { e->mutable_instructions(last)->set_bucket(9); },
      [&](proto::Schedule* e) {
        e->mutable_instructions(with_lists)->mutable_tensors()->Set(1, 77);
      },
      [&](proto::Schedule* e) { e->mutable_instructions(with_lists)->mutable_deps()->Set(1, 0); },
      [&](proto::Schedule* e) {
        auto* deps = e->mutable_instructions(with_lists)->mutable_deps();
        deps->SwapElements(0, 1);
      },
      [&](proto::Schedule* e) {
        // The last tensor becomes the first dep: the same values, in other lists.
        proto::Instruction* in = e->mutable_instructions(with_lists);
        const int t = in->tensors(in->tensors_size() - 1);
        in->mutable_tensors()->RemoveLast();
        in->mutable_deps()->Add(t);
        for (int k = in->deps_size() - 1; k > 0; --k) in->mutable_deps()->SwapElements(k, k - 1);
      },
      [&](proto::Schedule* e) { e->add_instructions()->CopyFrom(e->instructions(last)); },
      [&](proto::Schedule* e) { e->mutable_instructions()->SwapElements(1, 2); },
  };
  for (size_t k = 0; k < edits.size(); ++k) {
    proto::Schedule edited = s;
    edits[k](&edited);
    EXPECT_NE(InstructionsFingerprint(edited), original) << "edit " << k;
  }
}

// The verifier goes through the plan's simulations: identical instructions take the kept one;
// changed ones are simulated and checked afresh.
TEST(Verifier, TakesTheKeptSimulationOfIdenticalInstructionsOnly) {
  proto::Schedule s = EmptySchedule();
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, {}).ok());
  SimulationCache simulations;
  PassContext context{&kCosts};
  context.simulations = &simulations;
  SimResult first;
  ASSERT_TRUE(VerifySchedule(s, context, &first).ok());
  EXPECT_EQ(simulations.hits(), 0);
  SimResult taken;
  ASSERT_TRUE(VerifySchedule(s, context, &taken).ok());
  EXPECT_EQ(simulations.hits(), 1);
  EXPECT_EQ(taken.peak_device_bytes, first.peak_device_bytes);
  EXPECT_EQ(taken.step_seconds, first.step_seconds);
  // A changed schedule is simulated, and a budget under its peak fails.
  proto::Schedule changed = s;
  changed.mutable_instructions(1)->set_bucket(7);
  EXPECT_NE(InstructionsFingerprint(changed), InstructionsFingerprint(s));
  context.budget_bytes = first.peak_device_bytes - 1;
  Status status = VerifySchedule(changed, context);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("over the budget"), std::string::npos) << status.message();
  EXPECT_EQ(status.shortfall_bytes(), 1);
  EXPECT_EQ(simulations.hits(), 1);
}

// The verifier checks the streams' order of identical instructions once per plan; a schedule
// that fails the check fails it every time.
TEST(Verifier, ChecksTheOrderOfIdenticalInstructionsOnce) {
  proto::Schedule s = EmptySchedule();
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, {}).ok());
  SimulationCache simulations;
  PassContext context{&kCosts};
  context.simulations = &simulations;
  ASSERT_TRUE(VerifySchedule(s, context).ok());
  EXPECT_EQ(simulations.order_hits(), 0);
  ASSERT_TRUE(VerifySchedule(s, context).ok());
  EXPECT_EQ(simulations.order_hits(), 1);
  // A compute that lost its wait for a gather on another stream.
  proto::Schedule unordered = s;
  bool cut = false;
  for (proto::Instruction& in : *unordered.mutable_instructions()) {
    if (in.stream() != proto::STREAM_COMPUTE) continue;
    for (int d : in.deps()) {
      cut = cut || unordered.instructions(d).kind() == proto::INSTR_ALL_GATHER;
    }
    if (cut) {
      in.clear_deps();
      break;
    }
  }
  ASSERT_TRUE(cut);
  // The check in the simulation's replay says what the check on its own says, kept or not.
  const Status alone = CheckHappensBefore(unordered);
  ASSERT_FALSE(alone.ok());
  for (int attempt = 0; attempt < 2; ++attempt) {
    const Status status = VerifySchedule(unordered, context);
    EXPECT_EQ(status.message(), alone.message());
  }
  EXPECT_EQ(simulations.order_hits(), 1);
  EXPECT_EQ(VerifySchedule(unordered, PassContext{&kCosts}).message(), alone.message());
  EXPECT_EQ(VerifySchedule(unordered, PassContext{}).message(), alone.message());
}

// The order check reads the memory plan too: identical instructions with other placements are
// checked again, and a buffer placed over a live one fails though its instructions passed.
TEST(Verifier, ChecksAgainTheSameInstructionsUnderAnotherMemoryPlan) {
  proto::Schedule s = EmptySchedule();
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, {}).ok());
  MemoryPlanPass memory_plan;
  ASSERT_TRUE(memory_plan.Run(&s, PassContext{&kCosts}).ok());
  ASSERT_GT(s.memory_plan().placements_size(), 1);
  SimulationCache simulations;
  PassContext context{&kCosts};
  context.simulations = &simulations;
  ASSERT_TRUE(VerifySchedule(s, context).ok());
  proto::Schedule stacked = s;
  for (proto::BufferPlacement& p : *stacked.mutable_memory_plan()->mutable_placements()) {
    p.set_offset_bytes(0);
  }
  const Status status = VerifySchedule(stacked, context);
  EXPECT_NE(status.message().find("which is still live there"), std::string::npos)
      << status.message();
  EXPECT_EQ(simulations.order_hits(), 0);
  EXPECT_EQ(simulations.hits(), 1);  // the simulation of the same instructions is kept
}

// The plan's simulations: a schedule met again with the same instructions, costs and options
// takes the kept result (the same numbers); any other is simulated; the oldest goes first.
TEST(SimulationCache, TakesOnlyIdenticalInstructionsUnderTheSameCostsAndOptions) {
  proto::Schedule s = EmptySchedule();
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, {}).ok());
  SimOptions quick;
  quick.memory_timeline = false;
  SimulationCache cache(/*capacity=*/2);
  auto first = cache.Simulate(s, kCosts, quick);
  ASSERT_TRUE(first.ok()) << first.status().message();
  EXPECT_EQ(cache.hits(), 0);
  auto again = cache.Simulate(s, kCosts, quick);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(cache.hits(), 1);
  auto fresh = Simulate(s, kCosts, quick);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(again->step_seconds, fresh->step_seconds);
  EXPECT_EQ(again->peak_device_bytes, fresh->peak_device_bytes);
  EXPECT_EQ(again->start_seconds, fresh->start_seconds);
  // Other options, other costs (equal numbers, another model), other instructions: simulated.
  ASSERT_TRUE(cache.Simulate(s, kCosts, SimOptions()).ok());
  const CostModel other_costs = kCosts;
  ASSERT_TRUE(cache.Simulate(s, other_costs, quick).ok());
  proto::Schedule changed = s;
  changed.mutable_instructions(1)->set_bucket(7);
  ASSERT_TRUE(cache.Simulate(changed, kCosts, quick).ok());
  EXPECT_EQ(cache.hits(), 1);
  // Two kept: the changed schedule and the other costs' run; the first has gone.
  ASSERT_TRUE(cache.Simulate(changed, kCosts, quick).ok());
  EXPECT_EQ(cache.hits(), 2);
  ASSERT_TRUE(cache.Simulate(s, kCosts, quick).ok());
  EXPECT_EQ(cache.hits(), 2);
  // A schedule the simulator refuses is refused again, not kept.
  proto::Schedule broken = s;
  broken.mutable_instructions(0)->add_tensors(1 << 30);
  EXPECT_FALSE(cache.Simulate(broken, kCosts, quick).ok());
  EXPECT_FALSE(cache.Simulate(broken, kCosts, quick).ok());
  EXPECT_EQ(cache.hits(), 2);
}

// Through a pipeline: the verifier's check of a pass's chosen candidate and every pipeline's
// zero3 schedule are taken from the plan's simulations, and the plan is the same as without.
TEST(SimulationCache, APipelineGivesTheSamePlanThroughIt) {
  auto run = [](SimulationCache* simulations) {
    auto pipeline = Make({"zero3", "bucket", "prefetch", "unshard"});
    proto::Schedule s = EmptySchedule();
    PassContext context{&kCosts};
    context.simulations = simulations;
    EXPECT_TRUE(pipeline->Run(&s, context).ok());
    return s;
  };
  SimulationCache cache;
  const proto::Schedule with = run(&cache);
  const proto::Schedule without = run(nullptr);
  EXPECT_GT(cache.hits(), 0);
  ASSERT_EQ(with.instructions_size(), without.instructions_size());
  for (int i = 0; i < with.instructions_size(); ++i) {
    EXPECT_EQ(with.instructions(i).SerializeAsString(), without.instructions(i).SerializeAsString())
        << "instruction " << i;
  }
  ASSERT_EQ(with.passes_size(), without.passes_size());
  for (int i = 0; i < with.passes_size(); ++i) {
    EXPECT_EQ(with.passes(i).predicted_step_seconds(), without.passes(i).predicted_step_seconds());
  }
}

}  // namespace
}  // namespace dc
