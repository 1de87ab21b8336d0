#include "collector/cupti/injection_env.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string_view>

namespace dc::cupti_internal {

namespace {

// An integer environment variable; `fallback` when unset.
StatusOr<int64_t> EnvInt(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0') {
    return Status::Error(std::string(name) + "='" + value + "' is not an integer");
  }
  return static_cast<int64_t>(parsed);
}

}  // namespace

std::string ProcessTracePath(const std::string& base, const char* rank_env, bool per_process,
                             pid_t pid) {
  std::string path = base;
  if (rank_env != nullptr && *rank_env != '\0') path += std::string(".rank") + rank_env;
  if (per_process) path += ".pid" + std::to_string(pid);
  return path;
}

StatusOr<InjectionConfig> InjectionConfigFromEnvironment() {
  const char* base = std::getenv(kEnvTraceOutput);
  if (base == nullptr || *base == '\0') {
    return Status::Error(std::string(kEnvTraceOutput) +
                         " is not set (start the program with dc-collect --attach)");
  }
  InjectionConfig config;
  CuptiCollectorOptions& o = config.options;
  const char* per_process = std::getenv(kEnvPerProcess);
  const char* rank = std::getenv("RANK");
  o.output_path = ProcessTracePath(
      base, rank, per_process != nullptr && std::string_view(per_process) == "1", ::getpid());
  DC_ASSIGN_OR_RETURN(int64_t rank_value, EnvInt("RANK", -1));
  DC_ASSIGN_OR_RETURN(int64_t local_rank, EnvInt("LOCAL_RANK", rank_value >= 0 ? rank_value : 0));
  DC_ASSIGN_OR_RETURN(int64_t world_size, EnvInt("WORLD_SIZE", -1));
  DC_ASSIGN_OR_RETURN(o.session_start_utc_ns, EnvInt(kEnvSessionStart, 0));
  o.rank = static_cast<int>(rank_value);
  o.local_rank = static_cast<int>(local_rank);
  o.world_size = static_cast<int>(world_size);
  const char* api = std::getenv(kEnvTraceApi);
  o.trace_api_calls = api == nullptr || std::string_view(api) != "0";
  o.capture_label = "attach";
  const char* command = std::getenv(kEnvCommand);
  if (command != nullptr && *command != '\0') o.metadata.emplace_back("dc.command", command);

  const char* range = std::getenv(kEnvCaptureRange);
  const std::string_view range_name = range != nullptr && *range != '\0' ? range : "auto";
  if (range_name == "auto") {
    o.capture_range = CaptureRange::kAuto;
  } else if (range_name == "cudaProfilerApi") {
    o.capture_range = CaptureRange::kProfilerApi;
  } else if (range_name == "all") {
    o.capture_range = CaptureRange::kExplicit;
    config.start_now = true;
  } else {
    return Status::Error(std::string(kEnvCaptureRange) + "='" + std::string(range_name) +
                         "': expected auto, cudaProfilerApi or all");
  }
  o.metadata.emplace_back("dc.capture_range", std::string(range_name));
  return config;
}

}  // namespace dc::cupti_internal
