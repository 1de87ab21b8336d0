#include "collector/host_tracer.h"

#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <unordered_map>
#include <utility>

#include "collector/sqlite_writer.h"
#include "collector/trace_blobs.h"
#include "collector/trace_rows.h"
#include "schemas/files.h"
#include "schemas/trace_schema.h"

namespace dc {

using collector_internal::Database;
using collector_internal::EvalRow;
using collector_internal::GpuInfoRow;
using collector_internal::KernelRow;
using collector_internal::MemcpyRow;
using collector_internal::MemoryEventRow;
using collector_internal::RecordStatsRow;
using collector_internal::TraceRowWriter;

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
    case proto::INSTR_ALL_REDUCE:
      return "gloo:AllReduce";
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
  std::vector<EvalRow> evals;
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
  if (recorded_.size() < described_.size()) recorded_.resize(described_.size());
  Recorded& recorded = recorded_[ref.instruction];
  recorded.step = ref.step;
  recorded.kernels_begin = records_->kernels.size();
  recorded.collectives_begin = records_->collectives.size();
  recorded.copies_begin = records_->copies.size();
  int64_t id = 0;
  switch (traced.kind) {
    case proto::INSTR_COMPUTE:
      id = Kernel(traced.op_name, traced.stream, start_ns, end_ns, ref);
      break;
    case proto::INSTR_OFFLOAD:
    case proto::INSTR_RELOAD:
      id = Copy(traced.kind, traced.stream, start_ns, end_ns, traced.bytes, ref);
      break;
    default:  // releases and renames only change memory
      if (IsCollective(traced.kind)) {
        id = Collective(traced.kind, traced.stream, start_ns, end_ns, traced.bytes, traced.tensors,
                        traced.bucket, ref);
      }
      break;
  }
  recorded.kernels_end = records_->kernels.size();
  recorded.collectives_end = records_->collectives.size();
  recorded.copies_end = records_->copies.size();
  return id;
}

void HostTracer::InstructionRan(const InstructionRef& ref, int64_t start_ns, int64_t end_ns) {
  if (ref.instruction < 0 || static_cast<size_t>(ref.instruction) >= recorded_.size()) return;
  const Recorded& recorded = recorded_[ref.instruction];
  if (recorded.step != ref.step) return;
  auto retime = [&](auto& records, size_t begin, size_t end) {
    for (size_t i = begin; i < end && i < records.size(); ++i) {
      records[i].start_ns = start_ns;
      records[i].end_ns = end_ns;
    }
  };
  retime(records_->kernels, recorded.kernels_begin, recorded.kernels_end);
  retime(records_->collectives, recorded.collectives_begin, recorded.collectives_end);
  retime(records_->copies, recorded.copies_begin, recorded.copies_end);
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

void HostTracer::Evaluation(int64_t step, int64_t start_ns, int64_t end_ns, double loss) {
  records_->evals.push_back({step, start_ns, end_ns, loss});
}

int64_t HostTracer::activities() const {
  return static_cast<int64_t>(records_->kernels.size() + records_->copies.size());
}

int64_t HostTracer::memory_events() const { return static_cast<int64_t>(records_->memory.size()); }

// ----- writing one rank's file -----

namespace {

// A record whose start could not be taken (0) or that ends before it starts.
bool BadTimestamp(int64_t start_ns, int64_t end_ns) { return start_ns == 0 || end_ns < start_ns; }

template <typename Record>
int64_t CountBadTimestamps(const std::vector<Record>& records) {
  int64_t n = 0;
  for (const auto& r : records) n += BadTimestamp(r.start_ns, r.end_ns) ? 1 : 0;
  return n;
}

// TC_RECORD_STATS over every record written so far, added to at each flush.
struct RecordCounts {
  int64_t kernels = 0, kernels_bad = 0, collectives = 0, collectives_bad = 0, copies = 0,
          copies_bad = 0, memory = 0, memory_bad = 0;

  void Add(const TracerRecords& records) {
    for (const auto& k : records.kernels) {
      // Collectives' kernel rows are counted with the collectives.
      if (k.collective) continue;
      ++kernels;
      kernels_bad += BadTimestamp(k.start_ns, k.end_ns) ? 1 : 0;
    }
    collectives += static_cast<int64_t>(records.collectives.size());
    collectives_bad += CountBadTimestamps(records.collectives);
    copies += static_cast<int64_t>(records.copies.size());
    copies_bad += CountBadTimestamps(records.copies);
    memory += static_cast<int64_t>(records.memory.size());
    for (const auto& m : records.memory) memory_bad += BadTimestamp(m.ts_ns, m.ts_ns) ? 1 : 0;
  }

  std::vector<RecordStatsRow> Rows() const {
    return {
        {"kernel", kernels, 0, kernels_bad},
        {"collective", collectives, 0, collectives_bad},
        {"memcpy", copies, 0, copies_bad},
        {"memory", memory, 0, memory_bad},
    };
  }
};

// The columns every device activity row starts with, for this rank's one device and context.
template <typename Row, typename Record>
Row ActivityRow(const Record& record, int64_t device_id) {
  Row row;
  row.start_ns = record.start_ns;
  row.end_ns = record.end_ns;
  row.device_id = device_id;
  row.context_id = kContextId;
  row.stream_id = record.stream;
  row.correlation_id = record.correlation_id;
  return row;
}

// The rows of the rank itself, written once when the file is made: who it is, its streams and
// device, the session's start and the start clock anchor.
Status WriteRankRows(TraceRowWriter& rows, const RankIdentity& identity, const ClockAnchor& start,
                     int64_t session_start_utc_ns) {
  const int64_t device_id = identity.local_rank;
  DC_RETURN_IF_ERROR(
      rows.Rank({identity.hostname, identity.rank, identity.local_rank, identity.world_size,
                 device_id, identity.backend, identity.device, identity.device_memory_bytes,
                 identity.host_cores, identity.threads_per_rank}));
  DC_RETURN_IF_ERROR(
      rows.ClockAnchor({"start", start.realtime_ns, start.monotonic_ns, start.session_ns}));
  for (int s = proto::Stream_MIN; s <= proto::Stream_MAX; ++s) {
    if (s == proto::STREAM_UNSPECIFIED || !proto::Stream_IsValid(s)) continue;
    DC_RETURN_IF_ERROR(rows.Stream(s, StreamName(static_cast<proto::Stream>(s))));
  }
  GpuInfoRow gpu;
  gpu.vm_id = static_cast<int64_t>(identity.rank) << kRankShift;
  gpu.id = device_id;
  gpu.name = identity.device;
  gpu.total_memory = identity.device_memory_bytes;
  gpu.cu_device = device_id;
  DC_RETURN_IF_ERROR(rows.GpuInfo(gpu));
  return rows.SessionStart(session_start_utc_ns);
}

// Writes the records held, every row through the shared TraceRowWriter; strings from index
// `strings_from` on (the earlier ones are in the file already).
Status WriteRecords(TraceRowWriter& rows, int64_t device_id, const TracerRecords& records,
                    size_t strings_from) {
  for (size_t i = strings_from; i < records.strings.size(); ++i) {
    DC_RETURN_IF_ERROR(rows.String(static_cast<int64_t>(i) + 1, records.strings[i]));
  }
  // Launch geometry is meaningless on the host: KernelRow's defaults (grid and block 1).
  for (const auto& k : records.kernels) {
    auto row = ActivityRow<KernelRow>(k, device_id);
    row.demangled_name_id = k.name_id;
    row.short_name_id = k.name_id;
    DC_RETURN_IF_ERROR(rows.Kernel(row));
  }
  for (const auto& c : records.collectives) {
    DC_RETURN_IF_ERROR(rows.Collective({c.start_ns, c.end_ns, device_id, c.stream, c.correlation_id,
                                        InstrKindName(c.kind), c.bytes, c.num_tensors, c.bucket}));
  }
  for (const auto& c : records.copies) {
    const bool to_device = c.kind == proto::INSTR_RELOAD;
    auto row = ActivityRow<MemcpyRow>(c, device_id);
    row.bytes = c.bytes;
    row.copy_kind = to_device ? kCopyKindHtoD : kCopyKindDtoH;
    row.src_kind = to_device ? kMemKindPinned : kMemKindDevice;
    row.dst_kind = to_device ? kMemKindDevice : kMemKindPinned;
    row.src_device_id = row.dst_device_id = device_id;
    row.src_context_id = row.dst_context_id = kContextId;
    DC_RETURN_IF_ERROR(rows.Memcpy(row));
  }
  for (const auto& m : records.mappings) {
    DC_RETURN_IF_ERROR(rows.InstructionMap({m.correlation_id, m.ref.step, m.ref.micro_step,
                                            m.ref.instruction, InstrKindName(m.kind)}));
  }
  for (const auto& m : records.memory) {
    MemoryEventRow row;
    row.ts_ns = m.ts_ns;
    row.device_id = device_id;
    row.context_id = kContextId;
    row.address = m.address;
    row.bytes = m.bytes;
    row.mem_kind = kMemKindDevice;
    row.operation = m.alloc ? kMemOperAllocation : kMemOperDeallocation;
    row.name = records.strings[m.name_id - 1];
    row.correlation_id = m.correlation_id;
    row.tc_kind = BufferKindName(m.kind);
    DC_RETURN_IF_ERROR(rows.MemoryEvent(row));
  }
  // Last: a step's row in the file means every record of the step is there too.
  for (const auto& s : records.steps) {
    DC_RETURN_IF_ERROR(rows.Step({s.step, s.start_ns, s.end_ns, s.loss, s.warmup}));
  }
  for (const EvalRow& e : records.evals) DC_RETURN_IF_ERROR(rows.Evaluation(e));
  return Status::Ok();
}

}  // namespace

// The file a tracer writes into, open from StreamTo (or WriteRankFile) to the end.
struct HostTracer::Stream {
  Stream(std::string path_in, Database db_in) : path(std::move(path_in)), db(std::move(db_in)) {}
  std::string path;
  Database db;
  TraceRowWriter rows;  // after db: its statements are finalized first
  size_t strings_written = 0;
  RecordCounts counts;
  Status failed;  // the first error writing a step; nothing more is written after it
};

HostTracer::~HostTracer() = default;
HostTracer::HostTracer(HostTracer&&) noexcept = default;
HostTracer& HostTracer::operator=(HostTracer&&) noexcept = default;

Status HostTracer::StreamTo(const std::string& path, const proto::Schedule* schedule) {
  if (stream_) return Status::Error(path + ": this rank's trace is already being written");
  std::remove(path.c_str());
  for (const char* suffix : {"-wal", "-shm"}) std::remove((path + suffix).c_str());
  DC_ASSIGN_OR_RETURN(Database db, Database::Create(path));
  auto stream = std::make_unique<Stream>(path, std::move(db));
  // WAL: every committed step survives the process being killed; readers see whole steps.
  DC_RETURN_IF_ERROR(stream->db.Exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"));
  DC_RETURN_IF_ERROR(stream->db.Exec(TraceSchemaSql()));
  DC_ASSIGN_OR_RETURN(stream->rows, TraceRowWriter::Create(&stream->db, global_pid_));
  DC_RETURN_IF_ERROR(stream->db.Exec("BEGIN"));
  DC_RETURN_IF_ERROR(
      WriteRankRows(stream->rows, identity_, records_->start_anchor, session_start_utc_ns_));
  if (schedule != nullptr) {
    DC_RETURN_IF_ERROR(collector_internal::WriteScheduleBlobs(&stream->db, *schedule));
  }
  DC_RETURN_IF_ERROR(stream->db.Exec("COMMIT"));
  stream_ = std::move(stream);
  return Status::Ok();
}

Status HostTracer::Flush() {
  Stream& stream = *stream_;
  if (!stream.failed.ok()) return stream.failed;
  Status status = [&]() -> Status {
    DC_RETURN_IF_ERROR(stream.db.Exec("BEGIN"));
    DC_RETURN_IF_ERROR(
        WriteRecords(stream.rows, identity_.local_rank, *records_, stream.strings_written));
    return stream.db.Exec("COMMIT");
  }();
  if (!status.ok()) {
    (void)stream.db.Exec("ROLLBACK");
    stream.failed = status;
    return status;
  }
  stream.strings_written = records_->strings.size();
  stream.counts.Add(*records_);
  records_->kernels.clear();
  records_->collectives.clear();
  records_->copies.clear();
  records_->mappings.clear();
  records_->memory.clear();
  records_->steps.clear();
  records_->evals.clear();
  // Their records are gone: a late InstructionRan must not move the next step's.
  for (Recorded& r : recorded_) r.step = -1;
  return Status::Ok();
}

void HostTracer::Step(int step, int64_t start_ns, int64_t end_ns, double loss, bool warmup) {
  records_->steps.push_back({step, start_ns, end_ns, loss, warmup});
  if (stream_) (void)Flush();  // an error is kept and returned by WriteRankFile
}

Status HostTracer::WriteRankFile(const std::string& path) {
  const bool streamed = stream_ != nullptr;
  if (streamed && stream_->path != path) {
    return Status::Error(path + ": this rank's trace is being written to " + stream_->path);
  }
  const std::string tmp = streamed ? path : TempPathBeside(path);
  const RemoveOnSignal remove_tmp(streamed ? std::string() : tmp);
  Status status = [&]() -> Status {
    if (!streamed) DC_RETURN_IF_ERROR(StreamTo(tmp));
    DC_RETURN_IF_ERROR(Flush());
    Stream& stream = *stream_;
    const ClockAnchor end{ClockNs(CLOCK_REALTIME), ClockNs(CLOCK_MONOTONIC), NowNs()};
    DC_RETURN_IF_ERROR(stream.db.Exec("BEGIN"));
    DC_RETURN_IF_ERROR(
        stream.rows.ClockAnchor({"end", end.realtime_ns, end.monotonic_ns, end.session_ns}));
    for (const RecordStatsRow& row : stream.counts.Rows()) {
      DC_RETURN_IF_ERROR(stream.rows.RecordStats(row));
    }
    DC_RETURN_IF_ERROR(stream.db.Exec("COMMIT"));
    stream.rows.Close();
    // One self-contained file again: the WAL folded in and removed.
    DC_RETURN_IF_ERROR(stream.db.Exec("PRAGMA journal_mode=DELETE"));
    DC_RETURN_IF_ERROR(stream.db.Close());
    if (!streamed && std::rename(tmp.c_str(), path.c_str()) != 0) {
      return Status::Error(path + ": cannot rename the finished rank trace into place");
    }
    return Status::Ok();
  }();
  stream_.reset();
  if (!status.ok() && !streamed) std::remove(tmp.c_str());
  return status;
}

}  // namespace dc
