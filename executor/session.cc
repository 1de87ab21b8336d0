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

std::string RankPartPath(const RankEnv& env, const std::string& trace_path, int rank) {
  const std::string base =
      env.world_size > 1 ? env.rendezvous_dir + "/trace" : TempPathBeside(trace_path);
  return base + ".rank" + std::to_string(rank) + ".part";
}

}  // namespace

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
  if (env.world_size > 1) {
    std::error_code ec;
    std::filesystem::create_directories(env.rendezvous_dir, ec);
  }
  RendezvousOptions rendezvous;
  rendezvous.rank = env.rank;
  rendezvous.world_size = env.world_size;
  rendezvous.store_dir = env.rendezvous_dir;
  rendezvous.bind_host = env.bind_host;
  rendezvous.timeout = options.timeout;
  rendezvous.run_id = "dc-" + schedule.program_digest().substr(0, 12);
  DC_ASSIGN_OR_RETURN(auto comm, backend->Connect(rendezvous, env));
  DC_RETURN_IF_ERROR(CheckRunnable(schedule, comm->world_size(), backend->name()));

  std::unique_ptr<RankTracer> tracer;
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
    trace.part_path = RankPartPath(env, options.trace_path, env.rank);
    DC_ASSIGN_OR_RETURN(tracer, backend->MakeTracer(trace));
  }
  DC_ASSIGN_OR_RETURN(result.run, backend->Run(schedule, options.run, comm.get(), tracer.get()));
  if (!tracer) return result;

  Status written = tracer->WriteRankFile();
  double failed = written.ok() ? 0 : 1;
  DC_RETURN_IF_ERROR(comm->AllReduceSum(&failed, 1));  // every part written before the merge
  if (!written.ok()) return written;
  if (failed > 0) return Status::Error("another rank could not write its trace; see its message");
  if (env.rank == 0) {
    std::vector<std::string> parts;
    for (int r = 0; r < env.world_size; ++r)
      parts.push_back(RankPartPath(env, options.trace_path, r));
    DC_ASSIGN_OR_RETURN(result.trace, MergeRankTraces(parts, schedule, options.trace_path));
  }
  double done = 0;
  DC_RETURN_IF_ERROR(comm->AllReduceSum(&done, 1));  // ranks leave together
  return result;
}

}  // namespace dc
