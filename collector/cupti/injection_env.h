// The contract between `dc-collect --attach` and libdc_inject.so: the environment variables
// that configure the injected collector, and where each traced process writes its file.
// Private to collector/cupti (attach.cc, inject.cc and their tests).
#pragma once

#include <sys/types.h>

#include <string>

#include "collector/cupti/cupti_collector.h"
#include "schemas/status.h"

namespace dc::cupti_internal {

// Base path of the trace: one file per traced process, named by ProcessTracePath.
inline constexpr char kEnvTraceOutput[] = "DC_TRACE_OUTPUT";
// "1": several processes may be traced; each file name gets ".pid<PID>".
inline constexpr char kEnvPerProcess[] = "DC_TRACE_PER_PROCESS";
// CLOCK_REALTIME nanoseconds every process measures its timestamps from.
inline constexpr char kEnvSessionStart[] = "DC_SESSION_START_NS";
// auto (default) | cudaProfilerApi | all: see CaptureRange (all = the whole run, ignoring
// cudaProfilerStart/Stop).
inline constexpr char kEnvCaptureRange[] = "DC_CAPTURE_RANGE";
// "0": no runtime/driver API records.
inline constexpr char kEnvTraceApi[] = "DC_TRACE_API";
// The program's command line, recorded as META_DATA_CAPTURE dc.command.
inline constexpr char kEnvCommand[] = "DC_TRACE_COMMAND";
// What CUDA's driver loads at initialization.
inline constexpr char kEnvInjectionPath[] = "CUDA_INJECTION64_PATH";

struct InjectionConfig {
  CuptiCollectorOptions options;
  bool start_now = false;  // "all": start a window at once, never follow the profiler API
};

// The injected collector's options from this process's environment (DC_* above and torchrun's
// RANK, LOCAL_RANK, WORLD_SIZE). Errors say which variable is wrong.
StatusOr<InjectionConfig> InjectionConfigFromEnvironment();

// `base` + ".rank<RANK>" when RANK is set + ".pid<pid>" when `per_process`.
std::string ProcessTracePath(const std::string& base, const char* rank_env, bool per_process,
                             pid_t pid);

}  // namespace dc::cupti_internal
