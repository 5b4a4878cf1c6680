#include "cc/p2p/p2p.h"

#include <algorithm>
#include <cstring>

#include "cc/log.h"

namespace kungfu {

namespace {
// Payload owners of request buffers, for Connection::AbandonTarget: the high bit keeps them apart
// from collective op ids, which count up from 1.
constexpr uint64_t kRequestOwner = uint64_t{1} << 63;
// Requests kept while our connection back to their sender is still being set up, per sender.
constexpr size_t kMaxDeferred = 1024;

std::string Describe(const PeerRequest& r) { return "request '" + r.name + "'"; }

int64_t ElementSize(uint8_t dtype) {
  return IsValidDType(dtype) ? static_cast<int64_t>(DTypeSize(static_cast<DType>(dtype))) : 0;
}
}  // namespace

void PeerToPeer::ServeLocally(const VariableStore& store, const std::string& self, PeerRequest r) {
  std::shared_ptr<const SavedCopy> copy = store.Get(r.name);
  if (!copy) return r.done(Status::OK(), -1);
  Status s = CheckRequestMatches(self, copy->count, copy->dtype, copy->shape_sig, r.count, r.dtype, r.shape_sig);
  if (!s.ok()) return r.done(s.WithContext(Describe(r)), -1);
  if (copy->bytes() > 0) std::memcpy(r.out, copy->data.get(), static_cast<size_t>(copy->bytes()));
  r.done(Status::OK(), copy->version);
}

std::string PeerToPeer::PeerName(int peer) const { return "peer " + ctx_->config().peers.Describe(peer); }

uint32_t PeerToPeer::NextId() {
  // 32-bit ids wrap after four billion requests; only the ones in flight must differ.
  while (next_id_ == 0 || requests_.count(next_id_)) ++next_id_;
  return next_id_++;
}

void PeerToPeer::Start(PeerRequest r) {
  Status gone = ctx_->PeerStatus(r.peer);
  if (!gone.ok() && r.departed_ok && ctx_->PeerDeparted(r.peer)) return r.done(Status::OK(), -1);
  if (!gone.ok()) return r.done(gone.WithContext(Describe(r)), -1);
  const uint32_t id = NextId();
  FrameHeader h;
  h.kind = FrameKind::kRequest;
  h.algo = Algo::kPeerToPeer;
  h.dtype = static_cast<uint8_t>(r.dtype);
  h.count = r.count;
  h.shape_sig = r.shape_sig;
  h.tag = id;
  const int peer = r.peer;
  const std::string name = r.name;
  requests_.emplace(id, InFlight{std::move(r), DeadlineAfter(ctx_->config().timeout_seconds)});
  if (!ctx_->SendFrame(peer, h, name, nullptr, nullptr)) {
    Finish(id, Unavailable("no connection to " + PeerName(peer)));
  }
}

void PeerToPeer::OnRequest(int src, const FrameHeader& h, const std::string& name) {
  if (!ctx_->PeerStatus(src).ok()) return;  // nobody to answer
  if (Serve(src, h, name)) return;
  auto& waiting = deferred_[src];
  if (waiting.size() >= kMaxDeferred) {
    KF_LOG(Warning) << "rank " << ctx_->config().rank << ": dropped a request for '" << name << "' from "
                    << PeerName(src) << ": too many wait for the connection back to it";
    return;
  }
  waiting.push_back(Deferred{h, name});
}

void PeerToPeer::OnConnected(int peer) {
  auto it = deferred_.find(peer);
  if (it == deferred_.end()) return;
  std::vector<Deferred> waiting = std::move(it->second);
  deferred_.erase(it);
  for (const Deferred& d : waiting) OnRequest(peer, d.h, d.name);
}

// Answers one request from the store. False (nothing sent) when there is no connection to src yet.
bool PeerToPeer::Serve(int src, const FrameHeader& req, const std::string& name) {
  FrameHeader h;
  h.kind = FrameKind::kResponse;
  h.algo = Algo::kPeerToPeer;
  h.tag = req.tag;
  std::shared_ptr<const SavedCopy> copy = store_->Get(name);
  if (!copy) {
    h.aux = static_cast<uint32_t>(P2PStatus::kNotFound);
    return ctx_->SendFrame(src, h, name, nullptr, nullptr);
  }
  h.dtype = static_cast<uint8_t>(copy->dtype);
  h.count = copy->count;
  h.shape_sig = copy->shape_sig;
  h.generation = static_cast<uint64_t>(copy->version);
  if (req.dtype != h.dtype || req.count != h.count || req.shape_sig != h.shape_sig) {
    h.aux = static_cast<uint32_t>(P2PStatus::kMismatch);  // the requester words the error: it has both sides
    return ctx_->SendFrame(src, h, name, nullptr, nullptr);
  }
  h.aux = static_cast<uint32_t>(P2PStatus::kFound);
  // Pieces of at most chunk_bytes (<= kMaxPayloadBytes), whole elements each; one empty frame when count is 0.
  const int64_t es = static_cast<int64_t>(DTypeSize(copy->dtype));
  const int64_t per_piece = std::max<int64_t>(1, ctx_->config().chunk_bytes / es);
  int64_t offset = 0;
  do {
    const int64_t n = std::min(per_piece, copy->count - offset);
    h.offset = offset;
    h.payload_bytes = static_cast<uint64_t>(n * es);
    const char* piece = n > 0 ? copy->data.get() + offset * es : nullptr;
    if (!ctx_->SendFrame(src, h, name, piece, copy)) return false;  // only the first can fail: same connection
    offset += n;
  } while (offset < copy->count);
  return true;
}

char* PeerToPeer::PayloadTarget(int src, const FrameHeader& h, bool* discard, uint64_t* owner) {
  auto it = requests_.find(h.tag);
  if (it == requests_.end() || it->second.r.peer != src) {  // a late piece of a request that ended
    *discard = true;
    return nullptr;
  }
  const PeerRequest& r = it->second.r;
  const int64_t es = ElementSize(h.dtype);
  const bool fits = h.aux == static_cast<uint32_t>(P2PStatus::kFound) &&
                    h.cluster_version == ctx_->config().peers.version() && h.dtype == static_cast<uint8_t>(r.dtype) &&
                    h.count == r.count && h.shape_sig == r.shape_sig && es > 0 && h.payload_bytes % es == 0 &&
                    static_cast<uint64_t>(h.offset * es) + h.payload_bytes <= static_cast<uint64_t>(r.count * es);
  if (!fits) return nullptr;  // read into a buffer of its own; OnResponse fails the request saying why
  *owner = kRequestOwner | h.tag;
  return static_cast<char*>(r.out) + h.offset * es;
}

void PeerToPeer::OnResponse(int src, const FrameHeader& h, const char* data) {
  auto it = requests_.find(h.tag);
  if (it == requests_.end() || it->second.r.peer != src) return;  // a late answer to a request that ended
  bool complete = false;
  Status s = Accept(it->second, h, data, &complete);
  if (!s.ok() || complete) Finish(h.tag, s);
}

// Checks one RESPONSE frame against its request and places its piece; *complete once all arrived.
Status PeerToPeer::Accept(InFlight& f, const FrameHeader& h, const char* data, bool* complete) {
  const PeerRequest& r = f.r;
  const std::string who = PeerName(r.peer);
  const uint32_t cluster = ctx_->config().peers.version();
  if (h.cluster_version != cluster) {
    return Aborted(who + " works under cluster version " + std::to_string(h.cluster_version) + ", this worker under " +
                   std::to_string(cluster));
  }
  switch (static_cast<P2PStatus>(h.aux)) {
    case P2PStatus::kNotFound:
      f.version = -1;
      *complete = true;
      return Status::OK();
    case P2PStatus::kMismatch: {
      Status s = CheckRequestMatches(who, h.count, static_cast<DType>(h.dtype), h.shape_sig, r.count, r.dtype,
                                     r.shape_sig);
      return s.ok() ? InvalidArgument(who + " reported a shape mismatch") : s;
    }
    case P2PStatus::kFound:
      break;
    default:
      return InvalidArgument(who + " sent an unknown response status " + std::to_string(h.aux));
  }
  RETURN_IF_ERROR(
      CheckRequestMatches(who, h.count, static_cast<DType>(h.dtype), h.shape_sig, r.count, r.dtype, r.shape_sig));
  const int64_t es = static_cast<int64_t>(DTypeSize(r.dtype));
  const int64_t begin = h.offset * es, bytes = static_cast<int64_t>(h.payload_bytes);
  if (bytes % es != 0 || begin + bytes > r.count * es) return InvalidArgument(who + " sent a piece outside the tensor");
  // Pieces come in offset order on one connection: one sent twice must not count as a missing one.
  if (begin != f.received) return InvalidArgument(who + " sent a piece out of order (twice?)");
  const int64_t version = static_cast<int64_t>(h.generation);
  if (f.version >= 0 && version != f.version) {
    return Internal(who + " sent pieces of versions " + std::to_string(f.version) + " and " + std::to_string(version));
  }
  f.version = version;
  char* dst = static_cast<char*>(r.out) + begin;
  if (bytes > 0 && data != dst) std::memcpy(dst, data, static_cast<size_t>(bytes));  // not read in place
  f.received += bytes;
  *complete = f.received == r.count * es;
  return Status::OK();
}

void PeerToPeer::Finish(uint32_t id, const Status& s) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  InFlight f = std::move(it->second);
  requests_.erase(it);
  ctx_->AbandonTarget(f.r.peer, kRequestOwner | id);  // no more bytes into r.out once done has run
  if (s.ok()) {
    f.r.done(s, f.version);
  } else {
    f.r.done(s.WithContext(Describe(f.r)), -1);
  }
}

void PeerToPeer::OnPeerGone(int peer, const Status& why) {
  deferred_.erase(peer);
  std::vector<uint32_t> ids;
  for (const auto& [id, f] : requests_) {
    if (f.r.peer == peer) ids.push_back(id);
  }
  const bool departed = ctx_->PeerDeparted(peer);
  for (uint32_t id : ids) {
    InFlight& f = requests_.at(id);
    if (departed && f.r.departed_ok) {  // "none"; out may hold part of a copy cut short (Engine::Request)
      f.version = -1;
      Finish(id, Status::OK());
    } else {
      Finish(id, why);
    }
  }
}

void PeerToPeer::ExpireOverdue(Deadline now) {
  std::vector<std::pair<uint32_t, Status>> expired;
  for (const auto& [id, f] : requests_) {
    if (now < f.deadline) continue;
    expired.emplace_back(id, DeadlineExceeded("timed out after " + FormatNumber(ctx_->config().timeout_seconds) +
                                              " s (KUNGFU_TIMEOUT) waiting for " + PeerName(f.r.peer) + "; received " +
                                              std::to_string(f.received) + " of " +
                                              std::to_string(f.r.count * static_cast<int64_t>(DTypeSize(f.r.dtype))) +
                                              " bytes"));
  }
  for (auto& [id, s] : expired) Finish(id, s);
}

void PeerToPeer::Postpone(Clock::duration lost) {
  for (auto& [id, f] : requests_) f.deadline += lost;
}

void PeerToPeer::CancelAll(const Status& why) {
  std::vector<uint32_t> ids;
  for (const auto& [id, f] : requests_) ids.push_back(id);
  for (uint32_t id : ids) Finish(id, why);
}

}  // namespace kungfu
