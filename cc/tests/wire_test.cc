// Frame header encoding and the pad between a frame's name and its payload.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"
#include "cc/wire.h"

namespace kungfu {
namespace {

using testing::RunRanks;
using testing::StartCluster;

// The counts by name in BYE and FINALIZING frames: a round trip, and malformed payloads refused
// before anything is read out of bounds.
TEST(Wire, StartedByNameRoundTripAndBounds) {
  StartedByName m{{"grad/dense_1", 3}, {"kungfu/finalize", 1}, {std::string(kMaxNameBytes, 'n'), uint64_t{1} << 40}};
  const std::string bytes = EncodeStartedByName(m);
  StartedByName back{{"stale", 9}};
  EXPECT_OK(DecodeStartedByName(bytes.data(), bytes.size(), &back));
  EXPECT_TRUE(back == m);
  EXPECT_OK(DecodeStartedByName(nullptr, 0, &back));
  EXPECT_TRUE(back.empty());
  EXPECT_TRUE(!DecodeStartedByName(bytes.data(), bytes.size() - 1, &back).ok());  // a name cut short
  EXPECT_TRUE(!DecodeStartedByName(bytes.data(), 11, &back).ok());                // a header cut short
  std::string huge = bytes;
  const uint32_t too_long = kMaxNameBytes + 1;
  std::memcpy(huge.data(), &too_long, sizeof(too_long));
  EXPECT_TRUE(!DecodeStartedByName(huge.data(), huge.size(), &back).ok());
  std::string empty_name(12, '\0');
  EXPECT_TRUE(!DecodeStartedByName(empty_name.data(), empty_name.size(), &back).ok());
}

TEST(Wire, HeaderRoundTripAndBounds) {
  FrameHeader h;
  h.kind = FrameKind::kData;
  h.dtype = 6;
  h.algo = Algo::kAllReduceRing;
  h.aux = 3;
  h.cluster_version = 7;
  h.tag = 5;
  h.generation = 99;
  h.count = 1000;
  h.offset = 500;
  h.payload_bytes = 2000;
  uint8_t buf[kFrameHeaderSize];
  EncodeFrameHeader(h, 4, buf);
  FrameHeader g;
  uint32_t name_len = 0;
  EXPECT_OK(DecodeFrameHeader(buf, &g, &name_len));
  EXPECT_EQ(name_len, 4u);
  EXPECT_EQ(g.generation, 99u);
  EXPECT_EQ(g.offset, 500);
  h.payload_bytes = kMaxPayloadBytes + 1;
  EncodeFrameHeader(h, 4, buf);
  EXPECT_TRUE(!DecodeFrameHeader(buf, &g, &name_len).ok());
  h.payload_bytes = 8;
  EncodeFrameHeader(h, kMaxNameBytes + 1, buf);
  EXPECT_TRUE(!DecodeFrameHeader(buf, &g, &name_len).ok());
  buf[0] ^= 0xff;
  EXPECT_TRUE(!DecodeFrameHeader(buf, &g, &name_len).ok());
  h.pad = kMaxPadBytes - 1;
  EncodeFrameHeader(h, 4, buf);
  EXPECT_OK(DecodeFrameHeader(buf, &g, &name_len));
  EXPECT_EQ(int{g.pad}, kMaxPadBytes - 1);
  h.pad = kMaxPadBytes;
  EncodeFrameHeader(h, 4, buf);
  EXPECT_TRUE(!DecodeFrameHeader(buf, &g, &name_len).ok());
  h.pad = 0;
  h.kind = FrameKind::kTraits;  // a CPU mask of at most 1 KiB
  h.payload_bytes = kMaxTraitsBytes;
  EncodeFrameHeader(h, 4, buf);
  EXPECT_OK(DecodeFrameHeader(buf, &g, &name_len));
  h.payload_bytes = kMaxTraitsBytes + 1;
  EncodeFrameHeader(h, 4, buf);
  EXPECT_TRUE(!DecodeFrameHeader(buf, &g, &name_len).ok());
}

TEST(Wire, PayloadsFromEveryOffsetWithinACacheLine) {
  // Large payloads are padded into line with the sender's memory: every offset (and, through the name
  // length, every header length) gives a different pad, and the receiver must skip exactly that many.
  const int n = 3;
  auto engines = StartCluster(n);
  RunRanks(n, [&](int r) {
    for (int64_t count : {int64_t{5001}, int64_t{70001}}) {  // the star's and the ring's sizes
      for (int k = 0; k < 16; ++k) {
        const int shift = (k + 5 * r) % 16;  // int32 elements: 0-60 bytes, different on each worker
        std::vector<int32_t> storage(count + 16);
        int32_t* buf = storage.data() + shift;
        for (int64_t i = 0; i < count; ++i) buf[i] = static_cast<int32_t>(31 * i + 1000 * r);
        const std::string name = "pad" + std::string(k, 'x');
        EXPECT_OK(engines[r]->AllReduceSync(buf, buf, count, DType::kInt32, ReduceOp::kSum, name));
        int bad = 0;
        for (int64_t i = 0; i < count && bad < 3; ++i) {
          if (buf[i] != static_cast<int32_t>(n * 31 * i + 1000 * (n * (n - 1) / 2))) ++bad;
        }
        EXPECT_EQ(bad, 0);
      }
    }
  });
}

}  // namespace
}  // namespace kungfu
