// Peer-to-peer requests: fetch the latest saved copy of a named tensor from one given peer without
// that peer's training step taking part (for pair averaging, AD-PSGD).
//
// Threading and ownership:
//  - The engine's loop thread owns a PeerToPeer and calls every method except ServeLocally.
//  - Serving: a REQUEST frame is answered by the receiving engine's loop thread straight from its
//    VariableStore. The response frames borrow the immutable saved copy (a shared_ptr held by the
//    connection until written), so a concurrent save never tears a response.
//  - Requesting: each request gets an id (the frame's tag), so any number may be in flight, several
//    for the same name. RESPONSE pieces are read straight into the caller's buffer; the callback runs
//    once, on the loop thread, when the last piece has arrived, the peer answers "not found", the
//    shapes differ, the peer goes away or the deadline passes.
//  - A request to this worker itself never touches the loop: ServeLocally copies on the caller's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/engine.h"
#include "cc/p2p/store.h"
#include "cc/transport/socket.h"
#include "cc/wire.h"

namespace kungfu {

// The engine, as seen by PeerToPeer (loop thread).
class P2PContext {
 public:
  virtual ~P2PContext() = default;
  virtual const EngineConfig& config() const = 0;
  // Queues a frame to dst, filling in the cluster version; keep holds data alive until it is written.
  // False when there is no connection to dst yet (a broken one drops the frame: the peer is failing).
  virtual bool SendFrame(int dst, FrameHeader h, const std::string& name, const void* data,
                         std::shared_ptr<const void> keep) = 0;
  // OK while peer is alive; otherwise why it is gone (Unavailable naming it).
  virtual Status PeerStatus(int peer) const = 0;
  // Whether peer has left or begun to leave the cluster (a goodbye, or a finalizing notice).
  virtual bool PeerDeparted(int peer) const = 0;
  // The connection from peer must no longer read into the buffer of this payload owner.
  virtual void AbandonTarget(int peer, uint64_t owner) = 0;
};

// One request, as the caller made it.
struct PeerRequest {
  int peer = 0;
  std::string name;
  void* out = nullptr;  // count elements; written only when the peer's copy is found and matches
  int64_t count = 0;
  DType dtype = DType::kUInt8;
  uint32_t shape_sig = 0;
  RequestCallback done;
  bool departed_ok = false;  // a departed peer answers "none" (Engine::Request)
};

class PeerToPeer {
 public:
  PeerToPeer(P2PContext* ctx, const VariableStore* store) : ctx_(ctx), store_(store) {}

  // Thread-safe, any thread: answers a request to this worker itself from store, on the calling thread.
  static void ServeLocally(const VariableStore& store, const std::string& self, PeerRequest r);

  // Sends the request to r.peer (another worker). Fails at once when the peer is gone.
  void Start(PeerRequest r);
  // Frames (kRequest, kResponse) from src.
  void OnRequest(int src, const FrameHeader& h, const std::string& name);
  char* PayloadTarget(int src, const FrameHeader& h, bool* discard, uint64_t* owner);
  void OnResponse(int src, const FrameHeader& h, const char* data);

  // Our connection to peer now exists: answer the requests that came before it.
  void OnConnected(int peer);
  // Fails every request to peer with why.
  void OnPeerGone(int peer, const Status& why);
  // Fails the requests whose deadline is at or before now.
  void ExpireOverdue(Deadline now);
  // Moves every request's deadline later by lost (time this process was not run).
  void Postpone(Clock::duration lost);
  // Fails every request (shutdown).
  void CancelAll(const Status& why);
  bool idle() const { return requests_.empty(); }

 private:
  struct InFlight {
    PeerRequest r;
    Deadline deadline;
    int64_t received = 0;  // payload bytes placed into r.out so far
    int64_t version = -1;  // from the first piece; every piece must agree
  };
  struct Deferred {       // a request that came before our connection back to its sender
    FrameHeader h;
    std::string name;
  };

  bool Serve(int src, const FrameHeader& req, const std::string& name);
  Status Accept(InFlight& f, const FrameHeader& h, const char* data, bool* complete);
  void Finish(uint32_t id, const Status& s);
  uint32_t NextId();
  std::string PeerName(int peer) const;

  P2PContext* ctx_;
  const VariableStore* store_;
  std::unordered_map<uint32_t, InFlight> requests_;  // by request id
  uint32_t next_id_ = 1;
  std::unordered_map<int, std::vector<Deferred>> deferred_;  // by sender rank
};

}  // namespace kungfu
