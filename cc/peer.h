// Cluster membership: who the peers are, in rank order, under which version.
//
// A PeerList is immutable and carries a version (KUNGFU_CLUSTER_VERSION). Membership is fixed for
// the life of a job in this version: nothing resizes a cluster yet. The version is reserved for
// resizing, which a later version adds (a resize would build a new PeerList with a higher version);
// today another version means a misconfigured launch: the handshake refuses a peer of another version
// (Start fails with Aborted), and a frame of another version fails the work it meets with Aborted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cc/status.h"

namespace kungfu {

struct PeerID {
  std::string host;  // IPv4 literal or hostname
  uint16_t port = 0;
  std::string ToString() const { return host + ":" + std::to_string(port); }
  bool operator==(const PeerID& o) const { return host == o.host && port == o.port; }
};

// Parses "host:port".
StatusOr<PeerID> ParsePeerID(const std::string& s);

class PeerList {
 public:
  PeerList() = default;
  PeerList(std::vector<PeerID> peers, uint32_t version) : peers_(std::move(peers)), version_(version) {}
  // Parses "h1:p1,h2:p2,..." (rank order). Rejects duplicates and an empty list.
  static StatusOr<PeerList> Parse(const std::string& s, uint32_t version);

  int size() const { return static_cast<int>(peers_.size()); }
  uint32_t version() const { return version_; }
  const PeerID& at(int rank) const { return peers_.at(rank); }
  // -1 when absent.
  int RankOf(const PeerID& p) const;
  // "127.0.0.1:10001 (rank 1)", for error messages.
  std::string Describe(int rank) const;
  std::string ToString() const;

 private:
  std::vector<PeerID> peers_;
  uint32_t version_ = 0;
};

}  // namespace kungfu
