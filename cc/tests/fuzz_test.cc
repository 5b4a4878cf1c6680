// Wire-protocol fuzzing with fixed seeds (deterministic), bytes only: the frame header and started-by-name
// decoders and the connection's frame parser fed random and mutated bytes. The contract: nothing crashes,
// reads or writes out of bounds (run it under ASan too) or allocates without bound; a malformed frame
// breaks the connection with a Status. Live engines: fuzz_strangers_test.cc and fuzz_peer_test.cc.
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cc/tests/fuzz.h"
#include "cc/tests/testing.h"
#include "cc/transport/connection.h"
#include "cc/transport/socket.h"
#include "cc/wire.h"

namespace kungfu {
namespace {

using testing::EdgeValue;
using testing::FuzzEnv;
using testing::kFields;
using testing::kNumFields;
using testing::MutateHeader;
using testing::Pick;
using testing::Rng;

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
  if (h.kind == FrameKind::kTraits) h.payload_bytes %= kMaxTraitsBytes + 1;
  *name_len = static_cast<uint32_t>(1 + Pick(rng, Pick(rng, 8) == 0 ? kMaxNameBytes : 16));
  return h;
}

// Whether a header the decoder accepted is within every bound it promises.
bool WithinBounds(const FrameHeader& h, uint32_t name_len) {
  const auto kind = static_cast<uint8_t>(h.kind);
  const auto algo = static_cast<uint8_t>(h.algo);
  return kind >= 1 && kind <= kLastFrameKind && algo >= 1 && algo <= kLastAlgo && h.pad < kMaxPadBytes &&
         name_len >= 1 && name_len <= kMaxNameBytes && h.payload_bytes <= kMaxPayloadBytes && h.count >= 0 &&
         h.count <= kMaxElements && h.offset >= 0 && h.offset <= h.count &&
         (h.kind != FrameKind::kTraits || h.payload_bytes <= kMaxTraitsBytes);
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
      if (Pick(rng, 6) == 0 && (h.kind != FrameKind::kAbort && h.kind != FrameKind::kAck &&
                                h.kind != FrameKind::kRequest && h.kind != FrameKind::kTraits)) {
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

}  // namespace
}  // namespace kungfu
