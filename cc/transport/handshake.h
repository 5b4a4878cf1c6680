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

#include <string>

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

// Server side: returns the rank of the authenticated peer, or PermissionDenied/InvalidArgument.
StatusOr<int> ServerHandshake(int fd, const HandshakeParams& params, Deadline deadline);

}  // namespace kungfu
