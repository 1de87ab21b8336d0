#include "executor/session.h"

#include <signal.h>
#include <unistd.h>

#include <ctime>
#include <filesystem>

#include "schemas/files.h"

namespace dc {
namespace {

int64_t RealtimeNs() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

std::string Hostname() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

// This run's own directory inside the rendezvous directory: a directory used by an earlier run
// (the same --rendezvous for every torchrun job) holds nothing this run reads.
std::string RunDirOf(const std::string& rendezvous_dir, const std::string& run_id) {
  return run_id.empty() ? rendezvous_dir : rendezvous_dir + "/run-" + run_id;
}

std::string RunDir(const RankEnv& env) {
  return RunDirOf(env.rendezvous_dir, RunIdFromEnvironment());
}

// The name of a rank's part in a run's directory (RankPartPath's shared-directory case).
std::string PartInRunDir(const std::string& run_dir, int rank) {
  return run_dir + "/trace.rank" + std::to_string(rank) + ".part";
}

// Where each rank writes its part of the trace for rank 0 to merge: the shared rendezvous
// directory; over the TCP rendezvous, beside the trace (one host, or a shared file system for it).
std::string RankPartPath(const RankEnv& env, const std::string& trace_path, int rank) {
  const std::string suffix = ".rank" + std::to_string(rank) + ".part";
  // Beside the trace, where a one-rank run killed outright leaves it for `dc-trace merge`.
  if (env.world_size == 1) return trace_path + suffix;
  if (env.rendezvous_dir.empty()) return trace_path + suffix + ".tmp";
  return PartInRunDir(RunDir(env), rank);
}

// After a failed merge, the rank files go beside the trace the user asked for ("t.db.rank0.part"),
// out of the launcher's temporary directory, which is removed; says where they are.
std::string KeepRankParts(const std::vector<std::string>& parts, const std::string& trace_path) {
  std::string kept;
  for (size_t r = 0; r < parts.size(); ++r) {
    const std::string to = trace_path + ".rank" + std::to_string(r) + ".part";
    std::error_code ec;
    std::filesystem::rename(parts[r], to, ec);
    if (ec) {
      ec.clear();
      std::filesystem::copy_file(parts[r], to, std::filesystem::copy_options::overwrite_existing,
                                 ec);
    }
    if (ec) return "the rank files could not be kept (" + ec.message() + ")";
    kept += (r == 0 ? "" : ", ") + to;
  }
  return "the rank files were kept: " + kept;
}

}  // namespace

std::string SalvageRankTraces(const std::string& rendezvous_dir, const std::string& run_id,
                              int world_size, const std::string& trace_path,
                              const std::vector<int>& rank_pids) {
  for (int pid : rank_pids) std::remove(TempPathBeside(trace_path, pid).c_str());
  std::vector<std::string> parts;
  for (int r = 0; r < world_size; ++r) {
    parts.push_back(PartInRunDir(RunDirOf(rendezvous_dir, run_id), r));
    std::error_code ec;
    if (!std::filesystem::exists(parts.back(), ec)) return "";  // a rank never started tracing
  }
  MergeOptions merge;
  merge.incomplete = "a rank failed or was killed before the last step";
  auto merged = MergeRankTraces(parts, trace_path, merge);
  if (!merged.ok()) return "";
  return trace_path + " keeps the " + std::to_string(merged->last_step + 1) +
         " step(s) every rank completed (marked incomplete)";
}

StatusOr<SessionResult> RunAsRank(const proto::Schedule& schedule, const SessionOptions& options) {
  // A write to a peer that died must fail the collective with a message, not kill this rank
  // silently with SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  std::unique_ptr<RankBackend> cpu;
  RankBackend* backend = options.backend;
  if (backend == nullptr) {
    cpu = MakeCpuBackend();
    backend = cpu.get();
  }
  SessionResult result;
  DC_ASSIGN_OR_RETURN(result.env, RankEnvFromEnvironment(options.rendezvous_flag));
  const RankEnv& env = result.env;
  RendezvousOptions rendezvous;
  if (env.world_size > 1 && !env.rendezvous_dir.empty()) {
    std::error_code ec;  // an unwritable directory is reported by Connect
    std::filesystem::create_directories(RunDir(env), ec);
    rendezvous.store_dir = RunDir(env);
  }
  rendezvous.rank = env.rank;
  rendezvous.world_size = env.world_size;
  rendezvous.master_addr = env.master_addr;
  rendezvous.master_port = env.master_port;
  rendezvous.bind_host = env.bind_host;
  rendezvous.timeout = options.timeout;
  rendezvous.run_id = "dc-" + schedule.program_digest().substr(0, 12);
  DC_ASSIGN_OR_RETURN(auto comm, backend->Connect(rendezvous, env));
  DC_RETURN_IF_ERROR(CheckRunnable(schedule, comm->world_size(), backend->name()));
  result.transport = comm->transport();
  result.transport_note = comm->transport_note();

  std::unique_ptr<RankTracer> tracer;
  // A traced run asked to stop (SIGINT, SIGTERM, SIGHUP) ends after the step it is in, every
  // rank after the same one, and its trace keeps the steps done, marked incomplete. Ranks under
  // dc's launcher ignore repeats (the launcher kills those that do not stop in time).
  std::optional<GracefulStop> graceful;
  RunOptions run = options.run;
  if (!options.trace_path.empty()) {
    RankTraceOptions trace;
    trace.session_start_ns = RealtimeNs();
    DC_RETURN_IF_ERROR(comm->Broadcast(&trace.session_start_ns, 0));
    trace.identity.rank = env.rank;
    trace.identity.local_rank = env.local_rank;
    trace.identity.world_size = env.world_size;
    trace.identity.hostname = Hostname();
    trace.identity.backend = schedule.backend();
    trace.identity.device_memory_bytes = options.run.device_memory_bytes;
    trace.identity.host_cores = AvailableCores();
    trace.identity.threads_per_rank = options.run.num_threads;
    trace.part_path = RankPartPath(env, options.trace_path, env.rank);
    trace.schedule = &schedule;
    DC_ASSIGN_OR_RETURN(tracer, backend->MakeTracer(trace));
    graceful.emplace(!env.under_local_launcher);
    run.stop_requested = [] { return GracefulStop::Requested(); };
  }
  StatusOr<RunResult> ran = backend->Run(schedule, run, comm.get(), tracer.get());
  const std::string own_part =
      tracer ? RankPartPath(env, options.trace_path, env.rank) : std::string();
  if (!ran.ok()) {
    if (!tracer) return ran.status();
    // The steps done so far are in this rank's file.
    (void)tracer->WriteRankFile();
    std::string kept;
    if (env.world_size == 1) {
      MergeOptions merge;
      merge.incomplete = "the run failed: " + ran.status().message();
      if (MergeRankTraces({own_part}, schedule, options.trace_path, merge).ok()) {
        kept = "; " + options.trace_path + " keeps the steps done before (marked incomplete)";
      } else {
        // No complete step to keep (a failure at start-up): nothing half-written is left beside
        // the trace either.
        for (const char* suffix : {"", "-wal", "-shm", "-journal"}) {
          std::error_code ec;
          std::filesystem::remove(own_part + suffix, ec);
        }
      }
    }
    return Status::Error(ran.status().message() + kept);
  }
  result.run = *ran;
  if (!tracer) return result;

  // A stopped one-rank run leaves no part beside the trace.
  const RemoveOnSignal remove_part(env.world_size > 1 ? std::string() : own_part);
  Status written = tracer->WriteRankFile();
  if (!written.ok() && env.world_size == 1) {
    std::error_code ec;
    std::filesystem::remove(own_part, ec);
    // The message names the user's path, not the internal part file.
    std::string why = written.message();
    for (const std::string& internal : {TempPathBeside(own_part), own_part}) {
      for (size_t at; (at = why.find(internal)) != std::string::npos;)
        why.replace(at, internal.size(), options.trace_path);
    }
    written = Status::Error(options.trace_path + ": cannot write the trace: " + why);
  }
  double failed = written.ok() ? 0 : 1;
  DC_RETURN_IF_ERROR(comm->AllReduceSum(&failed, 1));  // every part written before the merge
  if (!written.ok()) return written;
  if (failed > 0) return Status::Error("another rank could not write its trace; see its message");
  if (env.rank == 0) {
    std::vector<std::string> parts;
    for (int r = 0; r < env.world_size; ++r)
      parts.push_back(RankPartPath(env, options.trace_path, r));
    MergeOptions merge;
    if (result.run.stop_signal != 0) {
      merge.incomplete = "stopped by " + StopSignalName(result.run.stop_signal) + " after " +
                         std::to_string(result.run.steps_done) + " of " +
                         std::to_string(options.run.warmup_steps + options.run.steps) + " step(s)";
    }
    auto merged = MergeRankTraces(parts, schedule, options.trace_path, merge);
    if (!merged.ok()) {
      return Status::Error(merged.status().message() + "; " +
                           KeepRankParts(parts, options.trace_path));
    }
    result.trace = *merged;
  }
  double done = 0;
  DC_RETURN_IF_ERROR(comm->AllReduceSum(&done, 1));  // ranks leave together
  return result;
}

}  // namespace dc
