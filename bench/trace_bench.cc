// trace_bench: dc-trace's summary over a synthetic dc trace of a million activities, with its
// time and peak RSS. The summary streams through SQLite, so its memory should stay flat as the
// trace grows; BuildProfile (which holds every interval) is timed beside it for comparison.
//
//   trace_bench [--activities N] [--ranks R] [--steps S] [--dir DIR] [--keep]
//
// Every phase runs in a fresh child process (this program re-executed with --write or
// --measure) and the parent stays small, so each child's peak RSS (getrusage through wait4;
// VmHWM from /proc as a cross-check) is its own.
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "analyzer/profile.h"
#include "analyzer/trace.h"
#include "collector/host_tracer.h"
#include "tracetools/report.h"

extern char** environ;

namespace {

using namespace dc;
using Clock = std::chrono::steady_clock;

struct Options {
  int64_t activities = 1000000;
  int ranks = 2;
  int steps = 10;
  std::string dir = std::filesystem::temp_directory_path().string();
  bool keep = false;
};

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Tensors w0 (param), g0 (grad); ops fwd0, fwd1; instructions 0 all_gather w0 | 1 fwd0
// (deps 0) | 2 fwd1 | 3 reduce_scatter g0.
proto::Schedule BenchSchedule(int world_size) {
  proto::Schedule schedule;
  schedule.set_format_version(kScheduleFormatVersion);
  schedule.set_world_size(world_size);
  schedule.set_backend("cpu");
  proto::Program* program = schedule.mutable_program();
  program->set_format_version(kProgramFormatVersion);
  program->mutable_config()->set_compute_dtype(proto::DTYPE_F32);
  for (const auto& [name, role, param] :
       {std::tuple{"w0", proto::ROLE_PARAM, -1}, std::tuple{"g0", proto::ROLE_GRAD, 0}}) {
    proto::Tensor* t = program->add_tensors();
    t->set_id(program->tensors_size() - 1);
    t->set_name(name);
    t->add_shape(1 << 20);
    t->set_dtype(proto::DTYPE_F32);
    t->set_role(role);
    t->set_param(param);
  }
  for (const char* name : {"fwd0", "fwd1"}) {
    proto::Op* op = program->add_ops();
    op->set_id(program->ops_size() - 1);
    op->set_name(name);
    op->set_phase(proto::PHASE_FORWARD);
    op->set_flops(1e9);
  }
  auto add = [&](proto::InstrKind kind, proto::Stream stream, int op, int tensor,
                 std::vector<int> deps) {
    proto::Instruction* instr = schedule.add_instructions();
    instr->set_kind(kind);
    instr->set_stream(stream);
    instr->set_op(op);
    if (tensor >= 0) instr->add_tensors(tensor);
    for (int d : deps) instr->add_deps(d);
  };
  add(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, -1, 0, {});
  add(proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, 0, -1, {0});
  add(proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, 1, -1, {});
  add(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, -1, 1, {});
  return schedule;
}

// One rank's activities in blocks of four (a gather overlapping a compute, a second compute, a
// reduce-scatter overlapping the next block), a gathered buffer per block, steps of equal
// length.
Status WriteRank(const Options& o, int rank, int64_t activities, const std::string& path) {
  RankIdentity identity;
  identity.rank = rank;
  identity.local_rank = rank;
  identity.world_size = o.ranks;
  identity.hostname = "bench";
  HostTracer tracer(identity, 0);
  constexpr int64_t kBlockNs = 6000, kGatherBytes = 4 << 20, kReduceBytes = 4 << 20;
  const int64_t blocks = activities / 4;
  const int64_t blocks_per_step = std::max<int64_t>(1, blocks / o.steps);
  for (int64_t b = 0; b < blocks; ++b) {
    const int step = static_cast<int>(std::min<int64_t>(b / blocks_per_step, o.steps - 1));
    const int64_t t = b * kBlockNs + step * kBlockNs;  // a gap between steps
    tracer.Collective(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, t, t + 3000, kGatherBytes, 1,
                      0, {step, 0, 0});
    tracer.Memory(t, b, kGatherBytes, true, "w0", BufferKind::kGathered, 0);
    tracer.Kernel("fwd0", proto::STREAM_COMPUTE, t + 1000, t + 4000, {step, 0, 1});
    tracer.Kernel("fwd1", proto::STREAM_COMPUTE, t + 4000, t + 5500, {step, 0, 2});
    tracer.Memory(t + 5500, b, kGatherBytes, false, "w0", BufferKind::kGathered, 0);
    tracer.Collective(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, t + 5000, t + 8000,
                      kReduceBytes, 1, 0, {step, 0, 3});
  }
  for (int s = 0; s < o.steps; ++s) {
    const int64_t start = s * blocks_per_step * kBlockNs + s * kBlockNs;
    const int64_t end = s + 1 == o.steps ? blocks * kBlockNs + s * kBlockNs + 3000
                                         : start + blocks_per_step * kBlockNs;
    tracer.Step(s, start, end, 1.0, s == 0);
  }
  return tracer.WriteRankFile(path);
}

StatusOr<std::string> WriteTrace(const Options& o) {
  std::vector<std::string> rank_paths;
  const std::string base = o.dir + "/trace_bench_" + std::to_string(::getpid());
  for (int r = 0; r < o.ranks; ++r) {
    rank_paths.push_back(base + "_rank" + std::to_string(r) + ".db");
    DC_RETURN_IF_ERROR(WriteRank(o, r, o.activities / o.ranks, rank_paths.back()));
  }
  const std::string out = base + ".db";
  DC_ASSIGN_OR_RETURN(MergeSummary merged,
                      MergeRankTraces(rank_paths, BenchSchedule(o.ranks), out));
  std::fprintf(stderr, "wrote %s: %d ranks, %lld activities, %lld memory events, %.1f MiB\n",
               out.c_str(), merged.ranks, static_cast<long long>(merged.activities),
               static_cast<long long>(merged.memory_events),
               static_cast<double>(std::filesystem::file_size(out)) / (1 << 20));
  return out;
}

// The peak resident set of this process image, from /proc/self/status (KiB).
long VmHwmKib() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  long kib = 0;
  while (std::fgets(line, sizeof(line), f)) {
    if (std::sscanf(line, "VmHWM: %ld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib;
}

// --measure summary|profile TRACE: runs one, prints "seconds count vmhwm_kib" on stdout.
int Measure(const std::string& what, const std::string& path) {
  const auto start = Clock::now();
  int64_t measured = 0;
  if (what == "summary") {
    auto timeline = OpenTraceTimeline(path);
    if (!timeline.ok()) return std::fprintf(stderr, "%s\n", timeline.status().message().c_str()), 1;
    auto summary = Summarize(**timeline, {});
    if (!summary.ok()) return std::fprintf(stderr, "%s\n", summary.status().message().c_str()), 1;
    for (const RankSummary& r : summary->ranks) measured += r.activities;
  } else {
    auto trace = Trace::Open(path);
    if (!trace.ok()) return std::fprintf(stderr, "%s\n", trace.status().message().c_str()), 1;
    auto profile = BuildProfile(**trace);
    if (!profile.ok()) return std::fprintf(stderr, "%s\n", profile.status().message().c_str()), 1;
    measured = static_cast<int64_t>(profile->overlap.size());
  }
  std::printf("%.6f %lld %ld\n", SecondsSince(start), static_cast<long long>(measured), VmHwmKib());
  return 0;
}

// --write DIR ACTIVITIES RANKS STEPS: writes the trace, prints "seconds path".
int Write(const Options& o) {
  const auto start = Clock::now();
  auto path = WriteTrace(o);
  if (!path.ok()) {
    std::fprintf(stderr, "trace_bench: %s\n", path.status().message().c_str());
    return 1;
  }
  std::printf("%.6f 0 0 %s\n", SecondsSince(start), path->c_str());
  return 0;
}

struct ChildResult {
  double seconds = 0;
  long long measured = 0;
  long vm_hwm_kib = 0;
  long peak_rss_kib = 0;  // getrusage of the child (wait4)
  std::string path;       // --write: the trace
};

// Re-executes this program with `args` in a fresh process.
StatusOr<ChildResult> RunChild(std::vector<std::string> args) {
  const std::string what = args.front();
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return Status::Error("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  args.insert(args.begin(), self);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipe_fds[1]);
  if (rc != 0) return Status::Error(std::string("cannot run ") + self + ": " + std::strerror(rc));
  std::string out;
  char buffer[256];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) out.append(buffer, n);
  ::close(pipe_fds[0]);
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Status::Error("the " + what + " child failed");
  }
  ChildResult result;
  char path[4096] = {};
  if (std::sscanf(out.c_str(), "%lf %lld %ld %4095s", &result.seconds, &result.measured,
                  &result.vm_hwm_kib, path) < 3) {
    return Status::Error("the " + what + " child printed '" + out + "'");
  }
  result.path = path;
  result.peak_rss_kib = usage.ru_maxrss;
  return result;
}

double Mib(long kib) { return static_cast<double>(kib) / 1024.0; }

int Run(const Options& o) {
  auto written = RunChild({"--write", o.dir, std::to_string(o.activities), std::to_string(o.ranks),
                           std::to_string(o.steps)});
  if (!written.ok()) {
    std::fprintf(stderr, "trace_bench: %s\n", written.status().message().c_str());
    return 1;
  }
  std::printf("writing  %8.3f s  peak RSS %7.1f MiB\n", written->seconds,
              Mib(written->peak_rss_kib));
  int rc = 0;
  for (const char* what : {"summary", "profile"}) {
    auto result = RunChild({"--measure", what, written->path});
    if (!result.ok()) {
      std::fprintf(stderr, "trace_bench: %s\n", result.status().message().c_str());
      rc = 1;
      continue;
    }
    std::printf("%-8s %8.3f s  peak RSS %7.1f MiB (VmHWM %.1f MiB)  %s %lld\n", what,
                result->seconds, Mib(result->peak_rss_kib), Mib(result->vm_hwm_kib),
                std::string(what) == "summary" ? "activities in measured steps" : "windows",
                result->measured);
  }
  if (!o.keep) std::filesystem::remove(written->path);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines in order with the children's stderr
  if (argc == 4 && std::strcmp(argv[1], "--measure") == 0) return Measure(argv[2], argv[3]);
  Options o;
  if (argc == 6 && std::strcmp(argv[1], "--write") == 0) {
    o.dir = argv[2];
    o.activities = std::atoll(argv[3]);
    o.ranks = std::atoi(argv[4]);
    o.steps = std::atoi(argv[5]);
    return Write(o);
  }
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (arg == "--activities") {
      o.activities = std::atoll(next().c_str());
    } else if (arg == "--ranks") {
      o.ranks = std::max(1, std::atoi(next().c_str()));
    } else if (arg == "--steps") {
      o.steps = std::max(1, std::atoi(next().c_str()));
    } else if (arg == "--dir") {
      o.dir = next();
    } else if (arg == "--keep") {
      o.keep = true;
    } else {
      std::fprintf(stderr,
                   "usage: trace_bench [--activities N] [--ranks R] [--steps S] [--dir DIR] "
                   "[--keep]\n");
      return 2;
    }
  }
  return Run(o);
}
