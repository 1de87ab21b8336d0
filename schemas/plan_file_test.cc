#include "schemas/plan_file.h"

#include <gtest/gtest.h>

#include "schemas/digest.h"

namespace dc {
namespace {

// The smallest plan the reader's validation (schemas/plan_check.h) accepts: a valid config, one
// param, its all-gather.
proto::Schedule SmallSchedule() {
  proto::Schedule s;
  s.set_world_size(2);
  proto::ModelConfig* c = s.mutable_program()->mutable_config();
  c->set_family(kFamilyLlama);
  c->set_layers(1);
  c->set_hidden(4);
  c->set_heads(1);
  c->set_kv_heads(1);
  c->set_ffn(4);
  c->set_vocab(8);
  c->set_seq(4);
  c->set_micro_batch(1);
  c->set_gas(1);
  c->set_compute_dtype(proto::DTYPE_F32);
  c->set_rope_theta(10000);
  c->set_norm_eps(1e-5);
  c->set_init_std(0.02);
  c->set_adam_eps(1e-8);
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

// The plan file of `schedule` as written, with the header's format version `version`.
std::string Framed(const proto::Schedule& schedule, uint32_t version) {
  const std::string payload = CanonicalBytes(schedule);
  std::string framed = SerializePlan(SmallSchedule()).substr(0, 8);
  for (int i = 0; i < 4; ++i) framed.push_back(static_cast<char>((version >> (8 * i)) & 0xFF));
  for (int i = 0; i < 8; ++i)
    framed.push_back(static_cast<char>((payload.size() >> (8 * i)) & 0xFF));
  return framed + Sha256Hex(payload) + payload;
}

// A plan of format version 1 (its program marks recomputes only by their names) is refused in
// one line that names the file and says to re-plan.
TEST(PlanFile, RefusesOlderVersion) {
  proto::Schedule old = SmallSchedule();
  old.set_format_version(1);
  old.mutable_program()->set_format_version(1);
  old.set_program_digest(DigestOf(old.program()));
  auto back = ParsePlan(Framed(old, 1), "old.dcplan");
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status().message(),
            "old.dcplan: plan format version 1 is older than this dc reads (" +
                std::to_string(kScheduleFormatVersion) + "); re-plan with dc-plan");

  // A current plan around an older program: the same advice.
  proto::Schedule mixed = SmallSchedule();
  mixed.set_format_version(kScheduleFormatVersion);
  mixed.mutable_program()->set_format_version(1);
  mixed.set_program_digest(DigestOf(mixed.program()));
  back = ParsePlan(Framed(mixed, kScheduleFormatVersion), "mixed.dcplan");
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status().message(),
            "mixed.dcplan: embedded program format version 1 is older than this dc reads (" +
                std::to_string(kProgramFormatVersion) + "); re-plan with dc-plan");
}

TEST(PlanFile, RefusesTamperedProgram) {
  proto::Schedule s = SmallSchedule();
  std::string bytes = SerializePlan(s);
  auto parsed = ParsePlan(bytes, "p");
  ASSERT_TRUE(parsed.ok());
  // Re-frame a payload whose program no longer matches its digest.
  proto::Schedule tampered = *parsed;
  tampered.mutable_program()->mutable_tensors(0)->set_name("other");
  auto back = ParsePlan(Framed(tampered, kScheduleFormatVersion), "p");
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("digest"), std::string::npos);
}

}  // namespace
}  // namespace dc
