#include "collector/sqlite_writer.h"

#include <sqlite3.h>

#include <utility>

namespace dc::collector_internal {

Statement::Statement(Statement&& other) noexcept
    : stmt_(std::exchange(other.stmt_, nullptr)), path_(std::move(other.path_)) {}

Statement& Statement::operator=(Statement&& other) noexcept {
  if (this != &other) {
    sqlite3_finalize(stmt_);
    stmt_ = std::exchange(other.stmt_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

Statement::~Statement() { sqlite3_finalize(stmt_); }

void Statement::Bind(int index, int64_t value) { sqlite3_bind_int64(stmt_, index, value); }
void Statement::Bind(int index, double value) { sqlite3_bind_double(stmt_, index, value); }
void Statement::Bind(int index, std::string_view value) {
  sqlite3_bind_text(stmt_, index, value.data(), static_cast<int>(value.size()), SQLITE_TRANSIENT);
}
void Statement::BindBlob(int index, std::string_view bytes) {
  sqlite3_bind_blob(stmt_, index, bytes.data(), static_cast<int>(bytes.size()), SQLITE_TRANSIENT);
}
void Statement::BindNull(int index) { sqlite3_bind_null(stmt_, index); }

Status Statement::Run() {
  const int rc = sqlite3_step(stmt_);
  sqlite3_reset(stmt_);
  sqlite3_clear_bindings(stmt_);
  if (rc != SQLITE_DONE && rc != SQLITE_ROW) {
    return Status::Error(path_ + ": " + sqlite3_errmsg(sqlite3_db_handle(stmt_)));
  }
  return Status::Ok();
}

StatusOr<bool> Statement::Next() {
  const int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  return Status::Error(path_ + ": " + sqlite3_errmsg(sqlite3_db_handle(stmt_)));
}

int64_t Statement::ColumnInt(int index) const { return sqlite3_column_int64(stmt_, index); }

std::string Statement::ColumnText(int index) const {
  const unsigned char* text = sqlite3_column_text(stmt_, index);
  return text ? std::string(reinterpret_cast<const char*>(text)) : std::string();
}

std::string Statement::ColumnBlob(int index) const {
  const void* bytes = sqlite3_column_blob(stmt_, index);
  const int size = sqlite3_column_bytes(stmt_, index);
  return bytes && size > 0 ? std::string(static_cast<const char*>(bytes), static_cast<size_t>(size))
                           : std::string();
}

StatusOr<Database> Database::Create(const std::string& path) {
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_URI, nullptr);
  if (rc != SQLITE_OK) {
    const std::string why = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    return Status::Error(path + ": cannot create the SQLite file (" + why +
                         "); is the directory writable?");
  }
  return Database(db, path);
}

Database::Database(Database&& other) noexcept
    : db_(std::exchange(other.db_, nullptr)), path_(std::move(other.path_)) {}

Database& Database::operator=(Database&& other) noexcept {
  if (this != &other) {
    sqlite3_close(db_);
    db_ = std::exchange(other.db_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

Database::~Database() { sqlite3_close(db_); }

Status Database::Error(const std::string& what) const {
  return Status::Error(path_ + ": " + what + ": " + sqlite3_errmsg(db_));
}

Status Database::Exec(const std::string& sql) {
  char* message = nullptr;
  if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &message) != SQLITE_OK) {
    const std::string why = message ? message : "unknown SQLite error";
    sqlite3_free(message);
    const std::string head = sql.substr(0, sql.find_first_of("(\n"));
    return Status::Error(path_ + ": " + why + " (in: " + head + ")");
  }
  return Status::Ok();
}

StatusOr<Statement> Database::Prepare(const std::string& sql) {
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v2(db_, sql.c_str(), static_cast<int>(sql.size()), &stmt, nullptr) !=
      SQLITE_OK) {
    return Error("cannot prepare \"" + sql.substr(0, 60) + "\"");
  }
  return Statement(stmt, path_);
}

StatusOr<int64_t> Database::QueryInt(const std::string& sql) {
  DC_ASSIGN_OR_RETURN(Statement stmt, Prepare(sql));
  DC_ASSIGN_OR_RETURN(bool row, stmt.Next());
  return row ? stmt.ColumnInt(0) : int64_t{0};
}

Status Database::Close() {
  if (db_ && sqlite3_close(db_) != SQLITE_OK) return Error("close failed");
  db_ = nullptr;
  return Status::Ok();
}

std::string SqlQuote(std::string_view value) {
  std::string quoted = "'";
  for (char c : value) {
    if (c == '\'') quoted += '\'';
    quoted += c;
  }
  return quoted + "'";
}

}  // namespace dc::collector_internal
