#include "executor/launch.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <thread>

#include "schemas/files.h"

namespace dc {
namespace {

constexpr const char* kLocalLaunchVar = "DC_LOCAL_LAUNCH";
// Where LaunchLocal hands rank 0 its own stderr for progress lines.
constexpr const char* kProgressFdVar = "DC_PROGRESS_FD";
constexpr int kProgressFd = 3;
constexpr const char* kRunIdVar = "DC_RUN_ID";
// After the first rank fails, how long the others may take to fail on their own before they
// are stopped.
constexpr std::chrono::milliseconds kSettle{300};

bool EnvSet(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0';
}

// The variable as an int; nothing when unset or empty; an error naming it when it is set to
// anything but a whole number in int's range ("WORLD_SIZE=abc" is a mistake, not "unset").
StatusOr<std::optional<int>> EnvInt(const char* name) {
  if (!EnvSet(name)) return std::optional<int>();
  const char* value = std::getenv(name);
  errno = 0;
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  if (*end != '\0' || errno == ERANGE || parsed < std::numeric_limits<int>::min() ||
      parsed > std::numeric_limits<int>::max()) {
    return Status::Error(std::string(name) + "='" + value +
                         "' is not a whole number; set it as torchrun does (e.g. " + name +
                         "=0) or unset it");
  }
  return std::optional<int>(static_cast<int>(parsed));
}

std::string LastLine(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last;
}

std::string DescribeExit(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return std::string("was killed by signal ") + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

}  // namespace

bool IsRankProcess() { return EnvSet("WORLD_SIZE") || EnvSet("SLURM_NTASKS"); }

std::string RunIdFromEnvironment() {
  auto get = [](const char* name) -> std::string {
    const char* value = std::getenv(name);
    return value ? value : "";
  };
  std::string id = get(kRunIdVar);
  // torchrun's default rendezvous id is "none", the same for every run.
  if (id.empty() && !get("TORCHELASTIC_RUN_ID").empty() && get("TORCHELASTIC_RUN_ID") != "none") {
    id = "torchrun-" + get("TORCHELASTIC_RUN_ID") + "-" + get("TORCHELASTIC_RESTART_COUNT");
  }
  if (id.empty() && !get("SLURM_JOB_ID").empty()) {
    id = "slurm-" + get("SLURM_JOB_ID") + "-" + get("SLURM_STEP_ID");
  }
  for (char& c : id) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  }
  return id;
}

int ProgressFd() {
  if (std::getenv(kLocalLaunchVar) == nullptr) return STDERR_FILENO;
  // A malformed value is the launcher's bug, not the user's: no progress rather than a failure.
  const StatusOr<std::optional<int>> fd = EnvInt(kProgressFdVar);
  return fd.ok() ? fd->value_or(-1) : -1;
}

StatusOr<RankEnv> RankEnvFromEnvironment(const std::string& rendezvous_flag) {
  RankEnv env;
  const bool torchrun = EnvSet("WORLD_SIZE");
  DC_ASSIGN_OR_RETURN(std::optional<int> world, EnvInt(torchrun ? "WORLD_SIZE" : "SLURM_NTASKS"));
  DC_ASSIGN_OR_RETURN(std::optional<int> rank, EnvInt(torchrun ? "RANK" : "SLURM_PROCID"));
  DC_ASSIGN_OR_RETURN(std::optional<int> local, EnvInt(torchrun ? "LOCAL_RANK" : "SLURM_LOCALID"));
  if (!world) return env;
  if (!rank) return Status::Error("WORLD_SIZE is set but RANK is not; set both (as torchrun does)");
  if (*world < 1 || *rank < 0 || *rank >= *world) {
    return Status::Error("RANK " + std::to_string(*rank) + " is outside WORLD_SIZE " +
                         std::to_string(*world));
  }
  env.world_size = *world;
  env.rank = *rank;
  env.local_rank = local.value_or(*rank);
  env.rendezvous_dir = rendezvous_flag;
  if (env.rendezvous_dir.empty()) {
    if (const char* dir = std::getenv("DC_RENDEZVOUS_DIR")) env.rendezvous_dir = dir;
  }
  if (env.world_size > 1 && env.rendezvous_dir.empty()) {
    // No shared directory: the ranks meet over TCP where the launcher says (torchrun and Slurm
    // scripts set MASTER_ADDR and MASTER_PORT). torchrun's agent may serve its own store on
    // MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), so dc's takes the next port there.
    const char* addr = std::getenv("MASTER_ADDR");
    const bool dc_port = EnvSet("DC_MASTER_PORT");
    DC_ASSIGN_OR_RETURN(std::optional<int> port,
                        EnvInt(dc_port ? "DC_MASTER_PORT" : "MASTER_PORT"));
    if (addr == nullptr || *addr == '\0' || !port) {
      return Status::Error("rank " + std::to_string(env.rank) +
                           ": no rendezvous; set MASTER_ADDR and MASTER_PORT (as torchrun does), "
                           "or pass --rendezvous DIR (or DC_RENDEZVOUS_DIR) naming a directory "
                           "every rank can reach");
    }
    const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    const int shift = !dc_port && agent_store && std::string(agent_store) == "True" ? 1 : 0;
    constexpr int kMaxPort = 65535;
    if (*port < 1 || *port + shift > kMaxPort) {
      return Status::Error(std::string(dc_port ? "DC_MASTER_PORT" : "MASTER_PORT") + "=" +
                           std::to_string(*port) + " is not a TCP port (1 to 65535)");
    }
    env.master_addr = addr;
    env.master_port = *port + shift;
  }
  if (const char* bind = std::getenv("DC_BIND_ADDR"); bind && *bind) {
    env.bind_host = bind;
  } else if (const char* master = std::getenv("MASTER_ADDR");
             master && *master && std::string(master) != "localhost" &&
             std::string(master).rfind("127.", 0) != 0) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    env.bind_host = host;
  }
  env.under_local_launcher = std::getenv(kLocalLaunchVar) != nullptr;
  return env;
}

Status CheckNprocAgainstEnvironment(int nproc) {
  if (nproc <= 0 || std::getenv(kLocalLaunchVar) != nullptr || !IsRankProcess()) {
    return Status::Ok();
  }
  DC_ASSIGN_OR_RETURN(std::optional<int> world,
                      EnvInt(EnvSet("WORLD_SIZE") ? "WORLD_SIZE" : "SLURM_NTASKS"));
  if (!world || nproc == *world) return Status::Ok();
  return Status::Error("--nproc " + std::to_string(nproc) + " disagrees with the launcher's " +
                       "WORLD_SIZE " + std::to_string(*world) +
                       " (RANK/WORLD_SIZE or SLURM_* are set, so an outside launcher starts the "
                       "ranks); drop --nproc, or unset those variables to start the ranks here");
}

namespace {

// The signal that asked the launcher to stop (SIGINT, SIGTERM, SIGHUP); 0 while none has.
volatile sig_atomic_t g_stop_signal = 0;

void RecordStopSignal(int sig) {
  if (g_stop_signal == 0) g_stop_signal = sig;
}

// The launcher's own stop signals, recorded instead of acted on so that it can stop its ranks
// and clean up; restored when LaunchLocal returns.
class StopSignals {
 public:
  StopSignals() {
    struct sigaction action {};
    action.sa_handler = RecordStopSignal;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &action, &saved_[i]);
  }
  ~StopSignals() {
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &saved_[i], nullptr);
  }
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGHUP};

 private:
  std::array<struct sigaction, 3> saved_{};
};

// $TMPDIR when set, else /tmp.
std::string TempRoot() {
  const char* tmpdir = std::getenv("TMPDIR");
  return tmpdir && *tmpdir ? tmpdir : "/tmp";
}

// The file in a launcher's rendezvous directory that names its owner: "<hostname> <pid>".
constexpr char kOwnerFile[] = "launcher";

std::string ThisHost() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

// A launcher killed outright (SIGKILL: nothing runs after it) leaves its rendezvous directory,
// and its ranks die with it (PR_SET_PDEATHSIG). The next launch in the same TMPDIR removes such
// directories: those whose owner file names this host and a process that no longer exists. A
// directory of another host (a TMPDIR shared over the network), of a live launcher, or without
// an owner file is left alone.
void RemoveDirsOfKilledLaunchers(const std::string& root) {
  std::error_code ec;
  const std::string host = ThisHost();
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("dc-rendezvous-", 0) != 0 || !entry.is_directory(ec)) continue;
    std::ifstream owner(entry.path() / kOwnerFile);
    std::string owner_host;
    long pid = 0;
    if (!(owner >> owner_host >> pid) || owner_host != host || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::filesystem::remove_all(entry.path(), ec);
  }
}

// Sends `sig` to every rank still running.
void SignalRanks(const std::vector<pid_t>& pids, int sig) {
  for (pid_t p : pids) {
    if (p > 0) ::kill(p, sig);
  }
}

}  // namespace

int LaunchLocal(const LaunchOptions& options, const std::vector<std::string>& argv) {
  const std::string root = TempRoot();
  RemoveDirsOfKilledLaunchers(root);
  std::string dir_template = root + "/dc-rendezvous-XXXXXX";
  if (!::mkdtemp(dir_template.data())) {
    std::cerr << options.program << ": cannot create a rendezvous directory in " << root << " ("
              << std::strerror(errno) << "); set TMPDIR to a writable directory\n";
    return 1;
  }
  const std::string dir = dir_template;
  // Removed on every path out of here: success, a failed rank, a signal.
  struct RemoveDir {
    std::string dir;
    ~RemoveDir() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } remove_dir{dir};
  std::error_code ec;
  std::filesystem::create_directories(dir + "/store", ec);
  std::ofstream(dir + "/" + kOwnerFile) << ThisHost() << " " << ::getpid() << "\n";
  // A fresh identity per run: nothing in the store is ever from another run.
  const std::string run_id = "local-" + std::to_string(::getpid());
  const StopSignals stop_signals;
  g_stop_signal = 0;
  const pid_t launcher = ::getpid();
  // Rank 0's progress lines go to the launcher's stderr (the ranks' own stderr is a file).
  const int progress_fd = ::dup(STDERR_FILENO);

  std::vector<pid_t> pids(options.nproc, -1);
  std::vector<int> started_pids;  // every rank started, for LaunchOptions::salvage
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  int running = 0;
  std::string start_failure;
  for (int r = 0; r < options.nproc && g_stop_signal == 0; ++r) {
    const std::string err_path = dir + "/rank" + std::to_string(r) + ".stderr";
    pid_t pid = ::fork();
    if (pid < 0) {
      start_failure =
          "cannot start rank " + std::to_string(r) + " (fork: " + std::strerror(errno) + ")";
      break;
    }
    if (pid == 0) {
      // A rank never outlives its launcher, even one killed with SIGKILL.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) std::_Exit(1);
      for (int sig : StopSignals::kSignals) ::signal(sig, SIG_DFL);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(options.nproc).c_str(), 1);
      ::setenv("DC_RENDEZVOUS_DIR", (dir + "/store").c_str(), 1);
      ::setenv(kRunIdVar, run_id.c_str(), 1);
      ::setenv(kLocalLaunchVar, "1", 1);
      ::setenv("OPENBLAS_NUM_THREADS", "1", 0);  // one core per rank; no idle thread pool
      if (r == 0 && progress_fd >= 0) {
        ::dup2(progress_fd, kProgressFd);
        ::setenv(kProgressFdVar, std::to_string(kProgressFd).c_str(), 1);
      }
      if (progress_fd >= 0 && (r != 0 || progress_fd != kProgressFd)) ::close(progress_fd);
      FILE* err = std::freopen(err_path.c_str(), "w", stderr);
      (void)err;
      if (r != 0) std::freopen("/dev/null", "w", stdout);
      ::execv("/proc/self/exe", args.data());
      std::fprintf(stderr, "cannot start rank %d: %s\n", r, std::strerror(errno));
      std::_Exit(127);
    }
    pids[r] = pid;
    started_pids.push_back(pid);
    ++running;
  }
  if (progress_fd >= 0) ::close(progress_fd);

  // Failures in the order they were reaped: (rank, status).
  std::vector<std::pair<int, int>> failures;
  using Clock = std::chrono::steady_clock;
  auto failed_at = Clock::time_point::max(), signalled_at = Clock::time_point::max();
  if (!start_failure.empty()) failed_at = Clock::now() - kSettle;  // stop the rest at once
  bool killed = false, stopped = false;
  int forwarded = 0;
  while (running > 0) {
    int status = 0;
    pid_t done = ::waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      for (int r = 0; r < options.nproc; ++r) {
        if (pids[r] != done) continue;
        pids[r] = -1;
        --running;
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
          failures.emplace_back(r, status);
          if (failed_at == Clock::time_point::max()) failed_at = Clock::now();
        }
      }
      continue;
    }
    const auto now = Clock::now();
    // A stop signal goes to every rank (a terminal's Ctrl-C reaches them already; `kill` on the
    // launcher does not); ranks that have not stopped within the grace period are killed.
    if (g_stop_signal != 0 && forwarded == 0) {
      forwarded = g_stop_signal;
      SignalRanks(pids, forwarded);
      signalled_at = now;
    }
    const auto since_failure = now - failed_at;
    // Ranks that fail together (all out of memory at once) get a moment to say so before the
    // rest are stopped, so the root cause is among the failures read below.
    if (!stopped && forwarded == 0 && since_failure > kSettle) {
      SignalRanks(pids, SIGTERM);
      stopped = true;
    }
    if (!killed && (since_failure > options.grace || now - signalled_at > options.stop_grace)) {
      SignalRanks(pids, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Ranks that failed or were killed may have left work behind (a streamed trace).
  std::string kept;
  if (options.salvage && (killed || !failures.empty() || !start_failure.empty())) {
    kept = options.salvage(dir + "/store", run_id, started_pids);
  }
  if (!kept.empty()) kept = "; " + kept;
  if (g_stop_signal != 0) {
    const int sig = g_stop_signal;
    // A rank that stopped on its own at a step boundary said what it kept (a traced run).
    std::ifstream rank0_err(dir + "/rank0.stderr");
    if (rank0_err && rank0_err.peek() != std::ifstream::traits_type::eof()) {
      std::cerr << rank0_err.rdbuf();
    }
    std::cerr << options.program << ": interrupted by " << StopSignalName(sig) << "; stopped the "
              << options.nproc << " rank(s)" << (killed ? " (killed those that did not stop)" : "")
              << " and removed their temporary files" << kept << "\n";
    return 128 + sig;
  }
  if (!start_failure.empty()) {
    std::cerr << options.program << ": " << start_failure
              << "; the ranks already started were stopped" << kept << "\n";
    return 1;
  }
  // The root cause: the first failure that is not a consequence of another rank's (a peer gone,
  // a rendezvous abandoned, a rank we stopped).
  int first_failed = -1, first_status = 0;
  for (const auto& [rank, status] : failures) {
    const std::string why = LastLine(dir + "/rank" + std::to_string(rank) + ".stderr");
    const bool consequence = why.find("peer rank is gone") != std::string::npos ||
                             why.find("could not meet") != std::string::npos || why.empty();
    if (first_failed < 0 || !consequence) {
      first_failed = rank;
      first_status = status;
      if (!consequence) break;
    }
  }

  if (first_failed < 0) {
    std::ifstream err(dir + "/rank0.stderr");
    std::cerr << err.rdbuf();
    return 0;
  }
  const std::string why = LastLine(dir + "/rank" + std::to_string(first_failed) + ".stderr");
  std::cerr << options.program << ": rank " << first_failed << " " << DescribeExit(first_status)
            << (why.empty() ? std::string() : ": " + why) << "; the other ranks were stopped"
            << kept << "\n";
  return 1;
}

}  // namespace dc
