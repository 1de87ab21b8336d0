#include "executor/launch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <thread>

namespace dc {
namespace {

constexpr const char* kLocalLaunchVar = "DC_LOCAL_LAUNCH";
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
    return Status::Error("rank " + std::to_string(env.rank) +
                         ": no rendezvous directory; pass --rendezvous DIR or set "
                         "DC_RENDEZVOUS_DIR to a directory every rank can reach");
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

Status CheckNprocAgainstEnvironment(int nproc, const RankEnv& env) {
  if (nproc <= 0 || env.under_local_launcher || !IsRankProcess() || nproc == env.world_size) {
    return Status::Ok();
  }
  return Status::Error("--nproc " + std::to_string(nproc) + " disagrees with the launcher's " +
                       "WORLD_SIZE " + std::to_string(env.world_size) +
                       " (RANK/WORLD_SIZE or SLURM_* are set, so an outside launcher starts the "
                       "ranks); drop --nproc, or unset those variables to start the ranks here");
}

int LaunchLocal(const LaunchOptions& options, const std::vector<std::string>& argv) {
  char dir_template[] = "/tmp/dc-rendezvous-XXXXXX";
  if (!::mkdtemp(dir_template)) {
    std::cerr << options.program << ": cannot create a rendezvous directory in /tmp ("
              << std::strerror(errno) << ")\n";
    return 1;
  }
  const std::string dir = dir_template;
  std::vector<pid_t> pids(options.nproc, -1);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  for (int r = 0; r < options.nproc; ++r) {
    const std::string err_path = dir + "/rank" + std::to_string(r) + ".stderr";
    pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(options.nproc).c_str(), 1);
      ::setenv("DC_RENDEZVOUS_DIR", (dir + "/store").c_str(), 1);
      ::setenv(kLocalLaunchVar, "1", 1);
      ::setenv("OPENBLAS_NUM_THREADS", "1", 0);  // one core per rank; no idle thread pool
      FILE* err = std::freopen(err_path.c_str(), "w", stderr);
      (void)err;
      if (r != 0) std::freopen("/dev/null", "w", stdout);
      ::execv("/proc/self/exe", args.data());
      std::fprintf(stderr, "cannot start rank %d: %s\n", r, std::strerror(errno));
      std::_Exit(127);
    }
    pids[r] = pid;
  }
  std::filesystem::create_directories(dir + "/store");

  int running = options.nproc;
  // Failures in the order they were reaped: (rank, status).
  std::vector<std::pair<int, int>> failures;
  auto failed_at = std::chrono::steady_clock::time_point::max();
  bool killed = false, stopped = false;
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
          if (failed_at == std::chrono::steady_clock::time_point::max()) {
            failed_at = std::chrono::steady_clock::now();
          }
        }
      }
      continue;
    }
    const auto since_failure = std::chrono::steady_clock::now() - failed_at;
    // Ranks that fail together (all out of memory at once) get a moment to say so before the
    // rest are stopped, so the root cause is among the failures read below.
    if (!stopped && since_failure > kSettle) {
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGTERM);
      }
      stopped = true;
    }
    if (!killed && since_failure > options.grace) {
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGKILL);
      }
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
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

  int rc = 0;
  if (first_failed < 0) {
    std::ifstream err(dir + "/rank0.stderr");
    std::cerr << err.rdbuf();
  } else {
    const std::string why = LastLine(dir + "/rank" + std::to_string(first_failed) + ".stderr");
    std::cerr << options.program << ": rank " << first_failed << " " << DescribeExit(first_status)
              << (why.empty() ? std::string() : ": " + why) << "; the other ranks were stopped\n";
    rc = 1;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}

}  // namespace dc
