// The PyTorch profiler (Kineto) JSON reader: each input is a trace file's bytes, read as
// dc-trace would (summary, memory chart, Perfetto). Errors are the expected outcome of most.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <sstream>

#include "analyzer/kineto.h"
#include "fuzz/trace_edits.h"
#include "tracetools/perfetto.h"
#include "tracetools/report.h"
#include "tracetools/svg.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dc::fuzz::TempPath("trace.json");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  dc::StatusOr<std::unique_ptr<dc::Timeline>> timeline = dc::OpenKinetoTimeline({path}, nullptr);
  if (!timeline.ok()) return 0;
  dc::SummaryOptions options;
  options.by_instruction = true;
  if (dc::StatusOr<dc::Summary> summary = dc::Summarize(**timeline, options); summary.ok()) {
    (void)dc::SummaryJson(*summary).dump();
    (void)dc::SummaryText(*summary);
  }
  if (dc::StatusOr<dc::MemoryChart> chart = dc::BuildMemoryChart(**timeline, {}); chart.ok()) {
    (void)dc::RenderMemorySvg(*chart);
  }
  std::ostringstream perfetto;
  (void)dc::WritePerfetto(**timeline, perfetto, nullptr);
  return 0;
}
