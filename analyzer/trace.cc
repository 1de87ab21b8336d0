#include "analyzer/trace.h"

#include <sqlite3.h>
#include <sys/stat.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>

#include "analyzer/sqlite_reader.h"
#include "schemas/digest.h"
#include "schemas/trace_schema.h"

namespace dc {

using analyzer_internal::ColumnNames;
using analyzer_internal::Query;
using analyzer_internal::SqliteError;
using analyzer_internal::TableNames;

namespace {

constexpr char kKernelTable[] = "CUPTI_ACTIVITY_KIND_KERNEL";
constexpr char kMemcpyTable[] = "CUPTI_ACTIVITY_KIND_MEMCPY";
constexpr char kMemsetTable[] = "CUPTI_ACTIVITY_KIND_MEMSET";
constexpr char kMemoryTable[] = "CUDA_GPU_MEMORY_USAGE_EVENTS";
constexpr char kRerecord[] = "re-record it with dc-collect";
// The processes of a dc trace's ranks, as SQL.
constexpr char kDcOwners[] = "SELECT globalPid FROM TC_RANK WHERE globalPid IS NOT NULL";

// nsys global ids: the process id sits in bits 24..47.
constexpr int64_t kPidUnit = int64_t{1} << 24;

// Kernel-name prefixes of communication: NCCL's (current, pre-2.19, symmetric-memory) and the
// cpu backend's Gloo collectives.
constexpr std::array<const char*, 4> kCommunicationPrefixes = {"ncclDevKernel_", "ncclKernel_",
                                                               "ncclSymkDevKernel_", "gloo:"};

// ENUM_CUDA_MEMCPY_OPER labels (nsys numbering); older exports have no ENUM tables.
constexpr std::array<const char*, 14> kCopyKindLabels = {"Unknown",
                                                         "Host-to-Device",
                                                         "Device-to-Host",
                                                         "Host-to-Array",
                                                         "Array-to-Host",
                                                         "Array-to-Array",
                                                         "Array-to-Device",
                                                         "Device-to-Array",
                                                         "Device-to-Device",
                                                         "Host-to-Host",
                                                         "Peer-to-Peer",
                                                         "Unified Host-to-Device",
                                                         "Unified Device-to-Host",
                                                         "Unified Device-to-Device"};
// ENUM_CUDA_MEM_KIND labels.
constexpr std::array<const char*, 8> kMemKindLabels = {"Pageable",       "Pinned",  "Device",
                                                       "Array",          "Managed", "Device Static",
                                                       "Managed Static", "Unknown"};

bool IsCommunicationKernel(const std::string& name) {
  for (const char* prefix : kCommunicationPrefixes) {
    if (name.starts_with(prefix)) return true;
  }
  return false;
}

// ----- file checks before SQLite sees the file -----

Status CheckFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::Error(path + ": cannot open (" + std::strerror(errno) +
                         "); check the path, or record a trace with dc-collect");
  }
  if (!S_ISREG(st.st_mode))
    return Status::Error(path + ": not a regular file; pass the trace file");
  if (st.st_size == 0) {
    return Status::Error(path + ": empty file (0 bytes); the recording did not finish, " +
                         kRerecord);
  }
  static constexpr char kHeader[] = "SQLite format 3";  // 16 bytes with its NUL
  char header[sizeof(kHeader)] = {};
  std::ifstream in(path, std::ios::binary);
  in.read(header, sizeof(header));
  if (in.gcount() != static_cast<std::streamsize>(sizeof(header)) ||
      std::memcmp(header, kHeader, sizeof(header)) != 0) {
    return Status::Error(path +
                         ": not a SQLite database; expected a dc trace or an nsys "
                         "SQLite export (nsys export --type sqlite)");
  }
  return Status::Ok();
}

// ----- SQL built from the columns a file has -----

// Expressions over one table whose columns vary by nsys version.
class Columns {
 public:
  Columns(std::string alias, std::set<std::string> names)
      : alias_(std::move(alias)), names_(std::move(names)) {}
  bool Has(const std::string& name) const { return names_.contains(name); }
  // "alias.name", or `fallback` (an SQL literal) where the column is missing.
  std::string Or(const std::string& name, const std::string& fallback) const {
    return Has(name) ? alias_ + ".\"" + name + "\"" : fallback;
  }

 private:
  std::string alias_;
  std::set<std::string> names_;
};

// The range rules of analyzer/limits.h over one table's rows, as an SQL CASE that names the
// first rule a row breaks (NULL for a good row). Only columns the table has are checked: the
// others read as literals. Integer checks come first, so comparisons see integers.
class ProblemCase {
 public:
  explicit ProblemCase(const Columns& c) : c_(c) {}
  // Not NULL, not text, not real.
  ProblemCase& Integer(const std::string& column) {
    if (c_.Has(column)) {
      Add("typeof(" + c_.Or(column, "") + ") != 'integer'", "NULL or non-integer " + column);
    }
    return *this;
  }
  // NULL, or an integer (a column that may be left out of a row).
  ProblemCase& IntegerOrNull(const std::string& column) {
    if (c_.Has(column)) {
      const std::string v = c_.Or(column, "");
      Add(v + " IS NOT NULL AND typeof(" + v + ") != 'integer'", "non-integer " + column);
    }
    return *this;
  }
  ProblemCase& Range(const std::string& column, int64_t lo, int64_t hi, const std::string& what) {
    if (c_.Has(column)) {
      const std::string v = c_.Or(column, "");
      Add(v + " < " + std::to_string(lo) + " OR " + v + " > " + std::to_string(hi),
          column + " out of range (" + what + ")");
    }
    return *this;
  }
  ProblemCase& Time(const std::string& column) {
    return Range(column, -TraceLimits::kMaxAbsTimeNs, TraceLimits::kMaxAbsTimeNs,
                 "more than 73 years from the trace's start");
  }
  ProblemCase& Bytes(const std::string& column) {
    return Range(column, 0, TraceLimits::kMaxRecordBytes, "negative or over 1 PiB");
  }
  ProblemCase& Ordered(const std::string& start, const std::string& end) {
    if (c_.Has(start) && c_.Has(end)) {
      Add(c_.Or(end, "") + " < " + c_.Or(start, ""), end + " before " + start);
    }
    return *this;
  }
  // The row's owner is one of `owners` (an SQL list or subquery: the trace's ranks).
  ProblemCase& OwnedBy(const std::string& column, const std::string& owners) {
    if (c_.Has(column) && !owners.empty()) {
      Add(c_.Or(column, "") + " NOT IN (" + owners + ")", column + " of no rank");
    }
    return *this;
  }
  // A kernel's name id (an integer, as dc and current nsys exports write it) that StringIds does
  // not hold: the name would print as a number, and a collective's name decides its kind.
  ProblemCase& NameInStrings(const std::string& column) {
    if (c_.Has(column)) {
      const std::string v = c_.Or(column, "");
      Add("typeof(" + v + ") = 'integer' AND NOT EXISTS (SELECT 1 FROM StringIds WHERE id = " + v +
              ")",
          column + " not in StringIds");
    }
    return *this;
  }
  std::string Sql() const { return whens_.empty() ? "NULL" : "(CASE" + whens_ + " END)"; }

 private:
  void Add(const std::string& condition, const std::string& problem) {
    std::string quoted;
    for (char c : problem) quoted += c == '\'' ? std::string("''") : std::string(1, c);
    whens_ += " WHEN " + condition + " THEN '" + quoted + "'";
  }
  const Columns& c_;
  std::string whens_;
};

// The column a kernel's name is read from (KernelNameSql), or "" where it has none.
std::string KernelNameColumn(const Columns& k) {
  for (const char* column : {"shortName", "demangledName", "name", "mangledName"}) {
    if (k.Has(column)) return column;
  }
  return "";
}

// An activity row (kernel, memcpy, memset): times, owner and stream, and bytes where it has them;
// with `names_in_strings` (kernels of a file with StringIds), a name id the table holds.
// `owners`: the ranks' globalPids as SQL (Trace::owners_sql_), or empty.
std::string ActivityProblems(const Columns& c, bool with_bytes, const std::string& owners,
                             bool names_in_strings = false) {
  ProblemCase p(c);
  p.Integer("start").Integer("end").Integer("globalPid").Integer("streamId");
  if (with_bytes) p.Integer("bytes");
  if (names_in_strings) p.NameInStrings(KernelNameColumn(c));
  p.OwnedBy("globalPid", owners);
  p.Time("start").Time("end").Ordered("start", "end");
  p.Range("streamId", 0, TraceLimits::kMaxStreamId, "negative or over 2^48");
  if (with_bytes) p.Bytes("bytes");
  return p.Sql();
}

std::string MemoryProblems(const Columns& c, const std::string& owners) {
  ProblemCase p(c);
  p.Integer("start").Integer("globalPid").Integer("address").Integer("bytes");
  p.OwnedBy("globalPid", owners);
  p.Integer("memoryOperationType").Time("start").Bytes("bytes");
  return p.Sql();
}

std::string CollectiveProblems(const Columns& c) {
  ProblemCase p(c);
  p.Integer("globalPid").Integer("correlationId").Integer("bytes").Bytes("bytes");
  return p.Sql();
}

std::string StepProblems(const Columns& c) {
  ProblemCase p(c);
  p.Integer("globalPid").Integer("step").Integer("start").Integer("end");
  p.OwnedBy("globalPid", kDcOwners);
  p.Range("step", 0, TraceLimits::kMaxIndex, "negative or over 2^31");
  p.Time("start").Time("end").Ordered("start", "end");
  return p.Sql();
}

std::string InstructionMapProblems(const Columns& c) {
  ProblemCase p(c);
  p.Integer("globalPid").Integer("correlationId").Integer("step").Integer("instruction");
  p.IntegerOrNull("microStep");
  p.Range("step", 0, TraceLimits::kMaxIndex, "negative or over 2^31");
  p.Range("instruction", 0, TraceLimits::kMaxIndex, "negative or over 2^31");
  p.Range("microStep", -1, TraceLimits::kMaxIndex, "below -1 or over 2^31");
  return p.Sql();
}

// A CASE over an integer column mapping the enum `labels` by index.
template <size_t N>
std::string LabelCase(const std::string& column, const std::array<const char*, N>& labels,
                      const std::string& prefix, const std::string& suffix) {
  std::string sql = "CASE " + column;
  for (size_t i = 0; i < N; ++i) {
    sql += " WHEN " + std::to_string(i) + " THEN '" + prefix + labels[i] + suffix + "'";
  }
  return sql + " ELSE '" + prefix + "Unknown" + suffix + "' END";
}

// A kernel's name: shortName (or the first name column present), an id into StringIds in
// current exports, text in some older ones.
std::string KernelNameSql(const Columns& k, bool have_strings) {
  for (const char* column : {"shortName", "demangledName", "name", "mangledName"}) {
    if (!k.Has(column)) continue;
    const std::string value = k.Or(column, "NULL");
    if (!have_strings) return "CAST(" + value + " AS TEXT)";
    return "COALESCE((SELECT value FROM StringIds WHERE id = " + value + "), CAST(" + value +
           " AS TEXT))";
  }
  return "'kernel'";
}

// Columns of every activity query: type, globalPid, deviceId, streamId, start, end,
// correlationId, bytes, name. Rows that break the range rules are left out (Trace::skipped()
// counts them); `collective_problems` is CollectiveProblems over TC_COLLECTIVE AS c (dc).
std::string KernelSelect(const Columns& k, bool dc, bool have_strings,
                         const std::string& collective_problems, const std::string& owners) {
  const std::string name = KernelNameSql(k, have_strings);
  const std::string common = k.Or("globalPid", "0") + ", " + k.Or("deviceId", "0") + ", " +
                             k.Or("streamId", "0") + ", k.start, k.\"end\", " +
                             k.Or("correlationId", "0");
  const std::string where =
      " WHERE " + ActivityProblems(k, false, owners, have_strings) + " IS NULL";
  if (!dc) {
    return "SELECT 0, " + common + ", 0, " + name + " FROM " + kKernelTable + " AS k" + where;
  }
  // A collective's kernel row and its TC_COLLECTIVE row share the correlation id: one activity.
  return "SELECT CASE WHEN c.kind IS NULL THEN 0 ELSE 3 END, " + common +
         ", COALESCE(c.bytes, 0), COALESCE(c.kind, " + name + ") FROM " + kKernelTable +
         " AS k LEFT JOIN TC_COLLECTIVE AS c ON c.globalPid = k.globalPid AND "
         "c.correlationId = k.correlationId AND " +
         collective_problems + " IS NULL" + where;
}

std::string CopySelect(const Columns& m, const std::string& owners) {
  return "SELECT 1, " + m.Or("globalPid", "0") + ", " + m.Or("deviceId", "0") + ", " +
         m.Or("streamId", "0") + ", m.start, m.\"end\", " + m.Or("correlationId", "0") + ", " +
         m.Or("bytes", "0") + ", " +
         LabelCase(m.Or("copyKind", "0"), kCopyKindLabels, "[CUDA memcpy ", "]") + " FROM " +
         kMemcpyTable + " AS m WHERE " + ActivityProblems(m, true, owners) + " IS NULL";
}

std::string MemsetSelect(const Columns& m, const std::string& owners) {
  return "SELECT 2, " + m.Or("globalPid", "0") + ", " + m.Or("deviceId", "0") + ", " +
         m.Or("streamId", "0") + ", m.start, m.\"end\", " + m.Or("correlationId", "0") + ", " +
         m.Or("bytes", "0") + ", '[CUDA memset]' FROM " + kMemsetTable + " AS m WHERE " +
         ActivityProblems(m, true, owners) + " IS NULL";
}

// Columns: globalPid, deviceId, start, address, bytes, operation, name, kind, correlationId.
std::string MemorySelect(const Columns& e, bool dc, const std::string& owners) {
  const std::string kind = dc && e.Has("tcKind")
                               ? e.Or("tcKind", "''")
                               : LabelCase(e.Or("memKind", "7"), kMemKindLabels, "", "");
  return "SELECT " + e.Or("globalPid", "0") + ", " + e.Or("deviceId", "0") + ", e.start, " +
         e.Or("address", "0") + ", " + e.Or("bytes", "0") + ", " +
         e.Or("memoryOperationType", "0") + ", " + e.Or("name", "''") + ", " + kind + ", " +
         e.Or("correlationId", "0") + " FROM " + kMemoryTable + " AS e WHERE " +
         MemoryProblems(e, owners) + " IS NULL ORDER BY 1, e.start, e.rowid";
}

// ----- dc-specific checks -----

StatusOr<std::map<std::string, std::string>> ExportMetadata(sqlite3* db, const std::string& path,
                                                            const std::set<std::string>& tables) {
  std::map<std::string, std::string> metadata;
  if (!tables.contains("META_DATA_EXPORT")) return metadata;
  Query query(db, path, "SELECT name, value FROM META_DATA_EXPORT");
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) break;
    metadata[query.Text(0)] = query.Text(1);
  }
  return metadata;
}

Status CheckSchemaVersion(const std::string& path,
                          const std::map<std::string, std::string>& metadata) {
  auto it = metadata.find("dc.trace_schema_version");
  if (it == metadata.end()) {
    return Status::Error(path + ": no dc.trace_schema_version in META_DATA_EXPORT (an unmerged " +
                         "rank file?); " + kRerecord);
  }
  const int version = std::atoi(it->second.c_str());
  if (version <= 0) {
    return Status::Error(path + ": bad dc.trace_schema_version '" + it->second + "'; " + kRerecord);
  }
  if (version > kTraceSchemaVersion) {
    return Status::Error(path + ": trace schema version " + std::to_string(version) +
                         " is newer than this build reads (" + std::to_string(kTraceSchemaVersion) +
                         "); update dc");
  }
  return Status::Ok();
}

struct Blob {
  int64_t format_version = 0;
  std::string digest, data;
};

template <typename Message>
StatusOr<Message> ParseBlob(const std::string& path, const std::string& name, const Blob& blob,
                            uint32_t newest_version) {
  const std::string computed = Sha256Hex(blob.data);
  if (computed != blob.digest) {
    return Status::Error(path + ": TC_BLOB '" + name + "' does not match its digest (stored " +
                         blob.digest.substr(0, 12) + ", computed " + computed.substr(0, 12) +
                         "); the trace was modified or damaged, " + kRerecord);
  }
  if (blob.format_version > newest_version) {
    return Status::Error(path + ": the embedded " + name + " has format version " +
                         std::to_string(blob.format_version) + ", newer than this build reads (" +
                         std::to_string(newest_version) + "); update dc");
  }
  Message message;
  if (!message.ParseFromString(blob.data)) {
    return Status::Error(path + ": TC_BLOB '" + name + "' does not parse; " + kRerecord);
  }
  return message;
}

}  // namespace

// ----- Trace -----

StatusOr<std::unique_ptr<Trace>> Trace::Open(const std::string& path) {
  DC_RETURN_IF_ERROR(CheckFile(path));
  std::unique_ptr<Trace> trace(new Trace());
  trace->path_ = path;
  const int rc = sqlite3_open_v2(path.c_str(), &trace->db_, SQLITE_OPEN_READONLY, nullptr);
  if (rc != SQLITE_OK) return SqliteError(path, trace->db_, rc, "cannot open");
  DC_RETURN_IF_ERROR(trace->Load());
  return trace;
}

Trace::~Trace() { sqlite3_close(db_); }

std::string Trace::program_digest() const { return program_ ? DigestOf(*program_) : ""; }

Status Trace::Load() {
  DC_ASSIGN_OR_RETURN(std::set<std::string> tables, TableNames(db_, path_));
  DC_ASSIGN_OR_RETURN(auto metadata, ExportMetadata(db_, path_, tables));
  auto producer = metadata.find("producer");
  const bool dc =
      tables.contains("TC_RANK") || (producer != metadata.end() && producer->second == "dc");
  if (!tables.contains(kKernelTable)) {
    return Status::Error(path_ + ": no table " + kKernelTable + "; is this an nsys or dc trace?");
  }
  source_ = dc ? TraceSource::kDc : TraceSource::kNsys;
  if (dc) {
    DC_RETURN_IF_ERROR(CheckSchemaVersion(path_, metadata));
    if (auto it = metadata.find(kIncompleteKey); it != metadata.end()) {
      incomplete_ = it->second.empty() ? "the run stopped early" : it->second;
      notes_.push_back("incomplete trace (" + incomplete_ + "): it holds the steps every rank " +
                       "completed");
    }
    DC_RETURN_IF_ERROR(LoadDc(tables));
  } else {
    DC_RETURN_IF_ERROR(LoadNsys(tables));
  }
  return BuildQueries(tables);
}

Status Trace::LoadDc(const std::set<std::string>& tables) {
  for (const char* table : {"TC_RANK", "TC_BLOB", "TC_STEP", "TC_INSTRUCTION_MAP", "TC_COLLECTIVE",
                            "TC_RECORD_STATS"}) {
    if (!tables.contains(table)) {
      return Status::Error(path_ + ": dc trace without table " + table + "; " + kRerecord);
    }
  }
  DC_RETURN_IF_ERROR(LoadDcBlobs());
  // hostCores and threadsPerRank: absent before dc recorded them; a value that is not a
  // positive whole number up to TraceLimits::kMaxIndex reads as not known.
  DC_ASSIGN_OR_RETURN(std::set<std::string> rank_names, ColumnNames(db_, path_, "TC_RANK"));
  const Columns rank_columns("r", rank_names);
  auto count_or_zero = [&](const std::string& column) {
    const std::string value = rank_columns.Or(column, "0");
    return "CASE WHEN typeof(" + value + ") = 'integer' AND " + value + " BETWEEN 1 AND " +
           std::to_string(TraceLimits::kMaxIndex) + " THEN " + value + " ELSE 0 END";
  };
  Query ranks(db_, path_,
              "SELECT globalPid, rank, worldSize, COALESCE(backend, ''), COALESCE(device, ''), "
              "COALESCE(hostname, ''), COALESCE(deviceMemoryBytes, 0), typeof(globalPid), "
              "typeof(rank), typeof(worldSize), " +
                  count_or_zero("hostCores") + ", " + count_or_zero("threadsPerRank") +
                  " FROM TC_RANK AS r ORDER BY rank");
  std::map<int64_t, int64_t> rank_of_pid;
  std::set<int64_t> rank_ids;
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, ranks.Next());
    if (!row) break;
    const int64_t pid = ranks.Int(0), rank = ranks.Int(1), world = ranks.Int(2);
    const bool integers =
        ranks.Text(7) == "integer" && ranks.Text(8) == "integer" && ranks.Text(9) == "integer";
    if (!integers || rank < 0 || world < 1 || world > TraceLimits::kMaxIndex || rank >= world) {
      return Status::Error(path_ + ": TC_RANK has a bad row (rank '" + ranks.Text(1) +
                           "' of world size '" + ranks.Text(2) + "'); " + kRerecord);
    }
    if (!rank_ids.insert(rank).second) {
      return Status::Error(path_ + ": TC_RANK lists rank " + std::to_string(rank) +
                           " twice; the rank files of two runs were merged, " + kRerecord);
    }
    if (!rank_of_pid.emplace(pid, rank).second) {
      return Status::Error(path_ + ": TC_RANK gives process " + std::to_string(pid) +
                           " two ranks (" + std::to_string(rank_of_pid[pid]) + " and " +
                           std::to_string(rank) + "); " + kRerecord);
    }
    ranks_.push_back({pid, static_cast<int>(rank), static_cast<int>(world), ranks.Text(3),
                      ranks.Text(4), ranks.Text(5), ranks.Int(6), static_cast<int>(ranks.Int(10)),
                      static_cast<int>(ranks.Int(11))});
  }
  if (ranks_.empty()) return Status::Error(path_ + ": dc trace without ranks; " + kRerecord);

  DC_ASSIGN_OR_RETURN(std::set<std::string> step_names, ColumnNames(db_, path_, "TC_STEP"));
  const Columns step_columns("s", step_names);
  const std::string step_problems = StepProblems(step_columns);
  DC_RETURN_IF_ERROR(CountSkipped("TC_STEP", "s", step_problems).status());
  Query steps(db_, path_,
              "SELECT globalPid, step, start, end, COALESCE(loss, 0), warmup FROM TC_STEP AS s "
              "WHERE " +
                  step_problems + " IS NULL ORDER BY globalPid, step, start");
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, steps.Next());
    if (!row) break;
    steps_.push_back({steps.Int(0), static_cast<int>(steps.Int(1)), steps.Int(2), steps.Int(3),
                      steps.Double(4), steps.Int(5) != 0});
  }
  Query dropped(db_, path_,
                "SELECT COALESCE(SUM(CASE WHEN typeof(dropped) = 'integer' AND dropped > 0 "
                "THEN dropped ELSE 0 END), 0) FROM TC_RECORD_STATS");
  DC_ASSIGN_OR_RETURN(bool row, dropped.Next());
  if (row) dropped_records_ = dropped.Int(0);
  if (!tables.contains(kMemoryTable))
    notes_.push_back(std::string("no ") + kMemoryTable + " table: no memory timeline");
  if (tables.contains("TC_STREAM")) {
    Query names(db_, path_, "SELECT streamId, name FROM TC_STREAM");
    while (true) {
      DC_ASSIGN_OR_RETURN(bool name_row, names.Next());
      if (!name_row) break;
      stream_names_[names.Int(0)] = names.Text(1);
    }
  }
  return Status::Ok();
}

namespace {

class MapLookup : public Trace::InstructionLookup {
 public:
  MapLookup(sqlite3* db, const std::string& path, const std::string& sql) : query_(db, path, sql) {}
  const Status& status() const { return query_.status(); }
  StatusOr<std::optional<std::pair<int, int>>> Find(int64_t global_pid,
                                                    int64_t correlation_id) override {
    query_.Reset();
    query_.Bind(1, global_pid);
    query_.Bind(2, correlation_id);
    DC_ASSIGN_OR_RETURN(bool row, query_.Next());
    if (!row) return std::optional<std::pair<int, int>>();
    return std::optional<std::pair<int, int>>(
        std::pair{static_cast<int>(query_.Int(0)), static_cast<int>(query_.Int(1))});
  }

 private:
  Query query_;
};

}  // namespace

StatusOr<std::unique_ptr<Trace::InstructionLookup>> Trace::LookupInstructions() const {
  if (source_ != TraceSource::kDc) {
    return Status::Error(path_ + ": an nsys export maps no activity to a dc instruction");
  }
  auto lookup = std::make_unique<MapLookup>(db_, path_, lookup_sql_);
  DC_RETURN_IF_ERROR(lookup->status());
  return std::unique_ptr<InstructionLookup>(std::move(lookup));
}

bool Trace::IsAttachCapture() const {
  Query query(db_, path_, "SELECT value FROM META_DATA_EXPORT WHERE name = 'dc.capture'");
  StatusOr<bool> row = query.Next();
  return row.ok() && *row && query.Text(0) == "attach";
}

Status Trace::LoadDcBlobs() {
  std::map<std::string, Blob> blobs;
  Query query(db_, path_, "SELECT name, formatVersion, digest, data FROM TC_BLOB");
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) break;
    blobs[query.Text(0)] = {query.Int(1), query.Text(2), query.Blob(3)};
  }
  if (blobs.empty() && IsAttachCapture()) {
    // `dc-collect --attach` of a program that is not ours: there is no program to re-plan.
    notes_.push_back(
        "captured with dc-collect --attach from a foreign program: report-only, no program to "
        "plan");
    return Status::Ok();
  }
  if (!blobs.contains("schedule")) {
    return Status::Error(path_ + ": dc trace without the schedule it ran (TC_BLOB 'schedule'); " +
                         kRerecord);
  }
  DC_ASSIGN_OR_RETURN(schedule_, ParseBlob<proto::Schedule>(path_, "schedule", blobs["schedule"],
                                                            kScheduleFormatVersion));
  program_ = schedule_->program();
  // Format version 1 marked recompute ops only by their names: its recomputes would plan as if
  // nothing were recomputed. Without recompute the versions mean the same.
  if (program_->format_version() < kProgramFormatVersion && program_->config().recompute_layers()) {
    return Status::Error(path_ + ": the embedded program has format version " +
                         std::to_string(program_->format_version()) +
                         " and recomputes layers, which this dc reads only from version " +
                         std::to_string(kProgramFormatVersion) + "; " + kRerecord);
  }
  if (blobs.contains("program")) {
    DC_ASSIGN_OR_RETURN(
        proto::Program program,
        ParseBlob<proto::Program>(path_, "program", blobs["program"], kProgramFormatVersion));
    if (DigestOf(program) != DigestOf(*program_)) {
      return Status::Error(path_ + ": TC_BLOB 'program' differs from the schedule's program; " +
                           kRerecord);
    }
  }
  return Status::Ok();
}

Status Trace::LoadNsys(const std::set<std::string>& tables) {
  const std::pair<const char*, const char*> optional[] = {
      {kMemcpyTable, "no copies"},
      {kMemsetTable, "no memsets"},
      {kMemoryTable, "no memory timeline (record with nsys --cuda-memory-usage=true)"},
      {"StringIds", "kernel names are shown as their ids"},
  };
  for (const auto& [table, consequence] : optional) {
    if (!tables.contains(table)) {
      notes_.push_back(std::string("no ") + table + " table: " + consequence);
    }
  }
  return LoadNsysRanks(tables);
}

// Ranks of an nsys export: MPI_RANKS where nsys traced MPI, else one per process with device
// activity, in globalPid order.
Status Trace::LoadNsysRanks(const std::set<std::string>& tables) {
  std::string sql;
  DC_ASSIGN_OR_RETURN(std::set<std::string> mpi_columns, ColumnNames(db_, path_, "MPI_RANKS"));
  if (mpi_columns.contains("globalTid") && mpi_columns.contains("rank")) {
    const std::string pid =
        "(globalTid / " + std::to_string(kPidUnit) + ") * " + std::to_string(kPidUnit);
    sql = "SELECT DISTINCT " + pid + ", rank FROM MPI_RANKS ORDER BY rank, 1";
    owners_sql_ = "SELECT " + pid + " FROM MPI_RANKS WHERE globalTid IS NOT NULL";
  } else {
    std::string pids;
    for (const char* table : {kKernelTable, kMemcpyTable, kMemsetTable}) {
      if (!tables.contains(table)) continue;
      DC_ASSIGN_OR_RETURN(std::set<std::string> columns, ColumnNames(db_, path_, table));
      if (!columns.contains("globalPid")) continue;
      pids += std::string(pids.empty() ? "" : " UNION ") + "SELECT globalPid FROM " + table;
    }
    if (pids.empty()) pids = "SELECT 0";
    sql = "SELECT DISTINCT globalPid, -1 FROM (" + pids + ") ORDER BY globalPid";
  }
  Query query(db_, path_, sql);
  std::set<int64_t> pids, rank_ids;
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) break;
    if (query.IsNull(0)) continue;  // a row without a process: no rank to show (counted below)
    TraceRank rank;
    rank.global_pid = query.Int(0);
    const int64_t number = query.Int(1);
    if (number > TraceLimits::kMaxIndex || number < -1) {
      return Status::Error(path_ + ": MPI_RANKS has rank " + std::to_string(number) +
                           ", out of range; export the trace again");
    }
    rank.rank = number >= 0 ? static_cast<int>(number) : static_cast<int>(ranks_.size());
    if (!rank_ids.insert(rank.rank).second) {
      return Status::Error(path_ + ": MPI_RANKS lists rank " + std::to_string(rank.rank) +
                           " for two processes; export one run per file");
    }
    if (!pids.insert(rank.global_pid).second) {
      return Status::Error(path_ + ": MPI_RANKS gives process " + std::to_string(rank.global_pid) +
                           " two ranks; export one run per file");
    }
    rank.backend = "cuda";
    ranks_.push_back(rank);
  }
  for (TraceRank& rank : ranks_) rank.world_size = static_cast<int>(ranks_.size());
  if (tables.contains("TARGET_INFO_GPU")) {
    // One name for all ranks: exports rarely tie processes to devices; the first GPU.
    Query gpu(db_, path_,
              "SELECT COALESCE(name, ''), COALESCE(totalMemory, 0) FROM TARGET_INFO_GPU "
              "ORDER BY id LIMIT 1");
    DC_ASSIGN_OR_RETURN(bool row, gpu.Next());
    for (TraceRank& rank : ranks_) {
      if (!row) break;
      rank.device = gpu.Text(0);
      rank.device_memory_bytes = gpu.Int(1);
    }
  }
  return Status::Ok();
}

StatusOr<int64_t> Trace::CountSkipped(const std::string& table, const std::string& alias,
                                      const std::string& problem_sql) {
  const std::string from = " FROM \"" + table + "\" AS " + alias;
  Query total(db_, path_, "SELECT COUNT(*)" + from);
  DC_ASSIGN_OR_RETURN(bool row, total.Next());
  int64_t good = row ? total.Int(0) : 0;
  // Grouping only the broken rows: a GROUP BY over every row sorted them all (twice the time).
  Query problems(db_, path_,
                 "SELECT problem, COUNT(*) FROM (SELECT " + problem_sql + " AS problem" + from +
                     ") WHERE problem IS NOT NULL GROUP BY problem ORDER BY problem");
  while (true) {
    DC_ASSIGN_OR_RETURN(bool next, problems.Next());
    if (!next) break;
    skipped_.push_back({table, problems.Text(0), problems.Int(1)});
    good -= problems.Int(1);
  }
  return good;
}

// Kernel names are ids into StringIds in dc traces and current nsys exports: without the table
// every name would print as a number.
Status Trace::CheckKernelNames(const std::set<std::string>& tables) {
  if (tables.contains("StringIds")) return Status::Ok();
  if (source_ == TraceSource::kDc) {
    return Status::Error(path_ + ": dc trace without table StringIds (its kernel names); " +
                         kRerecord);
  }
  DC_ASSIGN_OR_RETURN(std::set<std::string> kernel, ColumnNames(db_, path_, kKernelTable));
  for (const char* column : {"shortName", "demangledName", "name", "mangledName"}) {
    if (!kernel.contains(column)) continue;
    Query ids(db_, path_,
              std::string("SELECT 1 FROM ") + kKernelTable + " WHERE typeof(\"" + column +
                  "\") = 'integer' LIMIT 1");
    DC_ASSIGN_OR_RETURN(bool any, ids.Next());
    if (any) {
      return Status::Error(path_ + ": kernel names are ids into StringIds, which the file " +
                           "lacks; export it again (nsys export --type sqlite)");
    }
    break;
  }
  return Status::Ok();
}

Status Trace::BuildQueries(const std::set<std::string>& tables) {
  const bool dc = source_ == TraceSource::kDc;
  DC_ASSIGN_OR_RETURN(std::set<std::string> kernel, ColumnNames(db_, path_, kKernelTable));
  if (!kernel.contains("start") || !kernel.contains("end")) {
    return Status::Error(path_ + ": " + kKernelTable + " has no start/end columns; " +
                         "is this an nsys or dc trace?");
  }
  DC_RETURN_IF_ERROR(CheckKernelNames(tables));
  const Columns k("k", kernel);
  if (dc) owners_sql_ = kDcOwners;
  const std::string& owners = owners_sql_;
  const size_t kernel_problems = skipped_.size();  // the kernel table's come next
  DC_ASSIGN_OR_RETURN(
      int64_t kernels,
      CountSkipped(kKernelTable, "k",
                   ActivityProblems(k, false, owners, tables.contains("StringIds"))));
  if (kernels == 0) {
    const std::string how =
        dc ? std::string(kRerecord) : "record it again with nsys profile --trace=cuda";
    if (skipped_.size() == kernel_problems) {
      return Status::Error(path_ + ": no kernel rows in " + kKernelTable +
                           ": nothing ran on the device while it was recorded; " + how);
    }
    return Status::Error(path_ + ": none of the kernel rows is usable (" +
                         skipped_[kernel_problems].Text() + "); " + how);
  }
  std::string collective_problems = "NULL";
  if (dc) {
    DC_ASSIGN_OR_RETURN(std::set<std::string> collective, ColumnNames(db_, path_, "TC_COLLECTIVE"));
    const Columns c("c", collective);
    collective_problems = CollectiveProblems(c);
    DC_RETURN_IF_ERROR(CountSkipped("TC_COLLECTIVE", "c", collective_problems).status());
  }
  std::string sql = KernelSelect(k, dc, tables.contains("StringIds"), collective_problems, owners);
  DC_ASSIGN_OR_RETURN(std::set<std::string> memcpy_columns, ColumnNames(db_, path_, kMemcpyTable));
  const Columns m("m", memcpy_columns);
  if (memcpy_columns.contains("start") && memcpy_columns.contains("end")) {
    DC_RETURN_IF_ERROR(CountSkipped(kMemcpyTable, "m", ActivityProblems(m, true, owners)).status());
    sql += " UNION ALL " + CopySelect(m, owners);
  }
  DC_ASSIGN_OR_RETURN(std::set<std::string> memset_columns, ColumnNames(db_, path_, kMemsetTable));
  const Columns ms("m", memset_columns);
  if (memset_columns.contains("start") && memset_columns.contains("end")) {
    DC_RETURN_IF_ERROR(
        CountSkipped(kMemsetTable, "m", ActivityProblems(ms, true, owners)).status());
    sql += " UNION ALL " + MemsetSelect(ms, owners);
  }
  activity_sql_ = sql + " ORDER BY 2, 5, 6, 1, 7";
  DC_ASSIGN_OR_RETURN(std::set<std::string> memory, ColumnNames(db_, path_, kMemoryTable));
  const Columns e("e", memory);
  if (memory.contains("start")) {
    DC_RETURN_IF_ERROR(CountSkipped(kMemoryTable, "e", MemoryProblems(e, owners)).status());
    memory_sql_ = MemorySelect(e, dc, owners);
  }
  if (dc) {
    DC_ASSIGN_OR_RETURN(std::set<std::string> map_columns,
                        ColumnNames(db_, path_, "TC_INSTRUCTION_MAP"));
    const Columns map("m", map_columns);
    const std::string map_ok = InstructionMapProblems(map) + " IS NULL";
    DC_RETURN_IF_ERROR(
        CountSkipped("TC_INSTRUCTION_MAP", "m", InstructionMapProblems(map)).status());
    lookup_sql_ =
        "SELECT step, instruction FROM TC_INSTRUCTION_MAP AS m WHERE globalPid = ? AND "
        "correlationId = ? AND " +
        map_ok + " LIMIT 1";
    // Samples of skipped kernel or copy rows are left out with them.
    const Columns kk("k", kernel), p("p", memcpy_columns);
    samples_sql_ =
        "SELECT m.globalPid, m.step, COALESCE(m.microStep, -1), m.instruction, k.start, k.end, "
        "COALESCE(c.bytes, 0) FROM TC_INSTRUCTION_MAP AS m "
        "JOIN CUPTI_ACTIVITY_KIND_KERNEL AS k ON k.globalPid = m.globalPid AND "
        "k.correlationId = m.correlationId AND " +
        ActivityProblems(kk, false, owners, tables.contains("StringIds")) +
        " IS NULL "
        "LEFT JOIN TC_COLLECTIVE AS c ON c.globalPid = m.globalPid AND "
        "c.correlationId = m.correlationId AND " +
        collective_problems + " IS NULL WHERE " + map_ok;
    if (memcpy_columns.contains("start") && memcpy_columns.contains("end")) {
      samples_sql_ +=
          " UNION ALL "
          "SELECT m.globalPid, m.step, COALESCE(m.microStep, -1), m.instruction, p.start, p.end, "
          "p.bytes FROM TC_INSTRUCTION_MAP AS m "
          "JOIN CUPTI_ACTIVITY_KIND_MEMCPY AS p ON p.globalPid = m.globalPid AND "
          "p.correlationId = m.correlationId AND " +
          ActivityProblems(p, true, owners) + " IS NULL WHERE " + map_ok;
    }
    samples_sql_ += " ORDER BY 1, 2, 3, 4, 5";
  }
  return Status::Ok();
}

Status Trace::ForEachActivity(const std::function<void(const Activity&)>& fn) const {
  Query query(db_, path_, activity_sql_);
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) break;
    Activity a;
    a.type = static_cast<Activity::Type>(query.Int(0));
    a.global_pid = query.Int(1);
    a.device_id = query.Int(2);
    a.stream_id = query.Int(3);
    a.start_ns = query.Int(4);
    a.end_ns = query.Int(5);
    a.correlation_id = query.Int(6);
    a.bytes = query.Int(7);
    a.name = query.Text(8);
    a.communication = a.type == Activity::Type::kCollective ||
                      (a.type == Activity::Type::kKernel && IsCommunicationKernel(a.name));
    fn(a);
  }
  return Status::Ok();
}

Status Trace::ForEachMemoryEvent(const std::function<void(const MemoryEvent&)>& fn) const {
  if (memory_sql_.empty()) return Status::Ok();
  constexpr int64_t kDeallocation = 1;  // ENUM_CUDA_DEV_MEM_EVENT_OPER
  Query query(db_, path_, memory_sql_);
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) break;
    MemoryEvent e;
    e.global_pid = query.Int(0);
    e.device_id = query.Int(1);
    e.ts_ns = query.Int(2);
    e.address = query.Int(3);
    e.bytes = query.Int(4);
    e.alloc = query.Int(5) != kDeallocation;
    e.name = query.Text(6);
    e.kind = query.Text(7);
    e.correlation_id = query.Int(8);
    fn(e);
  }
  return Status::Ok();
}

Status Trace::ForEachInstructionSample(
    const std::function<void(const InstructionSample&)>& fn) const {
  if (source_ != TraceSource::kDc) return Status::Ok();
  Query query(db_, path_, samples_sql_);
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) break;
    InstructionSample s;
    s.global_pid = query.Int(0);
    s.step = static_cast<int>(query.Int(1));
    s.micro_step = static_cast<int>(query.Int(2));
    s.instruction = static_cast<int>(query.Int(3));
    s.start_ns = query.Int(4);
    s.end_ns = query.Int(5);
    s.bytes = query.Int(6);
    fn(s);
  }
  return Status::Ok();
}

}  // namespace dc
