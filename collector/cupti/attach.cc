#include "collector/cupti/attach.h"

#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "collector/cupti/injection_env.h"
#include "collector/host_tracer.h"
#include "collector/sqlite_writer.h"

extern char** environ;

namespace dc {

using collector_internal::Database;
using collector_internal::Statement;
namespace fs = std::filesystem;

namespace {

constexpr char kProgram[] = "dc-collect";
constexpr char kInjectLibrary[] = "libdc_inject.so";
// Per-process files are <temp dir>/<kProcessPrefix>[.rank<R>].pid<P>.
constexpr char kProcessPrefix[] = "proc";

int Fail(const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", kProgram, message.c_str());
  return 1;
}

bool IsRegularFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string CommandText(const std::vector<std::string>& command) {
  std::string text;
  for (const std::string& arg : command) text += (text.empty() ? "" : " ") + arg;
  return text;
}

int64_t RealtimeNs() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// SIGINT, SIGTERM and SIGQUIT ignored for as long as it lives (the child gets them: it shares
// the terminal's process group, or the sender targets it).
class IgnoreSignals {
 public:
  IgnoreSignals() {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    for (size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &ignore, &saved_[i]);
  }
  ~IgnoreSignals() {
    for (size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &saved_[i], nullptr);
  }

 private:
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGQUIT};
  std::array<struct sigaction, 3> saved_{};
};

// The child's environment: ours with the injection variables set.
std::vector<std::string> ChildEnvironment(const std::map<std::string, std::string>& overrides) {
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const std::string name(text.substr(0, text.find('=')));
    if (!overrides.contains(name)) env.emplace_back(text);
  }
  for (const auto& [name, value] : overrides) env.push_back(name + "=" + value);
  return env;
}

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

struct ChildExit {
  int status = 0;         // for dc-collect: the exit code, or 128 + signal
  std::string described;  // "exited with status 3", "was killed by signal 9 (Killed)"
};

ChildExit Describe(int wait_status) {
  if (WIFEXITED(wait_status)) {
    const int code = WEXITSTATUS(wait_status);
    return {code, "exited with status " + std::to_string(code)};
  }
  const int signal = WIFSIGNALED(wait_status) ? WTERMSIG(wait_status) : 0;
  return {128 + signal,
          "was killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")"};
}

// The finished per-process files in `dir` (not the temp files of a writer that died).
std::vector<std::string> ProcessFiles(const std::string& dir, int* unfinished) {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(std::string(kProcessPrefix) + ".")) continue;
    if (name.find(".tmp.") != std::string::npos) {
      ++*unfinished;
      continue;
    }
    files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

struct RankOfFile {
  std::string path;
  int rank = -1;
  int world_size = -1;
};

// Gives every file a distinct rank: known ranks (RANK was set) are kept where unique, the
// others (no RANK, or a helper process that inherited its parent's) numbered from the lowest
// free one; unknown world sizes become the number of files. Returns the files in rank order.
StatusOr<std::vector<std::string>> AssignRanks(const std::vector<std::string>& files) {
  std::vector<RankOfFile> ranks;
  for (const std::string& path : files) {
    DC_ASSIGN_OR_RETURN(Database db, Database::Create(path));
    DC_ASSIGN_OR_RETURN(Statement query, db.Prepare("SELECT rank, worldSize FROM TC_RANK"));
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) return Status::Error(path + ": no TC_RANK row; the traced process wrote a bad file");
    ranks.push_back(
        {path, static_cast<int>(query.ColumnInt(0)), static_cast<int>(query.ColumnInt(1))});
  }
  std::set<int> used;
  std::vector<bool> keep(ranks.size(), false);
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].rank >= 0 && used.insert(ranks[i].rank).second) keep[i] = true;
  }
  int next = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (keep[i]) continue;
    while (used.contains(next)) ++next;
    ranks[i].rank = next;
    used.insert(next);
  }
  const int count = static_cast<int>(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int world_size = ranks[i].world_size >= count ? ranks[i].world_size : count;
    if (keep[i] && world_size == ranks[i].world_size) continue;
    DC_ASSIGN_OR_RETURN(Database db, Database::Create(ranks[i].path));
    DC_RETURN_IF_ERROR(db.Exec("UPDATE TC_RANK SET rank = " + std::to_string(ranks[i].rank) +
                               ", worldSize = " + std::to_string(world_size)));
    DC_RETURN_IF_ERROR(db.Close());
  }
  std::sort(ranks.begin(), ranks.end(),
            [](const RankOfFile& a, const RankOfFile& b) { return a.rank < b.rank; });
  std::vector<std::string> ordered;
  for (const RankOfFile& r : ranks) ordered.push_back(r.path);
  return ordered;
}

// A merged trace of a foreign program: no program or schedule (MergeRankTraces wrote empty
// ones), its own metadata.
Status MarkForeign(const std::string& path, int processes, const std::string& command) {
  DC_ASSIGN_OR_RETURN(Database db, Database::Create(path));
  DC_RETURN_IF_ERROR(db.Exec(
      "BEGIN; DELETE FROM TC_BLOB; DELETE FROM META_DATA_EXPORT WHERE name IN "
      "('dc.world_size', 'dc.backend', 'dc.policy', 'dc.program_digest', 'dc.schedule_digest')"));
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db.Prepare("INSERT INTO META_DATA_EXPORT(name, value) VALUES (?, ?)"));
  const std::pair<std::string, std::string> rows[] = {
      {"dc.capture", "attach"},
      {"dc.world_size", std::to_string(processes)},
      {"dc.backend", "cuda"},
      {"dc.command", command},
  };
  for (const auto& [name, value] : rows) {
    insert.Bind(1, name);
    insert.Bind(2, value);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  insert = Statement();
  DC_RETURN_IF_ERROR(db.Exec("COMMIT"));
  return db.Close();
}

struct Report {
  int64_t kernels = 0, collectives = 0, memcpys = 0, memsets = 0, memory_events = 0;
  int64_t dropped = 0, zero_timestamp = 0;
  std::vector<std::string> warnings;
};

StatusOr<Report> ReadReport(const std::string& path) {
  DC_ASSIGN_OR_RETURN(Database db, Database::Create(path));
  Report r;
  DC_ASSIGN_OR_RETURN(int64_t kernel_rows,
                      db.QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"));
  DC_ASSIGN_OR_RETURN(r.collectives, db.QueryInt("SELECT count(*) FROM TC_COLLECTIVE"));
  r.kernels = kernel_rows - r.collectives;
  DC_ASSIGN_OR_RETURN(r.memcpys, db.QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY"));
  DC_ASSIGN_OR_RETURN(r.memsets, db.QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMSET"));
  DC_ASSIGN_OR_RETURN(r.memory_events,
                      db.QueryInt("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS"));
  DC_ASSIGN_OR_RETURN(r.dropped,
                      db.QueryInt("SELECT COALESCE(SUM(dropped), 0) FROM TC_RECORD_STATS"));
  DC_ASSIGN_OR_RETURN(r.zero_timestamp,
                      db.QueryInt("SELECT COALESCE(SUM(zeroTimestamp), 0) FROM TC_RECORD_STATS"));
  DC_ASSIGN_OR_RETURN(Statement warnings,
                      db.Prepare("SELECT DISTINCT value FROM META_DATA_CAPTURE WHERE name LIKE "
                                 "'dc.warning.%' ORDER BY rowid"));
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, warnings.Next());
    if (!row) break;
    r.warnings.push_back(warnings.ColumnText(0));
  }
  return r;
}

}  // namespace

StatusOr<std::string> FindInjectLibrary() {
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (error) {
    return Status::Error(std::string("cannot find ") + kInjectLibrary +
                         ": /proc/self/exe is unreadable (" + error.message() + ")");
  }
  const fs::path dir = exe.parent_path();
  const fs::path candidates[] = {dir / kInjectLibrary, dir.parent_path() / "lib" / kInjectLibrary};
  for (const fs::path& candidate : candidates) {
    if (IsRegularFile(candidate.string())) return candidate.lexically_normal().string();
  }
  return Status::Error(std::string(kInjectLibrary) + " not found in " + dir.string() + " nor " +
                       (dir.parent_path() / "lib").string() +
                       "; build dc where the CUDA toolkit is installed, or use the bundle "
                       "(tools/bundle.sh), which ships it in lib/");
}

int RunAttached(const AttachOptions& options, const std::vector<std::string>& command) {
  if (command.empty()) {
    return Fail(
        "--attach needs the program to run after --, e.g. dc-collect --attach -o "
        "trace.db -- python train.py");
  }
  if (options.output_path.empty()) return Fail("--attach needs an output trace (-o trace.db)");
  std::string library = options.inject_library;
  if (library.empty()) {
    StatusOr<std::string> found = FindInjectLibrary();
    if (!found.ok()) return Fail(found.status().message());
    library = *found;
  } else if (!IsRegularFile(library)) {
    return Fail(library + ": no such file; " + kInjectLibrary +
                " is needed to trace an unmodified program");
  }
  std::error_code error;
  library = fs::absolute(library, error).lexically_normal().string();

  // Per-process files go to a fresh directory beside the output (same file system).
  const fs::path out = fs::absolute(options.output_path, error);
  std::string pattern = (out.parent_path() / ".dc-attach-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) {
    return Fail(options.output_path + ": cannot create a temp directory beside it (" +
                std::strerror(errno) + "); is the directory writable?");
  }
  const std::string temp_dir = pattern;
  const std::string command_text = CommandText(command);

  const char* previous = std::getenv(cupti_internal::kEnvInjectionPath);
  if (previous != nullptr && *previous != '\0' && library != previous && !options.quiet) {
    std::fprintf(stderr, "%s: replacing %s=%s for the traced program\n", kProgram,
                 cupti_internal::kEnvInjectionPath, previous);
  }
  std::vector<std::string> env = ChildEnvironment({
      {cupti_internal::kEnvInjectionPath, library},
      {cupti_internal::kEnvTraceOutput, temp_dir + "/" + kProcessPrefix},
      {cupti_internal::kEnvPerProcess, "1"},
      {cupti_internal::kEnvSessionStart, std::to_string(RealtimeNs())},
      {cupti_internal::kEnvCaptureRange, options.capture_range},
      {cupti_internal::kEnvTraceApi, options.trace_api_calls ? "1" : "0"},
      {cupti_internal::kEnvCommand, command_text},
  });
  std::vector<std::string> args = command;
  std::vector<char*> argv = CStrings(args);
  std::vector<char*> envp = CStrings(env);

  ChildExit exit;
  {
    IgnoreSignals ignore;
    pid_t pid = 0;
    const int spawned = posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data());
    if (spawned != 0) {
      fs::remove_all(temp_dir, error);
      return Fail("cannot start '" + command[0] + "': " + std::strerror(spawned));
    }
    int wait_status = 0;
    while (waitpid(pid, &wait_status, 0) < 0) {
      if (errno != EINTR) {
        const std::string why = std::strerror(errno);
        fs::remove_all(temp_dir, error);
        return Fail("lost track of '" + command_text + "' (waitpid: " + why + ")");
      }
    }
    exit = Describe(wait_status);
  }

  int unfinished = 0;
  std::vector<std::string> files = ProcessFiles(temp_dir, &unfinished);
  if (files.empty()) {
    fs::remove_all(temp_dir, error);
    std::string why = unfinished > 0
                          ? "its processes died while writing their traces"
                          : "it never initialized CUDA, or it exited without running exit "
                            "handlers (os._exit, a signal)";
    return Fail("'" + command_text + "' produced no trace (" + why + "; the program " +
                exit.described + ")");
  }
  StatusOr<std::vector<std::string>> ordered = AssignRanks(files);
  if (!ordered.ok()) {
    return Fail(ordered.status().message() + "; the per-process traces are kept in " + temp_dir);
  }
  const proto::Schedule empty;
  StatusOr<MergeSummary> merged = MergeRankTraces(
      *ordered, options.schedule != nullptr ? *options.schedule : empty, options.output_path);
  if (!merged.ok()) {
    return Fail(merged.status().message() + " (in " + temp_dir + ")");
  }
  if (options.schedule == nullptr) {
    Status marked = MarkForeign(options.output_path, merged->ranks, command_text);
    if (!marked.ok()) return Fail(marked.message());
  }
  fs::remove_all(temp_dir, error);

  StatusOr<Report> report = ReadReport(options.output_path);
  if (!report.ok()) return Fail(report.status().message());
  const Report& r = *report;
  if (options.json) {
    nlohmann::json j;
    j["trace"] = options.output_path;
    j["command"] = command;
    j["exit_status"] = exit.status;
    j["processes"] = merged->ranks;
    j["kernels"] = r.kernels;
    j["collectives"] = r.collectives;
    j["memcpys"] = r.memcpys;
    j["memsets"] = r.memsets;
    j["memory_events"] = r.memory_events;
    j["dropped_records"] = r.dropped;
    j["zero_timestamp_records"] = r.zero_timestamp;
    j["unfinished_processes"] = unfinished;
    j["warnings"] = r.warnings;
    std::cout << j.dump() << "\n";
  } else if (!options.quiet) {
    std::printf(
        "wrote %s: %d process(es) of '%s' (which %s): %lld kernels, %lld NCCL collectives, "
        "%lld memcpys, %lld memsets, %lld memory events, %lld dropped records, %lld without "
        "timestamps\n",
        options.output_path.c_str(), merged->ranks, command_text.c_str(), exit.described.c_str(),
        static_cast<long long>(r.kernels), static_cast<long long>(r.collectives),
        static_cast<long long>(r.memcpys), static_cast<long long>(r.memsets),
        static_cast<long long>(r.memory_events), static_cast<long long>(r.dropped),
        static_cast<long long>(r.zero_timestamp));
    if (unfinished > 0) {
      std::fprintf(stderr, "%s: %d process(es) died while writing their traces; left out\n",
                   kProgram, unfinished);
    }
    if (options.capture_range == "cudaProfilerApi" && r.kernels + r.collectives == 0) {
      std::fprintf(stderr,
                   "%s: no kernels inside cudaProfilerStart/Stop; does the program call them? "
                   "(--capture-range auto records the whole run otherwise)\n",
                   kProgram);
    }
    for (const std::string& warning : r.warnings) {
      std::fprintf(stderr, "%s: warning: %s\n", kProgram, warning.c_str());
    }
  }
  return exit.status;
}

}  // namespace dc
