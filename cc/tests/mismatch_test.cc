// Collectives whose arguments differ across workers (count, shape, dtype, root, algorithm setting) fail
// with InvalidArgument on every worker, and bad arguments fail the call alone at once; the data held
// for a collective that fails is freed. N ranks as threads in one process over loopback.
#include <cstdint>
#include <string>
#include <vector>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"

namespace kungfu {
namespace {

using testing::RunRanks;
using testing::StartCluster;
using testing::Waiter;

TEST(Errors, HalvingSettingMismatchIsInvalidArgumentEverywhere) {
  // One worker with halving-doubling off runs the ring where the others halve: every worker must fail
  // the collective alike, and the message names both algorithms.
  const int n = 4;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.halving = c.rank != 3; });
  std::vector<std::string> messages(n);
  RunRanks(n, [&](int r) {
    std::vector<float> buf((1 << 20) / 4, 1.f);
    Status s = engines[r]->AllReduceSync(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum, "h");
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
    messages[r] = s.message();
  });
  // Rank 3 (it hears halving frames) or rank 0 (it hears rank 3's ring frames) saw the mismatch itself.
  bool named = false;
  for (const std::string& m : messages) {
    const bool ring = m.find("allreduce/ring") != std::string::npos;
    named = named || (ring && m.find("allreduce/halving") != std::string::npos);
  }
  if (!named) EXPECT_EQ(messages[0] + " | " + messages[3], "a message naming both algorithms");
}

TEST(Errors, CountMismatchIsInvalidArgumentEverywhere) {
  for (int64_t threshold : {int64_t{0}, int64_t{1} << 26}) {
    const int n = 4;
    auto engines = StartCluster(n, [&](EngineConfig& c) { c.ring_threshold_bytes = threshold; });
    RunRanks(n, [&](int r) {
      std::vector<float> buf(r == 2 ? 101 : 100, 1.f);
      Status s = engines[r]->AllReduceSync(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum, "m");
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      EXPECT_CONTAINS(s.message(), "allreduce 'm': ");
      // The same name works again afterwards with agreeing shapes.
      std::vector<float> ok(10, 1.f);
      EXPECT_OK(engines[r]->AllReduceSync(ok.data(), ok.data(), ok.size(), DType::kFloat32, ReduceOp::kSum, "m"));
      // From a name's second call on, errors say which call of it failed.
      s = engines[r]->AllReduceSync(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum, "m");
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      EXPECT_CONTAINS(s.message(), "allreduce 'm' (call 3): ");
    });
  }
}

// Arguments a peer would refuse on the wire fail the call alone, at once: before, a peer refused the
// frame and dropped the connection, so every later collective with this worker waited out the timeout.
TEST(Errors, BadNameOrCountFailsTheCallAloneAtOnce) {
  const int n = 3;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 20; });
  const auto t0 = std::chrono::steady_clock::now();
  RunRanks(n, [&](int r) {
    float x = 1;
    for (const std::string& bad : {std::string(5000, 'a'), std::string()}) {
      Status s = engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, bad);
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      EXPECT_TRUE(s.message().find("name must be 1 to 4096 bytes") != std::string::npos);
    }
    Waiter w;
    engines[r]->Broadcast(&x, -1, DType::kFloat32, 0, "negative", w.Callback());
    EXPECT_EQ(CodeName(w.Wait().code()), CodeName(Code::kInvalidArgument));
    ASSERT_OK(engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "ok"));
    EXPECT_EQ(x, 3.f);
  });
  EXPECT_TRUE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10);
}

// Data that arrives for a collective before this worker starts it is held in a bounded buffer. If the
// start then fails (a bad root here), that data must be freed: it used to stay, and the bound's room with it.
TEST(Errors, DataHeldForACollectiveThatFailsAtStartIsFreed) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.max_pending_bytes = 6000; });
  RunRanks(2, [&](int r) {
    std::vector<float> buf(1000, r == 0 ? 1.f : 0.f);  // 4,000 bytes: more than half the bound
    for (int step = 0; step < 3; ++step) {
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0's data comes first
      Waiter w;
      const int root = r == 1 && step == 0 ? 7 : 0;
      engines[r]->Broadcast(buf.data(), buf.size(), DType::kFloat32, root, "b" + std::to_string(step), w.Callback());
      Status s = w.Wait();
      if (step == 0) {
        EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      } else {
        EXPECT_OK(s);
      }
    }
  });
}

// Data past the pending bound fails the collective on every worker: rank 0, late, found rank 1's data
// dropped, but it sent its own before failing, and rank 1, which needed only that (recursive doubling),
// completed the allreduce that rank 0 failed.
TEST(Errors, PendingBoundOverflowFailsTheCollectiveEverywhere) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.max_pending_bytes = 1000; });
  RunRanks(2, [&](int r) {
    std::vector<float> in(1000, 1.f), out(1000, 0.f);  // 4,000 bytes: past the bound
    if (r == 0) {  // rank 1's data comes first (dropped frames are counted as received too)
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (engines[0]->stats().bytes_received < 4000 && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      // Not the give-up: that is the peer's timeout too, and its deadline would race rank 0's abort.
      EXPECT_TRUE(engines[0]->stats().bytes_received >= 4000);
    }
    Waiter w;
    engines[r]->AllReduce(in.data(), out.data(), in.size(), DType::kFloat32, ReduceOp::kSum, "over", w.Callback());
    Status s = w.Wait();
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kResourceExhausted));
  });
}

// Data held for a collective this worker never starts is let go when a peer's abort for it arrives (the
// root timed out and went on): it stayed for good, and a later collective found the bound full.
TEST(Errors, DataHeldForACollectiveAbortedElsewhereIsFreed) {
  auto engines = StartCluster(2, [](EngineConfig& c) {
    c.max_pending_bytes = 6000;
    c.timeout_seconds = 1;
  });
  RunRanks(2, [&](int r) {
    std::vector<float> buf(1000, 1.f);  // 4,000 bytes: more than half the bound
    if (r == 0) {
      Waiter w;
      engines[r]->Broadcast(buf.data(), buf.size(), DType::kFloat32, 0, "orphan", w.Callback());
      EXPECT_EQ(CodeName(w.Wait().code()), CodeName(Code::kDeadlineExceeded));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the abort has come
    }
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0's data comes first
    Waiter w;
    engines[r]->Broadcast(buf.data(), buf.size(), DType::kFloat32, 0, "later", w.Callback());
    EXPECT_OK(w.Wait());
  });
}

TEST(Errors, BroadcastCountMismatchIsInvalidArgumentEverywhere) {
  for (int64_t threshold : {int64_t{0}, int64_t{1} << 26}) {  // chain and star
    const int n = 4;
    auto engines = StartCluster(n, [&](EngineConfig& c) { c.ring_threshold_bytes = threshold; });
    for (int round = 0; round < 5; ++round) {
      RunRanks(n, [&](int r) {
        std::vector<int32_t> buf(r == 1 ? 3 : 2, r);
        Waiter w;
        engines[r]->Broadcast(buf.data(), buf.size(), DType::kInt32, 0, "b" + std::to_string(round), w.Callback());
        Status s = w.Wait();
        EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      });
    }
  }
}

TEST(Errors, SameCountOtherShapeIsInvalidArgumentEverywhere) {
  const int n = 3;
  auto engines = StartCluster(n);
  RunRanks(n, [&](int r) {
    std::vector<float> buf(6, 1.f);
    Waiter w;
    engines[r]->AllReduce(buf.data(), buf.data(), 6, DType::kFloat32, ReduceOp::kSum, "shape", w.Callback(),
                          r == 2 ? 0x1234 : 0x5678);
    Status s = w.Wait();
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
  });
}

TEST(Errors, DTypeMismatchIsInvalidArgumentEverywhere) {
  const int n = 3;
  auto engines = StartCluster(n);
  RunRanks(n, [&](int r) {
    std::vector<double> buf(8, 1.0);
    const DType d = r == 0 ? DType::kFloat64 : DType::kInt64;
    Status s = engines[r]->AllReduceSync(buf.data(), buf.data(), 8, d, ReduceOp::kSum, "dt");
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
  });
}

}  // namespace
}  // namespace kungfu
