// ConnectWithRetry and host names: every address a name resolves to is tried, in order; the name is
// looked up again while it does not resolve or its answer changes; a name that does not exist fails at
// once; the error names the addresses tried. A fake resolver stands in for DNS; the listeners are on
// loopback, bound to one address each so that the others refuse.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"
#include "cc/transport/socket.h"

namespace kungfu {
namespace {

in_addr Ip(const char* text) {
  in_addr a{};
  ::inet_pton(AF_INET, text, &a);
  return a;
}

// Listens on ip:port only (Listen takes every interface), so that 127.0.0.2:port refuses.
Fd ListenOn(const char* ip, uint16_t port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr = Ip(ip);
  addr.sin_port = htons(port);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd.get(), 8) != 0) return Fd();
  return fd;
}

// Answers each lookup with the next of answers (the last one again once they run out), or with the
// EAI_* code of codes where that is not 0.
struct FakeDns {
  std::vector<std::vector<const char*>> answers;
  std::vector<int> codes;  // per answer: 0, or the failure to return
  std::atomic<int> calls{0};
  Resolver resolver() {
    return [this](const std::string&, std::vector<in_addr>* out) {
      const size_t i = std::min<size_t>(calls++, answers.size() - 1);
      if (codes[i] != 0) return codes[i];
      out->clear();
      for (const char* ip : answers[i]) out->push_back(Ip(ip));
      return 0;
    };
  }
};

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool Has(const Status& s, const std::string& text) { return s.message().find(text) != std::string::npos; }

TEST(Connect, TriesEveryAddressTheNameResolvesTo) {
  const uint16_t port = testing::LoopbackPeers(1).at(0).port;
  Fd listener = ListenOn("127.0.0.1", port);
  ASSERT_TRUE(listener.valid());
  FakeDns dns{{{"127.0.0.2", "127.0.0.1"}}, {0}};  // the first refuses: nothing listens there
  const auto t0 = std::chrono::steady_clock::now();
  auto fd = ConnectWithRetry(PeerID{"nodea", port}, DeadlineAfter(5), dns.resolver());
  EXPECT_OK(fd.status());
  EXPECT_TRUE(SecondsSince(t0) < 2);
}

TEST(Connect, LooksTheNameUpAgainWhileItFailsOrItsAnswerChanges) {
  const uint16_t port = testing::LoopbackPeers(1).at(0).port;
  Fd listener = ListenOn("127.0.0.1", port);
  ASSERT_TRUE(listener.valid());
  // DNS briefly fails (no answer in time), then names an address where nothing listens (a stale
  // record), then the right one.
  FakeDns dns{{{}, {}, {"127.0.0.3"}, {"127.0.0.1"}}, {EAI_AGAIN, EAI_AGAIN, 0, 0}};
  const auto t0 = std::chrono::steady_clock::now();
  auto fd = ConnectWithRetry(PeerID{"nodea", port}, DeadlineAfter(10), dns.resolver());
  EXPECT_OK(fd.status());
  EXPECT_EQ(dns.calls.load(), 4);
  EXPECT_TRUE(SecondsSince(t0) < 5);  // lookups every 0.25 s while failing, every 1 s once answered
}

TEST(Connect, ANameThatDoesNotExistFailsAtOnce) {
  FakeDns dns{{{}}, {EAI_NONAME}};
  const auto t0 = std::chrono::steady_clock::now();
  auto fd = ConnectWithRetry(PeerID{"nohost", 1}, DeadlineAfter(10), dns.resolver());
  EXPECT_EQ(CodeName(fd.status().code()), CodeName(Code::kUnavailable));
  EXPECT_TRUE(Has(fd.status(), "cannot resolve host 'nohost'"));
  EXPECT_TRUE(SecondsSince(t0) < 1);
}

TEST(Connect, ANameThatNeverResolvesFailsAtTheDeadline) {
  FakeDns dns{{{}}, {EAI_AGAIN}};
  auto fd = ConnectWithRetry(PeerID{"nodea", 1}, DeadlineAfter(0.6), dns.resolver());
  EXPECT_EQ(CodeName(fd.status().code()), CodeName(Code::kDeadlineExceeded));
  EXPECT_TRUE(Has(fd.status(), "could not resolve host 'nodea' before the deadline: "));
  EXPECT_TRUE(dns.calls.load() >= 2);
}

TEST(Connect, TheErrorNamesTheAddressesTried) {
  const uint16_t port = testing::LoopbackPeers(1).at(0).port;  // nothing listens there now
  const std::string p = std::to_string(port);
  FakeDns one{{{"127.0.0.2"}}, {0}};
  auto fd = ConnectWithRetry(PeerID{"nodea", port}, DeadlineAfter(0.3), one.resolver());
  EXPECT_EQ(CodeName(fd.status().code()), CodeName(Code::kDeadlineExceeded));
  EXPECT_TRUE(Has(fd.status(), "could not connect to peer nodea:" + p +
                                   " (127.0.0.2) before the deadline: last error: Connection refused"));

  FakeDns two{{{"127.0.0.2", "127.0.0.3"}}, {0}};
  fd = ConnectWithRetry(PeerID{"nodea", port}, DeadlineAfter(0.3), two.resolver());
  EXPECT_TRUE(Has(fd.status(), "could not connect to peer nodea:" + p + " (127.0.0.2, 127.0.0.3) before the "
                               "deadline: last errors: 127.0.0.2: Connection refused; 127.0.0.3: Connection refused"));

  fd = ConnectWithRetry(PeerID{"127.0.0.2", port}, DeadlineAfter(0.3));  // an address: not said twice
  EXPECT_TRUE(Has(fd.status(), "could not connect to peer 127.0.0.2:" + p + " before the deadline: last error: "));
}

TEST(Connect, TheSystemResolverGivesIPv4AddressesOnce) {
  std::vector<in_addr> out;
  EXPECT_EQ(ResolveIPv4("127.0.0.5", &out), 0);
  ASSERT_EQ(out.size(), size_t{1});
  EXPECT_EQ(AddressText(out[0]), std::string("127.0.0.5"));
  out.clear();
  ASSERT_EQ(ResolveIPv4("localhost", &out), 0);  // ::1 too, maybe, which the engine (IPv4 only) leaves out
  bool loopback = false;
  for (const in_addr& a : out) loopback = loopback || AddressText(a) == "127.0.0.1";
  EXPECT_TRUE(loopback);
  for (size_t i = 0; i < out.size(); ++i) {
    for (size_t j = 0; j < i; ++j) EXPECT_TRUE(out[i].s_addr != out[j].s_addr);
  }
  const uint16_t port = testing::LoopbackPeers(1).at(0).port;
  Fd listener = ListenOn("127.0.0.1", port);
  ASSERT_TRUE(listener.valid());
  EXPECT_OK(ConnectWithRetry(PeerID{"localhost", port}, DeadlineAfter(5)).status());
}

}  // namespace
}  // namespace kungfu
