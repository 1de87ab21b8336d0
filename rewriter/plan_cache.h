// The plan cache: plans keyed by a digest of everything that decides them (program, world size,
// backend and device, budget, passes and their options, profile). Entries are whole plan files
// written atomically, so a reader never sees half of one.
#pragma once

#include <optional>
#include <string>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct PlanKeyInputs {
  std::string program_digest;
  int world_size = 1;
  std::string backend;
  std::string device;
  int64_t budget_bytes = 0;
  std::string policy;
  std::string pass_options;  // Pipeline::OptionsText()
  std::string profile_digest;
};

std::string PlanCacheKey(const PlanKeyInputs& inputs);

// $XDG_CACHE_HOME/dc, else $HOME/.cache/dc.
std::string DefaultCacheDir();

class PlanCache {
 public:
  explicit PlanCache(std::string dir) : dir_(std::move(dir)) {}
  const std::string& dir() const { return dir_; }
  std::string PathFor(const std::string& key) const;
  // The cached plan, if one is there, parses and carries the same key; a damaged entry is a
  // miss (and is overwritten by the next Store).
  std::optional<proto::Schedule> Lookup(const std::string& key) const;
  Status Store(const std::string& key, const proto::Schedule& plan) const;

 private:
  std::string dir_;
};

}  // namespace dc
