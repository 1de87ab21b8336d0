// `dc-collect --attach -- CMD ARGS...`: runs an unmodified CUDA program (python train.py,
// torchrun ..., a binary) with libdc_inject.so loaded by CUDA's driver into every process that
// initializes CUDA, then joins the per-process trace files into one trace in the dc schema.
// Foreign programs get no TC_BLOB rows (there is no dc program or schedule to embed):
// META_DATA_EXPORT says dc.capture=attach and the analyzer treats the trace as report-only.
#pragma once

#include <string>
#include <vector>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct AttachOptions {
  std::string output_path;  // the merged trace
  // libdc_inject.so; empty: FindInjectLibrary().
  std::string inject_library;
  // auto: the whole run, or the cudaProfilerStart/Stop ranges once the program uses them;
  // cudaProfilerApi: those ranges only; all: the whole run regardless.
  std::string capture_range = "auto";
  bool trace_api_calls = true;  // runtime/driver API rows
  // Set when the traced program is dc's own (dc-run plan.dcplan): its schedule is embedded in
  // the trace as for dc-collect's own runs. Not owned.
  const proto::Schedule* schedule = nullptr;
  bool json = false;   // the report as one JSON object on stdout
  bool quiet = false;  // no report on success (errors still print)
};

// libdc_inject.so beside the running executable or in its ../lib; the error names both places.
StatusOr<std::string> FindInjectLibrary();

// Runs `command` (argv, looked up in PATH) traced, waits for it (ignoring SIGINT/SIGTERM so the
// traced processes can write their files when the user interrupts them), merges the traces
// into options.output_path and reports. Returns the exit status for dc-collect: 1 with one line
// on stderr when libdc_inject.so is missing, the command cannot be started, no process wrote a
// trace, or the merge fails; else the program's own status (128 + signal when killed).
int RunAttached(const AttachOptions& options, const std::vector<std::string>& command);

}  // namespace dc
