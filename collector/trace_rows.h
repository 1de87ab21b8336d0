// The one writer of a rank file's rows (schemas/trace_schema.sql, Nsight Systems' tables plus
// dc's TC_* extensions), shared by the host tracer (collector/host_tracer.cc) and the CUPTI
// activity writer (collector/cupti/activity_writer.cc): each table's SQL and column order is
// written here once. A row holds every column either writer fills; what a writer cannot know
// stays at its default (launch geometry 1, other numbers 0) or, where optional, NULL. Free of
// protobuf, like the SQLite layer under it, so libdc_inject.so can link it. Private to
// collector/. Not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "collector/sqlite_writer.h"
#include "schemas/status.h"

namespace dc::collector_internal {

struct KernelRow {
  int64_t start_ns = 0, end_ns = 0;
  int64_t device_id = 0, context_id = 0, stream_id = 0, correlation_id = 0;
  int64_t demangled_name_id = 0, short_name_id = 0;  // StringIds
  std::optional<int64_t> mangled_name_id;
  int64_t launch_type = 0, cache_config = 0, registers_per_thread = 0;
  int64_t grid_x = 1, grid_y = 1, grid_z = 1, block_x = 1, block_y = 1, block_z = 1;
  int64_t static_shared_memory = 0, dynamic_shared_memory = 0;
  int64_t local_memory_per_thread = 0, local_memory_total = 0, grid_id = 0;
  std::optional<int64_t> shared_memory_executed, graph_node_id, shared_memory_limit_config;
};

struct CollectiveRow {
  int64_t start_ns = 0, end_ns = 0;
  int64_t device_id = 0, stream_id = 0, correlation_id = 0;
  std::string kind;  // all_gather, reduce_scatter, ... (InstrKindName or NCCL's)
  int64_t bytes = 0;
  std::optional<int64_t> tensors, bucket;
};

struct MemcpyRow {
  int64_t start_ns = 0, end_ns = 0;
  int64_t device_id = 0, context_id = 0, stream_id = 0, correlation_id = 0;
  int64_t bytes = 0, copy_kind = 0, src_kind = 0, dst_kind = 0;  // nsys's enum numbering
  std::optional<int64_t> src_device_id, src_context_id, dst_device_id, dst_context_id;  // peer
  std::optional<int64_t> graph_node_id;
};

struct MemsetRow {
  int64_t start_ns = 0, end_ns = 0;
  int64_t device_id = 0, context_id = 0, stream_id = 0, correlation_id = 0;
  int64_t value = 0, bytes = 0;
  std::optional<int64_t> graph_node_id;
  int64_t mem_kind = 0;
};

struct MemoryEventRow {
  int64_t ts_ns = 0;
  int64_t device_id = 0, context_id = 0, address = 0, pc = 0, bytes = 0;
  int64_t mem_kind = 0, operation = 0;  // ENUM_CUDA_MEM_KIND, ENUM_CUDA_DEV_MEM_EVENT_OPER
  std::optional<std::string> name;
  int64_t correlation_id = 0;
  std::optional<int64_t> stream_id;
  std::optional<int64_t> local_pool_address, local_pool_release_threshold, local_pool_size,
      local_pool_utilized_size, imported_pool_address, imported_pool_process_id;
  std::optional<std::string> tc_kind;  // dc's buffer kind (BufferKindName)
};

struct InstructionMapRow {
  int64_t correlation_id = 0;
  int64_t step = 0, micro_step = -1, instruction = -1;
  std::string kind;  // InstrKindName
};

struct RankRow {
  std::string hostname;
  int64_t rank = 0, local_rank = 0, world_size = 1, device_id = 0;
  std::string backend, device;
  int64_t device_memory_bytes = 0;
  int64_t host_cores = 0, threads_per_rank = 0;  // 0: not known
};

struct ClockAnchorRow {
  std::string tag;  // start, end (CLOCK_REALTIME), cupti_start, cupti_end (CUPTI's clock)
  int64_t realtime_ns = 0, monotonic_ns = 0, session_ns = 0;
};

struct StepRow {
  int step = 0;
  int64_t start_ns = 0, end_ns = 0;
  double loss = 0;
  bool warmup = false;
};

struct EvalRow {
  int64_t step = 0;
  int64_t start_ns = 0, end_ns = 0;
  double loss = 0;
};

struct RecordStatsRow {
  std::string kind;
  int64_t records = 0, dropped = 0, zero_timestamp = 0;
};

struct GpuInfoRow {
  int64_t vm_id = 0, id = 0;
  // Null where the writer knows only the id.
  std::optional<std::string> name, uuid;
  std::optional<int64_t> total_memory, memory_bandwidth, clock_rate, sm_count, l2_cache_size,
      compute_major, compute_minor;
  int64_t cu_device = 0;
};

// Every row of one rank's file under one globalPid. The statements are prepared once; each call
// binds and runs one row.
class TraceRowWriter {
 public:
  static StatusOr<TraceRowWriter> Create(Database* db, int64_t global_pid);
  TraceRowWriter() = default;

  Status String(int64_t id, std::string_view value);
  Status Kernel(const KernelRow& row);
  Status Collective(const CollectiveRow& row);
  Status Memcpy(const MemcpyRow& row);
  Status Memset(const MemsetRow& row);
  Status MemoryEvent(const MemoryEventRow& row);
  Status Step(const StepRow& row);
  Status Evaluation(const EvalRow& row);  // TC_EVAL
  Status InstructionMap(const InstructionMapRow& row);

  Status Rank(const RankRow& row);
  Status ClockAnchor(const ClockAnchorRow& row);
  Status RecordStats(const RecordStatsRow& row);
  Status Stream(int64_t stream_id, std::string_view name);
  Status GpuInfo(const GpuInfoRow& row);
  // TARGET_INFO_SESSION_START_TIME: the session's start in UTC and local time.
  Status SessionStart(int64_t utc_epoch_ns);

  // Closes the statements (before the database closes).
  void Close();

 private:
  Database* db_ = nullptr;
  int64_t global_pid_ = 0;
  Statement string_, kernel_, collective_, memcpy_, memset_, memory_, step_, instruction_map_;
};

}  // namespace dc::collector_internal
