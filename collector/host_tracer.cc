#include "collector/host_tracer.h"

#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <unordered_map>
#include <utility>

#include "collector/sqlite_writer.h"
#include "schemas/files.h"
#include "schemas/trace_schema.h"

namespace dc {

using collector_internal::Database;
using collector_internal::Statement;

namespace {

// nsys enum numbering (ENUM_CUDA_MEM_KIND, ENUM_CUDA_DEV_MEM_EVENT_OPER, ENUM_CUDA_MEMCPY_OPER).
constexpr int64_t kMemKindPinned = 1;
constexpr int64_t kMemKindDevice = 2;
constexpr int64_t kMemOperAllocation = 0;
constexpr int64_t kMemOperDeallocation = 1;
constexpr int64_t kCopyKindHtoD = 1;
constexpr int64_t kCopyKindDtoH = 2;
// Every activity of a rank runs in one context of its one device.
constexpr int64_t kContextId = 1;

constexpr int kRankShift = 48;
constexpr int kPidShift = 24;
constexpr int64_t kPidMask = 0xFFFFFF;

int64_t ClockNs(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// The kernel name NCCL would give the collective, with the backend's library in front.
std::string CollectiveKernelName(proto::InstrKind kind) {
  switch (kind) {
    case proto::INSTR_ALL_GATHER:
      return "gloo:AllGather";
    case proto::INSTR_REDUCE_SCATTER:
      return "gloo:ReduceScatter";
    default:
      return std::string("gloo:") + InstrKindName(kind);
  }
}

struct ClockAnchor {
  int64_t realtime_ns = 0, monotonic_ns = 0, session_ns = 0;
};

// All of one rank's records, in memory until WriteRankFile.
struct TracerRecords {
  struct Kernel {
    int64_t name_id;
    int stream;
    int64_t start_ns, end_ns, correlation_id;
    bool collective;  // the kernel face of a collective
  };
  struct Collective {
    proto::InstrKind kind;
    int stream;
    int64_t start_ns, end_ns, bytes;
    int num_tensors, bucket;
    int64_t correlation_id;
  };
  struct Copy {
    proto::InstrKind kind;
    int stream;
    int64_t start_ns, end_ns, bytes, correlation_id;
  };
  struct Mapping {
    int64_t correlation_id;
    InstructionRef ref;
    proto::InstrKind kind;
  };
  struct Memory {
    int64_t ts_ns, address, bytes;
    bool alloc;
    int64_t name_id;
    BufferKind kind;
    int64_t correlation_id;
  };
  struct Step {
    int step;
    int64_t start_ns, end_ns;
    double loss;
    bool warmup;
  };

  // Interned strings: id = index + 1 (StringIds ids).
  std::vector<std::string> strings;
  std::unordered_map<std::string, int64_t> string_ids;
  // Kernel rows: compute kernels and the kernel face of each collective.
  std::vector<Kernel> kernels;
  std::vector<Collective> collectives;
  std::vector<Copy> copies;
  std::vector<Mapping> mappings;
  std::vector<Memory> memory;
  std::vector<Step> steps;
  int64_t next_correlation_id = 1;
  ClockAnchor start_anchor;

  int64_t Intern(const std::string& value) {
    auto [it, inserted] = string_ids.try_emplace(value, static_cast<int64_t>(strings.size()) + 1);
    if (inserted) strings.push_back(value);
    return it->second;
  }

  void Map(int64_t correlation_id, const InstructionRef& ref, proto::InstrKind kind) {
    if (ref.instruction >= 0) mappings.push_back({correlation_id, ref, kind});
  }
};

}  // namespace

struct HostTracer::Records : TracerRecords {};

HostTracer::HostTracer(RankIdentity identity, int64_t session_start_utc_ns)
    : identity_(std::move(identity)),
      session_start_utc_ns_(session_start_utc_ns),
      global_pid_((static_cast<int64_t>(identity_.rank) << kRankShift) |
                  ((static_cast<int64_t>(::getpid()) & kPidMask) << kPidShift)),
      records_(std::make_unique<Records>()) {
  records_->start_anchor = {ClockNs(CLOCK_REALTIME), ClockNs(CLOCK_MONOTONIC), 0};
  records_->start_anchor.session_ns = records_->start_anchor.realtime_ns - session_start_utc_ns_;
}

HostTracer::~HostTracer() = default;
HostTracer::HostTracer(HostTracer&&) noexcept = default;
HostTracer& HostTracer::operator=(HostTracer&&) noexcept = default;

int64_t HostTracer::NowNs() const { return ClockNs(CLOCK_REALTIME) - session_start_utc_ns_; }

void HostTracer::DescribeInstruction(int index, const TracedInstruction& instruction) {
  if (index < 0) return;
  if (static_cast<size_t>(index) >= described_.size()) described_.resize(index + 1);
  described_[index] = instruction;
}

Status HostTracer::BeginInstruction(const InstructionRef& /*ref*/) { return Status::Ok(); }

StatusOr<int64_t> HostTracer::EndInstruction(const InstructionRef& ref, int64_t start_ns,
                                             int64_t end_ns) {
  if (ref.instruction < 0 || static_cast<size_t>(ref.instruction) >= described_.size()) {
    return Status::Error("the host tracer was not told of instruction " +
                         std::to_string(ref.instruction) + " (an executor bug; please report it)");
  }
  const TracedInstruction& traced = described_[ref.instruction];
  switch (traced.kind) {
    case proto::INSTR_COMPUTE:
      return Kernel(traced.op_name, traced.stream, start_ns, end_ns, ref);
    case proto::INSTR_OFFLOAD:
    case proto::INSTR_RELOAD:
      return Copy(traced.kind, traced.stream, start_ns, end_ns, traced.bytes, ref);
    case proto::INSTR_ALL_GATHER:
    case proto::INSTR_REDUCE_SCATTER:
      return Collective(traced.kind, traced.stream, start_ns, end_ns, traced.bytes, traced.tensors,
                        traced.bucket, ref);
    default:
      return 0;  // releases and renames only change memory
  }
}

int64_t HostTracer::Kernel(const std::string& name, proto::Stream stream, int64_t start_ns,
                           int64_t end_ns, const InstructionRef& ref) {
  const int64_t id = records_->next_correlation_id++;
  records_->kernels.push_back({records_->Intern(name), stream, start_ns, end_ns, id, false});
  records_->Map(id, ref, proto::INSTR_COMPUTE);
  return id;
}

int64_t HostTracer::Collective(proto::InstrKind kind, proto::Stream stream, int64_t start_ns,
                               int64_t end_ns, int64_t bytes, int num_tensors, int bucket,
                               const InstructionRef& ref) {
  const int64_t id = records_->next_correlation_id++;
  records_->collectives.push_back({kind, stream, start_ns, end_ns, bytes, num_tensors, bucket, id});
  records_->kernels.push_back(
      {records_->Intern(CollectiveKernelName(kind)), stream, start_ns, end_ns, id, true});
  records_->Map(id, ref, kind);
  return id;
}

int64_t HostTracer::Copy(proto::InstrKind kind, proto::Stream stream, int64_t start_ns,
                         int64_t end_ns, int64_t bytes, const InstructionRef& ref) {
  const int64_t id = records_->next_correlation_id++;
  records_->copies.push_back({kind, stream, start_ns, end_ns, bytes, id});
  records_->Map(id, ref, kind);
  return id;
}

void HostTracer::Memory(int64_t ts_ns, int64_t address, int64_t bytes, bool alloc,
                        const std::string& name, BufferKind kind, int64_t correlation_id) {
  records_->memory.push_back(
      {ts_ns, address, bytes, alloc, records_->Intern(name), kind, correlation_id});
}

void HostTracer::Step(int step, int64_t start_ns, int64_t end_ns, double loss, bool warmup) {
  records_->steps.push_back({step, start_ns, end_ns, loss, warmup});
}

int64_t HostTracer::activities() const {
  return static_cast<int64_t>(records_->kernels.size() + records_->copies.size());
}

int64_t HostTracer::memory_events() const { return static_cast<int64_t>(records_->memory.size()); }

// ----- writing one rank's file -----

namespace {

// Writes one rank's records; each method fills one table.
class RankFileWriter {
 public:
  RankFileWriter(Database* db, const RankIdentity& identity, int64_t global_pid,
                 const TracerRecords& records)
      : db_(db), identity_(identity), global_pid_(global_pid), records_(records) {}

  Status WriteStrings();
  Status WriteKernels();
  Status WriteCollectives();
  Status WriteCopies();
  Status WriteInstructionMap();
  Status WriteMemory();
  Status WriteSteps();
  Status WriteRank();
  Status WriteClockAnchors(const ClockAnchor& start, const ClockAnchor& end);
  Status WriteRecordStats();
  Status WriteStreams();
  Status WriteTargetInfo(int64_t session_start_utc_ns);

 private:
  int64_t device_id() const { return identity_.local_rank; }

  Database* db_;
  const RankIdentity& identity_;
  int64_t global_pid_;
  const TracerRecords& records_;
};

Status RankFileWriter::WriteStrings() {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_->Prepare("INSERT INTO StringIds(id, value) VALUES (?, ?)"));
  for (size_t i = 0; i < records_.strings.size(); ++i) {
    insert.Bind(1, static_cast<int64_t>(i) + 1);
    insert.Bind(2, records_.strings[i]);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteKernels() {
  // Launch geometry is meaningless on the host: grid and block are 1, other required columns 0.
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL(start, end, deviceId, contextId, "
                   "streamId, correlationId, globalPid, demangledName, shortName, launchType, "
                   "cacheConfig, registersPerThread, gridX, gridY, gridZ, blockX, blockY, blockZ, "
                   "staticSharedMemory, dynamicSharedMemory, localMemoryPerThread, "
                   "localMemoryTotal, gridId) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0)"));
  for (const auto& k : records_.kernels) {
    insert.Bind(1, k.start_ns);
    insert.Bind(2, k.end_ns);
    insert.Bind(3, device_id());
    insert.Bind(4, kContextId);
    insert.Bind(5, int64_t{k.stream});
    insert.Bind(6, k.correlation_id);
    insert.Bind(7, global_pid_);
    insert.Bind(8, k.name_id);
    insert.Bind(9, k.name_id);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteCollectives() {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO TC_COLLECTIVE(start, end, globalPid, deviceId, streamId, "
                   "correlationId, kind, bytes, tensors, bucket) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  for (const auto& c : records_.collectives) {
    insert.Bind(1, c.start_ns);
    insert.Bind(2, c.end_ns);
    insert.Bind(3, global_pid_);
    insert.Bind(4, device_id());
    insert.Bind(5, int64_t{c.stream});
    insert.Bind(6, c.correlation_id);
    insert.Bind(7, std::string_view(InstrKindName(c.kind)));
    insert.Bind(8, c.bytes);
    insert.Bind(9, int64_t{c.num_tensors});
    insert.Bind(10, int64_t{c.bucket});
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteCopies() {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY(start, end, deviceId, contextId, "
                   "streamId, correlationId, globalPid, bytes, copyKind, srcKind, dstKind, "
                   "srcDeviceId, srcContextId, dstDeviceId, dstContextId) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  for (const auto& c : records_.copies) {
    const bool to_device = c.kind == proto::INSTR_RELOAD;
    insert.Bind(1, c.start_ns);
    insert.Bind(2, c.end_ns);
    insert.Bind(3, device_id());
    insert.Bind(4, kContextId);
    insert.Bind(5, int64_t{c.stream});
    insert.Bind(6, c.correlation_id);
    insert.Bind(7, global_pid_);
    insert.Bind(8, c.bytes);
    insert.Bind(9, to_device ? kCopyKindHtoD : kCopyKindDtoH);
    insert.Bind(10, to_device ? kMemKindPinned : kMemKindDevice);
    insert.Bind(11, to_device ? kMemKindDevice : kMemKindPinned);
    insert.Bind(12, device_id());
    insert.Bind(13, kContextId);
    insert.Bind(14, device_id());
    insert.Bind(15, kContextId);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteInstructionMap() {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO TC_INSTRUCTION_MAP(globalPid, correlationId, step, microStep, "
                   "instruction, kind) VALUES (?, ?, ?, ?, ?, ?)"));
  for (const auto& m : records_.mappings) {
    insert.Bind(1, global_pid_);
    insert.Bind(2, m.correlation_id);
    insert.Bind(3, int64_t{m.ref.step});
    insert.Bind(4, int64_t{m.ref.micro_step});
    insert.Bind(5, int64_t{m.ref.instruction});
    insert.Bind(6, std::string_view(InstrKindName(m.kind)));
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteMemory() {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO CUDA_GPU_MEMORY_USAGE_EVENTS(start, globalPid, deviceId, "
                   "contextId, address, pc, bytes, memKind, memoryOperationType, name, "
                   "correlationId, tcKind) VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)"));
  for (const auto& m : records_.memory) {
    insert.Bind(1, m.ts_ns);
    insert.Bind(2, global_pid_);
    insert.Bind(3, device_id());
    insert.Bind(4, kContextId);
    insert.Bind(5, m.address);
    insert.Bind(6, m.bytes);
    insert.Bind(7, kMemKindDevice);
    insert.Bind(8, m.alloc ? kMemOperAllocation : kMemOperDeallocation);
    insert.Bind(9, records_.strings[m.name_id - 1]);
    insert.Bind(10, m.correlation_id);
    insert.Bind(11, std::string_view(BufferKindName(m.kind)));
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteSteps() {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_->Prepare("INSERT INTO TC_STEP(globalPid, step, start, end, loss, "
                                   "warmup) VALUES (?, ?, ?, ?, ?, ?)"));
  for (const auto& s : records_.steps) {
    insert.Bind(1, global_pid_);
    insert.Bind(2, int64_t{s.step});
    insert.Bind(3, s.start_ns);
    insert.Bind(4, s.end_ns);
    insert.Bind(5, s.loss);
    insert.Bind(6, int64_t{s.warmup ? 1 : 0});
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteRank() {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO TC_RANK(globalPid, hostname, rank, localRank, worldSize, "
                   "deviceId, backend, device, deviceMemoryBytes) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"));
  insert.Bind(1, global_pid_);
  insert.Bind(2, identity_.hostname);
  insert.Bind(3, int64_t{identity_.rank});
  insert.Bind(4, int64_t{identity_.local_rank});
  insert.Bind(5, int64_t{identity_.world_size});
  insert.Bind(6, device_id());
  insert.Bind(7, identity_.backend);
  insert.Bind(8, identity_.device);
  insert.Bind(9, identity_.device_memory_bytes);
  return insert.Run();
}

Status RankFileWriter::WriteClockAnchors(const ClockAnchor& start, const ClockAnchor& end) {
  DC_ASSIGN_OR_RETURN(
      Statement insert,
      db_->Prepare("INSERT INTO TC_CLOCK_ANCHOR(globalPid, tag, realtimeNs, monotonicNs, "
                   "sessionNs) VALUES (?, ?, ?, ?, ?)"));
  for (const auto& [tag, anchor] : {std::pair{"start", start}, std::pair{"end", end}}) {
    insert.Bind(1, global_pid_);
    insert.Bind(2, std::string_view(tag));
    insert.Bind(3, anchor.realtime_ns);
    insert.Bind(4, anchor.monotonic_ns);
    insert.Bind(5, anchor.session_ns);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

// A record whose start could not be taken (0) or that ends before it starts.
bool BadTimestamp(int64_t start_ns, int64_t end_ns) { return start_ns == 0 || end_ns < start_ns; }

template <typename Record>
int64_t CountBadTimestamps(const std::vector<Record>& records) {
  int64_t n = 0;
  for (const auto& r : records) n += BadTimestamp(r.start_ns, r.end_ns) ? 1 : 0;
  return n;
}

Status RankFileWriter::WriteRecordStats() {
  int64_t compute_kernels = 0, compute_bad = 0;
  for (const auto& k : records_.kernels) {
    // Collectives' kernel rows are counted with the collectives.
    if (k.collective) continue;
    ++compute_kernels;
    compute_bad += BadTimestamp(k.start_ns, k.end_ns) ? 1 : 0;
  }
  int64_t memory_bad = 0;
  for (const auto& m : records_.memory) memory_bad += BadTimestamp(m.ts_ns, m.ts_ns) ? 1 : 0;
  struct Row {
    const char* kind;
    int64_t records, zero_timestamp;
  };
  const Row rows[] = {
      {"kernel", compute_kernels, compute_bad},
      {"collective", static_cast<int64_t>(records_.collectives.size()),
       CountBadTimestamps(records_.collectives)},
      {"memcpy", static_cast<int64_t>(records_.copies.size()), CountBadTimestamps(records_.copies)},
      {"memory", static_cast<int64_t>(records_.memory.size()), memory_bad},
  };
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_->Prepare("INSERT INTO TC_RECORD_STATS(globalPid, kind, records, "
                                   "dropped, zeroTimestamp) VALUES (?, ?, ?, 0, ?)"));
  for (const Row& row : rows) {
    insert.Bind(1, global_pid_);
    insert.Bind(2, std::string_view(row.kind));
    insert.Bind(3, row.records);
    insert.Bind(4, row.zero_timestamp);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteStreams() {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_->Prepare("INSERT INTO TC_STREAM(streamId, name) VALUES (?, ?)"));
  for (int s = proto::Stream_MIN; s <= proto::Stream_MAX; ++s) {
    if (s == proto::STREAM_UNSPECIFIED || !proto::Stream_IsValid(s)) continue;
    insert.Bind(1, int64_t{s});
    insert.Bind(2, std::string_view(StreamName(static_cast<proto::Stream>(s))));
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status RankFileWriter::WriteTargetInfo(int64_t session_start_utc_ns) {
  DC_ASSIGN_OR_RETURN(Statement gpu,
                      db_->Prepare("INSERT INTO TARGET_INFO_GPU(vmId, id, name, totalMemory, "
                                   "cuDevice) VALUES (?, ?, ?, ?, ?)"));
  gpu.Bind(1, static_cast<int64_t>(identity_.rank) << kRankShift);
  gpu.Bind(2, device_id());
  gpu.Bind(3, identity_.device);
  gpu.Bind(4, identity_.device_memory_bytes);
  gpu.Bind(5, device_id());
  DC_RETURN_IF_ERROR(gpu.Run());

  const time_t seconds = static_cast<time_t>(session_start_utc_ns / 1'000'000'000);
  char utc[32] = "", local[32] = "";
  tm parts{};
  if (gmtime_r(&seconds, &parts)) strftime(utc, sizeof(utc), "%Y-%m-%dT%H:%M:%S", &parts);
  if (localtime_r(&seconds, &parts)) strftime(local, sizeof(local), "%Y-%m-%dT%H:%M:%S", &parts);
  DC_ASSIGN_OR_RETURN(Statement start,
                      db_->Prepare("INSERT INTO TARGET_INFO_SESSION_START_TIME(utcEpochNs, "
                                   "utcTime, localTime) VALUES (?, ?, ?)"));
  start.Bind(1, session_start_utc_ns);
  start.Bind(2, std::string_view(utc));
  start.Bind(3, std::string_view(local));
  return start.Run();
}

Status WriteAll(RankFileWriter& writer, const ClockAnchor& start, const ClockAnchor& end,
                int64_t session_start_utc_ns) {
  DC_RETURN_IF_ERROR(writer.WriteStrings());
  DC_RETURN_IF_ERROR(writer.WriteKernels());
  DC_RETURN_IF_ERROR(writer.WriteCollectives());
  DC_RETURN_IF_ERROR(writer.WriteCopies());
  DC_RETURN_IF_ERROR(writer.WriteInstructionMap());
  DC_RETURN_IF_ERROR(writer.WriteMemory());
  DC_RETURN_IF_ERROR(writer.WriteSteps());
  DC_RETURN_IF_ERROR(writer.WriteRank());
  DC_RETURN_IF_ERROR(writer.WriteClockAnchors(start, end));
  DC_RETURN_IF_ERROR(writer.WriteRecordStats());
  DC_RETURN_IF_ERROR(writer.WriteStreams());
  return writer.WriteTargetInfo(session_start_utc_ns);
}

}  // namespace

Status HostTracer::WriteRankFile(const std::string& path) const {
  const ClockAnchor end{ClockNs(CLOCK_REALTIME), ClockNs(CLOCK_MONOTONIC), NowNs()};
  const std::string tmp = TempPathBeside(path);
  std::remove(tmp.c_str());
  Status status = [&]() -> Status {
    DC_ASSIGN_OR_RETURN(Database db, Database::Create(tmp));
    DC_RETURN_IF_ERROR(db.Exec("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"));
    DC_RETURN_IF_ERROR(db.Exec(TraceSchemaSql()));
    DC_RETURN_IF_ERROR(db.Exec("BEGIN"));
    {
      RankFileWriter writer(&db, identity_, global_pid_, *records_);
      DC_RETURN_IF_ERROR(WriteAll(writer, records_->start_anchor, end, session_start_utc_ns_));
    }
    DC_RETURN_IF_ERROR(db.Exec("COMMIT"));
    DC_RETURN_IF_ERROR(db.Close());
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      return Status::Error(path + ": cannot rename the finished rank trace into place");
    }
    return Status::Ok();
  }();
  if (!status.ok()) std::remove(tmp.c_str());
  return status;
}

}  // namespace dc
