// Strangers sending junk to a live cluster's ports (fixed seeds): random bytes, cut and malformed
// handshakes, a wrong token, stalls. The contract: every stranger is refused within the handshake
// deadline, and the cluster's collectives are neither disturbed nor slowed past their deadline.
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/fake_rank.h"
#include "cc/tests/fuzz.h"
#include "cc/tests/testing.h"
#include "cc/transport/handshake.h"
#include "cc/transport/socket.h"
#include "cc/wire.h"

namespace kungfu {
namespace {

using testing::EdgeValue;
using testing::EncodeFrame;
using testing::FuzzEnv;
using testing::Pick;
using testing::RandomBytes;
using testing::Rng;
using testing::RunRanks;
using testing::Seconds;
using testing::StartCluster;

// The handshake's HELLO (cc/transport/handshake.cc): magic, version, id_len, cluster version, rank,
// nonce[32], then the id. id_len is written as given, whatever the id's length.
std::string Hello(Rng& rng, uint16_t id_len, const std::string& id, uint32_t rank) {
  const uint32_t magic = 0x5348464b;
  const uint16_t version = (2 << 8) | kProtocolVersion;
  const uint32_t cluster = 0;
  std::string out(48, '\0');
  std::memcpy(&out[0], &magic, 4);
  std::memcpy(&out[4], &version, 2);
  std::memcpy(&out[6], &id_len, 2);
  std::memcpy(&out[8], &cluster, 4);
  std::memcpy(&out[12], &rank, 4);
  for (int i = 16; i < 48; ++i) out[i] = static_cast<char>(rng());
  return out + id;
}

// A stranger: connects to port, sends bytes (stopping quietly if the engine closes first), half-closes
// if asked, then waits for the engine to close the connection. Returns the seconds from connecting to
// that close, or -1 if it did not come within limit.
double Stranger(uint16_t port, const std::string& bytes, bool half_close, double limit,
                const std::function<void(int fd)>& talk = {}) {
  auto fd = ConnectWithRetry(PeerID{"127.0.0.1", port}, DeadlineAfter(5));
  if (!fd.ok()) return -1;
  const auto t0 = Clock::now();
  const int f = fd.value().get();
  if (talk) talk(f);
  for (size_t off = 0; off < bytes.size();) {
    const ssize_t n = ::send(f, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;  // refused already: the rest is of no interest
    off += static_cast<size_t>(n);
  }
  if (half_close) ::shutdown(f, SHUT_WR);
  char sink[4096];
  while (Seconds(t0) < limit) {
    pollfd pfd{f, POLLIN, 0};
    if (::poll(&pfd, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(f, sink, sizeof(sink), 0);
    if (n <= 0) return Seconds(t0);  // the close (0) or a reset (-1)
  }
  return -1;
}

// Strangers on both ranks' ports while the ranks run allreduces: random bytes, a megabyte of them,
// handshakes cut short, huge and zero declared lengths, a frame instead of a handshake, a wrong token,
// and two that stall (one silent, one after its HELLO), which the handshake deadline must drop. Every
// allreduce stays exact; every stranger is refused (and counted); a later allreduce still works.
TEST(Fuzz, StrangersOnTheEnginePortsAreRefused) {
  const double timeout = 3;  // the handshake deadline is min(timeout, 10 s)
  auto engines = StartCluster(2, [&](EngineConfig& c) { c.timeout_seconds = timeout; });
  ASSERT_TRUE(engines[0] && engines[1]);
  const PeerList peers = engines[0]->config().peers;
  std::atomic<int> strangers_left{2};
  std::atomic<int> sent_to[2] = {{0}, {0}};
  std::atomic<int> failures{0};
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      ++failures;
      std::fprintf(stderr, "  stranger: %s\n", what);
    }
  };
  auto strangers = [&](int r) {
    Rng rng(1000 + r);
    const uint16_t port = peers.at(r).port;
    const std::string id1 = peers.at(1 - r).ToString();
    auto go = [&](const std::string& bytes, bool half_close, double limit, const std::function<void(int)>& talk = {}) {
      ++sent_to[r];
      return Stranger(port, bytes, half_close, limit, talk);
    };
    // Stalls first: the strangers after them wait in the listen queue meanwhile.
    const double stall = r == 0 ? go("", false, timeout + 5) : go(Hello(rng, id1.size(), id1, 1 - r), false, timeout + 5);
    expect(stall >= timeout * 0.8 && stall <= timeout + 4, "a stalled stranger was not dropped at the handshake deadline");
    for (int k = 0; k < 12; ++k) {
      expect(go(RandomBytes(rng, 1 + Pick(rng, 200)), true, timeout + 2) >= 0, "random bytes were not refused");
    }
    expect(go(RandomBytes(rng, 1 << 20), true, timeout + 2) >= 0, "a megabyte of junk was not refused");
    for (int k = 0; k < 6; ++k) {
      const std::string hello = Hello(rng, id1.size(), id1, 1 - r);
      expect(go(hello.substr(0, Pick(rng, hello.size())), true, timeout + 2) >= 0, "a cut handshake was not refused");
    }
    // Declared lengths past the bound are refused at once, not waited for: well before the deadline.
    const double huge = go(Hello(rng, 0xffff, RandomBytes(rng, 4096), 1 - r), false, timeout + 2);
    expect(huge >= 0 && huge < timeout / 2, "a huge declared id length was not refused at once");
    const double zero = go(Hello(rng, 0, "", 1 - r), false, timeout + 2);
    expect(zero >= 0 && zero < timeout / 2, "a zero id length was not refused at once");
    FrameHeader h;
    h.payload_bytes = kMaxPayloadBytes;
    h.count = kMaxElements;
    const std::vector<uint8_t> frame = EncodeFrame(FrameHeader{}, "x");
    std::string as_frame(frame.begin(), frame.end());
    uint8_t header[kFrameHeaderSize];
    EncodeFrameHeader(h, kMaxNameBytes, header);
    as_frame.replace(0, kFrameHeaderSize, reinterpret_cast<char*>(header), kFrameHeaderSize);
    const double framed = go(as_frame, false, timeout + 2);
    expect(framed >= 0 && framed < timeout / 2, "a frame in place of a handshake was not refused at once");
    // A well-formed handshake with the wrong token, as rank 1 - r and as a rank outside the job.
    for (int as : {1 - r, 7}) {
      Status client;
      go("", false, timeout + 2, [&](int fd) {
        HandshakeParams hs;
        hs.token = "not-the-token";
        hs.peers = &peers;
        client = ClientHandshake(fd, hs, as, as == 7 ? PeerID{"127.0.0.1", 1} : peers.at(1 - r), r, DeadlineAfter(5));
      });
      expect(client.code() == Code::kPermissionDenied, "a wrong token was not refused");
    }
  };
  const auto t0 = Clock::now();
  std::thread s0([&] {
    strangers(0);
    --strangers_left;
  });
  std::thread s1([&] {
    strangers(1);
    --strangers_left;
  });
  // Meanwhile the real ranks: the small (doubling) and the large (ring) allreduce, exact values.
  int iterations[2] = {0, 0};
  RunRanks(2, [&](int r) {
    for (int it = 0;; ++it) {
      const int64_t count = it % 3 == 2 ? 300000 : (it % 3 == 1 ? 1000 : 1);
      std::vector<int32_t> x(count);
      for (int64_t i = 0; i < count; ++i) x[i] = static_cast<int32_t>(i * (r + 1) + it);
      ASSERT_OK(engines[r]->AllReduceSync(x.data(), x.data(), count, DType::kInt32, ReduceOp::kSum,
                                          "busy" + std::to_string(it)));
      int bad = 0;
      for (int64_t i = 0; i < count; ++i) bad += x[i] != static_cast<int32_t>(3 * i + 2 * it);
      ASSERT_EQ(bad, 0);
      iterations[r] = it + 1;
      // Both ranks stop at the same iteration: they agree on it by a collective.
      int32_t more = strangers_left > 0 && Seconds(t0) < 60 ? 1 : 0;
      ASSERT_OK(engines[r]->AllReduceSync(&more, &more, 1, DType::kInt32, ReduceOp::kMax, "more" + std::to_string(it)));
      if (more == 0 && it >= 39) break;
    }
  });
  s0.join();
  s1.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(iterations[0] >= 40 && iterations[0] == iterations[1]);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(engines[r]->stats().refused_handshakes, int64_t{sent_to[r].load()});
  // And after them.
  RunRanks(2, [&](int r) {
    float x = static_cast<float>(r + 1);
    ASSERT_OK(engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "after"));
    EXPECT_EQ(x, 3.f);
  });
  std::fprintf(stderr, "  strangers: %d and %d connections, %.1f s\n", sent_to[0].load(), sent_to[1].load(), Seconds(t0));
}

}  // namespace
}  // namespace kungfu
