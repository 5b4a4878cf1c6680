// What fails Engine::Start, promptly and saying why: a peer without the job token, another worker of
// the job (or this one) answering at a peer's address (a name that resolves to loopback among the
// causes), a peer of another build, a port someone else holds. N ranks as threads in one process over
// loopback.
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "cc/engine.h"
#include "cc/sha256.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"
#include "cc/transport/socket.h"

namespace kungfu {
namespace {

using testing::RunRanks;

TEST(Handshake, WrongTokenIsRefused) {
  const PeerList peers = testing::LoopbackPeers(2);
  std::vector<Status> results(2);
  std::vector<std::unique_ptr<Engine>> engines(2);
  RunRanks(2, [&](int r) {
    EngineConfig c;
    c.peers = peers;
    c.rank = r;
    c.token = r == 0 ? "right" : "wrong";
    c.timeout_seconds = 1;  // a refused handshake is retried until the deadline
    auto e = Engine::Start(c);
    results[r] = e.status();
    if (e.ok()) engines[r] = std::move(e.value());
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(CodeName(results[r].code()), CodeName(Code::kPermissionDenied));
}

// Workers started under different cluster versions (a misconfigured launch): the handshake refuses the
// one of the other version, Start fails at once with Aborted (ClusterChangedError in Python) saying so,
// not retried until the deadline. The other may then find nobody listening and fail at its own deadline.
TEST(Handshake, AnotherClusterVersionFailsStartAtOnce) {
  const PeerList ports = testing::LoopbackPeers(2);
  std::vector<Status> results(2);
  std::vector<double> secs(2);
  RunRanks(2, [&](int r) {
    EngineConfig c;
    c.peers = PeerList({ports.at(0), ports.at(1)}, r == 0 ? 0 : 1);
    c.rank = r;
    c.token = "t";
    c.timeout_seconds = 3;
    const auto t0 = std::chrono::steady_clock::now();
    auto e = Engine::Start(c);
    secs[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    results[r] = e.status();
  });
  int aborted = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(!results[r].ok());
    if (results[r].code() != Code::kAborted) continue;
    ++aborted;
    EXPECT_TRUE(secs[r] < 2.5);
    EXPECT_TRUE(results[r].message().find("another cluster version than this worker's " + std::to_string(r)) !=
                std::string::npos);
  }
  EXPECT_TRUE(aborted >= 1);
}

// Two names of one host, each given the same port (e.g. "node2" and its address in a hostfile): the
// address of one rank leads to another rank's engine, which listens on every interface, or to this
// worker's own. The handshake names the rank that signed, so Start fails at once with that, instead of
// a worker taking its own connection for a peer's and the collectives failing later with a mismatch.
TEST(Handshake, AnotherWorkerAnsweringAtAPeersAddressFailsStartAtOnce) {
  const PeerList ports = testing::LoopbackPeers(3);
  // Rank 0 was told rank 2 is at rank 1's port (another name of this host); rank 1 knows better, and
  // gives up on the rank 2 that never comes after 3 s.
  const PeerList aliased({ports.at(0), ports.at(1), PeerID{"127.0.0.2", ports.at(1).port}}, 0);
  std::vector<Status> results(2);
  std::vector<double> secs(2);
  std::vector<std::unique_ptr<Engine>> engines(2);
  RunRanks(2, [&](int r) {
    EngineConfig c;
    c.peers = r == 0 ? aliased : ports;
    c.rank = r;
    c.token = "t";
    c.timeout_seconds = r == 0 ? 20 : 3;
    const auto t0 = std::chrono::steady_clock::now();
    auto e = Engine::Start(c);
    secs[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    results[r] = e.status();
    if (e.ok()) engines[r] = std::move(e.value());
  });
  EXPECT_EQ(CodeName(results[0].code()), CodeName(Code::kAlreadyExists));
  EXPECT_TRUE(results[0].message().find("the address of rank 2, 127.0.0.2:" + std::to_string(ports.at(1).port) +
                                        ", reached rank 1: two workers listen") != std::string::npos);
  EXPECT_TRUE(results[0].message().find("loopback") == std::string::npos);  // an address, not a name
  EXPECT_TRUE(secs[0] < 3);  // at once: not rank 0's 20 s, nor after rank 1 gave up
  EXPECT_EQ(CodeName(results[1].code()), CodeName(Code::kDeadlineExceeded));

  // Rank 1's address leads back to rank 0 itself.
  const PeerList ports2 = testing::LoopbackPeers(2);
  EngineConfig c;
  c.peers = PeerList({ports2.at(0), PeerID{"127.0.0.2", ports2.at(0).port}}, 0);
  c.token = "t";
  c.timeout_seconds = 20;
  const auto t0 = std::chrono::steady_clock::now();
  auto self = Engine::Start(c);
  EXPECT_EQ(CodeName(self.status().code()), CodeName(Code::kAlreadyExists));
  EXPECT_TRUE(self.status().message().find("the address of rank 1, 127.0.0.2:" + std::to_string(ports2.at(0).port) +
                                          ", reached this worker itself") != std::string::npos);
  EXPECT_TRUE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 3);
}

// A name that resolves to a loopback address on this host (Debian's /etc/hosts maps a host's own name to
// 127.0.1.1; here "localhost" stands for it) leads to this host's engine, not to the peer's: the error
// names the address the name resolved to, and says so.
TEST(Handshake, ANameThatResolvesToLoopbackIsNamedWithItsAddress) {
  const PeerList ports = testing::LoopbackPeers(1);
  EngineConfig c;
  c.peers = PeerList({ports.at(0), PeerID{"localhost", ports.at(0).port}}, 0);
  c.token = "t";
  c.timeout_seconds = 20;
  auto self = Engine::Start(c);
  const std::string m = self.status().message();  // a copy: status() returns a temporary
  EXPECT_EQ(CodeName(self.status().code()), CodeName(Code::kAlreadyExists));
  EXPECT_TRUE(m.find("the address of rank 1, localhost:" + std::to_string(ports.at(0).port) +
                     " (127.0.0.1), reached this worker itself") != std::string::npos);
  EXPECT_TRUE(m.find("a name that resolves to a loopback address on some host: here localhost is 127.0.0.1") !=
              std::string::npos);
}

// A server of handshake version 1 signs no rank: the client says it is another build, at once.
TEST(Handshake, AVersion1ServerIsAnotherBuild) {
  const PeerList peers = testing::LoopbackPeers(2);
  auto listener = Listen(peers.at(1).port);
  ASSERT_TRUE(listener.ok());
  std::thread old_server([&] {
    pollfd pfd{listener.value().get(), POLLIN, 0};
    if (::poll(&pfd, 1, 10000) != 1) return;
    Fd fd(::accept4(listener.value().get(), nullptr, nullptr, SOCK_CLOEXEC));
    uint8_t hello[16 + 32 + 255];
    if (!ReadFull(fd.get(), hello, 16 + 32, DeadlineAfter(5)).ok()) return;
    uint16_t id_len;
    std::memcpy(&id_len, hello + 6, 2);
    if (!ReadFull(fd.get(), hello + 48, id_len, DeadlineAfter(5)).ok()) return;
    uint8_t challenge[64] = {};  // nonce 0; MAC over the client's nonce and ours, no rank (version 1)
    std::vector<uint8_t> msg{'k', 'u', 'n', 'g', 'f', 'u', '-', 's', 'e', 'r', 'v', 'e', 'r'};
    msg.insert(msg.end(), hello + 16, hello + 48);
    msg.insert(msg.end(), challenge, challenge + 32);
    const Digest mac = HmacSha256("t", msg.data(), msg.size());
    std::memcpy(challenge + 32, mac.data(), 32);
    (void)WriteFull(fd.get(), challenge, sizeof(challenge), DeadlineAfter(5));
    uint8_t proof[32];
    (void)ReadFull(fd.get(), proof, sizeof(proof), DeadlineAfter(5));
  });
  EngineConfig c;
  c.peers = peers;
  c.token = "t";
  c.timeout_seconds = 20;
  const auto t0 = std::chrono::steady_clock::now();
  auto e = Engine::Start(c);
  old_server.join();
  EXPECT_EQ(CodeName(e.status().code()), CodeName(Code::kInvalidArgument));
  EXPECT_TRUE(e.status().message().find("handshake version 1") != std::string::npos);
  EXPECT_TRUE(e.status().message().find("another build of kungfu") != std::string::npos);
  EXPECT_TRUE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10);
}

// Clients that connect and then say nothing (a port scanner, a health check) or stop mid-HELLO must not
// hold up the handshakes of the job's own workers: rank 0 is started alone, two such strangers connect to
// it, and only then rank 1. Handshakes taken one at a time would keep rank 1's waiting behind theirs for
// min(timeout, 10 s) each, past the timeout of Start on both ranks; taken at once, start-up completes
// while the strangers still hold their connections, which are refused when their time runs out.
TEST(Handshake, StrangersThatStallDelayNoOtherHandshake) {
  const PeerList peers = testing::LoopbackPeers(2);
  std::vector<StatusOr<std::unique_ptr<Engine>>> started;
  started.reserve(2);
  started.emplace_back(Internal("not started"));
  started.emplace_back(Internal("not started"));
  auto start = [&](int r) {
    EngineConfig c;
    c.peers = peers;
    c.rank = r;
    c.token = "t";
    c.timeout_seconds = 3;
    started[r] = Engine::Start(c);
  };
  std::thread rank0(start, 0);
  auto silent = ConnectWithRetry(peers.at(0), DeadlineAfter(10));
  auto halfway = ConnectWithRetry(peers.at(0), DeadlineAfter(10));
  const uint8_t part_of_a_hello[10] = {'K', 'F', 'H', 'S', 2, 7, 9, 0, 0, 0};
  if (halfway.ok()) (void)WriteFull(halfway.value().get(), part_of_a_hello, sizeof(part_of_a_hello), DeadlineAfter(5));
  std::thread rank1(start, 1);
  rank0.join();
  rank1.join();
  ASSERT_TRUE(silent.ok() && halfway.ok());
  ASSERT_TRUE(started[0].ok());
  EXPECT_TRUE(started[1].ok());
  // Both strangers are still connected here (they keep quiet); their handshakes run out after 3 s.
  char byte = 0;
  for (Fd* stranger : {&silent.value(), &halfway.value()}) {
    const Status closed = ReadFull(stranger->get(), &byte, 1, DeadlineAfter(10));
    EXPECT_EQ(CodeName(closed.code()), CodeName(Code::kUnavailable));  // the engine closed it
  }
  EXPECT_EQ(started[0].value()->stats().refused_handshakes, 2);
}

TEST(Errors, PortInUseFailsStartPromptly) {
  const PeerList peers = testing::LoopbackPeers(2);
  EngineConfig c;
  c.peers = peers;
  c.rank = 0;
  c.token = "t";
  c.timeout_seconds = 30;
  auto listener = Listen(peers.at(0).port);  // someone else holds rank 0's port
  ASSERT_TRUE(listener.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto second = Engine::Start(c);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // A local start-up failure, not a lost peer (Unavailable: kungfu.errors.PeerError, "recoverable").
  EXPECT_EQ(CodeName(second.status().code()), CodeName(Code::kAlreadyExists));
  EXPECT_TRUE(second.status().message().find("bind port") != std::string::npos);
  EXPECT_TRUE(second.status().message().find("Address already in use") != std::string::npos);
  EXPECT_TRUE(secs < 2);
}

}  // namespace
}  // namespace kungfu
