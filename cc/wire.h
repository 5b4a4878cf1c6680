// The frame format between engines. Every frame is a fixed 64-byte header, the collective name,
// 0-63 zero bytes of pad, then the payload. All integers are little-endian. Lengths are bounded
// before any allocation.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "cc/status.h"

namespace kungfu {

constexpr uint32_t kFrameMagic = 0x474e464b;  // "KFNG"
// 2: adds the peer-to-peer REQUEST and RESPONSE frames (and their algorithm id).
// 3: adds the BYE frame.
// 4: adds allreduce by halving-doubling (its algorithm id).
// 5: adds the pad between the name and the payload.
// 6: adds the FINALIZING frame.
// 7: BYE and FINALIZING carry the sender's started counts by name (EncodeStartedByName).
// 8: adds the TRAITS frame.
constexpr uint16_t kProtocolVersion = 8;
constexpr size_t kFrameHeaderSize = 64;
constexpr uint32_t kMaxNameBytes = 4096;
constexpr uint8_t kMaxPadBytes = 64;
constexpr uint64_t kMaxPayloadBytes = uint64_t{64} << 20;  // pieces are at most chunk_bytes
constexpr int64_t kMaxElements = int64_t{1} << 40;
constexpr uint64_t kMaxAbortBytes = 4096;  // an ABORT frame's text; ACK and REQUEST frames carry none
constexpr uint64_t kMaxTraitsBytes = 1024;  // a TRAITS frame's CPU mask (8192 CPUs)

enum class FrameKind : uint8_t {
  kData = 1,   // a piece of a collective's payload
  kAbort = 2,  // the sender failed this collective; tag = status code, payload = message
  kAck = 3,    // the sender finished its part (broadcast); no payload
  // Peer-to-peer (cc/p2p/): the same header layout, some fields read differently (P2PStatus below).
  kRequest = 4,   // asks for the receiver's saved copy of `name`; no payload. tag = request id;
                  // dtype, count and shape_sig: what the requester expects
  kResponse = 5,  // answers one request: tag = its id, aux = P2PStatus, generation = the copy's version;
                  // dtype, count, shape_sig: the copy's; offset and payload: one piece of its data
  kBye = 6,  // the sender leaves cleanly: everything it owed was sent before this frame, and it has nothing
             // in flight. generation = how many collectives it started; payload = how many times it
             // started each name (EncodeStartedByName), or none if that would not fit in a frame
  kFinalizing = 7,  // the sender has begun to finalize and starts no collective but the finalize barrier;
                    // generation and payload: what it started before, as for kBye
  kTraits = 8,  // the first frame on every connection: what the receiver needs to know of the sender to
                // pick algorithms as every other worker does. aux = its SmallAllReduce preference
                // (TraitsPreference); payload = the CPUs it may run on, as sched_getaffinity's mask
                // (bytes, CPU i is bit i % 8 of byte i / 8; none if unknown)
};
constexpr uint8_t kLastFrameKind = 8;

// aux of a TRAITS frame: the sender's EngineConfig::small_star.
enum class TraitsPreference : uint32_t {
  kAuto = 0,      // small_star -1: let the workers' CPUs decide
  kStar = 1,      // small_star 1
  kDoubling = 2,  // small_star 0
};

// Which collective algorithm produced the frame. Peers must agree; a mismatch is InvalidArgument.
enum class Algo : uint8_t {
  kAllReduceStar = 1,
  kAllReduceRing = 2,
  kBroadcastStar = 3,
  kBroadcastChain = 4,
  kAllGather = 5,
  kAllReduceDoubling = 6,
  kPeerToPeer = 7,  // REQUEST and RESPONSE frames
  kAllReduceHalving = 8,
};
constexpr uint8_t kLastAlgo = 8;

// aux of a RESPONSE frame.
enum class P2PStatus : uint32_t {
  kFound = 0,     // pieces of the data follow, in offset order (one frame, no payload, when empty)
  kNotFound = 1,  // nothing saved under the name; no payload
  kMismatch = 2,  // saved, but dtype/count/shape_sig differ from the request's; the header describes the copy
};
const char* AlgoName(Algo a);

struct FrameHeader {
  FrameKind kind = FrameKind::kData;
  uint8_t dtype = 0;
  Algo algo = Algo::kAllReduceStar;
  uint8_t pad = 0;               // zero bytes between the name and the payload, < kMaxPadBytes (see
                                 // Connection::Enqueue for why)
  uint32_t aux = 0;              // reduce op (allreduce), root (broadcast), own count check (allgather),
                                 // P2PStatus (response)
  uint32_t cluster_version = 0;  // membership version the sender works under
  uint32_t tag = 0;              // algorithm step; request id (p2p)
  uint32_t shape_sig = 0;        // hash of the sender's tensor shape (0: not checked)
  uint64_t generation = 0;       // how many times the sender had started this name before; the saved
                                 // copy's version (response)
  int64_t count = 0;             // the sender's element count for the whole collective
  int64_t offset = 0;            // element offset of this payload within the collective
  uint64_t payload_bytes = 0;
};

// Writes header + name length into out[kFrameHeaderSize].
void EncodeFrameHeader(const FrameHeader& h, uint32_t name_len, uint8_t* out);
// Parses and bounds-checks a header; *name_len receives the name length that follows it.
Status DecodeFrameHeader(const uint8_t* in, FrameHeader* h, uint32_t* name_len);

// The payload of BYE and FINALIZING: for each collective name, how many times the sender started it
// (its next generation of that name). Each entry is u32 name length, u64 count, then the name's bytes.
// Empty when it would exceed kMaxPayloadBytes; the engine sends none past 8 MiB (engine_leave.cc), and
// the receiver then has only the frame's total count.
using StartedByName = std::unordered_map<std::string, uint64_t>;
std::string EncodeStartedByName(const StartedByName& started);
Status DecodeStartedByName(const char* data, uint64_t bytes, StartedByName* out);

}  // namespace kungfu
