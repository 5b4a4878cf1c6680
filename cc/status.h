// Status and StatusOr: how every error in the engine travels.
//
// Errors are values: the engine never ends the process and throws nothing across its boundary. A Status carries a code
// (mirroring TF/absl canonical codes so kf_ops can map them one-to-one) and a message; context is
// prepended as the error travels up: "allreduce 'grad/w': peer 127.0.0.1:10001 (rank 1) closed the connection".
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace kungfu {

// Values match tensorflow::error::Code / absl::StatusCode.
enum class Code : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
};

const char* CodeName(Code code);

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status OK() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;
  // Returns a copy whose message is "<context>: <message>".
  Status WithContext(const std::string& context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return Status(Code::kInvalidArgument, std::move(m)); }
inline Status DeadlineExceeded(std::string m) { return Status(Code::kDeadlineExceeded, std::move(m)); }
inline Status Unavailable(std::string m) { return Status(Code::kUnavailable, std::move(m)); }
inline Status Aborted(std::string m) { return Status(Code::kAborted, std::move(m)); }
inline Status Internal(std::string m) { return Status(Code::kInternal, std::move(m)); }
inline Status PermissionDenied(std::string m) { return Status(Code::kPermissionDenied, std::move(m)); }
inline Status FailedPrecondition(std::string m) { return Status(Code::kFailedPrecondition, std::move(m)); }
inline Status ResourceExhausted(std::string m) { return Status(Code::kResourceExhausted, std::move(m)); }
inline Status Cancelled(std::string m) { return Status(Code::kCancelled, std::move(m)); }
inline Status AlreadyExists(std::string m) { return Status(Code::kAlreadyExists, std::move(m)); }
// An OS error with errno text: "connect to 127.0.0.1:9: Connection refused".
Status ErrnoStatus(Code code, const std::string& what, int err);

// A number for messages, as a person writes it: "5", "0.5", "1e+07" (not std::to_string's "5.000000").
std::string FormatNumber(double x);

template <typename T>
class StatusOr {
 public:
  StatusOr(Status s) : v_(std::move(s)) {}  // NOLINT: implicit by design, like absl
  StatusOr(T value) : v_(std::move(value)) {}  // NOLINT
  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  T& operator*() { return std::get<T>(v_); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace kungfu

#define KF_CONCAT_INNER(a, b) a##b
#define KF_CONCAT(a, b) KF_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                       \
  do {                                              \
    ::kungfu::Status _kf_status = (expr);           \
    if (!_kf_status.ok()) return _kf_status;        \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, expr) ASSIGN_OR_RETURN_IMPL(KF_CONCAT(_kf_or_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
