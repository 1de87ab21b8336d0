// Whole-file reads and atomic writes: a file is either fully written or not there at all.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "schemas/status.h"

namespace dc {

StatusOr<std::string> ReadFileBytes(const std::string& path);

// Writes `bytes` to a temporary file beside `path`, flushes it and renames it over `path`.
Status WriteFileAtomic(const std::string& path, const std::string& bytes);

// The same for a file written piece by piece (never held whole in memory): Open makes the
// temporary file, Append writes to it, Commit flushes it and renames it over the path. A writer
// destroyed before Commit (an error on the way) removes its temporary file.
class AtomicFileWriter {
 public:
  static StatusOr<std::unique_ptr<AtomicFileWriter>> Open(const std::string& path);
  ~AtomicFileWriter();
  Status Append(const void* data, int64_t bytes);
  Status Commit();

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd)
      : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}
  std::string path_, tmp_;
  int fd_ = -1;
};

// A temporary path beside `path` ("path.tmp.<pid>") for writers that build a file in place
// (SQLite) before renaming it.
std::string TempPathBeside(const std::string& path);
// The one process `pid` uses: what a launcher removes after killing it.
std::string TempPathBeside(const std::string& path, int pid);

// Checks before any work that `path` can be written: not empty, not a directory, and a file can
// be created beside it. "t.db: cannot write here (No such file or directory); ..." otherwise.
Status CheckOutputWritable(const std::string& path);

// While it lives, `path` is removed if this process is stopped by SIGINT, SIGTERM or SIGHUP
// (which then ends the process as it would have): for temporary files that a stopped run must
// not leave behind. At most kMaxRemoveOnSignal at once (more are not guarded); not thread-safe.
class RemoveOnSignal {
 public:
  static constexpr int kMaxRemoveOnSignal = 8;
  explicit RemoveOnSignal(const std::string& path);
  ~RemoveOnSignal();
  RemoveOnSignal(const RemoveOnSignal&) = delete;
  RemoveOnSignal& operator=(const RemoveOnSignal&) = delete;

 private:
  int slot_ = -1;
};

// While it lives, SIGINT, SIGTERM and SIGHUP ask this process to stop at its next safe point (a
// step boundary) instead of ending it: Requested() says which signal came first (0 while none
// has). With `repeat_ends_process`, a second signal ends the process as if none were armed
// (RemoveOnSignal's files removed first); without it (ranks under a launcher, which kills those
// that do not stop in time) repeats are ignored. One at a time; not thread-safe.
class GracefulStop {
 public:
  explicit GracefulStop(bool repeat_ends_process);
  ~GracefulStop();
  GracefulStop(const GracefulStop&) = delete;
  GracefulStop& operator=(const GracefulStop&) = delete;
  static int Requested();
};

// "SIGINT", "SIGTERM", "SIGHUP", else "signal N": how messages name a stop signal.
std::string StopSignalName(int sig);

// The cores this process may run on: its affinity mask's, else std::thread's count, at least 1.
int AvailableCores();

// Refuses to write `output` over one of `inputs` (the same file by path or by link): "t.db:
// the output is also the input t.db; write it to another file". Empty paths are ignored.
Status CheckOutputIsNotAnInput(const std::string& output, const std::vector<std::string>& inputs);

}  // namespace dc
