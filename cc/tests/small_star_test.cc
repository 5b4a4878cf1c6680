// How the workers agree on the small-message allreduce of 2, 4, 8, ... workers (EngineConfig::small_star,
// ChooseSmallStar): each says what it asks for and which CPUs it may run on in its first frame (TRAITS).
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/fake_rank.h"
#include "cc/tests/testing.h"

namespace kungfu {
namespace {

using testing::LoopbackPeers;
using testing::RunRanks;
using testing::StartCluster;

// A CPU mask of the given CPUs.
std::string Mask(const std::vector<int>& cpus) {
  std::string m;
  for (int c : cpus) {
    if (m.size() <= static_cast<size_t>(c / 8)) m.resize(c / 8 + 1, '\0');
    m[c / 8] = static_cast<char>(static_cast<unsigned char>(m[c / 8]) | (1u << (c % 8)));
  }
  return m;
}

PeerList Peers(const std::vector<std::string>& hosts) {
  std::vector<PeerID> ids;
  for (size_t i = 0; i < hosts.size(); ++i) ids.push_back(PeerID{hosts[i], static_cast<uint16_t>(10000 + i)});
  return PeerList(ids, 0);
}

std::vector<WorkerTraits> Auto(const std::vector<std::string>& masks) {
  std::vector<WorkerTraits> t;
  for (const auto& m : masks) t.push_back(WorkerTraits{-1, m});
  return t;
}

TEST(SmallStar, ChosenWhereSomeHostHasMoreWorkersThanCpus) {
  const std::string two = Mask({0, 1}), sixteen = Mask({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
  // One host, 2 CPUs: 2 workers fit, 4 do not.
  EXPECT_TRUE(!ChooseSmallStar(Peers({"a", "a"}), Auto({two, two})));
  EXPECT_TRUE(ChooseSmallStar(Peers({"a", "a", "a", "a"}), Auto({two, two, two, two})));
  EXPECT_TRUE(!ChooseSmallStar(Peers({"a", "a", "a", "a"}), Auto({sixteen, sixteen, sixteen, sixteen})));
  // Workers bound to CPUs of their own fit; bound to one CPU together they do not (the union counts).
  EXPECT_TRUE(!ChooseSmallStar(Peers({"a", "a"}), Auto({Mask({0}), Mask({9})})));
  EXPECT_TRUE(ChooseSmallStar(Peers({"a", "a"}), Auto({Mask({3}), Mask({3})})));
  // Hosts by name: two hosts of 2 workers on 2 CPUs each fit; one short host is enough to choose the star.
  EXPECT_TRUE(!ChooseSmallStar(Peers({"a", "a", "b", "b"}), Auto({two, two, two, two})));
  EXPECT_TRUE(ChooseSmallStar(Peers({"a", "a", "b", "b"}), Auto({two, two, Mask({0}), Mask({0})})));
  // Unknown masks (empty) count as enough.
  EXPECT_TRUE(!ChooseSmallStar(Peers({"a", "a", "a", "a"}), Auto({"", "", "", ""})));
  EXPECT_TRUE(ChooseSmallStar(Peers({"a", "a", "a", "a"}), Auto({"", two, "", ""})));
  // Asked for: the star by anyone wins, then doubling by anyone, over what the CPUs say.
  std::vector<WorkerTraits> t = Auto({two, two, two, two});
  t[3].small_star = 0;
  EXPECT_TRUE(!ChooseSmallStar(Peers({"a", "a", "a", "a"}), t));
  t[1].small_star = 1;
  EXPECT_TRUE(ChooseSmallStar(Peers({"a", "a", "a", "a"}), t));
  t = Auto({sixteen, sixteen});
  t[0].small_star = 1;
  EXPECT_TRUE(ChooseSmallStar(Peers({"a", "a"}), t));
}

TEST(SmallStar, OwnCpuMaskHasACpu) {
  const std::string m = OwnCpuMask();
  int cpus = 0;
  for (unsigned char b : m) cpus += __builtin_popcount(b);
  EXPECT_TRUE(cpus >= 1);
  EXPECT_TRUE(m.empty() || m.back() != '\0');
}

// Each rank's small_star, by rank; then checks that every engine made the same choice, `want`, and that a
// small allreduce runs (a worker on the other algorithm would fail it with InvalidArgument).
void ExpectAgreed(const std::vector<int>& asked, bool want) {
  const int n = static_cast<int>(asked.size());
  auto engines = StartCluster(n, [&](EngineConfig& c) { c.small_star = asked[c.rank]; });
  ASSERT_EQ(static_cast<int>(engines.size()), n);
  RunRanks(n, [&](int r) {
    EXPECT_EQ(engines[r]->small_star(), want);
    std::vector<float> x(1024, static_cast<float>(r + 1)), y(1024);
    EXPECT_OK(engines[r]->AllReduceSync(x.data(), y.data(), 1024, DType::kFloat32, ReduceOp::kSum, "small"));
    EXPECT_EQ(y[1023], static_cast<float>(n * (n + 1) / 2));
  });
}

TEST(SmallStar, WorkersAgreeWhateverEachAsks) {
  ExpectAgreed({0, 0, 1, 0}, true);
  ExpectAgreed({0, 0}, false);
  ExpectAgreed({1, 1}, true);
  // Left to the CPUs: every rank is a thread of this process, on this process's CPUs.
  int cpus = 0;
  for (unsigned char b : OwnCpuMask()) cpus += __builtin_popcount(b);
  ExpectAgreed({-1, -1, -1, -1}, cpus < 4);
  ExpectAgreed({-1, 0, -1, -1}, false);
}

TEST(SmallStar, FromTheEnvironment) {
  EngineConfig c;
  EXPECT_EQ(c.small_star, -1);
  for (const char* v : {"1", "0", "-1"}) {
    setenv("KUNGFU_SMALL_STAR", v, 1);
    EXPECT_OK(ApplyEnvOverrides(&c));
    EXPECT_EQ(c.small_star, std::atoi(v));
  }
  for (const char* bad : {"yes", "0.5", "2", "-2"}) {
    setenv("KUNGFU_SMALL_STAR", bad, 1);
    EXPECT_EQ(CodeName(ApplyEnvOverrides(&c).code()), CodeName(Code::kInvalidArgument));
  }
  unsetenv("KUNGFU_SMALL_STAR");
}

// A peer that connects both ways but never sends its first frame fails Start at the deadline, named.
TEST(SmallStar, StartWaitsForEveryPeersTraitsUntilTheDeadline) {
  const PeerList peers = LoopbackPeers(2);
  HandshakeParams hs;
  hs.token = "test-token";
  hs.peers = &peers;
  testing::FakeRank fake;
  std::thread t([&] { fake = testing::ConnectFakeRank(peers, hs, 1, /*send_traits=*/false); });
  EngineConfig c;
  c.peers = peers;
  c.token = "test-token";
  c.timeout_seconds = 1;
  auto engine = Engine::Start(c);
  t.join();
  ASSERT_TRUE(!engine.ok());
  EXPECT_EQ(CodeName(engine.status().code()), CodeName(Code::kDeadlineExceeded));
  EXPECT_TRUE(engine.status().message().find("nothing came from rank 1") != std::string::npos);
}

// A peer whose connections close before its first frame came (it crashed just after start-up) fails
// Start at once, named, instead of at the deadline.
TEST(SmallStar, APeerGoneBeforeItsTraitsFailsStartAtOnce) {
  const PeerList peers = LoopbackPeers(2);
  HandshakeParams hs;
  hs.token = "test-token";
  hs.peers = &peers;
  std::thread t([&] {
    testing::FakeRank fake = testing::ConnectFakeRank(peers, hs, 1, /*send_traits=*/false);
    fake = testing::FakeRank{};  // closes both of its connections
  });
  EngineConfig c;
  c.peers = peers;
  c.token = "test-token";
  c.timeout_seconds = 20;
  const auto start = std::chrono::steady_clock::now();
  auto engine = Engine::Start(c);
  t.join();
  ASSERT_TRUE(!engine.ok());
  EXPECT_EQ(CodeName(engine.status().code()), CodeName(Code::kUnavailable));
  EXPECT_TRUE(engine.status().message().find("rank 1") != std::string::npos);
  EXPECT_TRUE(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

}  // namespace
}  // namespace kungfu
