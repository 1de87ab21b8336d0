// MergeRankTraces: the ranks' files joined into the run's one trace.
#include <sys/stat.h>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "collector/host_tracer.h"
#include "collector/sqlite_writer.h"
#include "collector/trace_blobs.h"
#include "schemas/digest.h"
#include "schemas/files.h"
#include "schemas/trace_schema.h"

namespace dc {

using collector_internal::Database;
using collector_internal::SqlQuote;
using collector_internal::Statement;

namespace {

constexpr char kRankSchema[] = "rank_file";

// Columns that hold StringIds ids, per table: remapped when rows are copied.
bool IsStringIdColumn(const std::string& table, const std::string& column) {
  if (table == "CUPTI_ACTIVITY_KIND_KERNEL") {
    return column == "demangledName" || column == "shortName" || column == "mangledName";
  }
  if (table == "CUPTI_ACTIVITY_KIND_RUNTIME" || table == "ThreadNames") return column == "nameId";
  if (table == "NVTX_EVENTS") return column == "textId" || column == "jsonTextId";
  return false;
}

// Tables the merge writes itself rather than copying from the ranks.
bool MergeOwnsTable(const std::string& table) {
  return table == "StringIds" || table.starts_with("ENUM_") || table == "TC_BLOB" ||
         table == "META_DATA_EXPORT" || table == "ANALYSIS_DETAILS";
}

// Indexes as the reference recommends for nsys-shaped data (nsys ships none), plus ours.
constexpr const char* kIndexes[] = {
    "CREATE INDEX ix_kernel_dev_start ON CUPTI_ACTIVITY_KIND_KERNEL(deviceId, start)",
    "CREATE INDEX ix_kernel_corr ON CUPTI_ACTIVITY_KIND_KERNEL(globalPid, correlationId)",
    "CREATE INDEX ix_memcpy_dev_start ON CUPTI_ACTIVITY_KIND_MEMCPY(deviceId, start)",
    "CREATE INDEX ix_memset_dev_start ON CUPTI_ACTIVITY_KIND_MEMSET(deviceId, start)",
    "CREATE INDEX ix_runtime_corr ON CUPTI_ACTIVITY_KIND_RUNTIME(correlationId, globalTid)",
    "CREATE INDEX ix_mem_dev_start ON CUDA_GPU_MEMORY_USAGE_EVENTS(deviceId, start)",
    "CREATE INDEX ix_nvtx_tid_start ON NVTX_EVENTS(globalTid, start)",
    "CREATE INDEX ix_instruction_map_corr ON TC_INSTRUCTION_MAP(globalPid, correlationId)",
    "CREATE INDEX ix_collective_corr ON TC_COLLECTIVE(globalPid, correlationId)",
};

bool FileExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

StatusOr<std::vector<std::string>> Strings(Database& db, const std::string& sql) {
  DC_ASSIGN_OR_RETURN(Statement query, db.Prepare(sql));
  std::vector<std::string> values;
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) break;
    values.push_back(query.ColumnText(0));
  }
  return values;
}

StatusOr<std::vector<std::string>> Columns(Database& db, const std::string& schema,
                                           const std::string& table) {
  return Strings(db, "SELECT name FROM pragma_table_info(" + SqlQuote(table) + ", " +
                         SqlQuote(schema) + ") ORDER BY cid");
}

class Merger {
 public:
  explicit Merger(Database* db) : db_(db) {}

  Status Prepare();
  Status AddRank(const std::string& rank_path, bool first);
  Status AddBlobs(const proto::Schedule& schedule);
  // For an incomplete run: cuts every rank to the last step all of them completed; returns it.
  StatusOr<int64_t> CutToCommonStep();
  Status AddMetadata(const proto::Schedule& schedule, const std::string& incomplete);
  Status AddAnalysisDetails();
  Status AddIndexes();
  StatusOr<MergeSummary> Summary();

 private:
  Status CheckRankFile(const std::string& rank_path);
  Status MergeStrings();
  Status CopyTable(const std::string& table, bool first);

  Database* db_;
  std::vector<std::string> tables_;  // main's tables, in schema order
};

Status Merger::Prepare() {
  DC_RETURN_IF_ERROR(db_->Exec("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"));
  DC_RETURN_IF_ERROR(db_->Exec(TraceSchemaSql()));
  // Strings are merged by value: this index makes the lookups cheap; dropped at the end.
  DC_RETURN_IF_ERROR(
      db_->Exec("CREATE UNIQUE INDEX dc_merge_string_value ON StringIds(value);"
                "CREATE TEMP TABLE dc_string_map(old INTEGER PRIMARY KEY, new INTEGER NOT NULL);"));
  DC_ASSIGN_OR_RETURN(tables_, Strings(*db_,
                                       "SELECT name FROM main.sqlite_master WHERE type = "
                                       "'table' ORDER BY rowid"));
  return Status::Ok();
}

Status Merger::CheckRankFile(const std::string& rank_path) {
  DC_ASSIGN_OR_RETURN(int64_t has_rank,
                      db_->QueryInt(std::string("SELECT count(*) FROM ") + kRankSchema +
                                    ".sqlite_master WHERE name = 'TC_RANK'"));
  if (has_rank == 0) return Status::Error("rank file " + rank_path + " has no TC_RANK table");
  DC_ASSIGN_OR_RETURN(
      int64_t rows, db_->QueryInt(std::string("SELECT count(*) FROM ") + kRankSchema + ".TC_RANK"));
  if (rows != 1) return Status::Error("rank file " + rank_path + " must hold exactly one rank");
  DC_ASSIGN_OR_RETURN(
      int64_t duplicate,
      db_->QueryInt(std::string("SELECT count(*) FROM main.TC_RANK m JOIN ") + kRankSchema +
                    ".TC_RANK r ON r.rank = m.rank OR r.globalPid = m.globalPid"));
  if (duplicate != 0) {
    return Status::Error("rank file " + rank_path + " repeats a rank already merged");
  }
  return Status::Ok();
}

Status Merger::MergeStrings() {
  const std::string rank_strings = std::string(kRankSchema) + ".StringIds";
  return db_->Exec(
      "DELETE FROM temp.dc_string_map;"
      "INSERT OR IGNORE INTO main.StringIds(value) SELECT value FROM " +
      rank_strings +
      " ORDER BY id;"
      "INSERT INTO temp.dc_string_map(old, new) SELECT r.id, m.id FROM " +
      rank_strings + " r JOIN main.StringIds m ON m.value = r.value;");
}

Status Merger::CopyTable(const std::string& table, bool first) {
  DC_ASSIGN_OR_RETURN(std::vector<std::string> rank_columns, Columns(*db_, kRankSchema, table));
  if (rank_columns.empty()) return Status::Ok();  // the rank file lacks this table
  DC_ASSIGN_OR_RETURN(std::vector<std::string> columns, Columns(*db_, "main", table));
  const std::set<std::string> present(rank_columns.begin(), rank_columns.end());
  std::string names, values;
  for (const std::string& column : columns) {
    if (!present.contains(column)) continue;
    const std::string quoted = "\"" + column + "\"";
    names += (names.empty() ? "" : ", ") + quoted;
    values += values.empty() ? "" : ", ";
    values += IsStringIdColumn(table, column)
                  ? "(SELECT new FROM temp.dc_string_map WHERE old = src." + quoted + ")"
                  : "src." + quoted;
  }
  // Every rank writes the same stream names and the run's one session start.
  std::string verb = "INSERT INTO";
  if (table == "TC_STREAM") verb = "INSERT OR IGNORE INTO";
  if (table == "TARGET_INFO_SESSION_START_TIME" && !first) return Status::Ok();
  return db_->Exec(verb + " main.\"" + table + "\"(" + names + ") SELECT " + values + " FROM " +
                   kRankSchema + ".\"" + table + "\" AS src ORDER BY src.rowid");
}

Status Merger::AddRank(const std::string& rank_path, bool first) {
  if (!FileExists(rank_path)) return Status::Error("rank file " + rank_path + " is missing");
  // ATTACH and DETACH are refused inside a transaction: one transaction per rank.
  DC_RETURN_IF_ERROR(db_->Exec("ATTACH DATABASE " + SqlQuote(rank_path) + " AS " + kRankSchema));
  Status status = [&]() -> Status {
    DC_RETURN_IF_ERROR(db_->Exec("BEGIN"));
    DC_RETURN_IF_ERROR(CheckRankFile(rank_path));
    DC_RETURN_IF_ERROR(MergeStrings());
    for (const std::string& table : tables_) {
      if (MergeOwnsTable(table)) continue;
      DC_RETURN_IF_ERROR(CopyTable(table, first));
    }
    return db_->Exec("COMMIT");
  }();
  // On failure the whole output is discarded, so a half-copied rank needs no rollback.
  if (!status.ok()) {
    (void)db_->Exec("ROLLBACK");
    (void)db_->Exec(std::string("DETACH DATABASE ") + kRankSchema);
    return status;
  }
  return db_->Exec(std::string("DETACH DATABASE ") + kRankSchema);
}

Status Merger::AddBlobs(const proto::Schedule& schedule) {
  return collector_internal::WriteScheduleBlobs(db_, schedule);
}

StatusOr<int64_t> Merger::CutToCommonStep() {
  DC_ASSIGN_OR_RETURN(int64_t ranks, db_->QueryInt("SELECT count(*) FROM TC_RANK"));
  DC_ASSIGN_OR_RETURN(int64_t ranks_with_steps,
                      db_->QueryInt("SELECT count(DISTINCT globalPid) FROM TC_STEP"));
  if (ranks_with_steps < ranks) {
    return Status::Error("no step was completed by every rank; nothing to keep");
  }
  DC_ASSIGN_OR_RETURN(int64_t last, db_->QueryInt("SELECT MIN(m) FROM (SELECT MAX(step) AS m "
                                                  "FROM TC_STEP GROUP BY globalPid)"));
  const std::string step = std::to_string(last);
  // Each rank's records end with its steps; what a rank ran past the common last step goes. The
  // cut of each rank in a table of its own, keyed by rank: looked up in TC_STEP (unindexed) for
  // every row it took 30 s on a one-rank trace of 837 steps.
  DC_RETURN_IF_ERROR(db_->Exec(
      "CREATE TEMP TABLE dc_cut(globalPid INTEGER PRIMARY KEY, cut_end INTEGER NOT NULL); "
      "INSERT INTO dc_cut SELECT globalPid, MAX(end) FROM TC_STEP WHERE step = " +
      step + " GROUP BY globalPid"));
  const std::string cutoff = "(SELECT c.cut_end FROM dc_cut AS c WHERE c.globalPid = t.globalPid)";
  for (const char* table :
       {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
        "CUDA_GPU_MEMORY_USAGE_EVENTS", "TC_COLLECTIVE"}) {
    DC_RETURN_IF_ERROR(
        db_->Exec(std::string("DELETE FROM ") + table + " AS t WHERE t.start > " + cutoff));
  }
  DC_RETURN_IF_ERROR(db_->Exec("DELETE FROM TC_INSTRUCTION_MAP WHERE step > " + step +
                               "; DELETE FROM TC_STEP WHERE step > " + step +
                               "; DROP TABLE dc_cut"));
  return last;
}

Status Merger::AddMetadata(const proto::Schedule& schedule, const std::string& incomplete) {
  DC_ASSIGN_OR_RETURN(int64_t ranks, db_->QueryInt("SELECT count(*) FROM TC_RANK"));
  std::vector<std::pair<std::string, std::string>> rows = {
      {"producer", "dc"},
      {"dc.trace_schema_version", std::to_string(kTraceSchemaVersion)},
      {"dc.ranks", std::to_string(ranks)},
      {"dc.world_size", std::to_string(schedule.world_size())},
      {"dc.backend", schedule.backend()},
      {"dc.policy", schedule.policy()},
      {"dc.program_digest", DigestOf(schedule.program())},
      {"dc.schedule_digest", DigestOf(schedule)},
  };
  if (!incomplete.empty()) rows.emplace_back(kIncompleteKey, incomplete);
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db_->Prepare("INSERT INTO META_DATA_EXPORT(name, value) VALUES (?, ?)"));
  for (const auto& [name, value] : rows) {
    insert.Bind(1, name);
    insert.Bind(2, value);
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

Status Merger::AddAnalysisDetails() {
  return db_->Exec(
      "INSERT INTO ANALYSIS_DETAILS(globalVid, duration, startTime, stopTime) "
      "SELECT 0, COALESCE(MAX(e) - MIN(s), 0), COALESCE(MIN(s), 0), COALESCE(MAX(e), 0) FROM ("
      "SELECT start AS s, end AS e FROM CUPTI_ACTIVITY_KIND_KERNEL UNION ALL "
      "SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMCPY UNION ALL "
      "SELECT start, start FROM CUDA_GPU_MEMORY_USAGE_EVENTS UNION ALL "
      "SELECT start, end FROM TC_STEP)");
}

Status Merger::AddIndexes() {
  for (const char* sql : kIndexes) DC_RETURN_IF_ERROR(db_->Exec(sql));
  return db_->Exec("DROP INDEX dc_merge_string_value");
}

StatusOr<MergeSummary> Merger::Summary() {
  MergeSummary summary;
  DC_ASSIGN_OR_RETURN(int64_t ranks, db_->QueryInt("SELECT count(*) FROM TC_RANK"));
  summary.ranks = static_cast<int>(ranks);
  DC_ASSIGN_OR_RETURN(int64_t kernels,
                      db_->QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"));
  DC_ASSIGN_OR_RETURN(int64_t copies,
                      db_->QueryInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY"));
  summary.activities = kernels + copies;
  DC_ASSIGN_OR_RETURN(summary.memory_events,
                      db_->QueryInt("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS"));
  DC_ASSIGN_OR_RETURN(summary.dropped_records,
                      db_->QueryInt("SELECT COALESCE(SUM(dropped), 0) FROM TC_RECORD_STATS"));
  DC_ASSIGN_OR_RETURN(summary.last_step,
                      db_->QueryInt("SELECT COALESCE(MAX(step), -1) FROM TC_STEP"));
  return summary;
}

StatusOr<MergeSummary> MergeInto(const std::string& tmp_path,
                                 const std::vector<std::string>& rank_paths,
                                 const proto::Schedule& schedule, const MergeOptions& options) {
  if (rank_paths.empty()) return Status::Error("no rank files to merge");
  DC_ASSIGN_OR_RETURN(Database db, Database::Create(tmp_path));
  MergeSummary summary;
  {
    Merger merger(&db);
    DC_RETURN_IF_ERROR(merger.Prepare());
    for (size_t i = 0; i < rank_paths.size(); ++i) {
      DC_RETURN_IF_ERROR(merger.AddRank(rank_paths[i], i == 0));
    }
    DC_RETURN_IF_ERROR(db.Exec("BEGIN"));
    if (!options.incomplete.empty()) DC_RETURN_IF_ERROR(merger.CutToCommonStep().status());
    DC_RETURN_IF_ERROR(merger.AddBlobs(schedule));
    DC_RETURN_IF_ERROR(merger.AddMetadata(schedule, options.incomplete));
    DC_RETURN_IF_ERROR(merger.AddAnalysisDetails());
    DC_RETURN_IF_ERROR(merger.AddIndexes());
    DC_ASSIGN_OR_RETURN(summary, merger.Summary());
    summary.incomplete = options.incomplete;
    DC_RETURN_IF_ERROR(db.Exec("COMMIT"));
  }
  DC_RETURN_IF_ERROR(db.Close());
  return summary;
}

// The schedule a rank file carries (HostTracer::StreamTo writes it), checked against its digest.
StatusOr<proto::Schedule> ScheduleOfRankFile(const std::string& path) {
  if (!FileExists(path)) return Status::Error("rank file " + path + " is missing");
  DC_ASSIGN_OR_RETURN(Database db, Database::Create(path));
  DC_ASSIGN_OR_RETURN(int64_t has_blobs,
                      db.QueryInt("SELECT count(*) FROM sqlite_master WHERE name = 'TC_BLOB'"));
  if (has_blobs == 0) return Status::Error("rank file " + path + " is not a dc rank trace");
  DC_ASSIGN_OR_RETURN(Statement query,
                      db.Prepare("SELECT digest, data FROM TC_BLOB WHERE name = 'schedule'"));
  DC_ASSIGN_OR_RETURN(bool row, query.Next());
  if (!row) return Status::Error("rank file " + path + " does not carry the schedule it ran");
  const std::string digest = query.ColumnText(0), data = query.ColumnBlob(1);
  proto::Schedule schedule;
  if (!schedule.ParseFromString(data) || DigestOf(schedule) != digest) {
    return Status::Error("rank file " + path + " carries a damaged schedule");
  }
  return schedule;
}

StatusOr<bool> HasEndAnchor(const std::string& path) {
  DC_ASSIGN_OR_RETURN(Database db, Database::Create(path));
  DC_ASSIGN_OR_RETURN(int64_t has_table,
                      db.QueryInt("SELECT count(*) FROM sqlite_master WHERE name = "
                                  "'TC_CLOCK_ANCHOR'"));
  if (has_table == 0) return Status::Error("rank file " + path + " is not a dc rank trace");
  DC_ASSIGN_OR_RETURN(int64_t ends,
                      db.QueryInt("SELECT count(*) FROM TC_CLOCK_ANCHOR WHERE tag = 'end'"));
  return ends > 0;
}

}  // namespace

StatusOr<MergeSummary> MergeRankTraces(const std::vector<std::string>& rank_paths,
                                       const std::string& out_path, const MergeOptions& options) {
  if (rank_paths.empty()) return Status::Error(out_path + ": no rank files to merge");
  StatusOr<proto::Schedule> schedule = ScheduleOfRankFile(rank_paths.front());
  if (!schedule.ok()) return Status::Error(out_path + ": " + schedule.status().message());
  MergeOptions merge = options;
  if (merge.incomplete.empty()) {
    // A rank file is finished with its end clock anchor; one without it is from a run that
    // was killed or failed.
    for (const std::string& path : rank_paths) {
      StatusOr<bool> finished = HasEndAnchor(path);
      if (!finished.ok()) return Status::Error(out_path + ": " + finished.status().message());
      if (!*finished) {
        merge.incomplete = "the run did not finish (" + path + " ends early)";
        break;
      }
    }
  }
  return MergeRankTraces(rank_paths, *schedule, out_path, merge);
}

StatusOr<MergeSummary> MergeRankTraces(const std::vector<std::string>& rank_paths,
                                       const proto::Schedule& schedule, const std::string& out_path,
                                       const MergeOptions& options) {
  const std::string tmp = TempPathBeside(out_path);
  const RemoveOnSignal remove_tmp(tmp);  // a run stopped mid-merge leaves no half-written file
  std::remove(tmp.c_str());
  StatusOr<MergeSummary> summary = MergeInto(tmp, rank_paths, schedule, options);
  if (summary.ok() && std::rename(tmp.c_str(), out_path.c_str()) != 0) {
    summary = Status::Error("cannot rename " + tmp + " into place");
  }
  if (!summary.ok()) {
    std::remove(tmp.c_str());
    return Status::Error(out_path +
                         ": merging the rank traces failed: " + summary.status().message());
  }
  for (const std::string& rank_path : rank_paths) {
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((rank_path + suffix).c_str());
  }
  return summary;
}

}  // namespace dc
