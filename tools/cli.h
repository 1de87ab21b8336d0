// What the three commands share: model flags, byte-size flags, the rank-or-launch decision,
// and printing one error line.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "schemas/status.h"

namespace dc::cli {

struct ModelFlags {
  std::string preset = "tiny";
  ModelOverrides overrides;
  void Add(CLI::App& app);
  // The model flags the command line gave (after parsing), e.g. to refuse them where the
  // model comes from elsewhere (a trace).
  std::vector<std::string> Given(const CLI::App& app) const;

 private:
  std::vector<std::string> names_;  // every flag Add registered
};

// A byte-size option ("1073741824", "1GiB", "512MiB") stored into `*bytes`.
CLI::Option* AddBytesOption(CLI::App& app, const std::string& name, int64_t* bytes,
                            const std::string& help);

// --threads-per-rank: BLAS (OpenBLAS) threads in each rank of the cpu backend.
struct ThreadsPerRankFlag {
  int threads = 0;  // 0: not given, use the default
  void Add(CLI::App& app);
  // The flag's value, or the default: the cores this process may run on (its affinity mask)
  // shared by the ranks on this host (LOCAL_WORLD_SIZE where a launcher sets it, else
  // `world_size`), at least 1. A value above those cores is an error naming both.
  StatusOr<int> Resolve(int world_size) const;
};

// The exit codes of every dc command (README, "Exit codes"): 0 on success, kUsageExitCode when the
// command line does not parse (an unknown flag, a missing argument, a value of the wrong type or
// outside its range: what CLI11 checks), 1 for every other error (Fail).
inline constexpr int kUsageExitCode = 2;

// The longest --timeout a command accepts: a day.
inline constexpr int kMaxTimeoutSeconds = 24 * 3600;

// Parses the command line. Returns nothing to go on, or the code to exit with: 0 after --help,
// kUsageExitCode after CLI11's one-line message.
std::optional<int> Parse(CLI::App& app, int argc, char** argv);

// A path flag that names a file to write or read: an empty value ("") is refused.
const CLI::Validator& NonEmptyPath();

// Prints "<program>: <message>" on one line to stderr and returns 1.
int Fail(const std::string& program, const Status& status);

// This program's own arguments, for re-executing it as ranks.
std::vector<std::string> Args(int argc, char** argv);

}  // namespace dc::cli
