#include <atomic>
#include <chrono>
#include <cstring>

#include <unistd.h>

#include "cc/tests/testing.h"

namespace kungfu::testing {

std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}

namespace {
std::atomic<int> g_failures_in_test{0};  // rank threads (RunRanks) fail checks at once
}

void Fail(const char* file, int line, const std::string& what) {
  ++g_failures_in_test;
  std::fprintf(stderr, "  %s:%d: %s\n", file, line, what.c_str());
}

std::string CaptureStderr(const std::function<void()>& body) {
  char path[] = "/tmp/kf_stderr_XXXXXX";
  const int file = ::mkstemp(path);
  if (file < 0) {
    Fail(__FILE__, __LINE__, "CaptureStderr: mkstemp failed");
    return "";
  }
  ::unlink(path);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(file, 2);
  auto restore = [&] {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    std::string text;
    char buf[4096];
    ::lseek(file, 0, SEEK_SET);
    for (ssize_t n; (n = ::read(file, buf, sizeof buf)) > 0;) text.append(buf, static_cast<size_t>(n));
    ::close(file);
    return text;
  };
  try {
    body();
  } catch (...) {
    std::fputs(restore().c_str(), stderr);
    throw;
  }
  return restore();
}

}  // namespace kungfu::testing

// Usage: <test binary> [substring filter]
int main(int argc, char** argv) {
  using namespace kungfu::testing;
  const char* filter = argc > 1 ? argv[1] : nullptr;
  int passed = 0, failed = 0;
  std::string failed_names;  // repeated after the count, so the last lines of a long log name them
  for (const auto& t : Registry()) {
    if (filter && !std::strstr(t.name, filter)) continue;
    g_failures_in_test = 0;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      t.fn();
    } catch (const AssertionAbort&) {
    } catch (const std::exception& e) {
      Fail(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (g_failures_in_test == 0) {
      ++passed;
      std::fprintf(stderr, "[ PASS ] %s (%.0f ms)\n", t.name, ms);
    } else {
      ++failed;
      std::fprintf(stderr, "[ FAIL ] %s (%.0f ms)\n", t.name, ms);
      failed_names += failed_names.empty() ? "" : ", ";
      failed_names += t.name;
    }
  }
  std::printf("%s: %d passed, %d failed%s%s\n", argv[0], passed, failed, failed ? ": " : "",
              failed_names.c_str());
  return failed == 0 ? 0 : 1;
}
