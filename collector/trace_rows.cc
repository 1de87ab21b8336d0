#include "collector/trace_rows.h"

#include <time.h>

namespace dc::collector_internal {
namespace {

void Bind(Statement& s, int index, const std::optional<int64_t>& value) {
  if (value) {
    s.Bind(index, *value);
  } else {
    s.BindNull(index);
  }
}

void Bind(Statement& s, int index, const std::optional<std::string>& value) {
  if (value) {
    s.Bind(index, std::string_view(*value));
  } else {
    s.BindNull(index);
  }
}

// The columns every device activity table starts with: start, end, deviceId, contextId,
// streamId, correlationId, globalPid.
template <typename Row>
void BindActivity(Statement& s, const Row& r, int64_t global_pid) {
  s.Bind(1, r.start_ns);
  s.Bind(2, r.end_ns);
  s.Bind(3, r.device_id);
  s.Bind(4, r.context_id);
  s.Bind(5, r.stream_id);
  s.Bind(6, r.correlation_id);
  s.Bind(7, global_pid);
}

}  // namespace

StatusOr<TraceRowWriter> TraceRowWriter::Create(Database* db, int64_t global_pid) {
  TraceRowWriter w;
  w.db_ = db;
  w.global_pid_ = global_pid;
  DC_ASSIGN_OR_RETURN(w.string_, db->Prepare("INSERT INTO StringIds(id, value) VALUES (?, ?)"));
  DC_ASSIGN_OR_RETURN(
      w.kernel_,
      db->Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL(start, end, deviceId, contextId, "
                  "streamId, correlationId, globalPid, demangledName, shortName, mangledName, "
                  "launchType, cacheConfig, registersPerThread, gridX, gridY, gridZ, blockX, "
                  "blockY, blockZ, staticSharedMemory, dynamicSharedMemory, "
                  "localMemoryPerThread, localMemoryTotal, gridId, sharedMemoryExecuted, "
                  "graphNodeId, sharedMemoryLimitConfig) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                  "?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(
      w.collective_,
      db->Prepare("INSERT INTO TC_COLLECTIVE(start, end, globalPid, deviceId, streamId, "
                  "correlationId, kind, bytes, tensors, bucket) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(
      w.memcpy_,
      db->Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY(start, end, deviceId, contextId, "
                  "streamId, correlationId, globalPid, bytes, copyKind, srcKind, dstKind, "
                  "srcDeviceId, srcContextId, dstDeviceId, dstContextId, graphNodeId) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(
      w.memset_,
      db->Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET(start, end, deviceId, contextId, "
                  "streamId, correlationId, globalPid, value, bytes, graphNodeId, memKind) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(
      w.memory_, db->Prepare("INSERT INTO CUDA_GPU_MEMORY_USAGE_EVENTS(start, globalPid, deviceId, "
                             "contextId, address, pc, bytes, memKind, memoryOperationType, name, "
                             "correlationId, streamId, localMemoryPoolAddress, "
                             "localMemoryPoolReleaseThreshold, localMemoryPoolSize, "
                             "localMemoryPoolUtilizedSize, importedMemoryPoolAddress, "
                             "importedMemoryPoolProcessId, tcKind) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(
      w.instruction_map_,
      db->Prepare("INSERT INTO TC_INSTRUCTION_MAP(globalPid, correlationId, step, microStep, "
                  "instruction, kind) VALUES (?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(w.step_, db->Prepare("INSERT INTO TC_STEP(globalPid, step, start, end, "
                                           "loss, warmup) VALUES (?, ?, ?, ?, ?, ?)"));
  return w;
}

void TraceRowWriter::Close() {
  string_ = Statement();
  kernel_ = Statement();
  collective_ = Statement();
  memcpy_ = Statement();
  memset_ = Statement();
  memory_ = Statement();
  step_ = Statement();
  instruction_map_ = Statement();
}

Status TraceRowWriter::String(int64_t id, std::string_view value) {
  string_.Bind(1, id);
  string_.Bind(2, value);
  return string_.Run();
}

Status TraceRowWriter::Kernel(const KernelRow& r) {
  Statement& k = kernel_;
  BindActivity(k, r, global_pid_);
  k.Bind(8, r.demangled_name_id);
  k.Bind(9, r.short_name_id);
  Bind(k, 10, r.mangled_name_id);
  k.Bind(11, r.launch_type);
  k.Bind(12, r.cache_config);
  k.Bind(13, r.registers_per_thread);
  k.Bind(14, r.grid_x);
  k.Bind(15, r.grid_y);
  k.Bind(16, r.grid_z);
  k.Bind(17, r.block_x);
  k.Bind(18, r.block_y);
  k.Bind(19, r.block_z);
  k.Bind(20, r.static_shared_memory);
  k.Bind(21, r.dynamic_shared_memory);
  k.Bind(22, r.local_memory_per_thread);
  k.Bind(23, r.local_memory_total);
  k.Bind(24, r.grid_id);
  Bind(k, 25, r.shared_memory_executed);
  Bind(k, 26, r.graph_node_id);
  Bind(k, 27, r.shared_memory_limit_config);
  return k.Run();
}

Status TraceRowWriter::Collective(const CollectiveRow& r) {
  Statement& c = collective_;
  c.Bind(1, r.start_ns);
  c.Bind(2, r.end_ns);
  c.Bind(3, global_pid_);
  c.Bind(4, r.device_id);
  c.Bind(5, r.stream_id);
  c.Bind(6, r.correlation_id);
  c.Bind(7, std::string_view(r.kind));
  c.Bind(8, r.bytes);
  Bind(c, 9, r.tensors);
  Bind(c, 10, r.bucket);
  return c.Run();
}

Status TraceRowWriter::Memcpy(const MemcpyRow& r) {
  Statement& m = memcpy_;
  BindActivity(m, r, global_pid_);
  m.Bind(8, r.bytes);
  m.Bind(9, r.copy_kind);
  m.Bind(10, r.src_kind);
  m.Bind(11, r.dst_kind);
  Bind(m, 12, r.src_device_id);
  Bind(m, 13, r.src_context_id);
  Bind(m, 14, r.dst_device_id);
  Bind(m, 15, r.dst_context_id);
  Bind(m, 16, r.graph_node_id);
  return m.Run();
}

Status TraceRowWriter::Memset(const MemsetRow& r) {
  Statement& m = memset_;
  BindActivity(m, r, global_pid_);
  m.Bind(8, r.value);
  m.Bind(9, r.bytes);
  Bind(m, 10, r.graph_node_id);
  m.Bind(11, r.mem_kind);
  return m.Run();
}

Status TraceRowWriter::MemoryEvent(const MemoryEventRow& r) {
  Statement& m = memory_;
  m.Bind(1, r.ts_ns);
  m.Bind(2, global_pid_);
  m.Bind(3, r.device_id);
  m.Bind(4, r.context_id);
  m.Bind(5, r.address);
  m.Bind(6, r.pc);
  m.Bind(7, r.bytes);
  m.Bind(8, r.mem_kind);
  m.Bind(9, r.operation);
  Bind(m, 10, r.name);
  m.Bind(11, r.correlation_id);
  Bind(m, 12, r.stream_id);
  Bind(m, 13, r.local_pool_address);
  Bind(m, 14, r.local_pool_release_threshold);
  Bind(m, 15, r.local_pool_size);
  Bind(m, 16, r.local_pool_utilized_size);
  Bind(m, 17, r.imported_pool_address);
  Bind(m, 18, r.imported_pool_process_id);
  Bind(m, 19, r.tc_kind);
  return m.Run();
}

Status TraceRowWriter::Step(const StepRow& r) {
  Statement& s = step_;
  s.Bind(1, global_pid_);
  s.Bind(2, int64_t{r.step});
  s.Bind(3, r.start_ns);
  s.Bind(4, r.end_ns);
  s.Bind(5, r.loss);
  s.Bind(6, int64_t{r.warmup ? 1 : 0});
  return s.Run();
}

Status TraceRowWriter::Evaluation(const EvalRow& r) {
  // A few rows a run: prepared per row.
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_->Prepare("INSERT INTO TC_EVAL(globalPid, step, start, end, loss) "
                                   "VALUES (?, ?, ?, ?, ?)"));
  insert.Bind(1, global_pid_);
  insert.Bind(2, r.step);
  insert.Bind(3, r.start_ns);
  insert.Bind(4, r.end_ns);
  insert.Bind(5, r.loss);
  return insert.Run();
}

Status TraceRowWriter::InstructionMap(const InstructionMapRow& r) {
  Statement& insert = instruction_map_;
  insert.Bind(1, global_pid_);
  insert.Bind(2, r.correlation_id);
  insert.Bind(3, r.step);
  insert.Bind(4, r.micro_step);
  insert.Bind(5, r.instruction);
  insert.Bind(6, std::string_view(r.kind));
  return insert.Run();
}

Status TraceRowWriter::Rank(const RankRow& r) {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO TC_RANK(globalPid, hostname, rank, localRank, worldSize, "
                   "deviceId, backend, device, deviceMemoryBytes, hostCores, threadsPerRank) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  insert.Bind(1, global_pid_);
  insert.Bind(2, std::string_view(r.hostname));
  insert.Bind(3, r.rank);
  insert.Bind(4, r.local_rank);
  insert.Bind(5, r.world_size);
  insert.Bind(6, r.device_id);
  insert.Bind(7, std::string_view(r.backend));
  insert.Bind(8, std::string_view(r.device));
  insert.Bind(9, r.device_memory_bytes);
  insert.Bind(10, r.host_cores);
  insert.Bind(11, r.threads_per_rank);
  return insert.Run();
}

Status TraceRowWriter::ClockAnchor(const ClockAnchorRow& r) {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO TC_CLOCK_ANCHOR(globalPid, tag, realtimeNs, monotonicNs, "
                   "sessionNs) VALUES (?, ?, ?, ?, ?)"));
  insert.Bind(1, global_pid_);
  insert.Bind(2, std::string_view(r.tag));
  insert.Bind(3, r.realtime_ns);
  insert.Bind(4, r.monotonic_ns);
  insert.Bind(5, r.session_ns);
  return insert.Run();
}

Status TraceRowWriter::RecordStats(const RecordStatsRow& r) {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_->Prepare("INSERT INTO TC_RECORD_STATS(globalPid, kind, records, "
                                   "dropped, zeroTimestamp) VALUES (?, ?, ?, ?, ?)"));
  insert.Bind(1, global_pid_);
  insert.Bind(2, std::string_view(r.kind));
  insert.Bind(3, r.records);
  insert.Bind(4, r.dropped);
  insert.Bind(5, r.zero_timestamp);
  return insert.Run();
}

Status TraceRowWriter::Stream(int64_t stream_id, std::string_view name) {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_->Prepare("INSERT OR REPLACE INTO TC_STREAM(streamId, name) "
                                   "VALUES (?, ?)"));
  insert.Bind(1, stream_id);
  insert.Bind(2, name);
  return insert.Run();
}

Status TraceRowWriter::GpuInfo(const GpuInfoRow& r) {
  DC_ASSIGN_OR_RETURN(
      Statement gpu,
      db_->Prepare("INSERT INTO TARGET_INFO_GPU(vmId, id, name, uuid, totalMemory, "
                   "memoryBandwidth, clockRate, smCount, l2CacheSize, computeMajor, "
                   "computeMinor, cuDevice) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  gpu.Bind(1, r.vm_id);
  gpu.Bind(2, r.id);
  Bind(gpu, 3, r.name);
  Bind(gpu, 4, r.uuid);
  Bind(gpu, 5, r.total_memory);
  Bind(gpu, 6, r.memory_bandwidth);
  Bind(gpu, 7, r.clock_rate);
  Bind(gpu, 8, r.sm_count);
  Bind(gpu, 9, r.l2_cache_size);
  Bind(gpu, 10, r.compute_major);
  Bind(gpu, 11, r.compute_minor);
  gpu.Bind(12, r.cu_device);
  return gpu.Run();
}

Status TraceRowWriter::SessionStart(int64_t utc_epoch_ns) {
  const time_t seconds = static_cast<time_t>(utc_epoch_ns / 1'000'000'000);
  char utc[32] = "", local[32] = "";
  tm parts{};
  if (gmtime_r(&seconds, &parts)) strftime(utc, sizeof(utc), "%Y-%m-%dT%H:%M:%S", &parts);
  if (localtime_r(&seconds, &parts)) strftime(local, sizeof(local), "%Y-%m-%dT%H:%M:%S", &parts);
  DC_ASSIGN_OR_RETURN(Statement start,
                      db_->Prepare("INSERT INTO TARGET_INFO_SESSION_START_TIME(utcEpochNs, "
                                   "utcTime, localTime) VALUES (?, ?, ?)"));
  start.Bind(1, utc_epoch_ns);
  start.Bind(2, std::string_view(utc));
  start.Bind(3, std::string_view(local));
  return start.Run();
}

}  // namespace dc::collector_internal
