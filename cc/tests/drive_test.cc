// Blocking callers drive the engine themselves (Engine::RunAndWait, EventLoop::DriveUntil): the I/O and
// the callbacks run on the waiting thread, several such threads take turns, and the loop's own thread
// goes on with the rest (async collectives, peer-to-peer answers) once none drives.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"

namespace kungfu {
namespace {

using testing::RunRanks;
using testing::StartCluster;
using testing::Waiter;

// Runs one allreduce of x through RunAndWait and returns the id of the thread its callback ran on.
std::thread::id CallbackThread(Engine& e, float* x, Status* s) {
  std::atomic<bool> finished{false};
  std::thread::id where;
  e.RunAndWait(
      [&] {
        e.AllReduce(x, x, 1, DType::kFloat32, ReduceOp::kSum, "where", [&](const Status& st) {
          *s = st;
          where = std::this_thread::get_id();
          finished = true;
          e.WakeWaiters();
        });
      },
      [&] { return finished.load(); });
  return where;
}

TEST(Drive, TheWaitingThreadRunsTheCallback) {
  for (bool drives : {true, false}) {
    auto engines = StartCluster(2, [&](EngineConfig& c) { c.caller_drives = drives; });
    RunRanks(2, [&](int r) {
      for (int i = 0; i < 5; ++i) {
        float x = static_cast<float>(r + 1);
        Status s;
        const std::thread::id where = CallbackThread(*engines[r], &x, &s);
        EXPECT_OK(s);
        EXPECT_EQ(x, 3.f);
        // Driving, the caller runs it; sleeping, the loop's thread does.
        EXPECT_EQ(where == std::this_thread::get_id(), drives);
      }
    });
  }
}

// Four threads per worker, each with its own blocking collectives, started in a different order on
// every worker, plus one thread of async ones: they take turns driving and none waits for the others.
TEST(Drive, ThreadsOfOneWorkerTakeTurns) {
  const int n = 3, threads = 4, iters = 40;
  auto engines = StartCluster(n, [](EngineConfig& c) { c.timeout_seconds = 30; });
  RunRanks(n, [&](int r) {
    std::vector<std::thread> ts;
    for (int j = 0; j < threads; ++j) {
      const int t = (j + r) % threads;  // a rank-dependent order
      ts.emplace_back([&, t] {
        for (int i = 0; i < iters; ++i) {
          std::vector<float> buf(1 + 97 * t, static_cast<float>((r + 1) * (t + 1)));
          const std::string name = "t" + std::to_string(t);
          EXPECT_OK(engines[r]->AllReduceSync(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum,
                                              name));
          EXPECT_EQ(buf.back(), static_cast<float>((t + 1) * n * (n + 1) / 2));
        }
      });
    }
    ts.emplace_back([&] {
      for (int i = 0; i < iters; ++i) {
        Waiter w;
        int64_t x = r;
        engines[r]->AllReduce(&x, &x, 1, DType::kInt64, ReduceOp::kMax, "async", w.Callback());
        EXPECT_OK(w.Wait());
        EXPECT_EQ(x, n - 1);
      }
    });
    for (auto& th : ts) th.join();
  });
}

// Right after a blocking call (the loop's thread lingers, parked, in case another comes), an async
// collective and a peer-to-peer request that the other worker's loop must answer still complete.
TEST(Drive, AsyncWorkGoesOnAfterABlockingCall) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 10; });
  std::vector<int32_t> saved(1000, 7);
  ASSERT_OK(engines[1]->Save("w", saved.data(), saved.size(), DType::kInt32));
  for (int round = 0; round < 20; ++round) {
    RunRanks(2, [&](int r) {
      float x = 1;
      EXPECT_OK(engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "sync"));
      EXPECT_EQ(x, 2.f);
      if (r == 0) {
        std::vector<int32_t> got(saved.size(), 0);
        Waiter w;
        engines[0]->Request(1, "w", got.data(), got.size(), DType::kInt32, 0,
                            [d = w.Callback()](const Status& s, int64_t) { d(s); });
        EXPECT_OK(w.Wait());
        EXPECT_EQ(got.back(), 7);
      }
      Waiter w;
      float y = 2;
      engines[r]->AllReduce(&y, &y, 1, DType::kFloat32, ReduceOp::kSum, "async", w.Callback());
      EXPECT_OK(w.Wait());
      EXPECT_EQ(y, 4.f);
    });
  }
}

// A caller about to drive posts its collective without writing the loop's eventfd (EventLoop::Post): the
// first iteration a driver runs does not wait and takes what is posted. Wake-ups left: when the loop's
// thread stopped lingering between two calls (LeaveDrive must then make it look), rare back to back.
TEST(Drive, BlockingCallsNeedNoWakeUp) {
  auto engines = StartCluster(2);
  const int calls = 200;
  RunRanks(2, [&](int r) {
    float x = 1;
    EXPECT_OK(engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "first"));
    const int64_t before = engines[r]->stats().loop_wakes;
    for (int i = 0; i < calls; ++i) {
      x = 1;
      EXPECT_OK(engines[r]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "again"));
      EXPECT_EQ(x, 2.f);
    }
    const int64_t wakes = engines[r]->stats().loop_wakes - before;
    KF_CHECK_IMPL(wakes < calls / 4, "rank " << r << ": " << wakes << " wake-ups for " << calls << " blocking calls",
                  (void)0);
  });
}

// A collective started by the driving caller on another thread's behalf, and still in flight when
// the caller leaves, keeps its deadline: the loop's thread, whatever state it was left in, takes over.
TEST(Drive, WorkLeftInFlightByADriverStillTimesOut) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 0.5; });
  for (int round = 0; round < 3; ++round) {
    RunRanks(2, [&](int r) {
      if (r == 1) {  // joins "a" late, so that rank 0 drives meanwhile; never joins "lonely"
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        float x = 1;
        EXPECT_OK(engines[1]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "a"));
        return;
      }
      Waiter lonely;
      float y = 1;
      std::thread poster([&] {  // posts while rank 0's main thread drives its wait for "a"
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        engines[0]->AllReduce(&y, &y, 1, DType::kFloat32, ReduceOp::kSum, "lonely", lonely.Callback());
      });
      float x = 1;
      EXPECT_OK(engines[0]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "a"));
      poster.join();
      const auto t0 = std::chrono::steady_clock::now();
      Status s = lonely.Wait();
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
      EXPECT_TRUE(took < 3);
    });
  }
}

// A start() that takes a while (a group packing its buckets) lets what it already submitted go out with
// Progress(), although nothing drives the loop until it returns: here the peer finishes first.
TEST(Drive, ProgressSendsWhatAStartSubmittedSoFar) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 10; });
  std::atomic<bool> peer_done{false}, peer_done_during_start{false};
  RunRanks(2, [&](int r) {
    float x = 1;
    if (r == 1) {
      Waiter w;
      engines[1]->AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "p", [&, d = w.Callback()](const Status& s) {
        peer_done = true;
        d(s);
      });
      EXPECT_OK(w.Wait());
      EXPECT_EQ(x, 2.f);
      return;
    }
    std::atomic<bool> finished{false};
    Status result;
    engines[0]->RunAndWait(
        [&] {
          engines[0]->AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "p", [&](const Status& s) {
            result = s;
            finished = true;
            engines[0]->WakeWaiters();
          });
          for (int i = 0; i < 100 && !peer_done; ++i) {  // "packing", up to 1 s
            engines[0]->Progress();
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
          peer_done_during_start = peer_done.load();
        },
        [&] { return finished.load(); });
    EXPECT_OK(result);
    EXPECT_EQ(x, 2.f);
  });
  EXPECT_TRUE(peer_done_during_start.load());
}

// A caller driving its own wait sees a peer that goes away at once, not at the deadline.
TEST(Drive, BlockedCallerSeesADeadPeerPromptly) {
  auto engines = StartCluster(2, [](EngineConfig& c) { c.timeout_seconds = 30; });
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    engines[1].reset();  // closes without saying goodbye, as a crash would
  });
  const auto t0 = std::chrono::steady_clock::now();
  float x = 1;
  Status s = engines[0]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "never-joined");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  killer.join();
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kUnavailable));
  EXPECT_TRUE(took < 10);
}

}  // namespace
}  // namespace kungfu
