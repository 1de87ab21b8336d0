// The plan validator: one real plan of the tiny model, and one bad index, offset, shape or size
// of each kind in it, each refused with a message saying what is wrong.
#include "schemas/plan_check.h"

#include <gtest/gtest.h>

#include <functional>
#include <limits>

#include "schemas/plan_file.h"
#include "tests/support/cuda_test_plans.h"

namespace dc {
namespace {

using testing::TinyPlan;
using testing::TinyPlanOptions;

// Two ranks, two micro-steps, with a memory plan (the dc policy runs memory-plan).
const proto::Schedule& Good() {
  static const proto::Schedule plan = [] {
    TinyPlanOptions options;
    options.backend = "cpu";
    options.world_size = 2;
    options.policy = "dc";
    auto made = TinyPlan(options);
    EXPECT_TRUE(made.ok()) << made.status().message();
    return made.ok() ? *made : proto::Schedule();
  }();
  return plan;
}

void ExpectRefused(const std::function<void(proto::Schedule*)>& edit, const std::string& expect,
                   const PlanLimits& limits = {}) {
  proto::Schedule plan = Good();
  edit(&plan);
  const Status status = ValidatePlan(plan, limits);
  ASSERT_FALSE(status.ok()) << "accepted; expected: " << expect;
  EXPECT_NE(status.message().find(expect), std::string::npos) << status.message();
  EXPECT_EQ(status.message().find('\n'), std::string::npos) << status.message();
}

int FirstOf(const proto::Schedule& plan, proto::InstrKind kind) {
  for (int i = 0; i < plan.instructions_size(); ++i) {
    if (plan.instructions(i).kind() == kind) return i;
  }
  ADD_FAILURE() << "no " << InstrKindName(kind);
  return 0;
}

int TensorNamed(const proto::Program& program, const std::string& name) {
  for (const proto::Tensor& t : program.tensors()) {
    if (t.name() == name) return t.id();
  }
  ADD_FAILURE() << "no tensor " << name;
  return 0;
}

TEST(ValidatePlan, AcceptsWhatThePlannerMakes) {
  ASSERT_GT(Good().memory_plan().arena_bytes(), 0);
  ASSERT_GT(Good().memory_plan().placements_size(), 0);
  EXPECT_TRUE(ValidatePlan(Good()).ok()) << ValidatePlan(Good()).message();
  PlanLimits ample;
  ample.memory_bytes = int64_t{1} << 40;
  EXPECT_TRUE(ValidatePlan(Good(), ample).ok());
}

// The executor stages micro_batch x seq token ids per input: a config that disagrees with the
// tokens tensor wrote 16 KiB past a heap buffer before.
TEST(ValidatePlan, RefusesInputsThatDisagreeWithTheConfig) {
  ExpectRefused(
      [](proto::Schedule* s) {
        auto* config = s->mutable_program()->mutable_config();
        config->set_seq(config->seq() * 2);
      },
      "as the model config's micro_batch and seq say");
  ExpectRefused(
      [](proto::Schedule* s) {
        auto* config = s->mutable_program()->mutable_config();
        config->set_micro_batch(config->micro_batch() + 1);
      },
      "micro_batch and seq");
  ExpectRefused(
      [](proto::Schedule* s) {
        const int tokens = TensorNamed(s->program(), "tokens");
        s->mutable_program()->mutable_tensors(tokens)->set_dtype(proto::DTYPE_F32);
      },
      "input tokens is f32");
  ExpectRefused(
      [](proto::Schedule* s) {
        auto* config = s->mutable_program()->mutable_config();
        config->set_vocab(config->vocab() + 2);
      },
      "rows as the model config's vocab says");
}

TEST(ValidatePlan, RefusesABadModelConfig) {
  ExpectRefused([](proto::Schedule* s) { s->mutable_program()->mutable_config()->set_vocab(0); },
                "--vocab must be at least 2 (got 0)");
  ExpectRefused([](proto::Schedule* s) { s->mutable_program()->mutable_config()->set_vocab(1); },
                "--vocab must be at least 2 (got 1)");
  ExpectRefused([](proto::Schedule* s) { s->mutable_program()->mutable_config()->set_vocab(-5); },
                "--vocab must be at least 2");
  ExpectRefused([](proto::Schedule* s) { s->mutable_program()->mutable_config()->set_seq(-1); },
                "--seq must be at least 1");
  ExpectRefused(
      [](proto::Schedule* s) {
        s->mutable_program()->mutable_config()->set_seq(std::numeric_limits<int64_t>::max());
      },
      "over dc's limit");
  ExpectRefused(
      [](proto::Schedule* s) {
        s->mutable_program()->mutable_config()->set_lr(std::numeric_limits<double>::quiet_NaN());
      },
      "lr must be a finite number");
  ExpectRefused(
      [](proto::Schedule* s) { s->mutable_program()->mutable_config()->set_gas(1 << 20); },
      "--gas 1048576 is over dc's limit");
  ExpectRefused([](proto::Schedule* s) { s->set_world_size(0); }, "world size 0");
}

TEST(ValidatePlan, RefusesBadIndices) {
  const int compute = FirstOf(Good(), proto::INSTR_COMPUTE);
  const int gather = FirstOf(Good(), proto::INSTR_ALL_GATHER);
  ExpectRefused([&](proto::Schedule* s) { s->mutable_instructions(compute)->set_op(1 << 30); },
                "bad op id");
  ExpectRefused([&](proto::Schedule* s) { s->mutable_instructions(compute)->set_op(-1); },
                "bad op id");
  ExpectRefused([&](proto::Schedule* s) { s->mutable_instructions(gather)->set_tensors(0, -7); },
                "bad tensor id -7");
  ExpectRefused([&](proto::Schedule* s) { s->mutable_instructions(gather)->add_tensors(1 << 30); },
                "bad tensor id");
  ExpectRefused([&](proto::Schedule* s) { s->mutable_instructions(compute)->add_deps(compute); },
                "does not come before it");
  ExpectRefused(
      [&](proto::Schedule* s) {
        s->mutable_program()->mutable_ops(s->instructions(compute).op())->set_inputs(0, 1 << 30);
      },
      "reads a bad tensor id");
}

// A micro-step past the config's gas indexed per-micro-step tables out of bounds (and sized the
// replay's tables by it: gigabytes).
TEST(ValidatePlan, RefusesMicroStepsOutsideTheSteps) {
  const int compute = FirstOf(Good(), proto::INSTR_COMPUTE);
  ExpectRefused([&](proto::Schedule* s) { s->mutable_instructions(compute)->set_micro_step(2); },
                "is in micro-step 2, outside the plan's 2 (gas)");
  ExpectRefused(
      [&](proto::Schedule* s) { s->mutable_instructions(compute)->set_micro_step(1 << 30); },
      "outside the plan's 2 (gas)");
  ExpectRefused([&](proto::Schedule* s) { s->mutable_instructions(compute)->set_micro_step(-9); },
                "micro-step");
}

TEST(ValidatePlan, RefusesMemoryPlanPlacesOutsideTheArena) {
  auto place = [](proto::Schedule* s) { return s->mutable_memory_plan()->mutable_placements(0); };
  ExpectRefused([&](proto::Schedule* s) { place(s)->set_offset_bytes(-256); }, "does not hold its");
  ExpectRefused(
      [&](proto::Schedule* s) { place(s)->set_offset_bytes(place(s)->offset_bytes() + 4); },
      "aligned inside the arena");
  // Near INT64_MAX, offset + size overflows a naive check and wrote anywhere.
  ExpectRefused(
      [&](proto::Schedule* s) {
        place(s)->set_offset_bytes(std::numeric_limits<int64_t>::max() / 256 * 256);
      },
      "inside the arena");
  ExpectRefused(
      [&](proto::Schedule* s) {
        place(s)->set_offset_bytes(s->memory_plan().arena_bytes() / 256 * 256);
      },
      "inside the arena");
  ExpectRefused([&](proto::Schedule* s) { place(s)->set_size_bytes(1); }, "does not hold");
  ExpectRefused([&](proto::Schedule* s) { s->mutable_memory_plan()->set_arena_bytes(256); },
                "inside the arena of 256 bytes");
  ExpectRefused([&](proto::Schedule* s) { s->mutable_memory_plan()->set_arena_bytes(-1); },
                "arena has -1 bytes");
  ExpectRefused([&](proto::Schedule* s) { place(s)->set_tensor(1 << 30); },
                "which the program lacks");
  ExpectRefused([&](proto::Schedule* s) { place(s)->set_instruction(1 << 30); },
                "which the plan lacks");
  ExpectRefused([&](proto::Schedule* s) { place(s)->set_micro_step(99); },
                "micro-step 99, outside");
}

TEST(ValidatePlan, RefusesAPlanLargerThanTheMemoryGiven) {
  PlanLimits tiny;
  tiny.memory_bytes = 1024;
  ExpectRefused([](proto::Schedule*) {}, "more than the 1.00 KiB this host has", tiny);
  // An arena of an exabyte is refused before anything allocates it.
  PlanLimits host;
  host.memory_bytes = int64_t{1} << 40;
  ExpectRefused(
      [](proto::Schedule* s) { s->mutable_memory_plan()->set_arena_bytes(int64_t{1} << 60); },
      "this host has", host);
}

TEST(ValidatePlan, RefusesBrokenBufferEffects) {
  const int gather = FirstOf(Good(), proto::INSTR_ALL_GATHER);
  ExpectRefused([&](proto::Schedule* s) { s->mutable_instructions(gather)->clear_tensors(); },
                "which is not gathered");
}

// The plan file's reader validates after the digest: a mutated plan whose digest was recomputed
// is refused with the file's name and what to do.
TEST(ValidatePlan, ThePlanFileReaderRunsItAfterTheDigest) {
  proto::Schedule bad = Good();
  bad.mutable_program()->mutable_config()->set_seq(bad.program().config().seq() * 2);
  const auto parsed = ParsePlan(SerializePlan(bad), "bad.dcplan");
  ASSERT_FALSE(parsed.ok());
  const std::string message = parsed.status().message();
  EXPECT_EQ(message.rfind("bad.dcplan: ", 0), 0u) << message;
  EXPECT_NE(message.find("re-plan with dc-plan"), std::string::npos) << message;
  EXPECT_TRUE(ParsePlan(SerializePlan(Good()), "good.dcplan").ok());
}

}  // namespace
}  // namespace dc
