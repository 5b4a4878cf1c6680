// Wire-protocol fuzzing with fixed seeds (deterministic): the frame header and started-by-name decoders
// and the connection's frame parser fed random and mutated bytes; strangers sending junk to a live
// cluster's ports; and a fake rank that completes the real handshake, then sends mutated frames to a real
// rank 0 in the middle of its collectives. The contract: nothing crashes, reads or writes out of bounds
// (run it under ASan too), allocates without bound or hangs past the deadline; junk from strangers does
// not disturb the cluster; a malformed frame from a peer fails the collectives involving it with a Status.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/fake_rank.h"
#include "cc/tests/testing.h"
#include "cc/transport/connection.h"
#include "cc/transport/handshake.h"
#include "cc/transport/socket.h"
#include "cc/wire.h"

namespace kungfu {
namespace {

using testing::EncodeFrame;
using testing::FakeRank;
using testing::RunRanks;
using testing::StartBesideFakeRank1;
using testing::StartCluster;
using Rng = std::mt19937_64;

// A longer search than the default (fixed, deterministic) one, by hand: KF_FUZZ_SEED=n KF_FUZZ_ROUNDS=m.
uint64_t FuzzEnv(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

uint64_t Pick(Rng& rng, uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); }

// Values that sit on the bounds the decoders check, or far past them.
uint64_t EdgeValue(Rng& rng) {
  static const uint64_t kEdges[] = {0,
                                    1,
                                    2,
                                    7,
                                    8,
                                    63,
                                    64,
                                    255,
                                    256,
                                    kMaxNameBytes,
                                    kMaxNameBytes + 1,
                                    0xffff,
                                    0x7fffffff,
                                    0x80000000,
                                    0xffffffff,
                                    uint64_t{1} << 32,
                                    kMaxPayloadBytes,
                                    kMaxPayloadBytes + 1,
                                    uint64_t{kMaxElements},
                                    uint64_t{kMaxElements} + 1,
                                    uint64_t{0x7fffffffffffffff},
                                    uint64_t{0x8000000000000000},
                                    ~uint64_t{0},
                                    ~uint64_t{0} - 1};
  if (Pick(rng, 4) == 0) return rng();
  return kEdges[Pick(rng, sizeof(kEdges) / sizeof(kEdges[0]))];
}

// The header's fields: offset and width (wire.cc's layout).
struct Field {
  int at, width;
};
const Field kFields[] = {{0, 4},  {4, 2},  {6, 1},  {7, 1},  {8, 1},  {9, 1},  {10, 2}, {12, 4},
                         {16, 4}, {20, 4}, {24, 4}, {28, 4}, {32, 8}, {40, 8}, {48, 8}, {56, 8}};

void SetField(uint8_t* header, const Field& f, uint64_t v) { std::memcpy(header + f.at, &v, f.width); }

// Flips bits, sets fields to edge values, or overwrites random bytes of a 64-byte header.
void MutateHeader(Rng& rng, uint8_t* header) {
  const int n = 1 + static_cast<int>(Pick(rng, 3));
  for (int k = 0; k < n; ++k) {
    switch (Pick(rng, 3)) {
      case 0: header[Pick(rng, kFrameHeaderSize)] ^= static_cast<uint8_t>(1u << Pick(rng, 8)); break;
      case 1: SetField(header, kFields[Pick(rng, sizeof(kFields) / sizeof(kFields[0]))], EdgeValue(rng)); break;
      default: header[Pick(rng, kFrameHeaderSize)] = static_cast<uint8_t>(rng()); break;
    }
  }
}

FrameHeader RandomValidHeader(Rng& rng, uint32_t* name_len) {
  FrameHeader h;
  h.kind = static_cast<FrameKind>(1 + Pick(rng, kLastFrameKind));
  h.dtype = static_cast<uint8_t>(Pick(rng, 9));
  h.algo = static_cast<Algo>(1 + Pick(rng, kLastAlgo));
  h.pad = static_cast<uint8_t>(Pick(rng, kMaxPadBytes));
  h.aux = static_cast<uint32_t>(rng());
  h.cluster_version = static_cast<uint32_t>(Pick(rng, 3));
  h.tag = static_cast<uint32_t>(Pick(rng, 8));
  h.shape_sig = static_cast<uint32_t>(rng());
  h.generation = Pick(rng, 4);
  h.count = static_cast<int64_t>(Pick(rng, 1000));
  h.offset = static_cast<int64_t>(Pick(rng, static_cast<uint64_t>(h.count) + 1));
  h.payload_bytes = Pick(rng, 4) == 0 ? 0 : Pick(rng, 4 << 10);
  if (h.kind == FrameKind::kAck || h.kind == FrameKind::kRequest) h.payload_bytes = 0;  // these carry none
  *name_len = static_cast<uint32_t>(1 + Pick(rng, Pick(rng, 8) == 0 ? kMaxNameBytes : 16));
  return h;
}

// Whether a header the decoder accepted is within every bound it promises.
bool WithinBounds(const FrameHeader& h, uint32_t name_len) {
  const auto kind = static_cast<uint8_t>(h.kind);
  const auto algo = static_cast<uint8_t>(h.algo);
  return kind >= 1 && kind <= kLastFrameKind && algo >= 1 && algo <= kLastAlgo && h.pad < kMaxPadBytes &&
         name_len >= 1 && name_len <= kMaxNameBytes && h.payload_bytes <= kMaxPayloadBytes && h.count >= 0 &&
         h.count <= kMaxElements && h.offset >= 0 && h.offset <= h.count;
}

TEST(Fuzz, FrameHeaderDecoderStaysInBounds) {
  Rng rng(20261201);
  int accepted = 0, refused = 0;
  for (int i = 0; i < 30000; ++i) {
    // Exactly 64 bytes on the heap: a read past them is an ASan error.
    std::unique_ptr<uint8_t[]> buf(new uint8_t[kFrameHeaderSize]);
    if (i % 5 == 0) {
      for (size_t b = 0; b < kFrameHeaderSize; ++b) buf[b] = static_cast<uint8_t>(rng());
    } else {
      uint32_t len = 0;
      const FrameHeader valid = RandomValidHeader(rng, &len);
      EncodeFrameHeader(valid, len, buf.get());
      if (i % 5 != 1) MutateHeader(rng, buf.get());
    }
    FrameHeader h;
    uint32_t name_len = 0;
    Status s = DecodeFrameHeader(buf.get(), &h, &name_len);
    if (!s.ok()) {
      ++refused;
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      EXPECT_TRUE(!s.message().empty());
      continue;
    }
    ++accepted;
    ASSERT_TRUE(WithinBounds(h, name_len));
    // What it accepted survives a round trip.
    uint8_t again[kFrameHeaderSize];
    EncodeFrameHeader(h, name_len, again);
    FrameHeader g;
    uint32_t g_len = 0;
    ASSERT_OK(DecodeFrameHeader(again, &g, &g_len));
    EXPECT_TRUE(g_len == name_len && g.kind == h.kind && g.count == h.count && g.offset == h.offset &&
                g.payload_bytes == h.payload_bytes && g.generation == h.generation && g.tag == h.tag);
  }
  // Frames that carry no data are bounded by their kind: an abort's text, and no payload at all for the rest.
  for (const auto& [kind, bytes, ok] : std::vector<std::tuple<FrameKind, uint64_t, bool>>{
           {FrameKind::kAbort, kMaxAbortBytes, true}, {FrameKind::kAbort, kMaxAbortBytes + 1, false},
           {FrameKind::kAck, 0, true}, {FrameKind::kAck, 1, false}, {FrameKind::kRequest, 4, false},
           {FrameKind::kData, kMaxPayloadBytes, true}, {FrameKind::kBye, kMaxPayloadBytes, true}}) {
    FrameHeader h;
    h.kind = kind;
    h.payload_bytes = bytes;
    uint8_t buf[kFrameHeaderSize];
    EncodeFrameHeader(h, 1, buf);
    FrameHeader g;
    uint32_t len = 0;
    EXPECT_EQ(DecodeFrameHeader(buf, &g, &len).ok(), ok);
  }
  EXPECT_TRUE(accepted > 3000);  // the mutations reach the accepting path, not only the refusals
  EXPECT_TRUE(refused > 3000);
}

TEST(Fuzz, StartedByNameDecoderStaysInBounds) {
  Rng rng(424242);
  int accepted = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string bytes;
    if (i % 4 == 0) {
      bytes.resize(Pick(rng, 200));
      for (char& c : bytes) c = static_cast<char>(rng());
    } else {
      StartedByName m;
      const int names = static_cast<int>(Pick(rng, 6));
      for (int k = 0; k < names; ++k) {
        m[std::string(1 + Pick(rng, Pick(rng, 10) == 0 ? kMaxNameBytes : 20), static_cast<char>('a' + k))] = rng();
      }
      bytes = EncodeStartedByName(m);
      if (!bytes.empty() && i % 4 != 1) {
        switch (Pick(rng, 4)) {
          case 0: bytes.resize(Pick(rng, bytes.size())); break;  // cut short
          case 1: bytes[Pick(rng, bytes.size())] ^= static_cast<char>(1 << Pick(rng, 8)); break;
          case 2: {  // a length field (the first entry's) at an edge value
            const uint32_t len = static_cast<uint32_t>(EdgeValue(rng));
            std::memcpy(bytes.data(), &len, std::min<size_t>(4, bytes.size()));
            break;
          }
          default: bytes += std::string(1 + Pick(rng, 16), static_cast<char>(rng())); break;
        }
      }
    }
    std::unique_ptr<char[]> exact(new char[std::max<size_t>(bytes.size(), 1)]);  // a read past it: ASan
    std::memcpy(exact.get(), bytes.data(), bytes.size());
    StartedByName out{{"stale", 1}};
    Status s = DecodeStartedByName(exact.get(), bytes.size(), &out);
    if (!s.ok()) {
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      continue;
    }
    ++accepted;
    uint64_t total = 0;
    for (const auto& [name, count] : out) {
      ASSERT_TRUE(!name.empty() && name.size() <= kMaxNameBytes);
      total += 12 + name.size();
    }
    EXPECT_TRUE(total <= bytes.size());  // fewer when a name repeats
  }
  EXPECT_TRUE(accepted > 1000);
}

// A FrameSink that checks what the connection hands it: names within bounds, a payload pointer for every
// payload, and the payload into memory exactly its size (heap, so ASan sees a write past it).
class CheckingSink : public FrameSink {
 public:
  explicit CheckingSink(Rng* rng) : rng_(rng) {}
  char* PayloadTarget(int, const FrameHeader& h, const std::string& name, bool* discard, uint64_t*) override {
    EXPECT_TRUE(!name.empty() && name.size() <= kMaxNameBytes);
    EXPECT_TRUE(h.payload_bytes > 0 && h.payload_bytes <= kMaxPayloadBytes);
    switch (Pick(*rng_, 3)) {
      case 0: return nullptr;  // the connection allocates
      case 1:
        *discard = true;
        got.push_back(Got{h, name, std::string(), true});
        return nullptr;
      default:
        if (h.payload_bytes > (1 << 20)) return nullptr;  // a declared size, not yet sent: no need to hold it
        target_.reset(new char[h.payload_bytes]);
        return target_.get();
    }
  }
  void OnFrame(int, const FrameHeader& h, std::string name, char* data, Buffer owned) override {
    EXPECT_TRUE(!name.empty() && name.size() <= kMaxNameBytes);
    EXPECT_TRUE(h.payload_bytes == 0 || data != nullptr);
    EXPECT_TRUE(!owned || data == owned.get());
    Got g{h, std::move(name), std::string(), false};
    if (data) g.payload.assign(data, h.payload_bytes);
    got.push_back(std::move(g));
  }
  struct Got {
    FrameHeader h;
    std::string name, payload;
    bool discarded;
  };
  std::vector<Got> got;

 private:
  Rng* rng_;
  std::unique_ptr<char[]> target_;
};

// The connection's frame parser over a socketpair: streams of valid frames (names of every length, pads,
// payloads that go through staging and straight into the target) arrive in random-sized pieces and come
// out intact; mutated and random streams end with a broken connection or parsed frames, never a crash.
TEST(Fuzz, ConnectionParsesMutatedStreams) {
  Rng rng(FuzzEnv("KF_FUZZ_SEED", 7777));
  int intact = 0, broken = 0;
  for (uint64_t iter = 0; iter < 400 * FuzzEnv("KF_FUZZ_ROUNDS", 1); ++iter) {
    int sv[2];
    ASSERT_TRUE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
    Fd writer(sv[1]);
    CheckingSink sink(&rng);
    Connection conn(Fd(sv[0]), 1, &sink, 1 + Pick(rng, 256 << 10));
    // The stream: a few frames, each with a pad and a payload of recognisable bytes.
    std::string stream;
    struct Sent {
      std::string name, payload;
    };
    std::vector<Sent> sent;
    const int frames = 1 + static_cast<int>(Pick(rng, 6));
    for (int f = 0; f < frames; ++f) {
      uint32_t name_len = 0;
      FrameHeader h = RandomValidHeader(rng, &name_len);
      if (Pick(rng, 6) == 0 && (h.kind != FrameKind::kAbort && h.kind != FrameKind::kAck && h.kind != FrameKind::kRequest)) {
        h.payload_bytes = 16 * 1024 + Pick(rng, 80 * 1024);  // the direct read path
      }
      uint8_t header[kFrameHeaderSize];
      EncodeFrameHeader(h, name_len, header);
      std::string name(name_len, static_cast<char>('A' + f));
      std::string payload(h.payload_bytes, '\0');
      for (size_t b = 0; b < payload.size(); ++b) payload[b] = static_cast<char>(b * 31 + f);
      stream.append(reinterpret_cast<char*>(header), kFrameHeaderSize);
      stream += name;
      stream.append(h.pad, '\0');
      stream += payload;
      sent.push_back(Sent{name, payload});
    }
    const int mode = static_cast<int>(Pick(rng, 4));  // 0: intact; 1: a header mutated; 2: random bytes; 3: cut
    if (mode == 1) {
      // Mutate one frame's header: find its start by walking the frames.
      size_t at = 0;
      const size_t which = Pick(rng, sent.size());
      for (size_t f = 0; f < which; ++f) {
        FrameHeader h;
        uint32_t len = 0;
        (void)DecodeFrameHeader(reinterpret_cast<const uint8_t*>(stream.data() + at), &h, &len);
        at += kFrameHeaderSize + len + h.pad + h.payload_bytes;
      }
      MutateHeader(rng, reinterpret_cast<uint8_t*>(stream.data() + at));
    } else if (mode == 2) {
      for (size_t k = 0, n = 1 + Pick(rng, 8); k < n; ++k) stream[Pick(rng, stream.size())] = static_cast<char>(rng());
    } else if (mode == 3) {
      stream.resize(Pick(rng, stream.size()));
    }
    // Feed it in pieces, reading after each, then close.
    size_t off = 0;
    while (off < stream.size() && !conn.broken()) {
      const size_t piece = std::min(stream.size() - off, static_cast<size_t>(1 + Pick(rng, Pick(rng, 2) ? 100 : 40000)));
      const ssize_t n = ::send(writer.get(), stream.data() + off, piece, MSG_NOSIGNAL);
      if (n > 0) off += static_cast<size_t>(n);
      while (conn.OnReadable()) {
      }
    }
    writer = Fd();
    for (int k = 0; k < 1000 && !conn.broken(); ++k) conn.OnReadable();
    ASSERT_TRUE(conn.broken());  // at the close, if not before
    Status why;
    ASSERT_TRUE(conn.TakeError(&why));
    if (mode == 0) {
      EXPECT_TRUE(why.message().find("closed the connection") != std::string::npos);
      ASSERT_EQ(sink.got.size(), sent.size());
      for (size_t f = 0; f < sent.size(); ++f) {
        EXPECT_TRUE(sink.got[f].name == sent[f].name);
        EXPECT_TRUE(sink.got[f].discarded || sink.got[f].payload == sent[f].payload);
      }
      ++intact;
    } else {
      EXPECT_TRUE(sink.got.size() <= sent.size() + 64);
      if (why.message().find("malformed frame") != std::string::npos) ++broken;
    }
  }
  EXPECT_TRUE(intact > 50);
  EXPECT_TRUE(broken > 50);  // the mutations reach the decoder's refusals through the connection
}


// ---- live engines -------------------------------------------------------------------------------

// Waits for one completion, but not forever: a collective that outlives its deadline by far is a hang,
// and the test stops the process (its buffers may still be written to) rather than wait on it.
class TimedWaiter {
 public:
  DoneCallback Callback() {
    return [this](const Status& s) { Set(s); };
  }
  RequestCallback RequestDone() {
    return [this](const Status& s, int64_t version) {
      version_ = version;
      Set(s);
    };
  }
  Status Wait(double seconds, const std::string& what) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) {
      std::fprintf(stderr, "  %s did not finish within %.0f s: the engine hangs\n", what.c_str(), seconds);
      std::abort();
    }
    return status_;
  }
  int64_t version() const { return version_; }

 private:
  void Set(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = s;
    done_ = true;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
  int64_t version_ = -2;
};

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

std::string RandomBytes(Rng& rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
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

// One frame the fake rank sends, and the op of rank 0 it belongs to.
struct FakeFrame {
  int op;
  std::vector<uint8_t> bytes;
};

std::vector<uint8_t> Frame(FrameHeader h, const std::string& name, int32_t fill_int = 0) {
  std::vector<uint8_t> f = EncodeFrame(h, name);  // payload of 1.0f
  if (fill_int != 0) {
    uint8_t* p = f.data() + kFrameHeaderSize + name.size();  // not aligned: copied, not stored as int32
    for (uint64_t i = 0; i < h.payload_bytes / sizeof(int32_t); ++i) std::memcpy(p + i * 4, &fill_int, 4);
  }
  return f;
}

// Mutates one frame of the fake rank's: header fields to edge or nearby values (lengths included, so the
// stream may lose its framing), flipped bits, another name of any length, a cut, garbage, a duplicate, an
// abort in its place. Returns the frames to send in its place.
std::vector<std::vector<uint8_t>> MutateFrame(Rng& rng, const std::vector<uint8_t>& frame) {
  std::vector<uint8_t> f = frame;
  FrameHeader h;
  uint32_t name_len = 0;
  (void)DecodeFrameHeader(f.data(), &h, &name_len);
  const std::string name(f.begin() + kFrameHeaderSize, f.begin() + kFrameHeaderSize + name_len);
  switch (Pick(rng, 11)) {
    case 0:
    case 8:
    case 9:
    case 10:
    case 1: {  // a field of the header
      const Field& field = kFields[2 + Pick(rng, sizeof(kFields) / sizeof(kFields[0]) - 2)];
      uint64_t v = 0;
      std::memcpy(&v, f.data() + field.at, field.width);
      switch (Pick(rng, 3)) {
        case 0: v = EdgeValue(rng); break;
        case 1: v += static_cast<uint64_t>(static_cast<int64_t>(Pick(rng, 257)) - 128); break;
        default: v ^= uint64_t{1} << Pick(rng, field.width * 8); break;
      }
      SetField(f.data(), field, v);
      return {f};
    }
    case 2: MutateHeader(rng, f.data()); return {f};
    case 3: {  // another name, of any length up to the bound
      std::string other = RandomBytes(rng, 1 + Pick(rng, Pick(rng, 2) ? kMaxNameBytes : 8));
      if (Pick(rng, 2)) other = name + other.substr(0, other.size() % 4);
      return {Frame(h, other.substr(0, kMaxNameBytes))};
    }
    case 4: f.resize(Pick(rng, f.size())); return {f};  // cut short: the rest never comes
    case 5: {  // garbage in its place
      const std::string junk = RandomBytes(rng, 1 + Pick(rng, 200));
      return {std::vector<uint8_t>(junk.begin(), junk.end())};
    }
    case 6: return {f, f};  // twice
    default: {              // an abort with any code and text
      FrameHeader a = h;
      a.kind = FrameKind::kAbort;
      a.tag = static_cast<uint32_t>(EdgeValue(rng));
      const std::string text = RandomBytes(rng, Pick(rng, 300));
      a.payload_bytes = text.size();
      std::vector<uint8_t> abort = EncodeFrame(a, name);
      std::copy(text.begin(), text.end(), abort.end() - text.size());
      return {abort};
    }
  }
}

// A fake rank 1 that knows the token sends rank 0 the frames of five collectives rank 0 runs with it
// (recursive doubling, the ring, a broadcast from rank 1, an all-gather and a peer-to-peer request),
// some of them mutated, in a shuffled order. Every collective of rank 0 must end by its deadline: OK
// with exact values when none of its frames was mutated, or else with an error that names it. Rank 0
// must then shut down, and a new cluster must work.
TEST(Fuzz, MutatedFramesFromAnAuthenticatedPeer) {
  Rng rng(FuzzEnv("KF_FUZZ_SEED", 31337));
  const double timeout = 1;
  int ok_exact = 0, failed = 0;
  const auto t0 = Clock::now();
  for (uint64_t session = 0; session < 12 * FuzzEnv("KF_FUZZ_ROUNDS", 1); ++session) {
    const PeerList peers = testing::LoopbackPeers(2);
    FakeRank fake;
    auto engine = StartBesideFakeRank1(peers, &fake, [&](EngineConfig& c) {
      c.timeout_seconds = timeout;
      c.ring_threshold_bytes = 256;  // on 2 workers, the ring from 1 KiB
      c.chunk_bytes = 512;
      c.max_pending_bytes = 256 << 10;
    });
    ASSERT_OK(engine.status());
    ASSERT_TRUE(fake.rank0_reads.valid());
    Engine& e = *engine.value();
    const std::string sfx = std::to_string(session);
    const uint32_t cv = peers.version();
    auto shape = [&](Algo algo, DType dtype, int64_t count, uint32_t aux) {
      FrameHeader h;
      h.algo = algo;
      h.dtype = static_cast<uint8_t>(dtype);
      h.count = count;
      h.aux = aux;
      h.cluster_version = cv;
      return h;
    };
    std::vector<FakeFrame> frames;
    // 0: recursive doubling, 4 float32: one frame.
    std::vector<float> d_in = {1, 2, 3, 4}, d_out(4, 0);
    {
      FrameHeader h = shape(Algo::kAllReduceDoubling, DType::kFloat32, 4, 1);
      h.payload_bytes = 16;
      frames.push_back({0, Frame(h, "d" + sfx)});
    }
    // 1: the ring, 1000 int32 (rank 0's zeros): chunk 1 in step 0, chunk 0 in step 1, pieces of 128.
    std::vector<int32_t> r_in(1000, 0), r_out(1000, -1);
    for (int step = 0; step < 2; ++step) {
      const int64_t b = step == 0 ? 500 : 0;
      for (int64_t off = b; off < b + 500; off += 128) {
        FrameHeader h = shape(Algo::kAllReduceRing, DType::kInt32, 1000, 1);
        h.tag = static_cast<uint32_t>(step);
        h.offset = off;
        h.payload_bytes = std::min<int64_t>(128, b + 500 - off) * 4;
        frames.push_back({1, Frame(h, "r" + sfx, 7)});
      }
    }
    // 2: a broadcast of 300 float32 from rank 1 (the star): pieces of 128, then the commit.
    std::vector<float> b_buf(300, -1);
    for (int64_t off = 0; off < 300; off += 128) {
      FrameHeader h = shape(Algo::kBroadcastStar, DType::kFloat32, 300, 1);
      h.offset = off;
      h.payload_bytes = std::min<int64_t>(128, 300 - off) * 4;
      frames.push_back({2, Frame(h, "b" + sfx)});
    }
    {
      FrameHeader h = shape(Algo::kBroadcastStar, DType::kFloat32, 300, 1);
      h.kind = FrameKind::kAck;
      h.tag = 1;
      frames.push_back({2, Frame(h, "b" + sfx)});
    }
    // 3: an all-gather of 5 + 7 int32: rank 1's block at 5.
    std::vector<int32_t> g_in = {100, 101, 102, 103, 104}, g_out(12, -1);
    {
      FrameHeader h = shape(Algo::kAllGather, DType::kInt32, 12, 7);
      h.offset = 5;
      h.payload_bytes = 28;
      frames.push_back({3, Frame(h, "g" + sfx, 7)});
    }
    // 4: a peer-to-peer request of 40 float32 (the engine's first request: id 1), answered with version 3.
    std::vector<float> q_out(40, -1);
    {
      FrameHeader h = shape(Algo::kPeerToPeer, DType::kFloat32, 40, static_cast<uint32_t>(P2PStatus::kFound));
      h.kind = FrameKind::kResponse;
      h.tag = 1;
      h.generation = 3;
      h.payload_bytes = 160;
      frames.push_back({4, Frame(h, "q" + sfx)});
    }
    // Mutate some (none in the first session: the control), then shuffle.
    bool mutated[5] = {};
    std::vector<std::vector<uint8_t>> wire;
    std::shuffle(frames.begin(), frames.end(), rng);
    for (const FakeFrame& f : frames) {
      if (session > 0 && Pick(rng, 8) == 0) {
        mutated[f.op] = true;
        for (auto& m : MutateFrame(rng, f.bytes)) wire.push_back(std::move(m));
      } else {
        wire.push_back(f.bytes);
      }
    }
    TimedWaiter w[5];
    e.AllReduce(d_in.data(), d_out.data(), 4, DType::kFloat32, ReduceOp::kSum, "d" + sfx, w[0].Callback());
    e.AllReduce(r_in.data(), r_out.data(), 1000, DType::kInt32, ReduceOp::kSum, "r" + sfx, w[1].Callback());
    e.Broadcast(b_buf.data(), 300, DType::kFloat32, 1, "b" + sfx, w[2].Callback());
    e.AllGather(g_in.data(), g_out.data(), {5, 7}, DType::kInt32, "g" + sfx, w[3].Callback());
    e.Request(1, "q" + sfx, q_out.data(), 40, DType::kFloat32, 0, w[4].RequestDone());
    for (const auto& bytes : wire) {
      if (!WriteFull(fake.rank0_reads.get(), bytes.data(), bytes.size(), DeadlineAfter(5)).ok()) break;
    }
    const char* names[5] = {"d", "r", "b", "g", "q"};
    for (int op = 0; op < 5; ++op) {
      const std::string name = names[op] + sfx;
      Status s = w[op].Wait(timeout + 20, "'" + name + "'");
      if (!s.ok()) {
        ++failed;
        EXPECT_TRUE(mutated[op] || session > 0);  // the control session must succeed
        EXPECT_TRUE(s.message().find("'" + name + "'") != std::string::npos);
        continue;
      }
      if (mutated[op]) continue;  // a mutation it took in stride (a flipped unused bit, say)
      ++ok_exact;
      switch (op) {
        case 0:
          for (int i = 0; i < 4; ++i) EXPECT_EQ(d_out[i], d_in[i] + 1);
          break;
        case 1: EXPECT_TRUE(std::all_of(r_out.begin(), r_out.end(), [](int32_t v) { return v == 7; })); break;
        case 2: EXPECT_TRUE(std::all_of(b_buf.begin(), b_buf.end(), [](float v) { return v == 1.f; })); break;
        case 3:
          for (int i = 0; i < 12; ++i) EXPECT_EQ(g_out[i], i < 5 ? 100 + i : 7);
          break;
        case 4:
          EXPECT_EQ(w[op].version(), 3);
          EXPECT_TRUE(std::all_of(q_out.begin(), q_out.end(), [](float v) { return v == 1.f; }));
          break;
      }
    }
    const auto stop = Clock::now();
    engine.value().reset();  // shuts down: must not hang either
    EXPECT_TRUE(Seconds(stop) < timeout + 5);
  }
  std::fprintf(stderr, "  mutated frames: %d collectives exact, %d failed, %.1f s\n", ok_exact, failed, Seconds(t0));
  EXPECT_TRUE(ok_exact >= 5 && failed >= 5);
  // A new cluster on fresh ports works.
  auto engines = StartCluster(2);
  ASSERT_TRUE(engines[0] && engines[1]);
  RunRanks(2, [&](int r) {
    std::vector<int32_t> x(1000, r + 1);
    ASSERT_OK(engines[r]->AllReduceSync(x.data(), x.data(), 1000, DType::kInt32, ReduceOp::kSum, "later"));
    EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](int32_t v) { return v == 3; }));
  });
}

// Found by the test above: a piece sent twice in place of another one counted as the missing one, so
// the ring, a broadcast, an all-gather and a peer-to-peer request finished OK with part of the output
// never written. Each must fail instead, naming the collective.
TEST(Fuzz, APieceSentTwiceIsNotTheMissingOne) {
  const PeerList peers = testing::LoopbackPeers(2);
  FakeRank fake;
  auto engine = StartBesideFakeRank1(peers, &fake, [&](EngineConfig& c) {
    c.timeout_seconds = 5;
    c.ring_threshold_bytes = 256;
    c.chunk_bytes = 512;  // pieces of 128 elements
  });
  ASSERT_OK(engine.status());
  ASSERT_TRUE(fake.rank0_reads.valid());
  auto shape = [&](Algo algo, DType dtype, int64_t count, uint32_t aux) {
    FrameHeader h;
    h.algo = algo;
    h.dtype = static_cast<uint8_t>(dtype);
    h.count = count;
    h.aux = aux;
    h.cluster_version = peers.version();
    return h;
  };
  std::vector<std::vector<uint8_t>> wire;
  auto piece = [&](FrameHeader h, uint32_t tag, int64_t offset, int64_t elements, const std::string& name) {
    h.tag = tag;
    h.offset = offset;
    h.payload_bytes = static_cast<uint64_t>(elements) * 4;
    wire.push_back(Frame(h, name, h.dtype == static_cast<uint8_t>(DType::kInt32) ? 7 : 0));
  };
  // The ring, 1000 int32: step 0 pieces of chunk 1 in full; step 1's piece at 384 replaced by 0 again.
  const FrameHeader ring = shape(Algo::kAllReduceRing, DType::kInt32, 1000, 1);
  for (int64_t off : {500, 628, 756, 884}) piece(ring, 0, off, std::min<int64_t>(128, 1000 - off), "ring");
  for (int64_t off : {0, 128, 0}) piece(ring, 1, off, 128, "ring");
  piece(ring, 1, 384, 116, "ring");
  // A broadcast of 256 float32 from rank 1: piece 0 twice, then the commit.
  const FrameHeader bcast = shape(Algo::kBroadcastStar, DType::kFloat32, 256, 1);
  auto commit = [&](FrameHeader h, const std::string& name) {  // the root's commit of a broadcast
    h.kind = FrameKind::kAck;
    h.tag = 1;
    wire.push_back(Frame(h, name));
  };
  piece(bcast, 0, 0, 128, "bcast");
  piece(bcast, 0, 0, 128, "bcast");
  commit(bcast, "bcast");
  // An empty broadcast from rank 1: its one frame twice, then the commit.
  const FrameHeader empty = shape(Algo::kBroadcastStar, DType::kFloat32, 0, 1);
  piece(empty, 0, 0, 0, "bempty");
  piece(empty, 0, 0, 0, "bempty");
  commit(empty, "bempty");
  // An all-gather of 5 + 256 int32: rank 1's first piece twice.
  const FrameHeader gather = shape(Algo::kAllGather, DType::kInt32, 261, 256);
  piece(gather, 0, 5, 128, "gather");
  piece(gather, 0, 5, 128, "gather");
  // A request of 256 float32: the first piece twice.
  FrameHeader resp = shape(Algo::kPeerToPeer, DType::kFloat32, 256, static_cast<uint32_t>(P2PStatus::kFound));
  resp.kind = FrameKind::kResponse;
  piece(resp, 1, 0, 128, "req");
  piece(resp, 1, 0, 128, "req");

  Engine& e = *engine.value();
  std::vector<int32_t> r_in(1000, 0), r_out(1000, -1), g_in(5, 1), g_out(261, -1);
  std::vector<float> b_buf(256, -1), q_out(256, -1);
  TimedWaiter w[5];
  e.AllReduce(r_in.data(), r_out.data(), 1000, DType::kInt32, ReduceOp::kSum, "ring", w[0].Callback());
  e.Broadcast(b_buf.data(), 256, DType::kFloat32, 1, "bcast", w[1].Callback());
  e.AllGather(g_in.data(), g_out.data(), {5, 256}, DType::kInt32, "gather", w[2].Callback());
  e.Request(1, "req", q_out.data(), 256, DType::kFloat32, 0, w[3].RequestDone());
  e.Broadcast(nullptr, 0, DType::kFloat32, 1, "bempty", w[4].Callback());
  for (const auto& bytes : wire) ASSERT_OK(WriteFull(fake.rank0_reads.get(), bytes.data(), bytes.size(), DeadlineAfter(5)));
  const char* names[5] = {"ring", "bcast", "gather", "req", "bempty"};
  for (int op = 0; op < 5; ++op) {
    Status s = w[op].Wait(30, names[op]);
    EXPECT_TRUE(!s.ok());
    EXPECT_TRUE(s.message().find(std::string("'") + names[op] + "'") != std::string::npos);
    if (!s.ok()) std::fprintf(stderr, "  %s: %s\n", names[op], s.ToString().c_str());
  }
}

// The root of a star broadcast commits once every other worker has acknowledged the data: one worker's
// acknowledgement sent twice must not stand for another's, or the root commits (and its peers finish)
// before that one has the data. Rank 0 is the root of 3, fake rank 1 acknowledges twice, fake rank 2 never.
TEST(Fuzz, AnAcknowledgementSentTwiceIsNotAnotherWorkers) {
  const PeerList peers = testing::LoopbackPeers(3);
  std::vector<FakeRank> fakes;  // ranks 1 and 2
  auto engine = testing::StartBesideFakeRanks(peers, &fakes, [](EngineConfig& c) { c.timeout_seconds = 5; });
  ASSERT_OK(engine.status());
  ASSERT_TRUE(fakes[1].rank0_reads.valid());
  std::vector<float> buf(16, 1.f);
  TimedWaiter w;
  engine.value()->Broadcast(buf.data(), 16, DType::kFloat32, 0, "b", w.Callback());
  FrameHeader ack;
  ack.kind = FrameKind::kAck;
  ack.algo = Algo::kBroadcastStar;
  ack.dtype = static_cast<uint8_t>(DType::kFloat32);
  ack.count = 16;
  ack.aux = 0;  // the root
  ack.cluster_version = peers.version();
  const std::vector<uint8_t> frame = Frame(ack, "b");
  for (int i = 0; i < 2; ++i) ASSERT_OK(WriteFull(fakes[1].rank0_reads.get(), frame.data(), frame.size(), DeadlineAfter(5)));
  const Status s = w.Wait(30, "b");
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
  EXPECT_TRUE(s.message().find("came twice") != std::string::npos);
}

}  // namespace
}  // namespace kungfu
