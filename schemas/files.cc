#include "schemas/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

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

std::string TempPathBeside(const std::string& path) {
  return path + ".tmp." + std::to_string(::getpid());
}

Status WriteFileAtomic(const std::string& path, const std::string& bytes) {
  const std::string tmp = TempPathBeside(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status::Error(path + ": cannot create (" + std::strerror(errno) +
                         "); is the directory writable?");
  }
  size_t written = 0;
  while (written < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      return Status::Error(path + ": write failed (" + why + ")");
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return Status::Error(path + ": flush failed (" + std::strerror(errno) + ")");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return Status::Error(path + ": rename failed (" + why + ")");
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

}  // namespace dc
