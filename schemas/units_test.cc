#include "schemas/units.h"

#include <gtest/gtest.h>

namespace dc {
namespace {

TEST(Units, ParsesTheFormsUsersWrite) {
  EXPECT_EQ(*ParseBytes("1073741824"), 1073741824);
  EXPECT_EQ(*ParseBytes("1GiB"), 1073741824);
  EXPECT_EQ(*ParseBytes("512MiB"), 512LL << 20);
  EXPECT_EQ(*ParseBytes("1.5KiB"), 1536);
  EXPECT_EQ(*ParseBytes("2GB"), 2000000000);
}

TEST(Units, RejectsNonsense) {
  for (const char* bad : {"", "GiB", "12 apples", "1.2.3MiB", "-5"}) {
    auto parsed = ParseBytes(bad);
    EXPECT_FALSE(parsed.ok()) << bad;
  }
  EXPECT_NE(ParseBytes("12XB").status().message().find("not a byte size"), std::string::npos);
}

// Sizes past what int64 holds say so, rather than "not a byte size" (or overflowing).
TEST(Units, SaysWhenASizeIsTooLarge) {
  EXPECT_EQ(*ParseBytes("1EiB"), int64_t{1} << 60);
  EXPECT_EQ(*ParseBytes("2PiB"), int64_t{2} << 50);
  for (const char* huge : {"10EiB", "8EiB", "9223372036854775808", "99999999999999999999"}) {
    auto parsed = ParseBytes(huge);
    ASSERT_FALSE(parsed.ok()) << huge;
    EXPECT_NE(parsed.status().message().find("is too large"), std::string::npos)
        << parsed.status().message();
  }
}

TEST(Units, Formats) {
  EXPECT_EQ(FormatBytes(17), "17 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(3LL << 30), "3.00 GiB");
}

TEST(Units, JoinsNames) {
  EXPECT_EQ(Join({}, ", "), "");
  EXPECT_EQ(Join({"zero3"}, ", "), "zero3");
  EXPECT_EQ(Join({"zero3", "prefetch", "memory-plan"}, ", "), "zero3, prefetch, memory-plan");
  EXPECT_EQ(Join({"a", "b"}, ","), "a,b");
}

}  // namespace
}  // namespace dc
