#include "cc/collective/op.h"

#include <algorithm>

namespace kungfu {

Status Op::OnAck(OpContext*, int src, const FrameHeader&) {
  return InvalidArgument("unexpected acknowledgement from rank " + std::to_string(src));
}

FrameHeader MakeFrame(const FrameShape& s, uint32_t tag, int64_t offset, uint64_t payload_bytes, FrameKind kind) {
  FrameHeader h;
  h.kind = kind;
  h.algo = s.algo;
  h.dtype = static_cast<uint8_t>(s.dtype);
  h.aux = s.aux;
  h.count = s.count;
  h.tag = tag;
  h.offset = offset;
  h.payload_bytes = payload_bytes;
  return h;
}

namespace {

// What kind of collective an algorithm runs: workers that agree on it but not on the algorithm disagree on
// sizes or settings; workers that disagree on it gave one name to two different collectives.
int KindOf(Algo a) {
  switch (a) {
    case Algo::kAllReduceStar:
    case Algo::kAllReduceRing:
    case Algo::kAllReduceDoubling:
    case Algo::kAllReduceHalving: return 0;
    case Algo::kBroadcastStar:
    case Algo::kBroadcastChain: return 1;
    case Algo::kAllGather: return 2;
    case Algo::kPeerToPeer: return 3;
  }
  return -1;
}

}  // namespace

std::string RankList(const std::vector<int>& ranks) {
  if (ranks.empty()) return "no rank";
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  const size_t shown = std::min<size_t>(ranks.size(), 8);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > shown) out += " and " + std::to_string(ranks.size() - shown) + " more";
  return out;
}

Status CheckSameKind(const PeerList& peers, int src, Algo theirs, Algo mine) {
  if (KindOf(theirs) == KindOf(mine)) return Status::OK();
  return InvalidArgument("peer " + peers.Describe(src) + " runs " + AlgoName(theirs) + " under this name, this worker " +
                         AlgoName(mine) + ": one name for two different collectives (give each its own name)");
}

bool SameCollective(const FrameHeader& h, const FrameShape& s) {
  return h.algo == s.algo && h.dtype == static_cast<uint8_t>(s.dtype) && h.count == s.count && h.aux == s.aux;
}

Status CheckAgreement(const PeerList& peers, int src, const FrameHeader& h, const FrameShape& s,
                      const char* aux_name) {
  if (SameCollective(h, s)) return Status::OK();  // the common case builds no message
  const std::string who = "peer " + peers.Describe(src);
  if (Status kind = CheckSameKind(peers, src, h.algo, s.algo); !kind.ok()) return kind;
  if (h.algo != s.algo) {
    return InvalidArgument(who + " runs " + AlgoName(h.algo) + ", this worker " + AlgoName(s.algo) +
                           " (different sizes, or KUNGFU_RING_THRESHOLD, KUNGFU_CHUNK_BYTES or KUNGFU_HALVING"
                           " across workers?)");
  }
  if (h.dtype != static_cast<uint8_t>(s.dtype) || h.count != s.count) {
    const char* their = IsValidDType(h.dtype) ? DTypeName(static_cast<DType>(h.dtype)) : "unknown";
    return InvalidArgument(who + " has " + std::to_string(h.count) + " " + their + " elements, this worker " +
                           std::to_string(s.count) + " " + DTypeName(s.dtype));
  }
  auto text = [aux_name](uint32_t v) {  // a reduce op by its name ("sum"), anything else by its number
    if (std::string(aux_name) == "reduce op" && v <= 255 && IsValidReduceOp(static_cast<uint8_t>(v))) {
      return std::string(ReduceOpName(static_cast<ReduceOp>(v)));
    }
    return std::to_string(v);
  };
  return InvalidArgument(who + " has " + aux_name + " " + text(h.aux) + ", this worker " + text(s.aux));
}

}  // namespace kungfu
