// Running the dc commands from tests: a shell command's exit code, stdout and stderr.
#pragma once

#include <string>

namespace dc::testing {

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs `command` with /bin/sh, stdout and stderr captured to files in a temp directory.
CommandResult RunCommand(const std::string& command);

// Path of a built tool ("dc-collect") under the build tree.
std::string Tool(const std::string& name);

// A fresh, empty directory under the test temp dir.
std::string FreshDir(const std::string& name);

}  // namespace dc::testing
