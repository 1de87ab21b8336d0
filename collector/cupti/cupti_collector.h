// The CUPTI collector: records one process's device activity through the CUPTI Activity API
// (CUDA 13 records) into that rank's SQLite file, in the schema of schemas/trace_schema.sql that
// the CPU backend's HostTracer writes too, so MergeRankTraces joins the ranks unchanged.
//
// What it records: CONCURRENT_KERNEL (never KERNEL, which serializes kernels), MEMCPY, MEMCPY2
// (peer copies), MEMSET, MEMORY2 and MEMORY_POOL (allocations), RUNTIME and DRIVER (all calls
// but the chatty ones listed in cupti_collector.cc: kChattyRuntimeApis, kChattyDriverApis),
// EXTERNAL_CORRELATION (the executor's instruction ids), OVERHEAD and DEVICE. Kernels get
// demangled and short names; NCCL kernels are recognized by name and also written as
// TC_COLLECTIVE rows. Timestamps are nanoseconds since the session start on CLOCK_REALTIME,
// with CUPTI's clock measured against it at the start and end (TC_CLOCK_ANCHOR). Records
// CUPTI dropped or delivered without timestamps are counted per kind in TC_RECORD_STATS.
//
// One collector per process at a time: CUPTI allows one subscriber and its buffer callbacks
// are process-wide. Thread-safety: PushInstruction/PopInstruction from any thread that launches
// work (CUPTI keeps one stack per thread); everything else is internally locked but meant for
// one controlling thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "schemas/status.h"

struct CUstream_st;  // cudaStream_t and CUstream point to it

namespace dc::collector_internal {
class Database;
}

namespace dc {

// Which parts of the run are kept.
enum class CaptureRange {
  // Between the caller's Start() and Stop() calls (the executor).
  kExplicit,
  // The whole run, until the program first calls cudaProfilerStart (or cuProfilerStart): from
  // then on only inside cudaProfilerStart/Stop ranges (what came before is discarded).
  kAuto,
  // Only inside cudaProfilerStart/Stop ranges.
  kProfilerApi,
};

struct CuptiCollectorOptions {
  std::string output_path;  // this rank's SQLite file, written at Finish
  int rank = 0;             // -1: unknown (an attached process without RANK)
  int local_rank = 0;
  int world_size = 1;    // -1: unknown
  std::string hostname;  // empty: gethostname()
  // The run's common time origin (rank 0's CLOCK_REALTIME at start, shared with every rank);
  // 0: this process's CLOCK_REALTIME when the collector is created.
  int64_t session_start_utc_ns = 0;
  int device_id = -1;  // the rank's CUDA device; -1: the device with the most activity
  // Activity buffers handed to CUPTI; CUPTI recommends 1 to 10 MB.
  size_t buffer_size_bytes = size_t{4} << 20;
  // RUNTIME and DRIVER records. CUPTI ties external correlation ids (PushInstruction) to API
  // calls: without them TC_INSTRUCTION_MAP may stay empty.
  bool trace_api_calls = true;
  CaptureRange capture_range = CaptureRange::kExplicit;
  std::string capture_label = "executor";                     // META_DATA_CAPTURE dc.capture
  std::vector<std::pair<std::string, std::string>> metadata;  // more META_DATA_CAPTURE rows
  // When set, the rank file is written in place (WAL) and every Step commits the step's records
  // to it (the device synchronized and CUPTI flushed first): a run killed later leaves the steps
  // it completed, which MergeRankTraces joins as an incomplete run's (HostTracer::StreamTo's
  // contract). It writes the plan's TC_BLOB rows (collector/trace_blobs.h) into the file once.
  std::function<Status(collector_internal::Database*)> stream_blobs;
};

// What the executor knows about a schedule instruction, for the activities it launches.
struct InstructionInfo {
  std::string kind;  // InstrKindName ("all_gather"); empty: taken from the activity
  int micro_step = -1;
  int64_t bytes = 0;  // collectives: the payload, as InstructionBytes counts it
  int tensors = 0;
  int bucket = -1;
};

// What a finished rank file holds.
struct CuptiTraceCounts {
  int64_t kernels = 0;  // not counting NCCL kernels
  int64_t collectives = 0;
  int64_t memcpys = 0;
  int64_t memsets = 0;
  int64_t memory_events = 0;
  int64_t api_calls = 0;
  int64_t mapped_activities = 0;  // TC_INSTRUCTION_MAP rows
  int64_t dropped_records = 0;
  int64_t zero_timestamp_records = 0;
  int64_t out_of_window_records = 0;
  int64_t overhead_ns = 0;
  // What did not work but left a usable trace ("cuptiActivityEnable(MEMORY_POOL): ...").
  std::vector<std::string> warnings;
};

// The start of the message Create returns when another CUPTI client (nsys, ncu,
// compute-sanitizer, torch.profiler's Kineto) already subscribed in this process.
inline constexpr char kAnotherProfilerMessage[] =
    "another profiler (nsys, ncu or torch.profiler) already holds CUPTI in this process";
bool IsAnotherProfilerError(const Status& status);

class CuptiCollector {
 public:
  // Subscribes to CUPTI and opens the output's temp file. With kAuto collection starts here;
  // with kProfilerApi at the program's first cudaProfilerStart.
  static StatusOr<std::unique_ptr<CuptiCollector>> Create(CuptiCollectorOptions options);
  // Without Finish: stops collecting and removes the temp file.
  ~CuptiCollector();
  CuptiCollector(const CuptiCollector&) = delete;
  CuptiCollector& operator=(const CuptiCollector&) = delete;

  // Opens a capture window: enables the activity kinds. No-op while one is open.
  Status Start();
  // Closes it: synchronizes the calling thread's current CUDA context and every context
  // created since Create, disables the windowed kinds and flushes CUPTI's buffers (forced).
  // Allocations stay recorded until Finish. No-op while none is open.
  Status Stop();
  // Stops if needed, disables every kind, flushes, waits for the writer and writes the rank
  // file (renamed into place). Once only.
  StatusOr<CuptiTraceCounts> Finish();

  // Nanoseconds since the session start on CLOCK_REALTIME: the trace's clock, for Step().
  int64_t NowNs() const;

  // Tags the work this thread launches until the matching PopInstruction with the schedule
  // instruction it belongs to (CUPTI external correlation id `step << 32 | instruction`), so
  // every kernel and copy maps to its instruction in TC_INSTRUCTION_MAP. Cheap; nestable.
  Status PushInstruction(int step, int instruction);
  Status PopInstruction();
  // Kind, micro-step and payload of an instruction (once per instruction, any time before
  // Finish): collectives get their bytes in TC_COLLECTIVE from it.
  void DescribeInstruction(int instruction, InstructionInfo info);
  // Names a stream in TC_STREAM ("compute", "gather", ...).
  Status NameStream(CUstream_st* stream, const std::string& name);
  // An optimizer step as executed (TC_STEP), times from NowNs().
  void Step(int step, int64_t start_ns, int64_t end_ns, double loss, bool warmup);
  // A held-out evaluation as executed (TC_EVAL), times from NowNs().
  void Evaluation(int64_t step, int64_t start_ns, int64_t end_ns, double loss);

  const std::string& output_path() const;
  int64_t global_pid() const;

  struct Impl;

 private:
  explicit CuptiCollector(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dc
