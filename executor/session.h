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
  std::string transport;              // the collectives' (Communicator::transport)
  std::string transport_note;         // Communicator::transport_note
};

StatusOr<SessionResult> RunAsRank(const proto::Schedule& schedule, const SessionOptions& options);

// For LaunchOptions::salvage: after the ranks of a traced local run failed or were killed, joins
// the files they streamed (in the run's directory under `rendezvous_dir`) into `trace_path`,
// cut to the steps every rank completed and marked incomplete. Returns what to tell the user
// ("t.db keeps the 7 step(s) ..."), or "" when there is nothing to keep.
// The merge's temporary files of the killed ranks `rank_pids` are removed first.
std::string SalvageRankTraces(const std::string& rendezvous_dir, const std::string& run_id,
                              int world_size, const std::string& trace_path,
                              const std::vector<int>& rank_pids);

}  // namespace dc
