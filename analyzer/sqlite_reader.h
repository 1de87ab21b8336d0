// Read-only SQLite access for the analyzer: a query that steps row by row and errors that name
// the file, with SQLite's corruption errors turned into one line that says what to do. Private
// to analyzer/. Not thread-safe.
#pragma once

#include <cstdint>
#include <set>
#include <string>

#include "schemas/status.h"

struct sqlite3;
struct sqlite3_stmt;

namespace dc::analyzer_internal {

// The one-line Status for SQLite result code `rc` on the database at `path`: corruption,
// truncation and "not a database" become "truncated or corrupt SQLite file (...)".
Status SqliteError(const std::string& path, sqlite3* db, int rc, const std::string& doing);

class Query {
 public:
  // Prepares `sql`; check status() before stepping.
  Query(sqlite3* db, const std::string& path, const std::string& sql);
  Query(const Query&) = delete;
  Query& operator=(const Query&) = delete;
  ~Query();

  const Status& status() const { return status_; }
  void Bind(int index, int64_t value);
  // Rewinds the query to run again with new bindings.
  void Reset();
  // True while a row is available; an error (also left in status()) ends the loop.
  StatusOr<bool> Next();

  bool IsNull(int column) const;
  int64_t Int(int column) const;
  double Double(int column) const;
  std::string Text(int column) const;
  std::string Blob(int column) const;

 private:
  sqlite3* db_;
  std::string path_;
  std::string sql_;
  sqlite3_stmt* stmt_ = nullptr;
  Status status_;
};

// Names of the tables in the main schema.
StatusOr<std::set<std::string>> TableNames(sqlite3* db, const std::string& path);
// Column names of `table` (empty if there is no such table).
StatusOr<std::set<std::string>> ColumnNames(sqlite3* db, const std::string& path,
                                            const std::string& table);

}  // namespace dc::analyzer_internal
