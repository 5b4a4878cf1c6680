#include "cc/tests/fake_rank.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace kungfu::testing {

FakeRank ConnectFakeRank(const PeerList& peers, const HandshakeParams& hs, int self, bool send_traits) {
  FakeRank f;
  auto listener = Listen(peers.at(self).port);
  if (!listener.ok()) return f;
  pollfd pfd{listener.value().get(), POLLIN, 0};
  if (::poll(&pfd, 1, 10000) != 1) return f;
  Fd accepted(::accept4(listener.value().get(), nullptr, nullptr, SOCK_CLOEXEC));
  HandshakeParams as_self = hs;
  as_self.self_rank = self;  // the rank rank 0 dialed
  if (!ServerHandshake(accepted.get(), as_self, DeadlineAfter(10)).ok()) return f;
  auto out = ConnectWithRetry(peers.at(0), DeadlineAfter(10));
  if (!out.ok() || !ClientHandshake(out.value().get(), hs, self, peers.at(self), 0, DeadlineAfter(10)).ok()) return f;
  // Each side's first frame says what it runs on: the fake's, with no preference and no CPU mask (rank 0 then
  // decides alone), and rank 0's, read here so that a test's first read is what it provokes.
  FrameHeader traits;
  traits.kind = FrameKind::kTraits;
  traits.cluster_version = peers.version();
  const std::vector<uint8_t> frame = EncodeFrame(traits, "kungfu/traits");
  if (send_traits && !WriteFull(out.value().get(), frame.data(), frame.size(), DeadlineAfter(10)).ok()) return f;
  uint8_t head[kFrameHeaderSize];
  FrameHeader got;
  uint32_t name_len = 0;
  if (!ReadFull(accepted.get(), head, sizeof(head), DeadlineAfter(10)).ok() ||
      !DecodeFrameHeader(head, &got, &name_len).ok() || got.kind != FrameKind::kTraits) {
    return f;
  }
  std::vector<uint8_t> rest(name_len + got.pad + got.payload_bytes);
  if (!ReadFull(accepted.get(), rest.data(), rest.size(), DeadlineAfter(10)).ok()) return f;
  f.rank0_writes = std::move(accepted);
  f.rank0_reads = std::move(out.value());
  return f;
}

StatusOr<std::unique_ptr<Engine>> StartBesideFakeRanks(const PeerList& peers, std::vector<FakeRank>* fakes,
                                                       const std::function<void(EngineConfig&)>& tweak) {
  HandshakeParams hs;
  hs.token = "test-token";
  hs.peers = &peers;
  fakes->clear();
  fakes->resize(peers.size());
  std::vector<std::thread> threads;
  for (int r = 1; r < peers.size(); ++r) threads.emplace_back([&, r] { (*fakes)[r] = ConnectFakeRank(peers, hs, r); });
  EngineConfig c;
  c.peers = peers;
  c.token = "test-token";
  c.timeout_seconds = 20;
  c.small_star = 0;  // the frames tests send are recursive doubling's on any machine
  if (tweak) tweak(c);
  auto engine = Engine::Start(c);
  for (auto& t : threads) t.join();
  return engine;
}

StatusOr<std::unique_ptr<Engine>> StartBesideFakeRank1(const PeerList& peers, FakeRank* fake1,
                                                       const std::function<void(EngineConfig&)>& tweak) {
  std::vector<FakeRank> fakes;
  auto engine = StartBesideFakeRanks(peers, &fakes, tweak);
  *fake1 = std::move(fakes.at(1));
  return engine;
}

std::vector<uint8_t> EncodeFrame(const FrameHeader& h, const std::string& name) {
  std::vector<uint8_t> frame(kFrameHeaderSize + name.size() + h.payload_bytes);
  EncodeFrameHeader(h, static_cast<uint32_t>(name.size()), frame.data());
  std::copy(name.begin(), name.end(), frame.begin() + kFrameHeaderSize);
  // The payload follows the name, so it may be misaligned for float: copied in bytewise, not stored as floats.
  const float one = 1.f;
  for (uint64_t i = 0; i + sizeof(float) <= h.payload_bytes; i += sizeof(float)) {
    std::memcpy(frame.data() + kFrameHeaderSize + name.size() + i, &one, sizeof(float));
  }
  return frame;
}

}  // namespace kungfu::testing
