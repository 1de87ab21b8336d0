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

void BindOptional(Statement& stmt, int index, uint64_t value) {
  if (value == 0) {
    stmt.BindNull(index);
  } else {
    stmt.Bind(index, I(value));
  }
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
                                                               ApiNameFn api_name) {
  const std::string tmp = TempPathBeside(path);
  std::remove(tmp.c_str());
  auto db = Database::Create(tmp);
  if (!db.ok()) return db.status();
  std::unique_ptr<ActivityWriter> writer(
      new ActivityWriter(std::move(db).value(), path, tmp, global_pid, clock, std::move(api_name)));
  Status status = [&]() -> Status {
    DC_RETURN_IF_ERROR(writer->db_.Exec("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"));
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
  insert_string_ = Statement();
  insert_kernel_ = Statement();
  insert_collective_ = Statement();
  insert_memcpy_ = Statement();
  insert_memset_ = Statement();
  insert_memory_ = Statement();
  insert_api_ = Statement();
  insert_external_ = Statement();
  (void)db_.Close();
  std::remove(tmp_path_.c_str());
}

Status ActivityWriter::PrepareStatements() {
  DC_ASSIGN_OR_RETURN(insert_string_,
                      db_.Prepare("INSERT INTO StringIds(id, value) VALUES (?, ?)"));
  DC_ASSIGN_OR_RETURN(
      insert_kernel_,
      db_.Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL(start, end, deviceId, contextId, "
                  "streamId, correlationId, globalPid, demangledName, shortName, mangledName, "
                  "launchType, cacheConfig, registersPerThread, gridX, gridY, gridZ, blockX, "
                  "blockY, blockZ, staticSharedMemory, dynamicSharedMemory, "
                  "localMemoryPerThread, localMemoryTotal, gridId, sharedMemoryExecuted, "
                  "graphNodeId, sharedMemoryLimitConfig) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                  "?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(
      insert_collective_,
      db_.Prepare("INSERT INTO TC_COLLECTIVE(start, end, globalPid, deviceId, streamId, "
                  "correlationId, kind, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, 0)"));
  DC_ASSIGN_OR_RETURN(
      insert_memcpy_,
      db_.Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY(start, end, deviceId, contextId, "
                  "streamId, correlationId, globalPid, bytes, copyKind, srcKind, dstKind, "
                  "srcDeviceId, srcContextId, dstDeviceId, dstContextId, graphNodeId) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(
      insert_memset_,
      db_.Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET(start, end, deviceId, contextId, "
                  "streamId, correlationId, globalPid, value, bytes, graphNodeId, memKind) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  DC_ASSIGN_OR_RETURN(
      insert_memory_,
      db_.Prepare("INSERT INTO CUDA_GPU_MEMORY_USAGE_EVENTS(start, globalPid, deviceId, "
                  "contextId, address, pc, bytes, memKind, memoryOperationType, name, "
                  "correlationId, streamId, localMemoryPoolAddress, "
                  "localMemoryPoolReleaseThreshold, localMemoryPoolSize, "
                  "localMemoryPoolUtilizedSize, importedMemoryPoolAddress, "
                  "importedMemoryPoolProcessId) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
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
    insert_string_.Bind(1, it->second);
    insert_string_.Bind(2, value);
    Keep(insert_string_.Run());
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
  const int64_t start_ns = clock_.ToSessionNs(r.start);
  const int64_t end_ns = clock_.ToSessionNs(r.end);
  Statement& k = insert_kernel_;
  BindDeviceActivity(k, r);
  k.Bind(8, names.demangled_id);
  k.Bind(9, names.short_id);
  k.Bind(10, names.mangled_id);
  k.Bind(11, I(r.launchType));
  k.Bind(12, I(r.cacheConfig.config.executed));
  k.Bind(13, I(r.registersPerThread));
  k.Bind(14, I(r.gridX));
  k.Bind(15, I(r.gridY));
  k.Bind(16, I(r.gridZ));
  k.Bind(17, I(r.blockX));
  k.Bind(18, I(r.blockY));
  k.Bind(19, I(r.blockZ));
  k.Bind(20, I(r.staticSharedMemory));
  k.Bind(21, I(r.dynamicSharedMemory));
  k.Bind(22, I(r.localMemoryPerThread));
  k.Bind(23, r.localMemoryTotal_v2 != 0 ? I(r.localMemoryTotal_v2) : I(r.localMemoryTotal));
  k.Bind(24, I(r.gridId));
  k.Bind(25, I(r.sharedMemoryExecuted));
  BindOptional(k, 26, r.graphNodeId);
  k.Bind(27, I(r.shmemLimitConfig));
  Keep(k.Run());
  if (!names.collective) return;
  Statement& c = insert_collective_;
  c.Bind(1, start_ns);
  c.Bind(2, end_ns);
  c.Bind(3, global_pid_);
  c.Bind(4, I(r.deviceId));
  c.Bind(5, I(r.streamId));
  c.Bind(6, I(r.correlationId));
  c.Bind(7, std::string_view(*names.collective));
  Keep(c.Run());
}

void ActivityWriter::AddMemcpy(const CUpti_ActivityMemcpy6& r) {
  if (!Admit("memcpy", r.start, r.end)) return;
  Statement& m = insert_memcpy_;
  BindDeviceActivity(m, r);
  m.Bind(8, I(r.bytes));
  m.Bind(9, I(r.copyKind));  // ENUM_CUDA_MEMCPY_OPER numbers CUPTI's copy kinds as they are
  m.Bind(10, NsysMemKind(r.srcKind));
  m.Bind(11, NsysMemKind(r.dstKind));
  for (int index = 12; index <= 15; ++index) m.BindNull(index);  // peer copies only
  BindOptional(m, 16, r.graphNodeId);
  Keep(m.Run());
}

void ActivityWriter::AddPeerMemcpy(const CUpti_ActivityMemcpyPtoP4& r) {
  if (!Admit("memcpy", r.start, r.end)) return;
  Statement& m = insert_memcpy_;
  BindDeviceActivity(m, r);
  m.Bind(8, I(r.bytes));
  m.Bind(9, I(r.copyKind));
  m.Bind(10, NsysMemKind(r.srcKind));
  m.Bind(11, NsysMemKind(r.dstKind));
  m.Bind(12, I(r.srcDeviceId));
  m.Bind(13, I(r.srcContextId));
  m.Bind(14, I(r.dstDeviceId));
  m.Bind(15, I(r.dstContextId));
  BindOptional(m, 16, r.graphNodeId);
  Keep(m.Run());
}

void ActivityWriter::AddMemset(const CUpti_ActivityMemset4& r) {
  if (!Admit("memset", r.start, r.end)) return;
  Statement& m = insert_memset_;
  BindDeviceActivity(m, r);
  m.Bind(8, I(r.value));
  m.Bind(9, I(r.bytes));
  BindOptional(m, 10, r.graphNodeId);
  m.Bind(11, NsysMemKind(r.memoryKind));
  Keep(m.Run());
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
  Statement& m = insert_memory_;
  m.Bind(1, clock_.ToSessionNs(r.timestamp));
  m.Bind(2, global_pid_);
  m.Bind(3, I(r.deviceId));
  m.Bind(4, I(r.contextId));
  m.Bind(5, I(r.address));
  m.Bind(6, I(r.PC));
  m.Bind(7, I(r.bytes));
  m.Bind(8, NsysMemKind(r.memoryKind));
  m.Bind(9, *operation);
  if (r.name != nullptr) {
    m.Bind(10, std::string_view(r.name));
  } else {
    m.BindNull(10);
  }
  m.Bind(11, I(r.correlationId));
  if (r.isAsync) {
    m.Bind(12, I(r.streamId));
  } else {
    m.BindNull(12);
  }
  for (int index = 13; index <= 18; ++index) m.BindNull(index);
  const auto& pool = r.memoryPoolConfig;
  if (pool.memoryPoolType == CUPTI_ACTIVITY_MEMORY_POOL_TYPE_LOCAL) {
    m.Bind(13, I(pool.address));
    m.Bind(14, I(pool.releaseThreshold));
    m.Bind(15, I(pool.pool.size));
    m.Bind(16, I(pool.utilizedSize));
  } else if (pool.memoryPoolType == CUPTI_ACTIVITY_MEMORY_POOL_TYPE_IMPORTED) {
    m.Bind(17, I(pool.address));
    m.Bind(18, I(pool.pool.processId));
  }
  Keep(m.Run());
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

Status ActivityWriter::WriteInstructionMap(const std::vector<InstructionRow>& instructions) {
  DC_RETURN_IF_ERROR(
      db_.Exec("CREATE TEMP TABLE dc_instruction(instruction INTEGER PRIMARY KEY, kind TEXT, "
               "microStep INTEGER, bytes INTEGER, tensors INTEGER, bucket INTEGER)"));
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
  // externalId = step << 32 | instruction (CuptiCollector::PushInstruction).
  static const std::string kMapped =
      "(SELECT DISTINCT e.correlationId AS correlationId, e.externalId >> 32 AS step, "
      "e.externalId & 4294967295 AS instruction, i.kind AS kind, i.microStep AS microStep, "
      "i.bytes AS bytes, i.tensors AS tensors, i.bucket AS bucket FROM temp.dc_external AS e "
      "LEFT JOIN temp.dc_instruction AS i ON i.instruction = (e.externalId & 4294967295) "
      "WHERE e.correlationId <> 0)";
  // One row per (activity correlation id, instruction); kind from the executor, else from the
  // activity. A correlation id can cover several activities (a graph launch): one row.
  DC_RETURN_IF_ERROR(db_.Exec(
      "INSERT INTO TC_INSTRUCTION_MAP(globalPid, correlationId, step, microStep, instruction, "
      "kind) SELECT " +
      std::to_string(global_pid_) +
      ", m.correlationId, m.step, m.microStep, m.instruction, COALESCE(m.kind, MIN(a.kind)) "
      "FROM " +
      kMapped +
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
      kMapped + " AS m WHERE TC_COLLECTIVE.correlationId = m.correlationId");
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
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_.Prepare("INSERT INTO TC_RANK(globalPid, hostname, rank, localRank, worldSize, "
                  "deviceId, backend, device, deviceMemoryBytes) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  auto device = devices_.find(static_cast<uint32_t>(device_id));
  insert.Bind(1, global_pid_);
  insert.Bind(2, rank.hostname);
  insert.Bind(3, I(rank.rank));
  insert.Bind(4, I(rank.local_rank));
  insert.Bind(5, I(rank.world_size));
  insert.Bind(6, device_id);
  insert.Bind(7, std::string_view(kBackend));
  insert.Bind(8,
              device != devices_.end() ? device->second.name : "cuda:" + std::to_string(device_id));
  insert.Bind(9, device != devices_.end() ? device->second.memory_bytes : int64_t{0});
  return insert.Run();
}

Status ActivityWriter::WriteAnchors(const std::vector<ClockAnchorRow>& anchors) {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_.Prepare("INSERT INTO TC_CLOCK_ANCHOR(globalPid, tag, realtimeNs, monotonicNs, "
                  "sessionNs) VALUES (?, ?, ?, ?, ?)"));
  for (const ClockAnchorRow& anchor : anchors) {
    insert.Bind(1, global_pid_);
    insert.Bind(2, anchor.tag);
    insert.Bind(3, anchor.realtime_ns);
    insert.Bind(4, anchor.monotonic_ns);
    insert.Bind(5, anchor.session_ns);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
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
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_.Prepare("INSERT INTO TC_RECORD_STATS(globalPid, kind, records, "
                                  "dropped, zeroTimestamp) VALUES (?, ?, ?, ?, ?)"));
  for (const auto& [kind, entry] : table) {
    insert.Bind(1, global_pid_);
    insert.Bind(2, kind);
    insert.Bind(3, entry.first);
    insert.Bind(4, int64_t{0});
    insert.Bind(5, entry.second);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  // CUPTI counts dropped records per buffer (context and stream), not per kind.
  insert.Bind(1, global_pid_);
  insert.Bind(2, std::string_view("buffers"));
  insert.Bind(3, buffers_);
  insert.Bind(4, dropped_records_);
  insert.Bind(5, int64_t{0});
  DC_RETURN_IF_ERROR(insert.Run());
  counts->dropped_records = dropped_records_;
  counts->overhead_ns = overhead_ns_;
  return Status::Ok();
}

Status ActivityWriter::WriteSteps(const std::vector<StepRow>& steps) {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_.Prepare("INSERT INTO TC_STEP(globalPid, step, start, end, loss, "
                                  "warmup) VALUES (?, ?, ?, ?, ?, ?)"));
  for (const StepRow& s : steps) {
    insert.Bind(1, global_pid_);
    insert.Bind(2, I(s.step));
    insert.Bind(3, s.start_ns);
    insert.Bind(4, s.end_ns);
    insert.Bind(5, s.loss);
    insert.Bind(6, I(s.warmup ? 1 : 0));
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status ActivityWriter::WriteStreams(const std::vector<std::pair<int64_t, std::string>>& streams) {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_.Prepare("INSERT OR REPLACE INTO TC_STREAM(streamId, name) "
                                  "VALUES (?, ?)"));
  for (const auto& [id, name] : streams) {
    insert.Bind(1, id);
    insert.Bind(2, name);
    DC_RETURN_IF_ERROR(insert.Run());
  }
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
  DC_ASSIGN_OR_RETURN(
      Statement gpu,
      db_.Prepare("INSERT INTO TARGET_INFO_GPU(vmId, id, name, uuid, totalMemory, "
                  "memoryBandwidth, clockRate, smCount, l2CacheSize, computeMajor, "
                  "computeMinor, cuDevice) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  for (int64_t id : ids) {
    gpu.Bind(1, vm_id);
    gpu.Bind(2, id);
    gpu.Bind(12, id);
    auto it = devices_.find(static_cast<uint32_t>(id));
    if (it == devices_.end()) {
      // No CUPTI device record (collection began after CUDA initialized): the id only.
      for (int index = 3; index <= 11; ++index) gpu.BindNull(index);
    } else {
      const DeviceInfo& d = it->second;
      gpu.Bind(3, d.name);
      gpu.Bind(4, d.uuid);
      gpu.Bind(5, d.memory_bytes);
      gpu.Bind(6, d.bandwidth_bytes_per_s);
      gpu.Bind(7, d.clock_hz);
      gpu.Bind(8, d.sm_count);
      gpu.Bind(9, d.l2_bytes);
      gpu.Bind(10, d.compute_major);
      gpu.Bind(11, d.compute_minor);
    }
    DC_RETURN_IF_ERROR(gpu.Run());
  }

  const int64_t start_utc_ns = clock_.session_start_utc_ns;
  const time_t seconds = static_cast<time_t>(start_utc_ns / 1'000'000'000);
  char utc[32] = "", local[32] = "";
  tm parts{};
  if (gmtime_r(&seconds, &parts)) strftime(utc, sizeof(utc), "%Y-%m-%dT%H:%M:%S", &parts);
  if (localtime_r(&seconds, &parts)) strftime(local, sizeof(local), "%Y-%m-%dT%H:%M:%S", &parts);
  DC_ASSIGN_OR_RETURN(Statement start,
                      db_.Prepare("INSERT INTO TARGET_INFO_SESSION_START_TIME(utcEpochNs, "
                                  "utcTime, localTime) VALUES (?, ?, ?)"));
  start.Bind(1, start_utc_ns);
  start.Bind(2, std::string_view(utc));
  start.Bind(3, std::string_view(local));
  return start.Run();
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

StatusOr<TraceCounts> ActivityWriter::Finish(const FinishInput& input) {
  DC_RETURN_IF_ERROR(EndBatch());
  TraceCounts counts;
  Status status = [&]() -> Status {
    DC_RETURN_IF_ERROR(db_.Exec("BEGIN"));
    if (input.windows) DC_RETURN_IF_ERROR(DeleteOutOfWindow(*input.windows, &counts));
    DC_RETURN_IF_ERROR(WriteInstructionMap(input.instructions));
    DC_ASSIGN_OR_RETURN(int64_t device_id, RankDevice(input.rank));
    DC_RETURN_IF_ERROR(WriteRank(input.rank, device_id));
    DC_RETURN_IF_ERROR(WriteAnchors(input.anchors));
    DC_RETURN_IF_ERROR(WriteRecordStats(&counts));
    DC_RETURN_IF_ERROR(WriteSteps(input.steps));
    DC_RETURN_IF_ERROR(WriteStreams(input.streams));
    DC_RETURN_IF_ERROR(WriteTargetInfo(device_id, I(std::max(input.rank.rank, 0)) << kRankShift));
    DC_RETURN_IF_ERROR(WriteMetadata(input.metadata, counts));
    return db_.Exec("COMMIT");
  }();
  if (!status.ok()) return status;  // the destructor removes the temp file
  insert_string_ = Statement();
  insert_kernel_ = Statement();
  insert_collective_ = Statement();
  insert_memcpy_ = Statement();
  insert_memset_ = Statement();
  insert_memory_ = Statement();
  insert_api_ = Statement();
  insert_external_ = Statement();
  DC_RETURN_IF_ERROR(db_.Close());
  if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    return Status::Error(path_ + ": cannot rename the finished trace into place (" +
                         std::strerror(errno) + ")");
  }
  finished_ = true;
  return counts;
}

}  // namespace dc::cupti_internal
