#include "rewriter/schedule_text.h"

#include <gtest/gtest.h>

#include "models/model.h"
#include "rewriter/zero3.h"

namespace dc {
namespace {

proto::Schedule TinyBaseline(const ModelOverrides& overrides = {}) {
  auto config = MakeConfig("tiny", overrides);
  auto program = BuildProgram(*config);
  proto::Schedule s;
  s.set_world_size(2);
  *s.mutable_program() = *program;
  Zero3Pass pass;
  EXPECT_TRUE(pass.Run(&s, PassContext{}).ok());
  return s;
}

TEST(ScheduleText, RoundTripsTheBaseline) {
  ModelOverrides clip;  // with the grads' norm and its all-reduce
  clip.clip_grad_norm = 1.0;
  const proto::Schedule s = TinyBaseline(clip);
  const std::string text = ScheduleToText(s);
  EXPECT_NE(text.find(": all_reduce reduce opt [grad_norm_squared] deps="), std::string::npos);
  proto::Schedule back;
  *back.mutable_program() = s.program();
  Status parsed = ParseScheduleText(text, &back);
  ASSERT_TRUE(parsed.ok()) << parsed.message();
  ASSERT_EQ(back.instructions_size(), s.instructions_size());
  for (int i = 0; i < s.instructions_size(); ++i) {
    EXPECT_EQ(back.instructions(i).SerializeAsString(), s.instructions(i).SerializeAsString()) << i;
  }
}

TEST(ScheduleText, ReportsTheBadLine) {
  proto::Schedule s = TinyBaseline();
  Status parsed = ParseScheduleText("all_gather gather m0 [no.such.tensor]\n", &s);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.message().find("line 1"), std::string::npos) << parsed.message();
  EXPECT_NE(parsed.message().find("no.such.tensor"), std::string::npos);
  EXPECT_FALSE(ParseScheduleText("compute sideways m0 x\n", &s).ok());
  EXPECT_FALSE(ParseScheduleText("5: compute compute m0\n", &s).ok());
}

// Numbers that are not numbers are refused with the line, not thrown (found by
// fuzz/schedule_text_fuzzer: "m-" and "deps=x" ended the process with std::invalid_argument).
TEST(ScheduleText, RefusesBadNumbersInOneLine) {
  proto::Schedule s = TinyBaseline();
  for (const char* bad :
       {"all_gather gather m- [embed]\n", "all_gather gather mx [embed]\n",
        "all_gather gather m99999999999 [embed]\n", "all_gather gather m0 [embed] deps=x\n",
        "all_gather gather m0 [embed] bucket=\n", "all_gather gather m0 [embed] bucket=3z\n"}) {
    const Status parsed = ParseScheduleText(bad, &s);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.message().find("line 1"), std::string::npos) << parsed.message();
  }
}

}  // namespace
}  // namespace dc
