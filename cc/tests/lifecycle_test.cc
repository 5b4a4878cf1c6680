// Peers that leave, die or stall: N ranks as threads in one process over loopback. A dead or stalled
// peer is an error within the deadline, and a clean leave (LeaveCleanly) fails nobody. What fails Start
// is in startup_test.cc; races made certain by a fake rank are in fake_rank_test.cc.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"
#include "cc/transport/event_loop.h"
#include "cc/transport/socket.h"

namespace kungfu {
namespace {

using testing::RunRanks;
using testing::StartCluster;
using testing::Waiter;

TEST(Errors, PeerThatLeavesFailsOthersPromptlyNamingIt) {
  const int n = 3;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 30; });
  const auto t0 = std::chrono::steady_clock::now();
  RunRanks(n, [&](int r) {
    if (r == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      engines[r].reset();  // leaves without joining the collective
      return;
    }
    std::vector<float> buf(1000, 1.f);
    Status s = engines[r]->AllReduceSync(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum, "x");
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kUnavailable));
    EXPECT_TRUE(s.message().find("rank 2") != std::string::npos);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(secs < 10);  // far below the 30 s timeout: the close was noticed, not waited out
}

// kungfu.finalize's pattern: one last collective, then every worker leaves cleanly as soon as its own
// part is done, after the star (np 3), recursive doubling and the ring (np 4): every worker gets the
// right values and nobody fails or waits out the deadline. In threads the race this guards against
// (a peer still finishing when another leaves) seldom happens by itself, so it passed here without the
// goodbye too; the next test makes that race certain.
TEST(Leave, CleanLeaveAfterTheLastCollectiveFailsNoPeer) {
  struct Case {
    int n;
    int64_t ring_threshold;
    int64_t count;
  };
  for (const Case& k : {Case{3, 1 << 20, 1}, Case{4, 1 << 20, 1}, Case{4, 0, 4096}}) {
    for (int round = 0; round < 5; ++round) {
      auto engines = StartCluster(k.n, [&](EngineConfig& c) {
        c.timeout_seconds = 20;
        c.ring_threshold_bytes = k.ring_threshold;
        c.chunk_bytes = 1024;
      });
      RunRanks(k.n, [&](int r) {
        std::vector<float> buf(k.count, 1.f);
        Status s = engines[r]->AllReduceSync(buf.data(), buf.data(), k.count, DType::kFloat32, ReduceOp::kSum, "fin");
        EXPECT_OK(s);
        EXPECT_EQ(buf[k.count - 1], static_cast<float>(k.n));
        engines[r]->LeaveCleanly();
        engines[r].reset();
      });
    }
  }
}

// The same race, made certain. Recursive doubling at np 4 pairs 0-1 and 2-3, then 0-2 and 1-3. Rank 2's
// loop is held for 300 ms (a peer-to-peer answer from rank 3, whose callback sleeps there) before it
// reads rank 3's first-round data, while rank 3 joins late (100 ms), so ranks 1 and 3 finish and leave
// while rank 0 still waits for rank 2. Rank 0 must not take rank 1's exit for a failure.
TEST(Leave, PeerStillFinishingIsNotFailedByOneThatLeft) {
  const int n = 4;
  auto engines = StartCluster(n, [](EngineConfig& c) {
    c.timeout_seconds = 20;
    c.ring_threshold_bytes = 1 << 20;  // recursive doubling
  });
  RunRanks(n, [&](int r) {
    float x = 1;
    if (r == 3) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    Waiter fin;
    engines[r]->AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "fin", fin.Callback());
    if (r == 2) {  // answered by rank 3's loop before rank 3 joins, so ahead of its data on the wire
      float unused = 0;
      engines[r]->Request(3, "w", &unused, 1, DType::kFloat32, 0, [](const Status&, int64_t) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));  // holds rank 2's loop
      });
    }
    EXPECT_OK(fin.Wait());
    EXPECT_EQ(x, 4.f);
    engines[r]->LeaveCleanly();
    engines[r].reset();
  });
}

// The goodbye can sit behind much data the leaver sent: here rank 2's loop is held up until rank 1 has
// gathered 2 MiB to it and left, so all of it is still unread when rank 2 sees the close. Reading stops
// after a budget per call, and one call used to be all that was read before judging the close: the
// goodbye went unseen and the gather failed. The 64 KiB budget (4 MiB by default) makes that certain
// with a backlog that fits in the sockets' buffers once they have grown (the warm-up).
TEST(Leave, GoodbyeBehindManyMegabytesIsRead) {
  const int n = 3;
  const int64_t big = int64_t{2} << 20;
  auto engines = StartCluster(n, [](EngineConfig& c) {
    c.timeout_seconds = 20;
    c.read_budget_bytes = 64 << 10;
  });
  std::atomic<bool> left{false};
  RunRanks(n, [&](int r) {
    Engine* e = engines[r].get();
    std::vector<char> in(r == 1 ? big : 0, 7), out(big, 0);
    const std::vector<int64_t> counts = {0, big, 0};
    for (int i = 0; i < 3; ++i) {  // lets the sockets' buffers grow
      Waiter w;
      e->AllGather(in.data(), out.data(), counts, DType::kUInt8, "warm" + std::to_string(i), w.Callback());
      EXPECT_OK(w.Wait());
    }
    std::fill(out.begin(), out.end(), 0);
    Waiter gather, fin, hold;
    float x = 1;
    DoneCallback held = hold.Callback();
    e->AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "hold", [r, held, &left](const Status& s) {
      for (int i = 0; r == 2 && !left && i < 500; ++i) {  // rank 2's loop stops reading until rank 1 has left
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      held(s);
    });
    if (r != 1) {  // started before the hold ends, so rank 2 is ready for the data when it comes
      e->AllGather(in.data(), out.data(), counts, DType::kUInt8, "gather", gather.Callback());
      e->Barrier("fin", fin.Callback());
    }
    EXPECT_OK(hold.Wait());
    if (r == 1) {
      e->AllGather(in.data(), out.data(), counts, DType::kUInt8, "gather", gather.Callback());
      e->Barrier("fin", fin.Callback());
    }
    EXPECT_OK(gather.Wait());
    EXPECT_OK(fin.Wait());
    EXPECT_EQ(std::count(out.begin(), out.end(), 7), static_cast<std::ptrdiff_t>(big));
    if (r == 1) {
      e->LeaveCleanly();
      engines[r].reset();
      left = true;
    }
  });
  EXPECT_TRUE(left);
}

TEST(Leave, LaterCollectiveFailsAtOnceNamingTheLeaver) {
  const int n = 3;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 30; });
  const auto t0 = std::chrono::steady_clock::now();
  RunRanks(n, [&](int r) {
    float x = 1;
    EXPECT_OK(engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "fin"));
    if (r == 2) {
      engines[r]->LeaveCleanly();
      engines[r].reset();
      return;
    }
    // Started before or after the goodbye arrives: either way it can never finish, and says why.
    Status s = engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "after");
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kUnavailable));
    EXPECT_TRUE(s.message().find("rank 2") != std::string::npos);
    EXPECT_TRUE(s.message().find("left the cluster") != std::string::npos);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(secs < 10);  // not the 30 s timeout
}

// A worker that leaves its training loop early (sys.exit) finalizes: it announces that it starts no
// collective but the finalize barrier, and waits in that barrier. Its peers, waiting in a collective it
// never started, fail at once naming it (they used to wait out the timeout, as it did in the barrier),
// whether they started that collective before the announcement arrived or after; np 3 is the star,
// np 2 and 4 recursive doubling. Once they have failed and gone, the barrier fails at once too.
TEST(Leave, FinalizingPeerFailsTheCollectivesItNeverStarted) {
  for (int n : {2, 3, 4}) {
    auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 30; });
    const auto t0 = std::chrono::steady_clock::now();
    std::atomic<int> checked{0};  // the others leave only once all have failed (not on a closed connection)
    RunRanks(n, [&](int r) {
      float x = 1;
      EXPECT_OK(engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "step"));
      if (r == 1) {
        engines[r]->Finalizing();
        Status s = engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "kungfu/finalize");
        EXPECT_EQ(CodeName(s.code()), CodeName(Code::kUnavailable));  // the others left without joining
        engines[r].reset();
        return;
      }
      if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(200));  // starts after the news
      Status s = engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "step");
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kUnavailable));
      EXPECT_TRUE(s.message().find("rank 1") != std::string::npos);
      EXPECT_TRUE(s.message().find("finalize") != std::string::npos);
      ++checked;
      while (checked.load() < n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      engines[r].reset();
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(secs < 10);  // not the 30 s timeout
  }
}

// No false alarm: a worker that finalizes while the others still finish collectives it has finished
// (they are slow, or start them late) fails nobody, and every worker's barrier then succeeds.
TEST(Leave, FinalizingPeerFailsNothingItTookPartIn) {
  const int n = 3;
  auto engines = StartCluster(n, [](EngineConfig& c) {
    c.timeout_seconds = 20;
    c.ring_threshold_bytes = 0;  // the ring: rank 0 can finish before rank 2 has what it needs
    c.chunk_bytes = 1024;
  });
  RunRanks(n, [&](int r) {
    std::vector<float> buf(30000, 1.f);
    for (int step = 0; step < 3; ++step) {
      if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the slow one
      EXPECT_OK(engines[r]->AllReduceSync(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum,
                                          "step"));
    }
    EXPECT_EQ(buf[0], 27.f);  // 1 -> 3 -> 9 -> 27
    engines[r]->Finalizing();
    float one = 1;
    EXPECT_OK(engines[r]->AllReduceSync(&one, &one, 1, DType::kFloat32, ReduceOp::kSum, "kungfu/finalize"));
    engines[r]->LeaveCleanly();
    engines[r].reset();
  });
}

TEST(Errors, StalledPeerIsDeadlineExceeded) {
  const int n = 2;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 0.5; });
  std::vector<float> buf(10, 1.f);
  EXPECT_EQ(engines[0]->TimedOut(), false);
  Status s = engines[0]->AllReduceSync(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum, "stall");
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
  EXPECT_TRUE(s.message().find("stall") != std::string::npos);
  EXPECT_EQ(engines[0]->TimedOut(), true);  // kungfu.finalize then skips its barrier
  EXPECT_EQ(engines[1]->TimedOut(), false);
  RunRanks(n, [&](int r) {  // a collective that completes afterwards: recovered
    std::vector<float> ok(4, 1.f);
    EXPECT_OK(engines[r]->AllReduceSync(ok.data(), ok.data(), ok.size(), DType::kFloat32, ReduceOp::kSum, "ok"));
  });
  EXPECT_EQ(engines[0]->TimedOut(), false);
}

// A deadline's message names the workers a collective still waits for: rank 2 of 3 never joins. The star
// all-reduce's root names it; the other worker says it waits for the root, which waits for everyone.
TEST(Errors, StalledPeerIsNamedInTheDeadlineMessage) {
  const int n = 3;
  auto engines = StartCluster(n, [](EngineConfig& c) {
    c.timeout_seconds = 0.5;
    c.ring_threshold_bytes = int64_t{1} << 26;  // the star, on 3 workers
  });
  RunRanks(n - 1, [&](int r) {
    std::vector<float> in(4, 1.f), out(4 * n);
    Status s = engines[r]->AllReduceSync(in.data(), out.data(), 4, DType::kFloat32, ReduceOp::kSum, "stalled");
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
    const std::string want = r == 0 ? "waiting for rank 2" : "sent its part to rank 0";
    EXPECT_EQ(s.message().find(want) != std::string::npos, true);
    Waiter w;
    engines[r]->AllGather(in.data(), out.data(), std::vector<int64_t>(n, 4), DType::kFloat32, "gathered",
                          w.Callback());
    s = w.Wait();
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
    EXPECT_EQ(s.message().find("received 4 of 8 elements; waiting for rank 2") != std::string::npos, true);
    Waiter b;
    engines[r]->Broadcast(in.data(), 4, DType::kFloat32, 0, "broadcast", b.Callback());
    s = b.Wait();
    EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
    if (r == 0) EXPECT_EQ(s.message().find("of 2 acknowledgements; waiting for rank 2") != std::string::npos, true);
  });
}

// Cancel fails the collective in flight under a name, with the status given, and the peers' too: here
// rank 1 starts it only after rank 0 cancelled it, and fails at once from the abort waiting for it.
TEST(Errors, CancelFailsTheCollectiveHereAndAtThePeers) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 20; });
  const auto t0 = std::chrono::steady_clock::now();
  float x = 1, y = 1;
  Waiter first;
  engines[0]->AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "c", first.Callback());
  engines[0]->Cancel("c", InvalidArgument("another part failed"));
  engines[0]->Cancel("none in flight", InvalidArgument("ignored"));
  Status s = first.Wait();
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
  EXPECT_TRUE(s.message().find("another part failed") != std::string::npos);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the abort reaches rank 1 first
  s = engines[1]->AllReduceSync(&y, &y, 1, DType::kFloat32, ReduceOp::kSum, "c");
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
  EXPECT_TRUE(s.message().find("reported by peer") != std::string::npos);
  RunRanks(2, [&](int r) {  // the connections are fine
    float z = 1;
    EXPECT_OK(engines[r]->AllReduceSync(&z, &z, 1, DType::kFloat32, ReduceOp::kSum, "after"));
  });
  EXPECT_TRUE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10);
}

// A collective that timed out on one worker fails on the late one too, rather than completing there
// from what the first had sent before its deadline: every worker sees the same outcome.
TEST(Errors, ATimeoutFailsTheCollectiveAtALatePeerToo) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 0.5; });
  float x = 1, y = 2;
  Status first = engines[0]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "late");
  EXPECT_EQ(CodeName(first.code()), CodeName(Code::kDeadlineExceeded));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 1 comes after the deadline and the abort
  Status s = engines[1]->AllReduceSync(&y, &y, 1, DType::kFloat32, ReduceOp::kSum, "late");
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
  EXPECT_TRUE(s.message().find("reported by peer") != std::string::npos);
  RunRanks(2, [&](int r) {  // and they go on together
    float z = 1;
    EXPECT_OK(engines[r]->AllReduceSync(&z, &z, 1, DType::kFloat32, ReduceOp::kSum, "after"));
  });
}

// Time the loop was not run (a stopped process) is what a read of the clock comes later than allowed:
// the sleep the loop asked for, plus a slack of a second; nothing while it could sleep without limit.
TEST(Stop, StallMeterCountsOnlyWhatIsLatePastTheSlack) {
  using std::chrono::milliseconds;
  const auto t0 = StallMeter::Clock::time_point() + std::chrono::hours(1);
  const auto zero = StallMeter::Clock::duration(0);
  StallMeter m;
  EXPECT_TRUE(m.Read(t0) == zero);  // the first read has nothing to compare with
  m.Asked(20);
  EXPECT_TRUE(m.Read(t0 + milliseconds(1000)) == zero);  // 980 ms late: within the slack
  m.Asked(20);
  EXPECT_TRUE(m.Read(t0 + milliseconds(9020)) == milliseconds(8000));  // stopped 8 s past the 20 ms asked
  EXPECT_TRUE(m.Read(t0 + milliseconds(9500)) == zero);  // work between two reads, within the slack
  EXPECT_TRUE(m.Read(t0 + milliseconds(12500)) == milliseconds(3000));  // stopped in the middle of work
  m.Asked(-1);
  EXPECT_TRUE(m.Read(t0 + std::chrono::hours(2)) == zero);  // idle, nothing to time out: never counted
  m.Asked(1000);
  EXPECT_TRUE(m.Read(t0 + std::chrono::hours(2) + milliseconds(2000)) == zero);
}

namespace {
// Holds e's loop for `hold`: a collective of its own that it cancels, whose callback runs on the
// loop thread and sleeps there, as if the process were stopped. Returns once the hold has begun.
void HoldLoop(Engine& e, const std::string& name, std::chrono::milliseconds hold) {
  auto begun = std::make_shared<std::atomic<bool>>(false);
  static float unused = 0;
  e.AllReduce(&unused, &unused, 1, DType::kFloat32, ReduceOp::kSum, name, [begun, hold](const Status&) {
    *begun = true;
    std::this_thread::sleep_for(hold);
  });
  e.Cancel(name, Cancelled("holding the loop"));
  while (!*begun) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}
}  // namespace

// Every worker stopped for longer than the timeout (Ctrl-Z to kfrun): the collective and the request in
// flight on rank 1 do not time out when the workers go on, since neither loop ran meanwhile. Rank 0's loop
// is held first (it cannot answer rank 1's request), then rank 1's, with its collective and request in
// flight, both for 2.5 s against a 1.5 s timeout; then rank 0 joins the collective.
TEST(Stop, TimeNotRunDoesNotCountAgainstTheDeadline) {
  const auto hold = std::chrono::milliseconds(2500);
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 1.5; });
  float w = 7;
  EXPECT_OK(engines[0]->Save("w", &w, 1, DType::kFloat32));
  HoldLoop(*engines[0], "hold0", hold);
  float got = 0, x = 1;
  Waiter req, coll;
  engines[1]->Request(0, "w", &got, 1, DType::kFloat32, 0, [&](const Status& s, int64_t) { req.Callback()(s); });
  engines[1]->AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "x", coll.Callback());
  HoldLoop(*engines[1], "hold1", hold);
  std::this_thread::sleep_for(hold);  // rank 0's hold is over
  float y = 2;
  EXPECT_OK(engines[0]->AllReduceSync(&y, &y, 1, DType::kFloat32, ReduceOp::kSum, "x"));
  EXPECT_OK(coll.Wait());
  EXPECT_OK(req.Wait());
  EXPECT_EQ(x, 3.f);
  EXPECT_EQ(y, 3.f);
  EXPECT_EQ(got, 7.f);
}

// One worker stopped alone: its peer saw no gap and times out on it as before, at its own deadline;
// the stopped one, going on, fails the collective too (the peer's abort).
TEST(Stop, APeerNotStoppedStillTimesOutOnTheStoppedOne) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 1; });
  HoldLoop(*engines[1], "hold", std::chrono::milliseconds(2500));
  const auto t0 = std::chrono::steady_clock::now();
  float x = 1, y = 1;
  Status s = engines[0]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "x");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
  EXPECT_TRUE(secs < 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(1700));  // rank 1's hold is over, the abort read
  s = engines[1]->AllReduceSync(&y, &y, 1, DType::kFloat32, ReduceOp::kSum, "x");
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
  EXPECT_TRUE(s.message().find("reported by peer") != std::string::npos);
}

}  // namespace
}  // namespace kungfu
