// A fake rank for tests that need frames no real engine would send: built from the engine's own
// handshake and frame encoding, it plays a rank over raw sockets beside a real rank 0 on loopback.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/engine.h"
#include "cc/transport/handshake.h"
#include "cc/transport/socket.h"
#include "cc/wire.h"

namespace kungfu::testing {

// The fake's ends of rank 0's two connections: rank 0 reads from `rank0_reads` and writes to
// `rank0_writes`. Both are invalid if anything failed.
struct FakeRank {
  Fd rank0_writes, rank0_reads;
};

// Plays rank `self` of `peers`: accepts rank 0's connection on its port and connects to rank 0, then
// sends its first frame (TRAITS: no preference, no CPU mask) unless send_traits is false, and reads rank 0's.
FakeRank ConnectFakeRank(const PeerList& peers, const HandshakeParams& hs, int self, bool send_traits = true);

// Rank 0 of `peers`, a real engine with a 20 s timeout (tweak, if set, edits its config), and fake
// ranks 1 .. n-1 connected to it: (*fakes)[r] for rank r ((*fakes)[0] stays empty).
StatusOr<std::unique_ptr<Engine>> StartBesideFakeRanks(const PeerList& peers, std::vector<FakeRank>* fakes,
                                                       const std::function<void(EngineConfig&)>& tweak = {});

// The same with 2 peers: fake rank 1 is *fake1.
StatusOr<std::unique_ptr<Engine>> StartBesideFakeRank1(const PeerList& peers, FakeRank* fake1,
                                                       const std::function<void(EngineConfig&)>& tweak = {});

// The bytes of one frame: header, name, no pad, then h.payload_bytes of payload filled with 1.0f.
std::vector<uint8_t> EncodeFrame(const FrameHeader& h, const std::string& name);

}  // namespace kungfu::testing
