#include "cc/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kungfu {

namespace {
LogLevel ThresholdFromEnv() {
  const char* v = std::getenv("KUNGFU_LOG_LEVEL");
  if (v == nullptr) return LogLevel::kWarning;
  if (!std::strcmp(v, "debug")) return LogLevel::kDebug;
  if (!std::strcmp(v, "info")) return LogLevel::kInfo;
  if (!std::strcmp(v, "error")) return LogLevel::kError;
  return LogLevel::kWarning;
}
}  // namespace

bool LogEnabled(LogLevel level) {
  static const LogLevel threshold = ThresholdFromEnv();
  return level >= threshold;
}

void LogLine(LogLevel level, const std::string& line) {
  static const char kTag[] = {'D', 'I', 'W', 'E'};
  // One fprintf per line so lines from different threads do not interleave.
  std::fprintf(stderr, "[kungfu %c] %s\n", kTag[static_cast<int>(level)], line.c_str());
}

}  // namespace kungfu
