// Private to collector/cupti: turns CUPTI activity records (CUDA 13 structs: Kernel10, Memcpy6,
// MemcpyPtoP4, Memset4, Memory4, API, ExternalCorrelation, Overhead3, Device5) into one rank's
// SQLite file in the schema of schemas/trace_schema.sql, streaming rows into a temp file beside
// the output and renaming it into place at Finish; or, streamed, into the output itself (WAL),
// where each Checkpoint commits the steps done so that a killed run leaves them mergeable. Pure
// SQLite + the CUPTI headers' structs: it calls no CUPTI function, so tests can feed it synthetic
// records. Not thread-safe: one thread at a time (the collector's writer thread, then the thread
// that calls Finish).
#pragma once

#include <cupti_activity.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "collector/cupti/cupti_collector.h"
#include "collector/sqlite_writer.h"
#include "collector/trace_rows.h"
#include "schemas/status.h"

namespace dc::cupti_internal {

// ----- conversions to Nsight Systems' numbering -----

// ENUM_CUDA_MEM_KIND from CUpti_ActivityMemoryKind: nsys = cupti - 1, CUPTI's UNKNOWN (0) and
// kinds newer than this header -> 7 (Unknown).
int64_t NsysMemKind(uint32_t cupti_memory_kind);
// ENUM_CUDA_DEV_MEM_EVENT_OPER from CUpti_ActivityMemoryOperationType (1 ALLOCATION -> 0,
// 2 RELEASE -> 1); nullopt for INVALID and unknown values.
std::optional<int64_t> NsysMemoryOperation(uint32_t cupti_operation);

// ----- kernel names -----

// abi::__cxa_demangle of `mangled`; `mangled` itself when it is not a mangled C++ name.
std::string DemangleKernelName(const char* mangled);
// The base name nsys shows as shortName: no return type, scope, template arguments or
// parameters ("void at::native::f<float>(int)" -> "f").
std::string ShortKernelName(std::string_view demangled);
// The collective an NCCL kernel runs, by its short name ("ncclDevKernel_AllGather_RING_LL" ->
// "all_gather"; ncclSymkDevKernel_* and pre-2.19 ncclKernel_* too): all_gather,
// reduce_scatter, all_reduce, broadcast, reduce, send_recv, or "nccl" where the name does not
// say (ncclDevKernel_Generic). nullopt when the kernel is not NCCL's.
std::optional<std::string> NcclCollectiveKind(std::string_view short_name);

// ----- what the writer needs besides the records -----

// CUPTI timestamps to session nanoseconds: CUPTI's clock (CLOCK_REALTIME on Linux, but
// measured, not assumed) shifted onto CLOCK_REALTIME, minus the session start.
struct SessionClock {
  int64_t session_start_utc_ns = 0;
  int64_t cupti_to_realtime_ns = 0;  // realtime - cupti, sampled together at start
  int64_t ToSessionNs(uint64_t cupti_ns) const {
    return static_cast<int64_t>(cupti_ns) + cupti_to_realtime_ns - session_start_utc_ns;
  }
};

using ClockAnchorRow = collector_internal::ClockAnchorRow;
using StepRow = collector_internal::StepRow;
using EvalRow = collector_internal::EvalRow;

struct RankRow {
  int64_t global_pid = 0;
  int rank = 0;  // -1: unknown (an attached process without RANK); dc-collect renumbers
  int local_rank = 0;
  int world_size = 1;  // -1: unknown
  std::string hostname;
  int device_id = -1;  // -1: the device with the most activity
};

// What the executor said about one schedule instruction (CuptiCollector::DescribeInstruction).
struct InstructionRow {
  int instruction = 0;
  std::string kind;  // InstrKindName; empty: from the activity
  int micro_step = -1;
  int64_t bytes = 0;
  int tensors = 0;
  int bucket = -1;
};

// A capture window in session nanoseconds, both ends inclusive.
struct WindowRow {
  int64_t start_ns = 0, end_ns = 0;
};

struct FinishInput {
  RankRow rank;
  std::vector<ClockAnchorRow> anchors;
  // When set, device activity and API rows starting outside every window are deleted (and
  // counted as out of window). Memory events are always kept: they are the live-set baseline.
  std::optional<std::vector<WindowRow>> windows;
  std::vector<InstructionRow> instructions;
  std::vector<StepRow> steps;
  std::vector<EvalRow> evals;                                 // TC_EVAL
  std::vector<std::pair<int64_t, std::string>> streams;       // CUPTI stream id, name
  std::vector<std::pair<std::string, std::string>> metadata;  // META_DATA_CAPTURE
};

// What a streamed file holds from its first Checkpoint on, besides the records: the rank, its
// device and the plan once, then the rows each checkpoint adds (the vectors are the run's so
// far: append-only, and only the rows not yet written are written).
struct CheckpointInput {
  RankRow rank;
  std::vector<ClockAnchorRow> anchors;  // the start anchors; Finish adds the end ones
  // Writes the plan's TC_BLOB rows (CuptiCollectorOptions::stream_blobs); may be empty.
  std::function<Status(collector_internal::Database*)> write_blobs;
  std::vector<InstructionRow> instructions;
  std::vector<StepRow> steps;
  std::vector<EvalRow> evals;
  std::vector<std::pair<int64_t, std::string>> streams;
};

// What a finished rank file holds (warnings are the collector's to fill).
using TraceCounts = CuptiTraceCounts;

// Record counters of one activity kind (TC_RECORD_STATS.kind).
struct KindStats {
  int64_t seen = 0;
  int64_t zero_timestamp = 0;
};

class ActivityWriter {
 public:
  // Name of a runtime (driver = false) or driver API callback id.
  using ApiNameFn = std::function<std::string(bool driver, uint32_t cbid)>;

  // Creates `path`'s temp file with the trace schema; streamed, `path` itself (WAL), which the
  // writer leaves in place when it is destroyed unfinished: what its checkpoints committed is a
  // rank file MergeRankTraces takes as an incomplete run's.
  static StatusOr<std::unique_ptr<ActivityWriter>> Open(const std::string& path, int64_t global_pid,
                                                        SessionClock clock, ApiNameFn api_name,
                                                        bool streamed = false);
  ~ActivityWriter();
  ActivityWriter(const ActivityWriter&) = delete;
  ActivityWriter& operator=(const ActivityWriter&) = delete;

  // Records are written in batches (one SQLite transaction each).
  Status BeginBatch();
  Status EndBatch();
  // One record. Kernel and memory names must stay valid until the call returns. Write errors
  // stick: the first is returned by EndBatch and Finish; later records are only counted.
  void Add(const CUpti_Activity* record);
  // One CUPTI buffer was processed; CUPTI said it dropped `dropped_records` records with it.
  void AddBuffer(size_t dropped_records);

  // Streamed only: commits the records so far with the rows `input` adds (TC_RANK, the start
  // anchors, TARGET_INFO and the schedule the first time; then new steps, evaluations, streams
  // and the instruction map of the external correlations seen since the last checkpoint).
  Status Checkpoint(const CheckpointInput& input);

  // Writes the per-rank tables (those a checkpoint has not), closes the file and renames it to
  // `path` (streamed: folds the WAL in, the file is in place already).
  StatusOr<TraceCounts> Finish(const FinishInput& input);

  const std::string& path() const { return path_; }

 private:
  struct KernelNames {
    int64_t mangled_id = 0, demangled_id = 0, short_id = 0;
    std::optional<std::string> collective;  // NCCL's collective kind
  };
  struct DeviceInfo {
    std::string name, uuid;
    int64_t memory_bytes = 0, bandwidth_bytes_per_s = 0, clock_hz = 0, l2_bytes = 0;
    int64_t sm_count = 0, compute_major = 0, compute_minor = 0;
  };

  ActivityWriter(collector_internal::Database db, std::string path, std::string tmp_path,
                 int64_t global_pid, SessionClock clock, ApiNameFn api_name);
  Status PrepareStatements();
  int64_t Intern(std::string_view value);
  const KernelNames& NamesOf(const char* mangled);
  KindStats& Stats(const char* kind) { return stats_[kind]; }
  // Counts an interval record of `kind`; false when it is dropped for its timestamps (counted
  // as zero_timestamp) or writing has already failed.
  bool Admit(const char* kind, uint64_t start, uint64_t end);
  // The columns every device activity row starts with: start, end, deviceId, contextId,
  // streamId, correlationId.
  template <typename Row, typename Record>
  Row DeviceActivity(const Record& r) const {
    Row row;
    row.start_ns = clock_.ToSessionNs(r.start);
    row.end_ns = clock_.ToSessionNs(r.end);
    row.device_id = static_cast<int64_t>(r.deviceId);
    row.context_id = static_cast<int64_t>(r.contextId);
    row.stream_id = static_cast<int64_t>(r.streamId);
    row.correlation_id = static_cast<int64_t>(r.correlationId);
    return row;
  }
  void Keep(Status status);

  void AddKernel(const CUpti_ActivityKernel10& r);
  void AddMemcpy(const CUpti_ActivityMemcpy6& r);
  void AddPeerMemcpy(const CUpti_ActivityMemcpyPtoP4& r);
  void AddMemset(const CUpti_ActivityMemset4& r);
  void AddMemory(const CUpti_ActivityMemory4& r);
  void AddApi(const CUpti_ActivityAPI& r, bool driver);
  void AddExternalCorrelation(const CUpti_ActivityExternalCorrelation& r);
  void AddOverhead(const CUpti_ActivityOverhead3& r);
  void AddDevice(const CUpti_ActivityDevice5& r);

  Status DeleteOutOfWindow(const std::vector<WindowRow>& windows, TraceCounts* counts);
  // The map of the external correlations with rowid in (after, through]; after < 0: all of them,
  // replacing any rows a checkpoint wrote.
  Status WriteInstructionMap(const std::vector<InstructionRow>& instructions, int64_t after,
                             int64_t through);
  // The rows of `anchors`, `steps`, `evals` and `streams` not written yet; the counts of what
  // is written then go to *written (applied by the caller once its transaction commits).
  struct Written {
    std::set<std::string> anchors;
    size_t steps = 0, evals = 0, streams = 0;
  };
  Status WriteNewRows(const std::vector<ClockAnchorRow>& anchors, const std::vector<StepRow>& steps,
                      const std::vector<EvalRow>& evals,
                      const std::vector<std::pair<int64_t, std::string>>& streams,
                      Written* written);
  StatusOr<int64_t> RankDevice(const RankRow& rank);
  Status WriteRank(const RankRow& rank, int64_t device_id);
  Status WriteRecordStats(TraceCounts* counts);
  Status WriteTargetInfo(int64_t rank_device_id, int64_t vm_id);
  Status WriteMetadata(const std::vector<std::pair<std::string, std::string>>& metadata,
                       const TraceCounts& counts);

  collector_internal::Database db_;
  std::string path_, tmp_path_;
  int64_t global_pid_;
  SessionClock clock_;
  ApiNameFn api_name_;
  Status error_;
  bool in_batch_ = false;
  bool finished_ = false;
  bool streamed_ = false;
  // Streamed: what the committed checkpoints wrote.
  bool header_written_ = false;
  int64_t rank_device_ = 0;
  int64_t external_mark_ = 0;  // temp.dc_external rowids up to it are in TC_INSTRUCTION_MAP
  Written written_;

  collector_internal::TraceRowWriter rows_;
  // CUPTI's own: API calls and external correlations.
  collector_internal::Statement insert_api_, insert_external_;
  std::unordered_map<std::string, int64_t> string_ids_;
  std::unordered_map<std::string, KernelNames> kernel_names_;
  std::map<std::pair<bool, uint32_t>, int64_t> api_name_ids_;
  std::map<uint32_t, DeviceInfo> devices_;
  std::map<std::string, KindStats> stats_;  // by TC_RECORD_STATS kind, stable order
  int64_t buffers_ = 0;
  int64_t dropped_records_ = 0;
  int64_t invalid_records_ = 0;
  int64_t overhead_ns_ = 0;
};

}  // namespace dc::cupti_internal
