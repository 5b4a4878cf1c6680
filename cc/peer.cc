#include "cc/peer.h"

#include <cstdlib>

namespace kungfu {

StatusOr<PeerID> ParsePeerID(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) {
    return InvalidArgument("peer '" + s + "' is not of the form host:port");
  }
  const std::string port_text = s.substr(colon + 1);
  char* end = nullptr;
  const long port = std::strtol(port_text.c_str(), &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535) {
    return InvalidArgument("peer '" + s + "' has an invalid port '" + port_text + "'");
  }
  PeerID id;
  id.host = s.substr(0, colon);
  id.port = static_cast<uint16_t>(port);
  return id;
}

StatusOr<PeerList> PeerList::Parse(const std::string& s, uint32_t version) {
  std::vector<PeerID> peers;
  size_t start = 0;
  while (start <= s.size()) {
    const auto comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) {
      ASSIGN_OR_RETURN(PeerID id, ParsePeerID(item));
      for (const auto& p : peers) {
        if (p == id) return InvalidArgument("peer " + id.ToString() + " appears twice in the peer list");
      }
      peers.push_back(id);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (peers.empty()) return InvalidArgument("the peer list is empty");
  return PeerList(std::move(peers), version);
}

int PeerList::RankOf(const PeerID& p) const {
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (peers_[i] == p) return static_cast<int>(i);
  }
  return -1;
}

std::string PeerList::Describe(int rank) const {
  if (rank < 0 || rank >= size()) return "rank " + std::to_string(rank);
  return peers_[rank].ToString() + " (rank " + std::to_string(rank) + ")";
}

std::string PeerList::ToString() const {
  std::string out;
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (i) out += ",";
    out += peers_[i].ToString();
  }
  return out;
}

}  // namespace kungfu
