// A minimal test harness for the engine: no external dependency, so cc/ tests build with plain g++
// and offline Bazel alike. Each *_test.cc defines TESTs and links testing_main.cc.
#pragma once

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace kungfu::testing {

struct TestCase {
  const char* name;
  std::function<void()> fn;
};

std::vector<TestCase>& Registry();
// Records a failure of the running test (the test goes on; use ASSERT_* to stop it).
void Fail(const char* file, int line, const std::string& what);

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { Registry().push_back({name, std::move(fn)}); }
};

struct AssertionAbort {};  // thrown by ASSERT_* to stop the current test

// Runs body with this process's stderr (fd 2) going to a temporary file, and returns what was written
// there. If body throws (an ASSERT_*), what it wrote, failures included, goes on to the real stderr.
std::string CaptureStderr(const std::function<void()>& body);

}  // namespace kungfu::testing

#define KF_TEST_CONCAT_(a, b) a##b
#define KF_TEST_CONCAT(a, b) KF_TEST_CONCAT_(a, b)

#define TEST(suite, name)                                                                  \
  static void suite##_##name();                                                            \
  static ::kungfu::testing::Registrar KF_TEST_CONCAT(kf_reg_, __LINE__)(#suite "." #name, \
                                                                        &suite##_##name);  \
  static void suite##_##name()

#define KF_CHECK_IMPL(cond, text, on_fail)                            \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::ostringstream kf_os_;                                      \
      kf_os_ << text;                                                 \
      ::kungfu::testing::Fail(__FILE__, __LINE__, kf_os_.str());      \
      on_fail;                                                        \
    }                                                                 \
  } while (0)

#define EXPECT_TRUE(c) KF_CHECK_IMPL((c), "expected true: " #c, (void)0)
#define ASSERT_TRUE(c) KF_CHECK_IMPL((c), "expected true: " #c, throw ::kungfu::testing::AssertionAbort())
#define EXPECT_EQ(a, b) \
  KF_CHECK_IMPL((a) == (b), "expected " #a " == " #b ", got " << (a) << " vs " << (b), (void)0)
#define ASSERT_EQ(a, b)                                                                \
  KF_CHECK_IMPL((a) == (b), "expected " #a " == " #b ", got " << (a) << " vs " << (b), \
                throw ::kungfu::testing::AssertionAbort())
// text (a std::string) holds part; on failure, says what text was.
#define EXPECT_CONTAINS(text, part)                                                                  \
  KF_CHECK_IMPL((text).find(part) != std::string::npos,                                              \
                "expected " #text " to contain \"" << (part) << "\", got \"" << (text) << "\"", (void)0)
#define EXPECT_OK(s)                                                                   \
  do {                                                                                 \
    auto kf_s_ = (s);                                                                  \
    KF_CHECK_IMPL(kf_s_.ok(), "expected OK from " #s ", got " << kf_s_.ToString(), (void)0); \
  } while (0)
#define ASSERT_OK(s)                                                                   \
  do {                                                                                 \
    auto kf_s_ = (s);                                                                  \
    KF_CHECK_IMPL(kf_s_.ok(), "expected OK from " #s ", got " << kf_s_.ToString(),     \
                  throw ::kungfu::testing::AssertionAbort());                          \
  } while (0)
