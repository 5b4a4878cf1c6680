// The frame format between engines. Every frame is a fixed 64-byte header, the collective name,
// then the payload. All integers are little-endian. Lengths are bounded before any allocation.
#pragma once

#include <cstdint>
#include <string>

#include "cc/status.h"

namespace kungfu {

constexpr uint32_t kFrameMagic = 0x474e464b;  // "KFNG"
constexpr uint16_t kProtocolVersion = 1;
constexpr size_t kFrameHeaderSize = 64;
constexpr uint32_t kMaxNameBytes = 4096;
constexpr uint64_t kMaxPayloadBytes = uint64_t{64} << 20;  // pieces are at most chunk_bytes
constexpr int64_t kMaxElements = int64_t{1} << 40;

enum class FrameKind : uint8_t {
  kData = 1,   // a piece of a collective's payload
  kAbort = 2,  // the sender failed this collective; tag = status code, payload = message
  kAck = 3,    // the sender finished its part (broadcast); no payload
};

// Which collective algorithm produced the frame. Peers must agree; a mismatch is InvalidArgument.
enum class Algo : uint8_t {
  kAllReduceStar = 1,
  kAllReduceRing = 2,
  kBroadcastStar = 3,
  kBroadcastChain = 4,
  kAllGather = 5,
  kAllReduceDoubling = 6,
};
const char* AlgoName(Algo a);

struct FrameHeader {
  FrameKind kind = FrameKind::kData;
  uint8_t dtype = 0;
  Algo algo = Algo::kAllReduceStar;
  uint32_t aux = 0;              // reduce op (allreduce), root (broadcast), own count check (allgather)
  uint32_t cluster_version = 0;  // membership version the sender works under
  uint32_t tag = 0;              // algorithm step
  uint32_t shape_sig = 0;        // hash of the sender's tensor shape (0: not checked)
  uint64_t generation = 0;       // how many times the sender had started this name before
  int64_t count = 0;             // the sender's element count for the whole collective
  int64_t offset = 0;            // element offset of this payload within the collective
  uint64_t payload_bytes = 0;
};

// Writes header + name length into out[kFrameHeaderSize].
void EncodeFrameHeader(const FrameHeader& h, uint32_t name_len, uint8_t* out);
// Parses and bounds-checks a header; *name_len receives the name length that follows it.
Status DecodeFrameHeader(const uint8_t* in, FrameHeader* h, uint32_t* name_len);

}  // namespace kungfu
