// Minimal logging to stderr: "[kungfu W rank 1] message". Level from KUNGFU_LOG_LEVEL
// (debug, info, warning, error; default warning). Never aborts: a library reports, it does not exit.
#pragma once

#include <sstream>
#include <string>

namespace kungfu {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, const std::string& line);

class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage() { LogLine(level_, os_.str()); }
  std::ostream& stream() { return os_; }

 private:
  LogLevel level_;
  std::ostringstream os_;
};

}  // namespace kungfu

// The switch form keeps "if (x) KF_LOG(..) << ..; else ..." unambiguous.
#define KF_LOG(level)                                                       \
  switch (0)                                                                \
  default:                                                                  \
    if (!::kungfu::LogEnabled(::kungfu::LogLevel::k##level)) {              \
    } else                                                                  \
      ::kungfu::LogMessage(::kungfu::LogLevel::k##level).stream()
