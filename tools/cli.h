// What the three commands share: model flags, byte-size flags, the rank-or-launch decision,
// and printing one error line.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "models/model.h"
#include "schemas/status.h"

namespace dc::cli {

struct ModelFlags {
  std::string preset = "tiny";
  ModelOverrides overrides;
  void Add(CLI::App& app);
};

// A byte-size option ("1073741824", "1GiB", "512MiB") stored into `*bytes`.
CLI::Option* AddBytesOption(CLI::App& app, const std::string& name, int64_t* bytes,
                            const std::string& help);

// Prints "<program>: <message>" on one line to stderr and returns 1.
int Fail(const std::string& program, const Status& status);

// This program's own arguments, for re-executing it as ranks.
std::vector<std::string> Args(int argc, char** argv);

}  // namespace dc::cli
