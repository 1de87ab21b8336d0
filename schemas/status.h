// Errors as values. A Status carries one line meant for a person: what is wrong, where, and
// what to do. StatusOr<T> is a value or the Status that explains why there is none.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace dc {

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string message) { return Status(std::move(message)); }
  // An error that only says the work does not fit a memory budget (a plan over --budget): a
  // planner trying several candidates passes over these, and treats any other error of a
  // candidate as a defect to report. `shortfall_bytes` (0: not known): how many bytes more than
  // the budget the check that failed needed, where to start looking for the smallest budget
  // that plans (rewriter/search.h).
  static Status OverBudget(std::string message, int64_t shortfall_bytes = 0) {
    Status status(std::move(message), kOverBudget);
    status.shortfall_bytes_ = std::max<int64_t>(0, shortfall_bytes);
    return status;
  }
  // A candidate plan stopped because a plan in hand is already at least as fast as it can
  // become: no defect, and nothing for a person to fix.
  static Status CannotWin(std::string message) { return Status(std::move(message), kCannotWin); }

  bool ok() const { return !message_.has_value(); }
  bool over_budget() const { return reason_ == kOverBudget; }
  bool cannot_win() const { return reason_ == kCannotWin; }
  // OverBudget's shortfall; 0 for any other status.
  int64_t shortfall_bytes() const { return shortfall_bytes_; }
  const std::string& message() const {
    static const std::string kOk = "ok";
    return message_ ? *message_ : kOk;
  }
  // Returns this error with `context` in front ("plan.dcplan: " + message).
  Status Prefixed(const std::string& context) const {
    if (ok()) return *this;
    Status prefixed(context + message(), reason_);
    prefixed.shortfall_bytes_ = shortfall_bytes_;
    return prefixed;
  }

 private:
  enum Reason { kError, kOverBudget, kCannotWin };
  explicit Status(std::string message, Reason reason = kError)
      : message_(std::move(message)), reason_(reason) {}
  std::optional<std::string> message_;
  Reason reason_ = kError;
  int64_t shortfall_bytes_ = 0;
};

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  StatusOr(Status status) : value_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(value_); }
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(value_); }
  const T& value() const& { return std::get<T>(value_); }
  T& value() & { return std::get<T>(value_); }
  T&& value() && { return std::get<T>(std::move(value_)); }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

 private:
  std::variant<T, Status> value_;
};

}  // namespace dc

#define DC_CONCAT_INNER(a, b) a##b
#define DC_CONCAT(a, b) DC_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (a Status) is an error.
#define DC_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::dc::Status dc_status_ = (expr);        \
    if (!dc_status_.ok()) return dc_status_; \
  } while (0)

// `DC_ASSIGN_OR_RETURN(auto x, MakeX())`: binds the value or returns the error.
#define DC_ASSIGN_OR_RETURN(lhs, expr) \
  DC_ASSIGN_OR_RETURN_IMPL(DC_CONCAT(dc_statusor_, __LINE__), lhs, expr)
#define DC_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
