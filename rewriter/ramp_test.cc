#include "rewriter/ramp.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/prefetch_test_util.h"

namespace dc {
namespace {

using testing::HandCosts;
using testing::HandProgram;
using testing::MustSimulate;
using testing::RunAndCheck;

// Eight params of 4000 bytes gathered in one call at the start of the step, then one forward
// op of `op_seconds` each, op i reading param i and op i-1's output.
struct FusedStart {
  FusedStart() {
    std::string names, ops, releases;
    int previous = -1;
    for (int i = 0; i < 8; ++i) {
      const std::string name = std::to_string(i);
      params.push_back(program.Param("p" + name, 4000));
      const int out = program.Activation("a" + name, 4000);
      std::vector<int> reads = {params.back()};
      if (previous >= 0) reads.push_back(previous);
      program.Op("f" + name, proto::PHASE_FORWARD, reads, {out});
      previous = out;
      names += (i ? ", p" : "p") + name;
      ops += std::to_string(1 + i) + ": compute compute m0 f" + name + " deps=0\n";
      releases +=
          std::to_string(9 + i) + ": release compute m0 [p" + name + ", a" + name + "] deps=8\n";
    }
    schedule =
        program.Schedule("0: all_gather gather m0 [" + names + "] bucket=1\n" + ops + releases);
  }
  // Params per all-gather, in stream order.
  static std::vector<int> Pieces(const proto::Schedule& s) {
    std::vector<int> sizes;
    for (const auto& instr : s.instructions()) {
      if (instr.kind() == proto::INSTR_ALL_GATHER) sizes.push_back(instr.tensors_size());
    }
    return sizes;
  }
  HandProgram program;
  std::vector<int> params;
  proto::Schedule schedule;
};

TEST(Ramp, SplitsTheStepsFirstGatherSoTheRestHidesBehindCompute) {
  // A gather costs 2 s of latency plus 0.25 s per param, an op 1 s. Whole, the first op waits
  // for the 4 s transfer (12 s in all). Halved, 3 s are exposed and the second half (3 s) hides
  // behind the first four ops: 11 s. In quarters and more the latency comes back (11.5 s).
  FusedStart c;
  const CostModel costs = HandCosts(c.program.program(), 1.0, 2.0, 16'000);
  EXPECT_NEAR(MustSimulate(c.schedule, costs).step_seconds, 12, 1e-9);
  RampPass pass;
  const proto::Schedule out = RunAndCheck(pass, c.schedule, PassContext{&costs, 0});
  EXPECT_EQ(FusedStart::Pieces(out), (std::vector<int>{4, 4}));
  EXPECT_NEAR(MustSimulate(out, costs).step_seconds, 11, 1e-9);
  // Each op waits for the piece that holds its param, not for the whole gather.
  EXPECT_EQ(out.instructions(2).op(), 0);
  EXPECT_EQ(std::vector<int>(out.instructions(2).deps().begin(), out.instructions(2).deps().end()),
            std::vector<int>{0});
  EXPECT_EQ(out.instructions(6).op(), 4);
  EXPECT_EQ(std::vector<int>(out.instructions(6).deps().begin(), out.instructions(6).deps().end()),
            std::vector<int>{1});
  // Grouped pieces are grouped calls of their own.
  EXPECT_GT(out.instructions(0).bucket(), 0);
  EXPECT_GT(out.instructions(1).bucket(), 0);
  EXPECT_NE(out.instructions(0).bucket(), out.instructions(1).bucket());
  EXPECT_NE(pass.Summary().find("into 2"), std::string::npos) << pass.Summary();
}

TEST(Ramp, KeepsTheGatherWholeWhereTheLatencyCostsMore) {
  // Ops of 10 ms hide nothing: every piece's 2 s of latency lands on the step.
  FusedStart c;
  const CostModel costs = HandCosts(c.program.program(), 0.01, 2.0, 16'000);
  RampPass pass;
  const proto::Schedule out = RunAndCheck(pass, c.schedule, PassContext{&costs, 0});
  EXPECT_EQ(FusedStart::Pieces(out), std::vector<int>{8});
  EXPECT_NE(pass.Summary().find("kept"), std::string::npos) << pass.Summary();
}

TEST(Ramp, LeavesAFirstGatherOfOneParamAlone) {
  HandProgram program;
  const int p = program.Param("p", 4000);
  const int a = program.Activation("a", 4000);
  program.Op("f", proto::PHASE_FORWARD, {p}, {a});
  const proto::Schedule schedule = program.Schedule(R"(
    all_gather gather m0 [p]
    compute compute m0 f deps=0
    release compute m0 [p, a] deps=1
  )");
  const CostModel costs = HandCosts(program.program(), 1.0, 2.0, 16'000);
  RampPass pass;
  const proto::Schedule out = RunAndCheck(pass, schedule, PassContext{&costs, 0});
  EXPECT_EQ(out.instructions_size(), 3);
}

}  // namespace
}  // namespace dc
