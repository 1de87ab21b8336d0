// One rank's whole run: find the other ranks, agree on a time origin, run the plan, and (when
// asked) write this rank's trace and merge every rank's into one file on rank 0.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "collector/host_tracer.h"
#include "executor/backend.h"
#include "executor/executor.h"
#include "executor/launch.h"

namespace dc {

struct SessionOptions {
  RunOptions run;
  std::string trace_path;  // empty = no tracing
  std::string rendezvous_flag;
  std::chrono::milliseconds timeout{60000};
  // The backend that runs the plan (connects, traces, executes); null: the cpu backend.
  RankBackend* backend = nullptr;
};

struct SessionResult {
  RankEnv env;
  RunResult run;
  std::optional<MergeSummary> trace;  // on rank 0 when tracing
};

StatusOr<SessionResult> RunAsRank(const proto::Schedule& schedule, const SessionOptions& options);

}  // namespace dc
