#include "schemas/op_kinds.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace dc {
namespace {

TEST(OpKinds, TableIsIndexedByKindWithUniqueNames) {
  std::set<std::string> names;
  for (size_t i = 0; i < kNumOpKinds; ++i) {
    const OpKindInfo& info = kOpKinds[i];
    EXPECT_EQ(static_cast<size_t>(info.kind), i) << info.name;
    EXPECT_EQ(&InfoOf(info.kind), &info);
    EXPECT_FALSE(std::string(info.name).empty());
    EXPECT_TRUE(names.insert(info.name).second) << "two rows named " << info.name;
  }
}

TEST(OpKinds, FindsEveryKindByItsNameAndNoOther) {
  for (const OpKindInfo& info : kOpKinds) {
    const std::optional<OpKind> found = FindOpKind(info.name);
    ASSERT_TRUE(found.has_value()) << info.name;
    EXPECT_EQ(*found, info.kind);
  }
  EXPECT_FALSE(FindOpKind("no_such_kind").has_value());
  EXPECT_FALSE(FindOpKind("").has_value());
  EXPECT_FALSE(FindOpKind("matmul ").has_value());
}

TEST(OpKinds, NameConstantsAreTheTableNames) {
  EXPECT_STREQ(op_kind::kMatmul, "matmul");
  EXPECT_STREQ(op_kind::kMatmul, InfoOf(OpKind::kMatmul).name);
  EXPECT_STREQ(op_kind::kMoeCombineBackward, InfoOf(OpKind::kMoeCombineBackward).name);
  EXPECT_EQ(InfoOf(OpKind::kEmbedding).math, OpMath::kRowGather);
  EXPECT_EQ(InfoOf(OpKind::kAttentionBackward).math, OpMath::kMatrix);
  EXPECT_EQ(InfoOf(OpKind::kRmsNorm).math, OpMath::kVector);
}

// The convention of the header: every "<kind>_backward" is the backward of a kind of the table.
TEST(OpKinds, EveryBackwardKindHasItsForward) {
  const std::string suffix = "_backward";
  for (const OpKindInfo& info : kOpKinds) {
    const std::string name = info.name;
    if (!name.ends_with(suffix)) continue;
    EXPECT_TRUE(FindOpKind(name.substr(0, name.size() - suffix.size())).has_value()) << name;
  }
}

}  // namespace
}  // namespace dc
