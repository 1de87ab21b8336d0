// A thin RAII layer over the SQLite C API for the collector's writers: a database handle and
// prepared statements whose failures come back as Status values naming the file. Private to
// collector/. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "schemas/status.h"

struct sqlite3;
struct sqlite3_stmt;

namespace dc::collector_internal {

class Statement {
 public:
  Statement() = default;
  Statement(sqlite3_stmt* stmt, std::string path) : stmt_(stmt), path_(std::move(path)) {}
  Statement(Statement&& other) noexcept;
  Statement& operator=(Statement&& other) noexcept;
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  ~Statement();

  // Binds by 1-based position.
  void Bind(int index, int64_t value);
  void Bind(int index, double value);
  void Bind(int index, std::string_view value);
  void BindBlob(int index, std::string_view bytes);
  void BindNull(int index);

  // Runs a statement that returns no rows, then resets it for the next bindings.
  Status Run();
  // Steps a query: true while a row is available.
  StatusOr<bool> Next();
  int64_t ColumnInt(int index) const;
  std::string ColumnText(int index) const;
  std::string ColumnBlob(int index) const;

 private:
  sqlite3_stmt* stmt_ = nullptr;
  std::string path_;
};

class Database {
 public:
  // Creates (or opens) `path` for reading and writing, with URI file names enabled.
  static StatusOr<Database> Create(const std::string& path);
  Database(Database&& other) noexcept;
  Database& operator=(Database&& other) noexcept;
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;
  ~Database();

  Status Exec(const std::string& sql);
  StatusOr<Statement> Prepare(const std::string& sql);
  // The single integer a query returns (0 when it returns no row).
  StatusOr<int64_t> QueryInt(const std::string& sql);
  Status Close();
  const std::string& path() const { return path_; }

 private:
  Database(sqlite3* db, std::string path) : db_(db), path_(std::move(path)) {}
  Status Error(const std::string& what) const;
  sqlite3* db_ = nullptr;
  std::string path_;
};

// `value` as an SQL string literal ('it''s').
std::string SqlQuote(std::string_view value);

}  // namespace dc::collector_internal
