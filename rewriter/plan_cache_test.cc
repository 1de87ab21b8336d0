#include "rewriter/plan_cache.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/support/cuda_test_plans.h"

namespace dc {
namespace {

TEST(PlanCache, KeyChangesWithEveryInput) {
  PlanKeyInputs base;
  base.program_digest = "abc";
  base.world_size = 2;
  base.backend = "cpu";
  const std::string key = PlanCacheKey(base);
  EXPECT_EQ(key, PlanCacheKey(base));
  auto changed = [&](auto mutate) {
    PlanKeyInputs other = base;
    mutate(other);
    return PlanCacheKey(other) != key;
  };
  EXPECT_TRUE(changed([](PlanKeyInputs& k) { k.program_digest = "abd"; }));
  EXPECT_TRUE(changed([](PlanKeyInputs& k) { k.world_size = 4; }));
  EXPECT_TRUE(changed([](PlanKeyInputs& k) { k.backend = "cuda"; }));
  EXPECT_TRUE(changed([](PlanKeyInputs& k) { k.device = "h100"; }));
  EXPECT_TRUE(changed([](PlanKeyInputs& k) { k.budget_bytes = 1; }));
  EXPECT_TRUE(changed([](PlanKeyInputs& k) { k.policy = "baseline"; }));
  EXPECT_TRUE(changed([](PlanKeyInputs& k) { k.pass_options = "zero3{}"; }));
  EXPECT_TRUE(changed([](PlanKeyInputs& k) { k.profile_digest = "p"; }));
}

TEST(PlanCache, StoresLooksUpAndTreatsDamageAsAMiss) {
  const std::string dir = ::testing::TempDir() + "/dc-plan-cache-test";
  std::filesystem::remove_all(dir);
  PlanCache cache(dir);
  // A real plan: the cache reads entries back through the plan file's reader, which validates.
  testing::TinyPlanOptions options;
  options.backend = "cpu";
  options.world_size = 2;
  auto made = testing::TinyPlan(options);
  ASSERT_TRUE(made.ok()) << made.status().message();
  proto::Schedule plan = *made;
  plan.set_cache_key("k1");
  EXPECT_FALSE(cache.Lookup("k1").has_value());
  ASSERT_TRUE(cache.Store("k1", plan).ok());
  auto found = cache.Lookup("k1");
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->world_size(), 2);
  // Only the entry itself is in the directory: nothing temporary left behind.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1);
  {
    std::ofstream damage(cache.PathFor("k1"), std::ios::binary | std::ios::trunc);
    damage << "garbage";
  }
  EXPECT_FALSE(cache.Lookup("k1").has_value());
  // An entry that is intact but not a valid plan (its digests recomputed) is a miss too.
  proto::Schedule invalid = plan;
  invalid.mutable_program()->mutable_config()->set_vocab(0);
  ASSERT_TRUE(cache.Store("k1", invalid).ok());
  EXPECT_FALSE(cache.Lookup("k1").has_value());
}

}  // namespace
}  // namespace dc
