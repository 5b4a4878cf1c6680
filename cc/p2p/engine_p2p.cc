// Engine: the peer-to-peer API (Save, Request) and the engine's side of P2PContext. The protocol and
// the requests in flight are in p2p.cc; the store in store.cc.
#include <memory>

#include "cc/engine_impl.h"

namespace kungfu {

Status Engine::Save(const std::string& name, const void* data, int64_t count, DType dtype, uint32_t shape_sig,
                    int64_t* version) {
  return impl_->store().Save(name, data, count, dtype, shape_sig, version);
}

void Engine::Request(int peer, const std::string& name, void* out, int64_t count, DType dtype, uint32_t shape_sig,
                     RequestCallback done, bool departed_ok) {
  impl_->SubmitRequest(PeerRequest{peer, name, out, count, dtype, shape_sig, std::move(done), departed_ok});
}

namespace {
Status ValidateRequest(const PeerRequest& r, int size) {
  if (r.peer < 0 || r.peer >= size) {
    return InvalidArgument("peer " + std::to_string(r.peer) + " is not a rank of this cluster of size " +
                           std::to_string(size));
  }
  if (r.name.empty() || r.name.size() > kMaxNameBytes) {
    return InvalidArgument("a variable name must have 1 to " + std::to_string(kMaxNameBytes) + " bytes");
  }
  if (!IsValidDType(static_cast<uint8_t>(r.dtype))) return InvalidArgument("bad dtype");
  if (r.count < 0 || r.count > kMaxElements || (r.count > 0 && r.out == nullptr)) {
    return InvalidArgument("bad element count " + std::to_string(r.count));
  }
  return Status::OK();
}
}  // namespace

void Engine::Impl::SubmitRequest(PeerRequest r) {
  Status bad = ValidateRequest(r, size());
  if (!bad.ok()) return r.done(bad.WithContext("request '" + r.name + "'"), -1);
  if (r.peer == rank()) {
    return PeerToPeer::ServeLocally(store_, "rank " + std::to_string(rank()) + " (this worker)", std::move(r));
  }
  if (stopping_) return r.done(Cancelled("request '" + r.name + "': the engine is shutting down"), -1);
  // Counted until the callback returns, so that Shutdown waits for it like for a collective.
  ++requests_in_flight_;
  r.done = [this, done = std::move(r.done)](const Status& s, int64_t version) {
    done(s, version);
    --requests_in_flight_;
  };
  auto shared = std::make_shared<PeerRequest>(std::move(r));
  loop_.Post([this, shared] {
    if (stopping_) {  // may run on the thread that stopped the loop
      return shared->done(Cancelled("request '" + shared->name + "': the engine is shutting down"), -1);
    }
    p2p_.Start(std::move(*shared));
  });
}

bool Engine::Impl::SendFrame(int dst, FrameHeader h, const std::string& name, const void* data,
                             std::shared_ptr<const void> keep) {
  Connection* c = dst >= 0 && dst < size() ? out_[dst].get() : nullptr;
  if (c == nullptr) return false;
  if (c->broken()) return true;  // dropped: requests to dst fail through OnConnectionError
  h.cluster_version = config_.peers.version();
  c->EnqueueShared(h, name, data, std::move(keep));
  stats_.bytes_sent += static_cast<int64_t>(h.payload_bytes);
  if (!writing_[dst]) c->Flush(&sent_);
  return true;
}

Status Engine::Impl::PeerStatus(int peer) const { return dead_[peer]; }

bool Engine::Impl::PeerDeparted(int peer) const { return left_[peer] || finalizing_[peer] >= 0; }

void Engine::Impl::AbandonTarget(int peer, uint64_t owner) {
  if (in_[peer]) in_[peer]->AbandonTarget(owner);
}

}  // namespace kungfu
