#include "fuzz/trace_edits.h"

#include <sqlite3.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "analyzer/calibration.h"
#include "analyzer/profile.h"
#include "analyzer/trace.h"
#include "machine/hardware.h"
#include "tracetools/perfetto.h"
#include "tracetools/report.h"
#include "tracetools/svg.h"

namespace dc::fuzz {
namespace {

constexpr size_t kEditBytes = 12;
constexpr size_t kMaxEdits = 64;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

void Exec(sqlite3* db, const std::string& sql) {
  sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr);  // a failed edit is just skipped
}

std::vector<std::string> FirstColumn(sqlite3* db, const std::string& sql) {
  std::vector<std::string> values;
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) != SQLITE_OK) return values;
  while (sqlite3_step(stmt) == SQLITE_ROW) {
    values.emplace_back(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0)));
  }
  sqlite3_finalize(stmt);
  return values;
}

std::vector<std::string> Columns(sqlite3* db, const std::string& table) {
  return FirstColumn(db, "SELECT name FROM pragma_table_info('" + table + "')");
}

int64_t Le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<int64_t>(v);
}

// Values that sit on the range rules' edges (analyzer/limits.h) and beyond.
constexpr int64_t kEdges[] = {0,
                              -1,
                              1,
                              INT64_MIN,
                              INT64_MAX,
                              int64_t{1} << 61,
                              (int64_t{1} << 61) + 1,
                              -(int64_t{1} << 61) - 1,
                              int64_t{1} << 50,
                              (int64_t{1} << 50) + 1,
                              int64_t{1} << 48,
                              (int64_t{1} << 31) - 1,
                              int64_t{1} << 31,
                              int64_t{1} << 62};

}  // namespace

std::string TempPath(const std::string& name) {
  static const std::string dir = [] {
    std::string d =
        (std::filesystem::temp_directory_path() / ("dc-fuzz-" + std::to_string(::getpid())))
            .string();
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir + "/" + name;
}

SeedTrace SeedTrace::Loosened(const std::string& path, const std::vector<std::string>& tables) {
  SeedTrace seed;
  sqlite3* db = nullptr;
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) std::abort();
  Exec(db, "PRAGMA synchronous = OFF; PRAGMA journal_mode = MEMORY");
  for (const std::string& table : tables) {
    std::vector<std::string> columns = Columns(db, table);
    if (columns.empty()) continue;
    // The indexes go with the table; made again, the readers' joins stay fast.
    const std::vector<std::string> indexes =
        FirstColumn(db,
                    "SELECT sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL AND "
                    "tbl_name = '" +
                        table + "'");
    Exec(db, "CREATE TABLE loose AS SELECT * FROM \"" + table + "\"; DROP TABLE \"" + table +
                 "\"; ALTER TABLE loose RENAME TO \"" + table + "\";");
    for (const std::string& index : indexes) Exec(db, index);
    seed.tables_.push_back(table);
    seed.columns_.push_back(std::move(columns));
  }
  Exec(db, "VACUUM");
  sqlite3_close(db);
  seed.bytes_ = ReadAll(path);
  return seed;
}

SeedTrace SeedTrace::FromFile(const std::string& path, const std::vector<std::string>& tables) {
  const std::string copy = TempPath("seed.db");
  WriteAll(copy, ReadAll(path));
  return Loosened(copy, tables);
}

SeedTrace SeedTrace::FromSql(const std::string& sql, const std::vector<std::string>& tables) {
  const std::string copy = TempPath("seed.db");
  std::filesystem::remove(copy);
  sqlite3* db = nullptr;
  if (sqlite3_open(copy.c_str(), &db) != SQLITE_OK) std::abort();
  char* error = nullptr;
  if (sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &error) != SQLITE_OK) {
    std::fprintf(stderr, "seed SQL: %s\n", error ? error : "?");
    std::abort();
  }
  sqlite3_close(db);
  return Loosened(copy, tables);
}

// Each edit is 12 bytes: table, operation, column, row (mod the table's rows), a 64-bit value.
void SeedTrace::WriteEdited(const uint8_t* data, size_t size, const std::string& out) const {
  WriteAll(out, bytes_);
  if (tables_.empty()) return;
  sqlite3* db = nullptr;
  if (sqlite3_open(out.c_str(), &db) != SQLITE_OK) std::abort();
  // A scratch file: no syncs, one transaction (an fsync per edit dominated the run time).
  Exec(db, "PRAGMA synchronous = OFF; PRAGMA journal_mode = MEMORY; BEGIN");
  for (size_t e = 0; e < kMaxEdits && (e + 1) * kEditBytes <= size; ++e) {
    const uint8_t* p = data + e * kEditBytes;
    const size_t t = p[0] % tables_.size();
    const std::string table = "\"" + tables_[t] + "\"";
    const std::string column = "\"" + columns_[t][p[2] % columns_[t].size()] + "\"";
    const int64_t value = Le64(p + 4);
    const std::string row = " WHERE rowid = (SELECT rowid FROM " + table + " LIMIT 1 OFFSET " +
                            std::to_string(p[3]) + " % MAX(1, (SELECT COUNT(*) FROM " + table +
                            ")))";
    std::string sql;
    switch (p[1] % 10) {
      case 0:
        sql = "UPDATE " + table + " SET " + column + " = NULL" + row;
        break;
      case 1:
        sql = "UPDATE " + table + " SET " + column + " = " + std::to_string(value) + row;
        break;
      case 2:  // a small shift: end before start, neighbours' ids
        sql = "UPDATE " + table + " SET " + column + " = " + column + " + " +
              std::to_string(static_cast<int8_t>(p[4])) + row;
        break;
      case 3: {
        double real = 0;
        std::memcpy(&real, &value, sizeof(real));
        char text[64];
        std::snprintf(text, sizeof(text), "%.17g", real);
        sql = "UPDATE " + table + " SET " + column + " = " + text + row;
        break;
      }
      case 4:
        sql = "UPDATE " + table + " SET " + column + " = 'x" + std::to_string(p[4]) + "'" + row;
        break;
      case 5:
        sql = "DELETE FROM " + table + row;
        break;
      case 6:
        sql = "INSERT INTO " + table + " SELECT * FROM " + table + row;
        break;
      case 7:
        sql = "UPDATE " + table + " SET " + column + " = " +
              std::to_string(kEdges[static_cast<uint64_t>(value) % std::size(kEdges)]) + row;
        break;
      case 8:
        sql = "DELETE FROM " + table;
        break;
      default:
        if (p[4] == 0xAA) sql = "DROP TABLE " + table;  // rarely: most inputs keep the table
        break;
    }
    if (!sql.empty()) Exec(db, sql);
  }
  Exec(db, "COMMIT");
  sqlite3_close(db);
}

void ReadEverything(const std::string& path) {
  if (StatusOr<std::unique_ptr<Timeline>> timeline = OpenTimeline({path}, {}); timeline.ok()) {
    SummaryOptions options;
    options.by_instruction = true;
    if (StatusOr<Summary> summary = Summarize(**timeline, options); summary.ok()) {
      (void)SummaryJson(*summary).dump();
      (void)SummaryText(*summary);
    }
    if (StatusOr<MemoryChart> chart = BuildMemoryChart(**timeline, {}); chart.ok()) {
      (void)RenderMemorySvg(*chart);
      (void)MemoryChartJson(*chart).dump();
    }
    std::ostringstream perfetto;
    (void)WritePerfetto(**timeline, perfetto, nullptr);
  }
  if (StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path); trace.ok()) {
    (void)BuildProfile(**trace);
    // dc-calibrate's reading: every sample, the ranks' skews, the groups' observations.
    if (StatusOr<HardwareProfile> cpu = FindHardware("cpu"); cpu.ok()) {
      (void)TraceGroups({trace->get()}, *cpu);
    }
  }
}

}  // namespace dc::fuzz
