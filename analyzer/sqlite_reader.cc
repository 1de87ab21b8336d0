#include "analyzer/sqlite_reader.h"

#include <sqlite3.h>

namespace dc::analyzer_internal {

Status SqliteError(const std::string& path, sqlite3* db, int rc, const std::string& doing) {
  const std::string why = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  const int primary = rc & 0xFF;
  if (primary == SQLITE_CORRUPT || primary == SQLITE_NOTADB || primary == SQLITE_IOERR) {
    return Status::Error(path + ": truncated or corrupt SQLite file (" + why +
                         "); re-record it with dc-collect");
  }
  return Status::Error(path + ": " + doing + ": " + why);
}

Query::Query(sqlite3* db, const std::string& path, const std::string& sql)
    : db_(db), path_(path), sql_(sql) {
  const int rc = sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt_, nullptr);
  if (rc != SQLITE_OK) status_ = SqliteError(path_, db_, rc, "cannot read the trace");
}

Query::~Query() { sqlite3_finalize(stmt_); }

void Query::Bind(int index, int64_t value) { sqlite3_bind_int64(stmt_, index, value); }

void Query::Reset() { sqlite3_reset(stmt_); }

StatusOr<bool> Query::Next() {
  if (!status_.ok()) return status_;
  const int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  status_ = SqliteError(path_, db_, rc, "cannot read the trace");
  return status_;
}

bool Query::IsNull(int column) const { return sqlite3_column_type(stmt_, column) == SQLITE_NULL; }
int64_t Query::Int(int column) const { return sqlite3_column_int64(stmt_, column); }
double Query::Double(int column) const { return sqlite3_column_double(stmt_, column); }

std::string Query::Text(int column) const {
  const unsigned char* text = sqlite3_column_text(stmt_, column);
  return text ? std::string(reinterpret_cast<const char*>(text),
                            static_cast<size_t>(sqlite3_column_bytes(stmt_, column)))
              : std::string();
}

std::string Query::Blob(int column) const {
  const void* data = sqlite3_column_blob(stmt_, column);
  return data ? std::string(static_cast<const char*>(data),
                            static_cast<size_t>(sqlite3_column_bytes(stmt_, column)))
              : std::string();
}

namespace {
StatusOr<std::set<std::string>> FirstColumn(sqlite3* db, const std::string& path,
                                            const std::string& sql) {
  Query query(db, path, sql);
  std::set<std::string> names;
  while (true) {
    DC_ASSIGN_OR_RETURN(bool row, query.Next());
    if (!row) break;
    names.insert(query.Text(0));
  }
  return names;
}
}  // namespace

StatusOr<std::set<std::string>> TableNames(sqlite3* db, const std::string& path) {
  return FirstColumn(db, path, "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')");
}

StatusOr<std::set<std::string>> ColumnNames(sqlite3* db, const std::string& path,
                                            const std::string& table) {
  std::string quoted = "'";
  for (char c : table) quoted += c == '\'' ? std::string("''") : std::string(1, c);
  return FirstColumn(db, path, "SELECT name FROM pragma_table_info(" + quoted + "')");
}

}  // namespace dc::analyzer_internal
