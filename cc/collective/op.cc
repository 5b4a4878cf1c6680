#include "cc/collective/op.h"

namespace kungfu {

Status Op::OnAck(OpContext*, int src, const FrameHeader&) {
  return InvalidArgument("unexpected acknowledgement from rank " + std::to_string(src));
}

Status CheckAgreement(const PeerList& peers, int src, const FrameHeader& h, Algo algo, DType dtype, int64_t count,
                      uint32_t aux, const char* aux_name) {
  const std::string who = "peer " + peers.Describe(src);
  if (h.algo != algo) {
    return InvalidArgument(who + " runs " + AlgoName(h.algo) + ", this worker " + AlgoName(algo) +
                           " (different sizes or KUNGFU_RING_THRESHOLD across workers?)");
  }
  if (h.dtype != static_cast<uint8_t>(dtype) || h.count != count) {
    const char* their = IsValidDType(h.dtype) ? DTypeName(static_cast<DType>(h.dtype)) : "unknown";
    return InvalidArgument(who + " has " + std::to_string(h.count) + " " + their + " elements, this worker " +
                           std::to_string(count) + " " + DTypeName(dtype));
  }
  if (h.aux != aux) {
    return InvalidArgument(who + " has " + aux_name + " " + std::to_string(h.aux) + ", this worker " +
                           std::to_string(aux));
  }
  return Status::OK();
}

}  // namespace kungfu
