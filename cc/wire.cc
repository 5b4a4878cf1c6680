#include "cc/wire.h"

#include <cstring>

namespace kungfu {

namespace {
// The engine only runs on little-endian hosts (x86-64, aarch64), so memcpy is the encoding.
template <typename T>
void Put(uint8_t* out, size_t off, T v) {
  std::memcpy(out + off, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* in, size_t off) {
  T v;
  std::memcpy(&v, in + off, sizeof(T));
  return v;
}
}  // namespace

const char* AlgoName(Algo a) {
  switch (a) {
    case Algo::kAllReduceStar: return "allreduce/star";
    case Algo::kAllReduceRing: return "allreduce/ring";
    case Algo::kBroadcastStar: return "broadcast/star";
    case Algo::kBroadcastChain: return "broadcast/chain";
    case Algo::kAllGather: return "allgather";
    case Algo::kAllReduceDoubling: return "allreduce/doubling";
    case Algo::kPeerToPeer: return "p2p";
    case Algo::kAllReduceHalving: return "allreduce/halving";
  }
  return "unknown";
}

// Layout: magic u32 @0, version u16 @4, kind u8 @6, dtype u8 @7, algo u8 @8, pad u8 @9, (unused) @10..11,
// aux u32 @12, cluster_version u32 @16, name_len u32 @20, tag u32 @24, shape_sig u32 @28,
// generation u64 @32, count i64 @40, offset i64 @48, payload_bytes u64 @56.
void EncodeFrameHeader(const FrameHeader& h, uint32_t name_len, uint8_t* out) {
  std::memset(out, 0, kFrameHeaderSize);
  Put<uint32_t>(out, 0, kFrameMagic);
  Put<uint16_t>(out, 4, kProtocolVersion);
  Put<uint8_t>(out, 6, static_cast<uint8_t>(h.kind));
  Put<uint8_t>(out, 7, h.dtype);
  Put<uint8_t>(out, 8, static_cast<uint8_t>(h.algo));
  Put<uint8_t>(out, 9, h.pad);
  Put<uint32_t>(out, 12, h.aux);
  Put<uint32_t>(out, 16, h.cluster_version);
  Put<uint32_t>(out, 20, name_len);
  Put<uint32_t>(out, 24, h.tag);
  Put<uint32_t>(out, 28, h.shape_sig);
  Put<uint64_t>(out, 32, h.generation);
  Put<int64_t>(out, 40, h.count);
  Put<int64_t>(out, 48, h.offset);
  Put<uint64_t>(out, 56, h.payload_bytes);
}

Status DecodeFrameHeader(const uint8_t* in, FrameHeader* h, uint32_t* name_len) {
  if (Get<uint32_t>(in, 0) != kFrameMagic) return InvalidArgument("bad frame magic (not a KungFu peer?)");
  const uint16_t version = Get<uint16_t>(in, 4);
  if (version != kProtocolVersion) {
    return InvalidArgument("peer speaks protocol version " + std::to_string(version) + ", this engine " +
                           std::to_string(kProtocolVersion));
  }
  const uint8_t kind = Get<uint8_t>(in, 6);
  if (kind < 1 || kind > kLastFrameKind) return InvalidArgument("bad frame kind " + std::to_string(kind));
  h->kind = static_cast<FrameKind>(kind);
  h->dtype = Get<uint8_t>(in, 7);
  const uint8_t algo = Get<uint8_t>(in, 8);
  if (algo < 1 || algo > kLastAlgo) return InvalidArgument("bad algorithm id " + std::to_string(algo));
  h->algo = static_cast<Algo>(algo);
  h->pad = Get<uint8_t>(in, 9);
  if (h->pad >= kMaxPadBytes) return InvalidArgument("frame pad of " + std::to_string(h->pad) + " bytes out of bounds");
  h->aux = Get<uint32_t>(in, 12);
  h->cluster_version = Get<uint32_t>(in, 16);
  *name_len = Get<uint32_t>(in, 20);
  h->tag = Get<uint32_t>(in, 24);
  h->shape_sig = Get<uint32_t>(in, 28);
  h->generation = Get<uint64_t>(in, 32);
  h->count = Get<int64_t>(in, 40);
  h->offset = Get<int64_t>(in, 48);
  h->payload_bytes = Get<uint64_t>(in, 56);
  if (*name_len == 0 || *name_len > kMaxNameBytes) {
    return InvalidArgument("frame name length " + std::to_string(*name_len) + " out of bounds");
  }
  if (h->payload_bytes > kMaxPayloadBytes) {
    return InvalidArgument("frame payload of " + std::to_string(h->payload_bytes) + " bytes exceeds the bound of " +
                           std::to_string(kMaxPayloadBytes));
  }
  // Frames that hold no data are bounded more tightly: an abort's text to 4 KiB, traits to 1 KiB, and
  // acks and requests carry none.
  if ((h->kind == FrameKind::kAbort && h->payload_bytes > kMaxAbortBytes) ||
      (h->kind == FrameKind::kTraits && h->payload_bytes > kMaxTraitsBytes) ||
      ((h->kind == FrameKind::kAck || h->kind == FrameKind::kRequest) && h->payload_bytes > 0)) {
    return InvalidArgument("frame of kind " + std::to_string(kind) + " with a payload of " +
                           std::to_string(h->payload_bytes) + " bytes");
  }
  if (h->count < 0 || h->count > kMaxElements || h->offset < 0 || h->offset > h->count) {
    return InvalidArgument("frame element count/offset out of bounds");
  }
  return Status::OK();
}

std::string EncodeStartedByName(const StartedByName& started) {
  std::string out;
  for (const auto& [name, count] : started) {
    const size_t at = out.size();
    if (at + 12 + name.size() > kMaxPayloadBytes) return std::string();
    out.resize(at + 12 + name.size());
    auto* p = reinterpret_cast<uint8_t*>(out.data()) + at;
    Put<uint32_t>(p, 0, static_cast<uint32_t>(name.size()));
    Put<uint64_t>(p, 4, count);
    std::memcpy(p + 12, name.data(), name.size());
  }
  return out;
}

Status DecodeStartedByName(const char* data, uint64_t bytes, StartedByName* out) {
  out->clear();
  const auto* p = reinterpret_cast<const uint8_t*>(data);
  uint64_t at = 0;
  while (at < bytes) {
    if (bytes - at < 12) return InvalidArgument("started-by-name payload: a truncated entry");
    const uint32_t len = Get<uint32_t>(p, at);
    const uint64_t count = Get<uint64_t>(p, at + 4);
    if (len == 0 || len > kMaxNameBytes || bytes - at - 12 < len) {
      return InvalidArgument("started-by-name payload: a name of " + std::to_string(len) + " bytes out of bounds");
    }
    (*out)[std::string(data + at + 12, len)] = count;
    at += 12 + len;
  }
  return Status::OK();
}

}  // namespace kungfu
