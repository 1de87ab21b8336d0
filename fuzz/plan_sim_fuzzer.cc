// The simulator behind dc-trace on a plan: each input is a Schedule message (the plan file's
// payload, schemas/schedule.proto), written as a plan file with its digest recomputed (as a
// hostile hand could) and read as dc-trace reads a plan: loaded, checked, simulated with the
// default costs, summarized and charted.
#include <cstddef>
#include <cstdint>
#include <sstream>

#include "fuzz/trace_edits.h"
#include "schemas/plan_file.h"
#include "tracetools/perfetto.h"
#include "tracetools/report.h"
#include "tracetools/svg.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dc::proto::Schedule plan;
  if (!plan.ParseFromArray(data, static_cast<int>(size))) return 0;
  const std::string path = dc::fuzz::TempPath("plan.dcplan");
  if (!dc::SavePlan(path, plan).ok()) return 0;
  dc::StatusOr<std::unique_ptr<dc::Timeline>> timeline = dc::OpenTimeline({path}, {});
  if (!timeline.ok()) return 0;
  dc::SummaryOptions options;
  options.by_instruction = true;
  if (dc::StatusOr<dc::Summary> summary = dc::Summarize(**timeline, options); summary.ok()) {
    (void)dc::SummaryText(*summary);
  }
  if (dc::StatusOr<dc::MemoryChart> chart = dc::BuildMemoryChart(**timeline, {}); chart.ok()) {
    (void)dc::RenderMemorySvg(*chart);
  }
  std::ostringstream perfetto;
  (void)dc::WritePerfetto(**timeline, perfetto, nullptr);
  return 0;
}
