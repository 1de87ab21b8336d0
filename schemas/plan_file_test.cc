#include "schemas/plan_file.h"

#include <gtest/gtest.h>

#include "schemas/digest.h"

namespace dc {
namespace {

proto::Schedule SmallSchedule() {
  proto::Schedule s;
  s.set_world_size(2);
  s.set_budget_bytes(1 << 20);
  auto* t = s.mutable_program()->add_tensors();
  t->set_id(0);
  t->set_name("w");
  t->add_shape(4);
  t->set_dtype(proto::DTYPE_F32);
  t->set_role(proto::ROLE_PARAM);
  auto* i = s.add_instructions();
  i->set_kind(proto::INSTR_ALL_GATHER);
  i->add_tensors(0);
  return s;
}

TEST(PlanFile, RoundTrips) {
  const std::string bytes = SerializePlan(SmallSchedule());
  auto back = ParsePlan(bytes, "p");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->world_size(), 2);
  EXPECT_EQ(back->instructions_size(), 1);
  EXPECT_EQ(back->program_digest(), DigestOf(back->program()));
}

TEST(PlanFile, SerializationIsDeterministic) {
  EXPECT_EQ(SerializePlan(SmallSchedule()), SerializePlan(SmallSchedule()));
}

TEST(PlanFile, RefusesTruncated) {
  std::string bytes = SerializePlan(SmallSchedule());
  bytes.resize(bytes.size() - 3);
  auto back = ParsePlan(bytes, "p.dcplan");
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("truncated"), std::string::npos);
  EXPECT_EQ(back.status().message().rfind("p.dcplan: ", 0), 0u);
}

TEST(PlanFile, RefusesCorrupt) {
  std::string bytes = SerializePlan(SmallSchedule());
  bytes[bytes.size() - 2] ^= 0x5A;
  auto back = ParsePlan(bytes, "p");
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("corrupt"), std::string::npos);
}

TEST(PlanFile, RefusesNewerVersion) {
  std::string bytes = SerializePlan(SmallSchedule());
  bytes[8] = 99;  // format version field follows the 8-byte magic
  auto back = ParsePlan(bytes, "p");
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("newer"), std::string::npos);
}

TEST(PlanFile, RefusesEmptyAndForeign) {
  EXPECT_NE(ParsePlan("", "p").status().message().find("empty"), std::string::npos);
  EXPECT_NE(ParsePlan("SQLite format 3", "p").status().message().find("not a dc plan"),
            std::string::npos);
}

TEST(PlanFile, RefusesTamperedProgram) {
  proto::Schedule s = SmallSchedule();
  std::string bytes = SerializePlan(s);
  auto parsed = ParsePlan(bytes, "p");
  ASSERT_TRUE(parsed.ok());
  // Re-frame a payload whose program no longer matches its digest.
  proto::Schedule tampered = *parsed;
  tampered.mutable_program()->mutable_tensors(0)->set_name("other");
  const std::string payload = CanonicalBytes(tampered);
  std::string framed = bytes.substr(0, 12);
  for (int i = 0; i < 8; ++i)
    framed.push_back(static_cast<char>((payload.size() >> (8 * i)) & 0xFF));
  framed += Sha256Hex(payload) + payload;
  auto back = ParsePlan(framed, "p");
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("digest"), std::string::npos);
}

}  // namespace
}  // namespace dc
