#include "rewriter/plan_cache.h"

#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "rewriter/planner_sources.h"
#include "schemas/digest.h"
#include "schemas/plan_file.h"

namespace dc {

// The planner that makes the plans: its sources' digest (rewriter/CMakeLists.txt), so that a plan
// cached by another build of dc is a miss, never a plan this build would not make.
static constexpr const char* kPlannerVersion = "dc-planner-2 " DC_PLANNER_SOURCES_DIGEST;

std::string PlanCacheKey(const PlanKeyInputs& in) {
  const std::string text = std::string(kPlannerVersion) + "\nprogram=" + in.program_digest +
                           "\nworld=" + std::to_string(in.world_size) + "\nbackend=" + in.backend +
                           "\ndevice=" + in.device + "\nbudget=" + std::to_string(in.budget_bytes) +
                           "\npolicy=" + in.policy + "\npasses=" + in.pass_options +
                           "\nprofile=" + in.profile_digest + "\n";
  return Sha256Hex(text);
}

std::string DefaultCacheDir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/dc";
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::string(home) + "/.cache/dc";
  return ".dc-cache";
}

std::string PlanCache::PathFor(const std::string& key) const {
  return dir_ + "/" + key + ".dcplan";
}

std::optional<proto::Schedule> PlanCache::Lookup(const std::string& key) const {
  const std::string path = PathFor(key);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  StatusOr<proto::Schedule> plan = LoadPlan(path);
  if (!plan.ok() || plan->cache_key() != key) return std::nullopt;
  return std::move(plan).value();
}

Status PlanCache::Store(const std::string& key, const proto::Schedule& plan) const {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec)
    return Status::Error(dir_ + ": cannot create the plan cache (" + ec.message() +
                         "); pass --cache-dir or --no-cache");
  return SavePlan(PathFor(key), plan);
}

}  // namespace dc
