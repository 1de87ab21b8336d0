#include "collector/cupti/activity_writer.h"

#include <cxxabi.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "schemas/files.h"
#include "schemas/trace_schema.h"

namespace dc::cupti_internal {

using collector_internal::Database;
using collector_internal::Statement;

namespace {

// ENUM_CUDA_MEM_KIND's Unknown; ENUM_NSYS_EVENT_CLASS of runtime and driver API rows.
constexpr int64_t kNsysMemKindUnknown = 7;
constexpr int64_t kEventClassRuntime = 0;
constexpr int64_t kEventClassDriver = 1;
constexpr int kRankShift = 48;
constexpr int64_t kTidMask = 0xFFFFFF;
constexpr char kBackend[] = "cuda";
constexpr char kUnknownKernelName[] = "<unknown kernel>";

// Bind() has int64_t and double overloads: every integer goes through this to pick int64_t.
template <typename T>
int64_t I(T value) {
  return static_cast<int64_t>(value);
}

// CUPTI's "none" is 0.
std::optional<int64_t> Optional(uint64_t value) {
  if (value == 0) return std::nullopt;
  return I(value);
}

// Index of the bracket `open` that matches the `close` bracket at s[end], or npos.
size_t MatchBackward(std::string_view s, size_t end, char open, char close) {
  int depth = 0;
  for (size_t i = end + 1; i-- > 0;) {
    if (s[i] == close) {
      ++depth;
    } else if (s[i] == open && --depth == 0) {
      return i;
    }
  }
  return std::string_view::npos;
}

std::string_view TrimRight(std::string_view s) {
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

std::string UuidText(const CUuuid& uuid) {
  // nvidia-smi's form: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
  std::string text = "GPU-";
  for (int i = 0; i < 16; ++i) {
    char hex[3];
    std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned char>(uuid.bytes[i]));
    text += hex;
    if (i == 3 || i == 5 || i == 7 || i == 9) text += '-';
  }
  return text;
}

}  // namespace

// ----- conversions -----

int64_t NsysMemKind(uint32_t cupti_memory_kind) {
  if (cupti_memory_kind == CUPTI_ACTIVITY_MEMORY_KIND_UNKNOWN ||
      cupti_memory_kind > CUPTI_ACTIVITY_MEMORY_KIND_MANAGED_STATIC) {
    return kNsysMemKindUnknown;
  }
  return static_cast<int64_t>(cupti_memory_kind) - 1;
}

std::optional<int64_t> NsysMemoryOperation(uint32_t cupti_operation) {
  switch (cupti_operation) {
    case CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION:
    case CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE:
      return static_cast<int64_t>(cupti_operation) - 1;
    default:
      return std::nullopt;
  }
}

// ----- kernel names -----

std::string DemangleKernelName(const char* mangled) {
  if (mangled == nullptr || *mangled == '\0') return kUnknownKernelName;
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  if (status != 0 || demangled == nullptr) {
    std::free(demangled);
    return mangled;
  }
  std::string name(demangled);
  std::free(demangled);
  return name;
}

std::string ShortKernelName(std::string_view demangled) {
  std::string_view name = TrimRight(demangled);
  // The parameter list; parentheses inside it ("(anonymous namespace)") are balanced.
  if (!name.empty() && name.back() == ')') {
    const size_t open = MatchBackward(name, name.size() - 1, '(', ')');
    if (open != std::string_view::npos && open > 0) name = TrimRight(name.substr(0, open));
  }
  // Template arguments of the function itself.
  if (!name.empty() && name.back() == '>') {
    const size_t open = MatchBackward(name, name.size() - 1, '<', '>');
    if (open != std::string_view::npos && open > 0) name = TrimRight(name.substr(0, open));
  }
  // The last scope component, after the return type.
  int depth = 0;
  size_t begin = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (c == '<' || c == '(' || c == '[' || c == '{') {
      ++depth;
    } else if (c == '>' || c == ')' || c == ']' || c == '}') {
      --depth;
    } else if (depth == 0 && c == ' ') {
      begin = i + 1;
    } else if (depth == 0 && c == ':' && i + 1 < name.size() && name[i + 1] == ':') {
      begin = i + 2;
      ++i;
    }
  }
  const std::string_view base = name.substr(std::min(begin, name.size()));
  return std::string(base.empty() ? TrimRight(demangled) : base);
}

std::optional<std::string> NcclCollectiveKind(std::string_view short_name) {
  static constexpr std::string_view kPrefixes[] = {"ncclDevKernel_", "ncclSymkDevKernel_",
                                                   "ncclKernel_"};
  std::string_view rest;
  bool nccl = false;
  for (std::string_view prefix : kPrefixes) {
    if (short_name.starts_with(prefix)) {
      rest = short_name.substr(prefix.size());
      nccl = true;
      break;
    }
  }
  if (!nccl) return std::nullopt;
  const std::string_view collective = rest.substr(0, rest.find('_'));
  static constexpr std::pair<std::string_view, std::string_view> kKinds[] = {
      {"AllGather", "all_gather"}, {"ReduceScatter", "reduce_scatter"},
      {"AllReduce", "all_reduce"}, {"Broadcast", "broadcast"},
      {"Reduce", "reduce"},        {"SendRecv", "send_recv"},
      {"Send", "send_recv"},       {"Recv", "send_recv"},
      {"AllToAll", "all_to_all"},  {"AlltoAll", "all_to_all"},
  };
  for (const auto& [name, kind] : kKinds) {
    if (collective == name) return std::string(kind);
  }
  return std::string("nccl");  // Generic and kernels this list does not know
}

// ----- ActivityWriter -----

StatusOr<std::unique_ptr<ActivityWriter>> ActivityWriter::Open(const std::string& path,
                                                               int64_t global_pid,
                                                               SessionClock clock,
                                                               ApiNameFn api_name, bool streamed) {
  const std::string file = streamed ? path : TempPathBeside(path);
  for (const char* suffix : {"", "-wal", "-shm"}) std::remove((file + suffix).c_str());
  auto db = Database::Create(file);
  if (!db.ok()) return db.status();
  std::unique_ptr<ActivityWriter> writer(new ActivityWriter(
      std::move(db).value(), path, file, global_pid, clock, std::move(api_name)));
  writer->streamed_ = streamed;
  Status status = [&]() -> Status {
    // Streamed: WAL, so every committed checkpoint survives the process being killed.
    DC_RETURN_IF_ERROR(writer->db_.Exec(streamed
                                            ? "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
                                            : "PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"));
    DC_RETURN_IF_ERROR(writer->db_.Exec(TraceSchemaSql()));
    // External correlation records: correlation id -> (step << 32 | instruction).
    DC_RETURN_IF_ERROR(
        writer->db_.Exec("CREATE TEMP TABLE dc_external(correlationId INTEGER NOT NULL, "
                         "externalId INTEGER NOT NULL)"));
    return writer->PrepareStatements();
  }();
  if (!status.ok()) return status;  // the destructor removes the temp file
  return writer;
}

ActivityWriter::ActivityWriter(Database db, std::string path, std::string tmp_path,
                               int64_t global_pid, SessionClock clock, ApiNameFn api_name)
    : db_(std::move(db)),
      path_(std::move(path)),
      tmp_path_(std::move(tmp_path)),
      global_pid_(global_pid),
      clock_(clock),
      api_name_(std::move(api_name)) {}

ActivityWriter::~ActivityWriter() {
  if (finished_) return;
  // Statements must go before the connection closes.
  rows_.Close();
  insert_api_ = Statement();
  insert_external_ = Statement();
  (void)db_.Close();
  if (!streamed_) std::remove(tmp_path_.c_str());  // a streamed file keeps its checkpoints
}

Status ActivityWriter::PrepareStatements() {
  DC_ASSIGN_OR_RETURN(rows_, collector_internal::TraceRowWriter::Create(&db_, global_pid_));
  DC_ASSIGN_OR_RETURN(
      insert_api_,
      db_.Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME(start, end, eventClass, globalTid, "
                  "correlationId, nameId, returnValue) VALUES (?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(insert_external_,
                      db_.Prepare("INSERT INTO temp.dc_external(correlationId, externalId) "
                                  "VALUES (?, ?)"));
  return Status::Ok();
}

void ActivityWriter::Keep(Status status) {
  if (error_.ok() && !status.ok()) error_ = std::move(status);
}

int64_t ActivityWriter::Intern(std::string_view value) {
  auto [it, inserted] =
      string_ids_.try_emplace(std::string(value), static_cast<int64_t>(string_ids_.size()) + 1);
  if (inserted && error_.ok()) {
    Keep(rows_.String(it->second, value));
  }
  return it->second;
}

const ActivityWriter::KernelNames& ActivityWriter::NamesOf(const char* mangled) {
  const std::string key = mangled != nullptr && *mangled != '\0' ? mangled : kUnknownKernelName;
  auto it = kernel_names_.find(key);
  if (it != kernel_names_.end()) return it->second;
  const std::string demangled = DemangleKernelName(key.c_str());
  const std::string short_name = ShortKernelName(demangled);
  KernelNames names;
  names.mangled_id = Intern(key);
  names.demangled_id = Intern(demangled);
  names.short_id = Intern(short_name);
  names.collective = NcclCollectiveKind(short_name);
  return kernel_names_.emplace(key, std::move(names)).first->second;
}

Status ActivityWriter::BeginBatch() {
  if (in_batch_ || !error_.ok()) return error_;
  Status status = db_.Exec("BEGIN");
  in_batch_ = status.ok();
  Keep(status);
  return status;
}

Status ActivityWriter::EndBatch() {
  if (!in_batch_) return error_;
  in_batch_ = false;
  Keep(db_.Exec("COMMIT"));
  return error_;
}

void ActivityWriter::AddBuffer(size_t dropped_records) {
  ++buffers_;
  dropped_records_ += static_cast<int64_t>(dropped_records);
}

void ActivityWriter::Add(const CUpti_Activity* record) {
  switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      AddKernel(*reinterpret_cast<const CUpti_ActivityKernel10*>(record));
      break;
    case CUPTI_ACTIVITY_KIND_MEMCPY:
      AddMemcpy(*reinterpret_cast<const CUpti_ActivityMemcpy6*>(record));
      break;
    case CUPTI_ACTIVITY_KIND_MEMCPY2:
      AddPeerMemcpy(*reinterpret_cast<const CUpti_ActivityMemcpyPtoP4*>(record));
      break;
    case CUPTI_ACTIVITY_KIND_MEMSET:
      AddMemset(*reinterpret_cast<const CUpti_ActivityMemset4*>(record));
      break;
    case CUPTI_ACTIVITY_KIND_MEMORY2:
      AddMemory(*reinterpret_cast<const CUpti_ActivityMemory4*>(record));
      break;
    case CUPTI_ACTIVITY_KIND_MEMORY_POOL:
      // No table for pool creation/trim in the schema: counted; pool sizes ride on the memory
      // events' localMemoryPool* columns.
      ++Stats("memory_pool").seen;
      break;
    case CUPTI_ACTIVITY_KIND_RUNTIME:
      AddApi(*reinterpret_cast<const CUpti_ActivityAPI*>(record), /*driver=*/false);
      break;
    case CUPTI_ACTIVITY_KIND_DRIVER:
      AddApi(*reinterpret_cast<const CUpti_ActivityAPI*>(record), /*driver=*/true);
      break;
    case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION:
      AddExternalCorrelation(*reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record));
      break;
    case CUPTI_ACTIVITY_KIND_OVERHEAD:
      AddOverhead(*reinterpret_cast<const CUpti_ActivityOverhead3*>(record));
      break;
    case CUPTI_ACTIVITY_KIND_DEVICE:
      AddDevice(*reinterpret_cast<const CUpti_ActivityDevice5*>(record));
      break;
    default:
      ++Stats("other").seen;
      break;
  }
}

bool ActivityWriter::Admit(const char* kind, uint64_t start, uint64_t end) {
  KindStats& stats = Stats(kind);
  ++stats.seen;
  // start == end == 0: CUPTI could not take the timestamps (device buffer full).
  if (start == 0 || end == 0 || end < start) {
    ++stats.zero_timestamp;
    return false;
  }
  return error_.ok();
}

void ActivityWriter::AddKernel(const CUpti_ActivityKernel10& r) {
  const KernelNames& names = NamesOf(r.name);
  if (!Admit(names.collective ? "collective" : "kernel", r.start, r.end)) return;
  auto k = DeviceActivity<collector_internal::KernelRow>(r);
  k.demangled_name_id = names.demangled_id;
  k.short_name_id = names.short_id;
  k.mangled_name_id = names.mangled_id;
  k.launch_type = I(r.launchType);
  k.cache_config = I(r.cacheConfig.config.executed);
  k.registers_per_thread = I(r.registersPerThread);
  k.grid_x = I(r.gridX);
  k.grid_y = I(r.gridY);
  k.grid_z = I(r.gridZ);
  k.block_x = I(r.blockX);
  k.block_y = I(r.blockY);
  k.block_z = I(r.blockZ);
  k.static_shared_memory = I(r.staticSharedMemory);
  k.dynamic_shared_memory = I(r.dynamicSharedMemory);
  k.local_memory_per_thread = I(r.localMemoryPerThread);
  k.local_memory_total =
      r.localMemoryTotal_v2 != 0 ? I(r.localMemoryTotal_v2) : I(r.localMemoryTotal);
  k.grid_id = I(r.gridId);
  k.shared_memory_executed = I(r.sharedMemoryExecuted);
  k.graph_node_id = Optional(r.graphNodeId);
  k.shared_memory_limit_config = I(r.shmemLimitConfig);
  Keep(rows_.Kernel(k));
  if (!names.collective) return;
  // Its payload, tensors and bucket come from the instruction at Finish.
  Keep(rows_.Collective({k.start_ns, k.end_ns, k.device_id, k.stream_id, k.correlation_id,
                         *names.collective, 0, std::nullopt, std::nullopt}));
}

void ActivityWriter::AddMemcpy(const CUpti_ActivityMemcpy6& r) {
  if (!Admit("memcpy", r.start, r.end)) return;
  auto m = DeviceActivity<collector_internal::MemcpyRow>(r);
  m.bytes = I(r.bytes);
  m.copy_kind = I(r.copyKind);  // ENUM_CUDA_MEMCPY_OPER numbers CUPTI's copy kinds as they are
  m.src_kind = NsysMemKind(r.srcKind);
  m.dst_kind = NsysMemKind(r.dstKind);
  m.graph_node_id = Optional(r.graphNodeId);
  Keep(rows_.Memcpy(m));
}

void ActivityWriter::AddPeerMemcpy(const CUpti_ActivityMemcpyPtoP4& r) {
  if (!Admit("memcpy", r.start, r.end)) return;
  auto m = DeviceActivity<collector_internal::MemcpyRow>(r);
  m.bytes = I(r.bytes);
  m.copy_kind = I(r.copyKind);
  m.src_kind = NsysMemKind(r.srcKind);
  m.dst_kind = NsysMemKind(r.dstKind);
  m.src_device_id = I(r.srcDeviceId);
  m.src_context_id = I(r.srcContextId);
  m.dst_device_id = I(r.dstDeviceId);
  m.dst_context_id = I(r.dstContextId);
  m.graph_node_id = Optional(r.graphNodeId);
  Keep(rows_.Memcpy(m));
}

void ActivityWriter::AddMemset(const CUpti_ActivityMemset4& r) {
  if (!Admit("memset", r.start, r.end)) return;
  auto m = DeviceActivity<collector_internal::MemsetRow>(r);
  m.value = I(r.value);
  m.bytes = I(r.bytes);
  m.graph_node_id = Optional(r.graphNodeId);
  m.mem_kind = NsysMemKind(r.memoryKind);
  Keep(rows_.Memset(m));
}

void ActivityWriter::AddMemory(const CUpti_ActivityMemory4& r) {
  KindStats& stats = Stats("memory");
  ++stats.seen;
  if (r.timestamp == 0) {
    ++stats.zero_timestamp;
    return;
  }
  const std::optional<int64_t> operation = NsysMemoryOperation(r.memoryOperationType);
  if (!operation) {
    ++invalid_records_;
    return;
  }
  if (!error_.ok()) return;
  collector_internal::MemoryEventRow m;
  m.ts_ns = clock_.ToSessionNs(r.timestamp);
  m.device_id = I(r.deviceId);
  m.context_id = I(r.contextId);
  m.address = I(r.address);
  m.pc = I(r.PC);
  m.bytes = I(r.bytes);
  m.mem_kind = NsysMemKind(r.memoryKind);
  m.operation = *operation;
  if (r.name != nullptr) m.name = std::string(r.name);
  m.correlation_id = I(r.correlationId);
  if (r.isAsync) m.stream_id = I(r.streamId);
  const auto& pool = r.memoryPoolConfig;
  if (pool.memoryPoolType == CUPTI_ACTIVITY_MEMORY_POOL_TYPE_LOCAL) {
    m.local_pool_address = I(pool.address);
    m.local_pool_release_threshold = I(pool.releaseThreshold);
    m.local_pool_size = I(pool.pool.size);
    m.local_pool_utilized_size = I(pool.utilizedSize);
  } else if (pool.memoryPoolType == CUPTI_ACTIVITY_MEMORY_POOL_TYPE_IMPORTED) {
    m.imported_pool_address = I(pool.address);
    m.imported_pool_process_id = I(pool.pool.processId);
  }
  Keep(rows_.MemoryEvent(m));
}

void ActivityWriter::AddApi(const CUpti_ActivityAPI& r, bool driver) {
  if (!Admit(driver ? "driver" : "runtime", r.start, r.end)) return;
  auto [it, inserted] = api_name_ids_.try_emplace({driver, r.cbid}, 0);
  if (inserted) it->second = Intern(api_name_(driver, r.cbid));
  Statement& a = insert_api_;
  a.Bind(1, clock_.ToSessionNs(r.start));
  a.Bind(2, clock_.ToSessionNs(r.end));
  a.Bind(3, driver ? kEventClassDriver : kEventClassRuntime);
  a.Bind(4, global_pid_ | (I(r.threadId) & kTidMask));
  a.Bind(5, I(r.correlationId));
  a.Bind(6, it->second);
  a.Bind(7, I(r.returnValue));
  Keep(a.Run());
}

void ActivityWriter::AddExternalCorrelation(const CUpti_ActivityExternalCorrelation& r) {
  ++Stats("external_correlation").seen;
  // Only ours: the executor's (step, instruction) ids. Other kinds (OpenACC, a framework's
  // CUSTOM1/2) have no table in the schema.
  if (r.externalKind != CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0 || !error_.ok()) return;
  insert_external_.Bind(1, I(r.correlationId));
  insert_external_.Bind(2, static_cast<int64_t>(r.externalId));
  Keep(insert_external_.Run());
}

void ActivityWriter::AddOverhead(const CUpti_ActivityOverhead3& r) {
  KindStats& stats = Stats("overhead");
  ++stats.seen;
  if (r.start == 0 || r.end < r.start) {
    ++stats.zero_timestamp;
    return;
  }
  overhead_ns_ += static_cast<int64_t>(r.end - r.start);
}

void ActivityWriter::AddDevice(const CUpti_ActivityDevice5& r) {
  ++Stats("device").seen;
  DeviceInfo& info = devices_[r.id];
  info.name = r.name != nullptr ? r.name : "";
  info.uuid = UuidText(r.uuid);
  info.memory_bytes = I(r.globalMemorySize);
  info.bandwidth_bytes_per_s = I(r.globalMemoryBandwidth) * 1000;  // CUPTI: kB/s
  info.clock_hz = I(r.coreClockRate) * 1000;                       // CUPTI: kHz
  info.l2_bytes = I(r.l2CacheSize);
  info.sm_count = I(r.numMultiprocessors);
  info.compute_major = I(r.computeCapabilityMajor);
  info.compute_minor = I(r.computeCapabilityMinor);
}

// ----- Finish -----

Status ActivityWriter::DeleteOutOfWindow(const std::vector<WindowRow>& windows,
                                         TraceCounts* counts) {
  std::string inside;
  for (const WindowRow& w : windows) {
    inside += std::string(inside.empty() ? "" : " OR ") + "(start BETWEEN " +
              std::to_string(w.start_ns) + " AND " + std::to_string(w.end_ns) + ")";
  }
  const std::string outside = inside.empty() ? "1" : "NOT (" + inside + ")";
  // TC_COLLECTIVE rows mirror kernel rows: deleted with them, not counted twice.
  for (const char* table :
       {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
        "CUPTI_ACTIVITY_KIND_RUNTIME", "TC_COLLECTIVE"}) {
    const std::string where = std::string(" FROM ") + table + " WHERE " + outside;
    if (std::string_view(table) != "TC_COLLECTIVE") {
      DC_ASSIGN_OR_RETURN(int64_t n, db_.QueryInt("SELECT count(*)" + where));
      counts->out_of_window_records += n;
    }
    DC_RETURN_IF_ERROR(db_.Exec("DELETE" + where));
  }
  return Status::Ok();
}

Status ActivityWriter::WriteInstructionMap(const std::vector<InstructionRow>& instructions,
                                           int64_t after, int64_t through) {
  DC_RETURN_IF_ERROR(
      db_.Exec("CREATE TEMP TABLE IF NOT EXISTS dc_instruction(instruction INTEGER PRIMARY KEY, "
               "kind TEXT, microStep INTEGER, bytes INTEGER, tensors INTEGER, bucket INTEGER)"));
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_.Prepare("INSERT OR REPLACE INTO temp.dc_instruction(instruction, kind, "
                                  "microStep, bytes, tensors, bucket) VALUES (?, ?, ?, ?, ?, ?)"));
  for (const InstructionRow& row : instructions) {
    insert.Bind(1, I(row.instruction));
    if (row.kind.empty()) {
      insert.BindNull(2);
    } else {
      insert.Bind(2, row.kind);
    }
    insert.Bind(3, I(row.micro_step));
    insert.Bind(4, row.bytes);
    insert.Bind(5, I(row.tensors));
    insert.Bind(6, I(row.bucket));
    DC_RETURN_IF_ERROR(insert.Run());
  }
  std::string range;
  if (after < 0) {
    DC_RETURN_IF_ERROR(db_.Exec("DELETE FROM TC_INSTRUCTION_MAP"));  // a checkpoint's, if any
  } else {
    range =
        " AND e.rowid > " + std::to_string(after) + " AND e.rowid <= " + std::to_string(through);
  }
  // externalId = step << 32 | instruction (CuptiCollector::PushInstruction).
  const std::string mapped =
      "(SELECT DISTINCT e.correlationId AS correlationId, e.externalId >> 32 AS step, "
      "e.externalId & 4294967295 AS instruction, i.kind AS kind, i.microStep AS microStep, "
      "i.bytes AS bytes, i.tensors AS tensors, i.bucket AS bucket FROM temp.dc_external AS e "
      "LEFT JOIN temp.dc_instruction AS i ON i.instruction = (e.externalId & 4294967295) "
      "WHERE e.correlationId <> 0" +
      range + ")";
  // One row per (activity correlation id, instruction); kind from the executor, else from the
  // activity. A correlation id can cover several activities (a graph launch): one row.
  DC_RETURN_IF_ERROR(db_.Exec(
      "INSERT INTO TC_INSTRUCTION_MAP(globalPid, correlationId, step, microStep, instruction, "
      "kind) SELECT " +
      std::to_string(global_pid_) +
      ", m.correlationId, m.step, m.microStep, m.instruction, COALESCE(m.kind, MIN(a.kind)) "
      "FROM " +
      mapped +
      " AS m JOIN (SELECT k.correlationId AS correlationId, COALESCE(c.kind, 'compute') AS kind "
      "FROM CUPTI_ACTIVITY_KIND_KERNEL AS k LEFT JOIN TC_COLLECTIVE AS c ON "
      "c.correlationId = k.correlationId AND c.start = k.start "
      "UNION ALL SELECT correlationId, 'memcpy' FROM CUPTI_ACTIVITY_KIND_MEMCPY "
      "UNION ALL SELECT correlationId, 'memset' FROM CUPTI_ACTIVITY_KIND_MEMSET) AS a "
      "ON a.correlationId = m.correlationId "
      "GROUP BY m.correlationId, m.step, m.instruction ORDER BY m.correlationId, m.step, "
      "m.instruction"));
  // Collectives take their payload from the instruction; where NCCL's kernel name does not
  // say which collective ran (Generic, SendRecv), the executor's kind wins.
  return db_.Exec(
      "UPDATE TC_COLLECTIVE SET bytes = COALESCE(m.bytes, 0), tensors = m.tensors, "
      "bucket = m.bucket, kind = CASE WHEN TC_COLLECTIVE.kind IN ('nccl', 'send_recv') AND "
      "m.kind IS NOT NULL THEN m.kind ELSE TC_COLLECTIVE.kind END FROM " +
      mapped + " AS m WHERE TC_COLLECTIVE.correlationId = m.correlationId");
}

StatusOr<int64_t> ActivityWriter::RankDevice(const RankRow& rank) {
  if (rank.device_id >= 0) return I(rank.device_id);
  for (const char* table : {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
                            "CUDA_GPU_MEMORY_USAGE_EVENTS"}) {
    DC_ASSIGN_OR_RETURN(int64_t rows, db_.QueryInt(std::string("SELECT count(*) FROM ") + table));
    if (rows == 0) continue;
    return db_.QueryInt(std::string("SELECT deviceId FROM ") + table +
                        " GROUP BY deviceId ORDER BY count(*) DESC, deviceId LIMIT 1");
  }
  return devices_.empty() ? int64_t{0} : I(devices_.begin()->first);
}

Status ActivityWriter::WriteRank(const RankRow& rank, int64_t device_id) {
  auto device = devices_.find(static_cast<uint32_t>(device_id));
  return rows_.Rank(
      {rank.hostname, I(rank.rank), I(rank.local_rank), I(rank.world_size), device_id, kBackend,
       device != devices_.end() ? device->second.name : "cuda:" + std::to_string(device_id),
       device != devices_.end() ? device->second.memory_bytes : int64_t{0}});
}

Status ActivityWriter::WriteRecordStats(TraceCounts* counts) {
  // Table-backed kinds count the rows written (after the window filter); the others what
  // CUPTI delivered.
  DC_ASSIGN_OR_RETURN(int64_t kernel_rows,
                      db_.QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"));
  DC_ASSIGN_OR_RETURN(counts->collectives, db_.QueryInt("SELECT count(*) FROM TC_COLLECTIVE"));
  counts->kernels = kernel_rows - counts->collectives;
  DC_ASSIGN_OR_RETURN(counts->memcpys,
                      db_.QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY"));
  DC_ASSIGN_OR_RETURN(counts->memsets,
                      db_.QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMSET"));
  DC_ASSIGN_OR_RETURN(counts->memory_events,
                      db_.QueryInt("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS"));
  DC_ASSIGN_OR_RETURN(int64_t runtime_rows,
                      db_.QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE "
                                   "eventClass = " +
                                   std::to_string(kEventClassRuntime)));
  DC_ASSIGN_OR_RETURN(counts->api_calls,
                      db_.QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME"));
  DC_ASSIGN_OR_RETURN(counts->mapped_activities,
                      db_.QueryInt("SELECT count(*) FROM TC_INSTRUCTION_MAP"));
  const std::map<std::string, int64_t> rows = {
      {"kernel", counts->kernels},
      {"collective", counts->collectives},
      {"memcpy", counts->memcpys},
      {"memset", counts->memsets},
      {"memory", counts->memory_events},
      {"runtime", runtime_rows},
      {"driver", counts->api_calls - runtime_rows},
  };
  std::map<std::string, std::pair<int64_t, int64_t>> table;  // kind -> records, zero timestamp
  for (const auto& [kind, n] : rows) table[kind] = {n, 0};
  for (const auto& [kind, stats] : stats_) {
    auto& entry = table[kind];
    if (!rows.contains(kind)) entry.first = stats.seen;
    entry.second = stats.zero_timestamp;
    counts->zero_timestamp_records += stats.zero_timestamp;
  }
  for (const auto& [kind, entry] : table) {
    DC_RETURN_IF_ERROR(rows_.RecordStats({kind, entry.first, 0, entry.second}));
  }
  // CUPTI counts dropped records per buffer (context and stream), not per kind.
  DC_RETURN_IF_ERROR(rows_.RecordStats({"buffers", buffers_, dropped_records_, 0}));
  counts->dropped_records = dropped_records_;
  counts->overhead_ns = overhead_ns_;
  return Status::Ok();
}

Status ActivityWriter::WriteTargetInfo(int64_t rank_device_id, int64_t vm_id) {
  // The rank's device and every device this process put work on.
  std::set<int64_t> ids = {rank_device_id};
  DC_ASSIGN_OR_RETURN(Statement used,
                      db_.Prepare("SELECT DISTINCT deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL "
                                  "UNION SELECT deviceId FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                                  "UNION SELECT deviceId FROM CUPTI_ACTIVITY_KIND_MEMSET"));
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, used.Next());
    if (!row) break;
    ids.insert(used.ColumnInt(0));
  }
  for (int64_t id : ids) {
    collector_internal::GpuInfoRow gpu;
    gpu.vm_id = vm_id;
    gpu.id = id;
    gpu.cu_device = id;
    // Without a CUPTI device record (collection began after CUDA initialized): the id only.
    auto it = devices_.find(static_cast<uint32_t>(id));
    if (it != devices_.end()) {
      const DeviceInfo& d = it->second;
      gpu.name = d.name;
      gpu.uuid = d.uuid;
      gpu.total_memory = d.memory_bytes;
      gpu.memory_bandwidth = d.bandwidth_bytes_per_s;
      gpu.clock_rate = d.clock_hz;
      gpu.sm_count = d.sm_count;
      gpu.l2_cache_size = d.l2_bytes;
      gpu.compute_major = d.compute_major;
      gpu.compute_minor = d.compute_minor;
    }
    DC_RETURN_IF_ERROR(rows_.GpuInfo(gpu));
  }
  return rows_.SessionStart(clock_.session_start_utc_ns);
}

Status ActivityWriter::WriteMetadata(
    const std::vector<std::pair<std::string, std::string>>& metadata, const TraceCounts& counts) {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_.Prepare("INSERT INTO META_DATA_CAPTURE(name, value) VALUES (?, ?)"));
  // Per-process figures carry the globalPid: every rank's rows land in one merged table.
  const std::string pid = std::to_string(global_pid_);
  std::vector<std::pair<std::string, std::string>> rows = metadata;
  rows.emplace_back("dc.cupti_overhead_ns." + pid, std::to_string(counts.overhead_ns));
  rows.emplace_back("dc.out_of_window_records." + pid,
                    std::to_string(counts.out_of_window_records));
  if (invalid_records_ > 0) {
    rows.emplace_back("dc.invalid_memory_records." + pid, std::to_string(invalid_records_));
  }
  for (const auto& [name, value] : rows) {
    insert.Bind(1, name);
    insert.Bind(2, value);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status ActivityWriter::WriteNewRows(const std::vector<ClockAnchorRow>& anchors,
                                    const std::vector<StepRow>& steps,
                                    const std::vector<EvalRow>& evals,
                                    const std::vector<std::pair<int64_t, std::string>>& streams,
                                    Written* written) {
  *written = written_;
  for (const ClockAnchorRow& anchor : anchors) {
    if (!written->anchors.insert(anchor.tag).second) continue;
    DC_RETURN_IF_ERROR(rows_.ClockAnchor(anchor));
  }
  for (; written->steps < steps.size(); ++written->steps) {
    DC_RETURN_IF_ERROR(rows_.Step(steps[written->steps]));
  }
  for (; written->evals < evals.size(); ++written->evals) {
    DC_RETURN_IF_ERROR(rows_.Evaluation(evals[written->evals]));
  }
  for (; written->streams < streams.size(); ++written->streams) {
    const auto& [id, name] = streams[written->streams];
    DC_RETURN_IF_ERROR(rows_.Stream(id, name));
  }
  return Status::Ok();
}

Status ActivityWriter::Checkpoint(const CheckpointInput& input) {
  if (!streamed_) return Status::Error(path_ + ": a checkpoint needs a streamed trace");
  if (finished_) return Status::Error(path_ + ": the trace is finished");
  DC_RETURN_IF_ERROR(EndBatch());
  int64_t device_id = rank_device_, through = external_mark_;
  Written written;
  Status status = [&]() -> Status {
    DC_RETURN_IF_ERROR(db_.Exec("BEGIN"));
    if (!header_written_) {
      DC_ASSIGN_OR_RETURN(device_id, RankDevice(input.rank));
      DC_RETURN_IF_ERROR(WriteRank(input.rank, device_id));
      DC_RETURN_IF_ERROR(WriteTargetInfo(device_id, I(std::max(input.rank.rank, 0)) << kRankShift));
      if (input.write_blobs) DC_RETURN_IF_ERROR(input.write_blobs(&db_));
    }
    DC_RETURN_IF_ERROR(
        WriteNewRows(input.anchors, input.steps, input.evals, input.streams, &written));
    DC_ASSIGN_OR_RETURN(through,
                        db_.QueryInt("SELECT COALESCE(MAX(rowid), 0) FROM temp.dc_external"));
    DC_RETURN_IF_ERROR(WriteInstructionMap(input.instructions, external_mark_, through));
    return db_.Exec("COMMIT");
  }();
  if (!status.ok()) {
    (void)db_.Exec("ROLLBACK");
    Keep(status);
    return status;
  }
  header_written_ = true;
  rank_device_ = device_id;
  external_mark_ = through;
  written_ = std::move(written);
  return Status::Ok();
}

StatusOr<TraceCounts> ActivityWriter::Finish(const FinishInput& input) {
  DC_RETURN_IF_ERROR(EndBatch());
  TraceCounts counts;
  Status status = [&]() -> Status {
    DC_RETURN_IF_ERROR(db_.Exec("BEGIN"));
    if (input.windows) DC_RETURN_IF_ERROR(DeleteOutOfWindow(*input.windows, &counts));
    // The whole map, from every external correlation (replacing what checkpoints wrote: the
    // window may have taken activities they mapped).
    DC_RETURN_IF_ERROR(WriteInstructionMap(input.instructions, -1, 0));
    int64_t device_id = rank_device_;
    if (!header_written_) {
      DC_ASSIGN_OR_RETURN(device_id, RankDevice(input.rank));
      DC_RETURN_IF_ERROR(WriteRank(input.rank, device_id));
    }
    Written written;
    DC_RETURN_IF_ERROR(
        WriteNewRows(input.anchors, input.steps, input.evals, input.streams, &written));
    DC_RETURN_IF_ERROR(WriteRecordStats(&counts));
    if (!header_written_) {
      DC_RETURN_IF_ERROR(WriteTargetInfo(device_id, I(std::max(input.rank.rank, 0)) << kRankShift));
    }
    DC_RETURN_IF_ERROR(WriteMetadata(input.metadata, counts));
    return db_.Exec("COMMIT");
  }();
  if (!status.ok()) return status;  // the destructor removes the temp file
  rows_.Close();
  insert_api_ = Statement();
  insert_external_ = Statement();
  if (streamed_) {
    // One self-contained file again: the WAL folded in and removed; it is in place already.
    DC_RETURN_IF_ERROR(db_.Exec("PRAGMA journal_mode=DELETE"));
    DC_RETURN_IF_ERROR(db_.Close());
    finished_ = true;
    return counts;
  }
  DC_RETURN_IF_ERROR(db_.Close());
  if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    return Status::Error(path_ + ": cannot rename the finished trace into place (" +
                         std::strerror(errno) + ")");
  }
  finished_ = true;
  return counts;
}

}  // namespace dc::cupti_internal
