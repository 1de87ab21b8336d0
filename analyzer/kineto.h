// PyTorch profiler (Kineto) Chrome traces as timelines: one .json or .json.gz per rank, as
// torch.profiler's export_chrome_trace and tensorboard_trace_handler write them.
//
// Read from `traceEvents`: kernels (cat "kernel"; NCCL kernels, by name, are communication),
// copies and memsets (cat "gpu_memcpy" / "gpu_memset"), ProfilerStep#N windows (cat
// "user_annotation", else "gpu_user_annotation"), "[memory]" instant events of the CUDA caching
// allocator (args "Bytes", "Addr"), GPU thread names; `distributedInfo.rank` and
// `deviceProperties` where present. Events are parsed one at a time (the whole document is never
// held), times are moved so the earliest event of the run is at 0. Thread-safe (pure).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "analyzer/timeline.h"
#include "schemas/status.h"

namespace dc {

// `paths`: files, or directories whose *.json and *.json.gz files are read (sorted by name).
// Ranks come from distributedInfo.rank, else from the order of the files. Errors name the file:
// invalid JSON, a truncated or corrupt gzip, a JSON document without a traceEvents array, two
// files of one rank, a run without any device activity.
StatusOr<TimelineData> ReadKinetoTraces(const std::vector<std::string>& paths,
                                        const ProgressFn& progress);

StatusOr<std::unique_ptr<Timeline>> OpenKinetoTimeline(const std::vector<std::string>& paths,
                                                       const ProgressFn& progress);

}  // namespace dc
