// Peer-to-peer tests: save and request between N engines as threads in one process over loopback.
#include <atomic>
#include <chrono>
#include <numeric>
#include <thread>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"
#include "cc/wire.h"

namespace kungfu {
namespace {

using testing::RunRanks;
using testing::StartCluster;
using testing::Waiter;

// Waits for one request's completion.
struct Fetch {
  Waiter w;
  int64_t version = -2;  // -2: the callback has not run
  RequestCallback Callback() {
    DoneCallback d = w.Callback();
    return [this, d](const Status& s, int64_t v) {
      version = v;
      d(s);
    };
  }
};

Status RequestSync(Engine& e, int peer, const std::string& name, void* out, int64_t count, DType dtype,
                   int64_t* version, uint32_t sig = 0) {
  Fetch f;
  e.Request(peer, name, out, count, dtype, sig, f.Callback());
  Status s = f.w.Wait();
  *version = f.version;
  return s;
}

Status BarrierSync(Engine& e, const std::string& name) {
  Waiter w;
  e.Barrier(name, w.Callback());
  return w.Wait();
}

// Rank r's tensor: r * 1000000 + i (+ 7 * save), exact in float64 and int64.
std::vector<int64_t> Tensor(int rank, int64_t count, int save = 0) {
  std::vector<int64_t> v(count);
  for (int64_t i = 0; i < count; ++i) v[i] = rank * 1000000 + i + 7 * save;
  return v;
}

TEST(P2P, SaveAndRequestEveryRankNp1To4AllSizes) {
  // 4 KiB pieces: the 100000-element tensor goes in 196 pieces; 0 and 1 elements in one frame.
  const int64_t sizes[] = {0, 1, 1000, 100000};
  for (int n = 1; n <= 4; ++n) {
    auto engines = StartCluster(n, [](EngineConfig& c) { c.chunk_bytes = 4096; });
    RunRanks(n, [&](int r) {
      for (int save = 0; save < 2; ++save) {  // the second save replaces the first: version 1
        for (int64_t count : sizes) {
          auto mine = Tensor(r, count, save);
          int64_t v = -2;
          ASSERT_OK(engines[r]->Save("t" + std::to_string(count), mine.data(), count, DType::kInt64, 42, &v));
          EXPECT_EQ(v, save);
        }
        ASSERT_OK(BarrierSync(*engines[r], "saved" + std::to_string(save)));
        for (int peer = 0; peer < n; ++peer) {
          for (int64_t count : sizes) {
            std::vector<int64_t> got(count, -1);
            int64_t version = -2;
            EXPECT_OK(RequestSync(*engines[r], peer, "t" + std::to_string(count), got.data(), count, DType::kInt64,
                                  &version, 42));
            EXPECT_EQ(version, save);
            EXPECT_TRUE(got == Tensor(peer, count, save));
          }
        }
        ASSERT_OK(BarrierSync(*engines[r], "fetched" + std::to_string(save)));  // nobody saves while others fetch
      }
    });
  }
}

TEST(P2P, NotFoundLeavesOutputUntouched) {
  auto engines = StartCluster(2);
  RunRanks(2, [&](int r) {
    for (int peer = 0; peer < 2; ++peer) {
      std::vector<float> out(5, 3.5f);
      int64_t version = -2;
      EXPECT_OK(RequestSync(*engines[r], peer, "never-saved", out.data(), 5, DType::kFloat32, &version));
      EXPECT_EQ(version, -1);
      EXPECT_TRUE(out == std::vector<float>(5, 3.5f));
    }
  });
}

TEST(P2P, MismatchIsInvalidArgumentNamingBothSides) {
  auto engines = StartCluster(2);
  std::vector<float> saved(12, 1.f);
  ASSERT_OK(engines[1]->Save("w", saved.data(), 12, DType::kFloat32, 7));
  struct Case {
    int64_t count;
    DType dtype;
    uint32_t sig;
    const char* words;
  } cases[] = {{10, DType::kFloat32, 7, "asked for 10 float32"},
               {12, DType::kInt32, 7, "asked for 12 int32"},
               {12, DType::kFloat32, 8, "shape signature 0x00000008"}};
  for (int peer : {0, 1}) {  // rank 1 answers rank 0 over the network and itself locally
    Engine& e = *engines[peer == 1 ? 0 : 1];
    for (const Case& c : cases) {
      std::vector<float> out(c.count, -1.f);
      int64_t version = -2;
      Status s = RequestSync(e, 1, "w", out.data(), c.count, c.dtype, &version, c.sig);
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      EXPECT_TRUE(s.message().find("request 'w'") != std::string::npos);
      EXPECT_TRUE(s.message().find("saved 12 float32 elements") != std::string::npos);
      EXPECT_TRUE(s.message().find(c.words) != std::string::npos);
      if (s.message().find(c.words) == std::string::npos) std::fprintf(stderr, "    %s\n", s.message().c_str());
      EXPECT_TRUE(out == std::vector<float>(c.count, -1.f));
    }
  }
}

TEST(P2P, BadArgumentsFailAtOnce) {
  auto engines = StartCluster(2);
  float x = 0;
  int64_t version = 0;
  EXPECT_EQ(CodeName(RequestSync(*engines[0], 2, "w", &x, 1, DType::kFloat32, &version).code()),
            CodeName(Code::kInvalidArgument));
  EXPECT_EQ(CodeName(RequestSync(*engines[0], -1, "w", &x, 1, DType::kFloat32, &version).code()),
            CodeName(Code::kInvalidArgument));
  EXPECT_EQ(CodeName(RequestSync(*engines[0], 1, "", &x, 1, DType::kFloat32, &version).code()),
            CodeName(Code::kInvalidArgument));
  EXPECT_EQ(CodeName(engines[0]->Save("", &x, 1, DType::kFloat32).code()), CodeName(Code::kInvalidArgument));
  EXPECT_EQ(CodeName(engines[0]->Save("w", nullptr, 1, DType::kFloat32).code()), CodeName(Code::kInvalidArgument));
}

TEST(P2P, ConcurrentRequestsFromEveryRankToOne) {
  const int n = 4, kPerRank = 40;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.chunk_bytes = 8192; });
  const int64_t count = 5000;  // 40 KB: 5 pieces each, interleaved across the three connections
  auto target = Tensor(0, count);
  ASSERT_OK(engines[0]->Save("model", target.data(), count, DType::kInt64));
  RunRanks(n, [&](int r) {
    if (r == 0) return;
    std::vector<std::vector<int64_t>> outs(kPerRank, std::vector<int64_t>(count, -1));
    std::vector<Fetch> fetches(kPerRank);
    for (int i = 0; i < kPerRank; ++i) {  // all in flight at once, same name
      engines[r]->Request(0, "model", outs[i].data(), count, DType::kInt64, 0, fetches[i].Callback());
    }
    for (int i = 0; i < kPerRank; ++i) {
      EXPECT_OK(fetches[i].w.Wait());
      EXPECT_EQ(fetches[i].version, 0);
      EXPECT_TRUE(outs[i] == target);
    }
  });
}

TEST(P2P, SaveRacingWithRequestsAlwaysGivesOneWholeVersion) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.chunk_bytes = 16384; });
  const int64_t count = 200000;  // 1.6 MB in 98 pieces: saves land while pieces are on the wire
  std::vector<double> first(count, 0.0);
  ASSERT_OK(engines[0]->Save("racy", first.data(), count, DType::kFloat64));
  std::atomic<bool> stop{false};
  std::thread saver([&] {
    std::vector<double> buf(count);
    for (int k = 1; !stop; ++k) {
      std::fill(buf.begin(), buf.end(), static_cast<double>(k));  // save k holds k everywhere: version k
      int64_t v = -1;
      EXPECT_OK(engines[0]->Save("racy", buf.data(), count, DType::kFloat64, 0, &v));
      EXPECT_EQ(v, k);
    }
  });
  int64_t last = -1, distinct = 0;
  for (int i = 0; i < 60; ++i) {
    std::vector<double> out(count, -1.0);
    int64_t version = -2;
    EXPECT_OK(RequestSync(*engines[1], 0, "racy", out.data(), count, DType::kFloat64, &version));
    const double want = static_cast<double>(version);
    int64_t bad = 0;
    for (double x : out) bad += x != want;
    EXPECT_EQ(bad, 0);  // never a mix of two saves, and the values are the version's
    EXPECT_TRUE(version >= last);
    if (version != last) ++distinct;
    last = version;
  }
  stop = true;
  saver.join();
  EXPECT_TRUE(distinct > 1);  // the saves really raced with the requests
}

TEST(P2P, RequestToClosedPeerFailsPromptlyNamingIt) {
  const int n = 3;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 30; });
  std::vector<float> x(10, 1.f);
  ASSERT_OK(engines[2]->Save("w", x.data(), 10, DType::kFloat32));
  engines[2].reset();  // closes every connection
  const auto t0 = std::chrono::steady_clock::now();
  for (int attempt = 0; attempt < 2; ++attempt) {  // the first may go out before the close is seen
    std::vector<float> out(10);
    int64_t version = 0;
    Status s = RequestSync(*engines[0], 2, "w", out.data(), 10, DType::kFloat32, &version);
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kUnavailable));
    EXPECT_TRUE(s.message().find("rank 2") != std::string::npos);
    EXPECT_TRUE(s.message().find("request 'w'") != std::string::npos);
    EXPECT_EQ(version, -1);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(secs < 10);  // far below the 30 s timeout
  // Requests to live peers still work.
  std::vector<float> y(3, 2.f), out(3);
  ASSERT_OK(engines[1]->Save("y", y.data(), 3, DType::kFloat32));
  int64_t version = -2;
  EXPECT_OK(RequestSync(*engines[0], 1, "y", out.data(), 3, DType::kFloat32, &version));
  EXPECT_TRUE(out == y);
}

// departed_ok (pair averaging's requests): a peer that announced it was finalizing and then closed
// answers "none", with the output untouched; without departed_ok, or from a peer that crashed (no
// notice), the request fails naming it.
TEST(P2P, DepartedPeerAnswersNoneOnlyWhenAskedTo) {
  const int n = 3;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 30; });
  std::vector<float> x(10, 1.f);
  ASSERT_OK(engines[2]->Save("w", x.data(), 10, DType::kFloat32));
  ASSERT_OK(engines[1]->Save("w", x.data(), 10, DType::kFloat32));
  engines[2]->Finalizing();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the notice arrives before the close
  engines[2].reset();                                              // no goodbye: a failed finalize wait
  engines[1]->Finalizing();
  // A plain request fails, naming the peer, once the close is seen (the first may have been answered by
  // a connection error while in flight); from then on a departed_ok request is answered at its start.
  std::vector<float> out(10);
  int64_t version = 0;
  Status s;
  for (int attempt = 0; attempt < 2 && s.ok(); ++attempt) {
    s = RequestSync(*engines[0], 2, "w", out.data(), 10, DType::kFloat32, &version);
  }
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kUnavailable));
  EXPECT_TRUE(s.message().find("rank 2") != std::string::npos);
  std::vector<float> mine(10, 5.f);
  Fetch none;
  engines[0]->Request(2, "w", mine.data(), 10, DType::kFloat32, 0, none.Callback(), /*departed_ok=*/true);
  EXPECT_OK(none.w.Wait());
  EXPECT_EQ(none.version, -1);
  EXPECT_TRUE(mine == std::vector<float>(10, 5.f));
  // Rank 1 is finalizing but still here: it still answers with its copy.
  Fetch f;
  engines[0]->Request(1, "w", out.data(), 10, DType::kFloat32, 0, f.Callback(), /*departed_ok=*/true);
  EXPECT_OK(f.w.Wait());
  EXPECT_EQ(f.version, 0);
  EXPECT_TRUE(out == x);
}

TEST(P2P, CrashedPeerFailsEvenWhenDepartedPeersAnswerNone) {
  const int n = 2;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 30; });
  engines[1].reset();  // no finalizing notice: a crash
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::vector<float> out(4);
    Fetch f;
    engines[0]->Request(1, "w", out.data(), 4, DType::kFloat32, 0, f.Callback(), /*departed_ok=*/true);
    Status s = f.w.Wait();
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kUnavailable));
  }
}

TEST(P2P, UnansweredRequestMissesItsDeadlineAndLateAnswerIsDropped) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 0.5; });
  std::vector<int32_t> x(100, 9);
  ASSERT_OK(engines[0]->Save("x", x.data(), 100, DType::kInt32));
  ASSERT_OK(engines[1]->Save("x", x.data(), 100, DType::kInt32));
  // Block rank 1's loop thread: the callback of its own request runs there and sleeps 1.5 s.
  std::atomic<bool> blocked{false};
  std::vector<int32_t> sink(100);
  Waiter slept;
  DoneCallback wake = slept.Callback();
  engines[1]->Request(0, "x", sink.data(), 100, DType::kInt32, 0, [&](const Status&, int64_t) {
    blocked = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    wake(Status::OK());
  });
  while (!blocked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::vector<int32_t> out(100, -1);
  int64_t version = 0;
  Status s = RequestSync(*engines[0], 1, "x", out.data(), 100, DType::kInt32, &version);
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
  EXPECT_TRUE(s.message().find("rank 1") != std::string::npos);
  EXPECT_TRUE(out == std::vector<int32_t>(100, -1));
  EXPECT_OK(slept.Wait());
  // Rank 1 answers the expired request late; the answer is dropped and the next request works.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_OK(RequestSync(*engines[0], 1, "x", out.data(), 100, DType::kInt32, &version));
  EXPECT_TRUE(out == x);
}

TEST(P2P, ResponseLargerThanTheFrameBoundGoesInPieces) {
  // 80 MB: more than kMaxPayloadBytes (64 MiB) in one tensor, sent in default 1 MiB pieces.
  auto engines = StartCluster(2);
  const int64_t count = 10 << 20;
  std::vector<int64_t> big(count);
  std::iota(big.begin(), big.end(), 5);
  ASSERT_OK(engines[1]->Save("big", big.data(), count, DType::kInt64));
  std::vector<int64_t> out(count, 0);
  int64_t version = -2;
  EXPECT_OK(RequestSync(*engines[0], 1, "big", out.data(), count, DType::kInt64, &version));
  EXPECT_EQ(version, 0);
  EXPECT_TRUE(out == big);
}

TEST(P2P, RequestRightAfterStartIsAnswered) {
  // Rank 0 starts first and retries connecting to rank 1 every 50 ms; rank 1 requests as soon as its own
  // start returns, often before rank 0's connection back to it exists: rank 0 answers once it does.
  const PeerList peers = testing::LoopbackPeers(2);
  std::vector<std::unique_ptr<Engine>> engines(2);
  std::vector<float> x = {1.f, 2.f, 3.f};
  std::thread first([&] {
    EngineConfig c;
    c.peers = peers;
    c.rank = 0;
    c.token = "t";
    c.timeout_seconds = 10;
    auto e = Engine::Start(c);
    if (e.ok()) engines[0] = std::move(e.value());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EngineConfig c;
  c.peers = peers;
  c.rank = 1;
  c.token = "t";
  c.timeout_seconds = 10;
  auto e = Engine::Start(c);
  ASSERT_OK(e.status());
  engines[1] = std::move(e.value());
  std::vector<float> out(3, 0.f);
  int64_t version = -2;
  EXPECT_OK(RequestSync(*engines[1], 0, "w", out.data(), 3, DType::kFloat32, &version));
  EXPECT_EQ(version, -1);  // nothing saved yet, but answered
  first.join();
  ASSERT_TRUE(engines[0] != nullptr);
  ASSERT_OK(engines[0]->Save("w", x.data(), 3, DType::kFloat32));
  EXPECT_OK(RequestSync(*engines[1], 0, "w", out.data(), 3, DType::kFloat32, &version));
  EXPECT_TRUE(out == x);
}

TEST(P2P, RequestAndResponseHeadersRoundTrip) {
  FrameHeader h;
  h.kind = FrameKind::kResponse;
  h.algo = Algo::kPeerToPeer;
  h.aux = static_cast<uint32_t>(P2PStatus::kMismatch);
  h.tag = 0xfffffffeu;                      // request id
  h.generation = (uint64_t{1} << 40) + 3;   // version
  h.count = 12;
  h.dtype = static_cast<uint8_t>(DType::kFloat32);
  uint8_t buf[kFrameHeaderSize];
  EncodeFrameHeader(h, 1, buf);
  FrameHeader g;
  uint32_t name_len = 0;
  ASSERT_OK(DecodeFrameHeader(buf, &g, &name_len));
  EXPECT_TRUE(g.kind == FrameKind::kResponse && g.algo == Algo::kPeerToPeer);
  EXPECT_EQ(g.aux, h.aux);
  EXPECT_EQ(g.tag, h.tag);
  EXPECT_EQ(g.generation, h.generation);
  buf[6] = kLastFrameKind + 1;  // a kind this protocol does not know
  EXPECT_TRUE(!DecodeFrameHeader(buf, &g, &name_len).ok());
}

}  // namespace
}  // namespace kungfu
