#include "tests/run_command.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace dc::testing {

namespace {
std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
}  // namespace

CommandResult RunCommand(const std::string& command) {
  static int counter = 0;
  const std::string base = ::testing::TempDir() + "/dc-cmd-" + std::to_string(::getpid()) + "-" +
                           std::to_string(counter++);
  const std::string full = "(" + command + ") >" + base + ".out 2>" + base + ".err";
  const int status = std::system(full.c_str());
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = Slurp(base + ".out");
  result.err = Slurp(base + ".err");
  std::filesystem::remove(base + ".out");
  std::filesystem::remove(base + ".err");
  return result;
}

std::string Tool(const std::string& name) { return std::string(DC_BINARY_DIR) + "/tools/" + name; }

std::string FreshDir(const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "/dc-test-" + name + "-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace dc::testing
