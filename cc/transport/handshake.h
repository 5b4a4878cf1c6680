// The connection handshake: both ends prove they hold the job token without sending it.
//
//   client -> server  HELLO     magic, version, cluster version, client rank, client nonce, client id
//   server -> client  CHALLENGE server nonce, HMAC(token, "kungfu-server" | client nonce | server nonce |
//                               server rank)
//   client -> server  PROOF     HMAC(token, "kungfu-client" | server nonce | client nonce | hello fields)
//   server -> client  VERDICT   one byte: accepted, or the reason for refusal
//
// The server's MAC lets the client refuse an impostor; the client's MAC, compared in constant time,
// lets the server refuse a connection without the token. Nonces come from getrandom(2). The server's
// rank, under its MAC, lets the client refuse a worker of its own job that answers at another worker's
// address (two names of one host, each given the same port, lead one worker to the other, or to
// itself): it finds which rank signed, and sends no proof, so the server does not take the connection
// in. A server of handshake version 1 signs no rank, which the client recognises ("another build").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cc/peer.h"
#include "cc/status.h"
#include "cc/transport/socket.h"

namespace kungfu {

struct HandshakeParams {
  std::string token;
  uint32_t cluster_version = 0;
  const PeerList* peers = nullptr;  // server side: who may connect
  int self_rank = -1;               // server side: the rank it signs (must be set: Internal otherwise)
};

// Client side, on a freshly connected blocking socket. self_rank/self_id say who we are; expect_rank is
// the rank of the peer we dialed. AlreadyExists when another worker of the job answered there.
Status ClientHandshake(int fd, const HandshakeParams& params, int self_rank, const PeerID& self_id,
                       int expect_rank, Deadline deadline);

// The server side as a state machine that never blocks, so that one thread takes many handshakes at
// once and a silent or slow client holds up none of the others (the engine's acceptor). Each Advance
// reads what the socket holds, at most what the current message still lacks (never a byte past the
// PROOF: the client may send frames right after the VERDICT), and answers when a message is complete;
// the answers (64 bytes, then 1) go out with MSG_DONTWAIT and always fit a fresh socket's buffer.
class ServerHandshaker {
 public:
  explicit ServerHandshaker(const HandshakeParams& params);
  // OK with *done false: wants more bytes (poll fd for POLLIN); OK with *done true: accepted, rank() is
  // the authenticated peer's. An error (PermissionDenied, InvalidArgument, Unavailable) means refused or
  // broken: the client was told why where possible; close fd. Not called again after done or an error.
  Status Advance(int fd, bool* done);
  int rank() const { return rank_; }

 private:
  enum class Phase { kHelloHead, kHelloId, kProof };
  Status OnHello(int fd);
  Status OnProof(int fd, bool* done);

  const HandshakeParams& params_;
  Phase phase_ = Phase::kHelloHead;
  std::vector<uint8_t> buf_;  // the current message: want_ bytes, have_ of them read
  size_t want_ = 0, have_ = 0;
  std::vector<uint8_t> hello_raw_;  // the whole HELLO, as signed by the client's PROOF
  uint16_t hello_version_ = 0;
  uint32_t hello_cluster_version_ = 0, hello_rank_ = 0;
  std::string hello_id_;
  uint8_t challenge_[64] = {};  // server nonce, then its MAC
  int rank_ = -1;
};

// Server side, blocking until the deadline (a ServerHandshaker driven by poll): the rank of the
// authenticated peer, or PermissionDenied/InvalidArgument/Unavailable/DeadlineExceeded.
StatusOr<int> ServerHandshake(int fd, const HandshakeParams& params, Deadline deadline);

}  // namespace kungfu
