#include "schemas/files.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace dc {

StatusOr<std::string> ReadFileBytes(const std::string& path) {
  std::error_code error;
  // A directory opens and reads as empty: say what it is instead.
  if (std::filesystem::is_directory(path, error)) {
    return Status::Error(path + ": is a directory; pass a file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::Error(path + ": cannot open (" + std::strerror(errno) + ")");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) return Status::Error(path + ": read failed");
  return bytes.str();
}

Status CheckOutputWritable(const std::string& path) {
  if (path.empty()) return Status::Error("the output path is empty; name a file to write");
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Status::Error(path + ": is a directory; name a file to write, e.g. " + path +
                         "/trace.db");
  }
  const std::string probe = TempPathBeside(path);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status::Error(path + ": cannot write here (" + std::strerror(errno) +
                         "); check that its directory exists and is writable");
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return Status::Ok();
}

namespace {

// The paths RemoveOnSignal guards, read by the signal handler: fixed storage, no allocation.
constexpr size_t kMaxGuardedPathBytes = 4096;
char g_guarded[RemoveOnSignal::kMaxRemoveOnSignal][kMaxGuardedPathBytes];
volatile sig_atomic_t g_guarded_used[RemoveOnSignal::kMaxRemoveOnSignal];
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

// GracefulStop's state, read by the handler.
volatile sig_atomic_t g_graceful_armed = 0;
volatile sig_atomic_t g_graceful_repeat_ends = 0;
volatile sig_atomic_t g_stop_requested = 0;

// The one handler of the stop signals: a first signal while a GracefulStop is armed is
// recorded; anything else removes the guarded files and ends the process as the signal would.
void OnStopSignal(int sig) {
  if (g_graceful_armed) {
    if (g_stop_requested == 0) {
      g_stop_requested = sig;
      return;
    }
    if (!g_graceful_repeat_ends) return;
  }
  for (int i = 0; i < RemoveOnSignal::kMaxRemoveOnSignal; ++i) {
    if (g_guarded_used[i]) ::unlink(g_guarded[i]);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void InstallRemoveHandlerOnce() {
  static const bool installed = [] {
    for (int sig : kStopSignals) {
      struct sigaction old {};
      ::sigaction(sig, nullptr, &old);
      if (old.sa_handler != SIG_DFL) continue;  // ignored, or someone else's: leave it
      struct sigaction action {};
      action.sa_handler = OnStopSignal;
      sigemptyset(&action.sa_mask);
      ::sigaction(sig, &action, nullptr);
    }
    return true;
  }();
  (void)installed;
}

}  // namespace

RemoveOnSignal::RemoveOnSignal(const std::string& path) {
  if (path.empty() || path.size() >= kMaxGuardedPathBytes) return;
  InstallRemoveHandlerOnce();
  for (int i = 0; i < kMaxRemoveOnSignal; ++i) {
    if (g_guarded_used[i]) continue;
    std::memcpy(g_guarded[i], path.c_str(), path.size() + 1);
    g_guarded_used[i] = 1;
    slot_ = i;
    return;
  }
}

RemoveOnSignal::~RemoveOnSignal() {
  if (slot_ >= 0) g_guarded_used[slot_] = 0;
}

GracefulStop::GracefulStop(bool repeat_ends_process) {
  InstallRemoveHandlerOnce();
  g_stop_requested = 0;
  g_graceful_repeat_ends = repeat_ends_process ? 1 : 0;
  g_graceful_armed = 1;
}

GracefulStop::~GracefulStop() { g_graceful_armed = 0; }

int GracefulStop::Requested() { return g_stop_requested; }

std::string StopSignalName(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "signal " + std::to_string(sig);
  }
}

std::string TempPathBeside(const std::string& path) { return TempPathBeside(path, ::getpid()); }

std::string TempPathBeside(const std::string& path, int pid) {
  return path + ".tmp." + std::to_string(pid);
}

Status WriteFileAtomic(const std::string& path, const std::string& bytes) {
  DC_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> writer, AtomicFileWriter::Open(path));
  DC_RETURN_IF_ERROR(writer->Append(bytes.data(), static_cast<int64_t>(bytes.size())));
  return writer->Commit();
}

StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Open(const std::string& path) {
  std::string tmp = TempPathBeside(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status::Error(path + ": cannot create (" + std::strerror(errno) +
                         "); is the directory writable?");
  }
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, std::move(tmp), fd));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

Status AtomicFileWriter::Append(const void* data, int64_t bytes) {
  if (fd_ < 0) return Status::Error(path_ + ": written after it was committed (a dc bug)");
  const char* at = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, at, static_cast<size_t>(bytes));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::Error(path_ + ": write failed (" + std::strerror(errno) + ")");
    at += n;
    bytes -= n;
  }
  return Status::Ok();
}

Status AtomicFileWriter::Commit() {
  if (fd_ < 0) return Status::Error(path_ + ": committed twice (a dc bug)");
  const bool synced = ::fsync(fd_) == 0;
  const std::string sync_error = synced ? "" : std::strerror(errno);
  const bool closed = ::close(fd_) == 0;
  fd_ = -1;  // closed either way: the descriptor is never leaked
  if (!synced || !closed) {
    ::unlink(tmp_.c_str());
    return Status::Error(path_ + ": flush failed (" +
                         (synced ? std::string(std::strerror(errno)) : sync_error) + ")");
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp_.c_str());
    return Status::Error(path_ + ": rename failed (" + why + ")");
  }
  return Status::Ok();
}

Status CheckOutputIsNotAnInput(const std::string& output, const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  if (output.empty()) return Status::Ok();
  std::error_code error;
  const fs::path out = fs::weakly_canonical(output, error);
  for (const std::string& input : inputs) {
    if (input.empty()) continue;
    std::error_code same_error, canonical_error;
    const bool same =
        fs::equivalent(output, input, same_error) ||
        (!error && fs::weakly_canonical(input, canonical_error) == out && !canonical_error);
    if (same) {
      return Status::Error(output + ": the output is also the input " + input +
                           "; write it to another file");
    }
  }
  return Status::Ok();
}

int AvailableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace dc
