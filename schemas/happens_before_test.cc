#include "schemas/happens_before.h"

#include <gtest/gtest.h>

#include <string>

#include "rewriter/schedule_text.h"
#include "schemas/effects.h"
#include "tests/support/program_builder.h"

namespace dc {
namespace {

// A small program (world size 2, fp32): w and w2 params [4], x an input (2 token ids), a, c, c2, h
// activations [4]; ops fwd (x, w -> a), side (x -> c), late (x, w2 -> c2), head (a -> h).
proto::Schedule Program() {
  proto::Schedule schedule;
  schedule.set_world_size(2);
  proto::Program& program = *schedule.mutable_program();
  program.mutable_config()->set_compute_dtype(proto::DTYPE_F32);
  test::AddTensor(&program, "w", 4, proto::ROLE_PARAM);                    // 0
  test::AddTensor(&program, "w2", 4, proto::ROLE_PARAM);                   // 1
  test::AddTensor(&program, "x", 2, proto::ROLE_INPUT, proto::DTYPE_I32);  // 2
  test::AddTensor(&program, "a", 4, proto::ROLE_ACTIVATION);               // 3
  test::AddTensor(&program, "c", 4, proto::ROLE_ACTIVATION);               // 4
  test::AddTensor(&program, "c2", 4, proto::ROLE_ACTIVATION);              // 5
  test::AddTensor(&program, "h", 4, proto::ROLE_ACTIVATION);               // 6
  test::AddOp(&program, "fwd", proto::PHASE_FORWARD, {2, 0}, {3});
  test::AddOp(&program, "side", proto::PHASE_FORWARD, {2}, {4});
  test::AddOp(&program, "late", proto::PHASE_FORWARD, {2, 1}, {5});
  test::AddOp(&program, "head", proto::PHASE_FORWARD, {3}, {6});
  return schedule;
}

// "ok" or the check's message for the schedule `text` over Program().
std::string Check(const std::string& text, const proto::MemoryPlan& plan = {}) {
  proto::Schedule schedule = Program();
  *schedule.mutable_memory_plan() = plan;
  const Status parsed = ParseScheduleText(text, &schedule);
  if (!parsed.ok()) return "parse: " + parsed.message();
  const Status references = CheckReferences(schedule);
  if (!references.ok()) return "references: " + references.message();
  const Status checked = CheckHappensBefore(schedule);
  return checked.ok() ? std::string("ok") : checked.message();
}

TEST(HappensBefore, RefusesAReadOfAGatherOnAnotherStreamWithoutADependency) {
  EXPECT_EQ(Check("all_gather gather m0 [w]\n"
                  "compute compute m0 fwd\n"),
            "instruction 1 (compute on the compute stream, micro-step 0, op fwd) reads w "
            "(gathered), which instruction 0 (all_gather on the gather stream, micro-step 0, of "
            "w) writes, but nothing orders the two: no chain of deps (or one stream's order) "
            "leads from instruction 0 to instruction 1; add a dependency of instruction 1 on "
            "instruction 0");
}

TEST(HappensBefore, AcceptsTheSamePlanWithTheDependency) {
  EXPECT_EQ(Check("all_gather gather m0 [w]\n"
                  "compute compute m0 fwd deps=0\n"
                  "release compute m0 [w, x, a]\n"),
            "ok");
}

TEST(HappensBefore, AcceptsAPathThroughAThirdStream) {
  // 0 -> 1 (reduce stream) -> 2: the compute follows the gather through the other gather.
  EXPECT_EQ(Check("all_gather gather m0 [w]\n"
                  "all_gather reduce m0 [w2] deps=0\n"
                  "compute compute m0 fwd deps=1\n"),
            "ok");
  // Without the first link there is no path.
  const std::string broken = Check(
      "all_gather gather m0 [w]\n"
      "all_gather reduce m0 [w2]\n"
      "compute compute m0 fwd deps=1\n");
  EXPECT_NE(broken.find("instruction 2 (compute"), std::string::npos) << broken;
  EXPECT_NE(broken.find("reads w (gathered), which instruction 0 (all_gather"), std::string::npos)
      << broken;
}

TEST(HappensBefore, AcceptsOneStreamsOrder) {
  EXPECT_EQ(Check("all_gather compute m0 [w]\n"
                  "compute compute m0 fwd\n"
                  "release compute m0 [w]\n"),
            "ok");
  // The stream's order is transitive too: the gather on the gather stream, waited for by the
  // first compute, is ordered before the later computes on the compute stream.
  EXPECT_EQ(Check("all_gather gather m0 [w, w2]\n"
                  "compute compute m0 fwd deps=0\n"
                  "compute compute m0 late\n"),
            "ok");
}

TEST(HappensBefore, RefusesAReleaseOnAnotherStreamBeforeARead) {
  EXPECT_EQ(Check("all_gather gather m0 [w]\n"
                  "compute compute m0 fwd deps=0\n"
                  "release gather m0 [w]\n"),
            "instruction 2 (release on the gather stream, micro-step 0, of w) frees w "
            "(gathered), which instruction 1 (compute on the compute stream, micro-step 0, op "
            "fwd) reads, but nothing orders the two: no chain of deps (or one stream's order) "
            "leads from instruction 1 to instruction 2; add a dependency of instruction 2 on "
            "instruction 1");
  EXPECT_EQ(Check("all_gather gather m0 [w]\n"
                  "compute compute m0 fwd deps=0\n"
                  "release gather m0 [w] deps=1\n"),
            "ok");
}

TEST(HappensBefore, RefusesAnOverwriteOnAnotherStreamBeforeARead) {
  // The all-reduce sums into a in place: after its write (a dep), but not after head's read.
  EXPECT_EQ(Check("all_gather compute m0 [w]\n"
                  "compute compute m0 fwd\n"
                  "compute compute m0 head\n"
                  "all_reduce reduce m0 [a] deps=1\n"),
            "instruction 3 (all_reduce on the reduce stream, micro-step 0, of a) overwrites a "
            "(micro-step 0), which instruction 2 (compute on the compute stream, micro-step 0, op "
            "head) reads, but nothing orders the two: no chain of deps (or one stream's order) "
            "leads from instruction 2 to instruction 3; add a dependency of instruction 3 on "
            "instruction 2");
  EXPECT_EQ(Check("all_gather compute m0 [w]\n"
                  "compute compute m0 fwd\n"
                  "compute compute m0 head\n"
                  "all_reduce reduce m0 [a] deps=2\n"),
            "ok");
}

// Two buffers at the same arena bytes: the second may be allocated only after the first is
// freed, and ordered after that free.
TEST(HappensBefore, RefusesArenaReuseWithoutADependencyOnTheFree) {
  proto::MemoryPlan plan;
  plan.set_arena_bytes(256);
  auto place = [&plan](int instruction, int tensor) {
    proto::BufferPlacement* p = plan.add_placements();
    p->set_instruction(instruction);
    p->set_tensor(tensor);
    p->set_micro_step(0);
    p->set_offset_bytes(0);
    p->set_size_bytes(16);
  };
  place(1, 3);  // a, written by instruction 1
  place(3, 4);  // c, written by instruction 3, in a's bytes
  const std::string refused = Check(
      "all_gather compute m0 [w]\n"
      "compute compute m0 fwd\n"
      "release gather m0 [a] deps=1\n"
      "compute compute m0 side\n",
      plan);
  EXPECT_EQ(refused,
            "instruction 3 (compute on the compute stream, micro-step 0, op side) allocates c "
            "(micro-step 0) in arena bytes that a (micro-step 0) held until instruction 2 "
            "(release on the gather stream, micro-step 0, of a) freed it, but nothing orders the "
            "two: no chain of deps (or one stream's order) leads from instruction 2 to "
            "instruction 3; add a dependency of instruction 3 on instruction 2");
  EXPECT_EQ(Check("all_gather compute m0 [w]\n"
                  "compute compute m0 fwd\n"
                  "release gather m0 [a] deps=1\n"
                  "compute compute m0 side deps=2\n",
                  plan),
            "ok");
  place(2, 4);  // c again, written by instruction 2 while a is still live
  const std::string live = Check(
      "all_gather compute m0 [w]\n"
      "compute compute m0 fwd\n"
      "compute compute m0 side\n",
      plan);
  EXPECT_NE(live.find("the memory plan places c (micro-step 0) of instruction 2"),
            std::string::npos)
      << live;
  EXPECT_NE(live.find("over a (micro-step 0), which is still live there"), std::string::npos)
      << live;
}

}  // namespace
}  // namespace dc
