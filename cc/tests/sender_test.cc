// The sender thread (cc/transport/sender.h): it writes a payload beside its caller and wakes it when
// done, gives a job back promptly when aborted (also while the reader has stalled and the socket is
// full), and an engine with it on fails a collective whose payload it is writing to a stalled peer at
// the deadline without touching the caller's buffer afterwards (ASan checks that in cc-test-sanitize).
// The whole suite also runs with the sender on everywhere (KUNGFU_SEND_THREAD=1, see the Makefile).
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <dirent.h>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/fake_rank.h"
#include "cc/tests/testing.h"
#include "cc/transport/sender.h"
#include "cc/transport/socket.h"

namespace kungfu {
namespace {

using Clock = std::chrono::steady_clock;

struct Pair {
  Fd writer, reader;
};

Pair NonBlockingPair() {
  int fds[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return {};
  Pair p{Fd(fds[0]), Fd(fds[1])};
  ::fcntl(p.writer.get(), F_SETFL, ::fcntl(p.writer.get(), F_GETFL) | O_NONBLOCK);
  return p;
}

void SetPayload(Sender::Job* job, int fd, const std::vector<char>& data) {
  job->fd = fd;
  job->data = data.data();
  job->len = data.size();
}

bool WaitDone(const Sender::Job& job, double seconds) {
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (!job.done.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return job.done.load();
}

TEST(Sender, WritesAPayloadBesideTheCallerAndWakesIt) {
  Pair p = NonBlockingPair();
  ASSERT_TRUE(p.writer.valid());
  std::vector<char> data(8 << 20);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 3);
  std::vector<char> got(data.size());
  std::atomic<int> wakes{0};
  Sender sender([&] { ++wakes; }, 200);
  Sender::Job job;
  SetPayload(&job, p.writer.get(), data);
  ASSERT_TRUE(sender.Start(&job));  // before the reader starts, so a failure leaves no thread behind
  std::thread reader([&] {
    size_t n = 0;
    while (n < got.size()) {
      const ssize_t k = ::read(p.reader.get(), got.data() + n, got.size() - n);
      if (k <= 0) break;  // EOF: the writer was closed below
      n += static_cast<size_t>(k);
    }
  });
  EXPECT_TRUE(WaitDone(job, 10));
  sender.Abort(&job);  // a no-op when done; otherwise the sender lets go of the socket first
  p.writer = Fd();     // so a reader still waiting for bytes that never came sees EOF, not a hang
  reader.join();
  EXPECT_EQ(job.written, static_cast<uint64_t>(data.size()));
  EXPECT_EQ(job.error, 0);
  EXPECT_TRUE(got == data);
  EXPECT_TRUE(wakes.load() >= 1);
  sender.Stop();
  Sender::Job late;
  SetPayload(&late, p.reader.get(), data);
  EXPECT_TRUE(!sender.Start(&late));  // after Stop the caller writes for itself (nothing is written here)
}

TEST(Sender, AbortTakesBackAJobWhoseReaderStalled) {
  Pair p = NonBlockingPair();
  ASSERT_TRUE(p.writer.valid());
  std::vector<char> data(64 << 20, 1);  // far more than the socket buffers: it blocks
  Sender sender([] {}, 200);
  Sender::Job job;
  SetPayload(&job, p.writer.get(), data);
  ASSERT_TRUE(sender.Start(&job));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(!job.done.load());
  const auto t0 = Clock::now();
  sender.Abort(&job);
  EXPECT_TRUE(Clock::now() - t0 < std::chrono::seconds(1));
  EXPECT_TRUE(job.done.load());
  EXPECT_TRUE(job.written > 0 && job.written < job.len);
  sender.Abort(&job);  // a second abort of a finished job returns at once
}

TEST(Sender, AWriteErrorFinishesTheJobWithItsErrno) {
  Pair p = NonBlockingPair();
  ASSERT_TRUE(p.writer.valid());
  p.reader = Fd();  // closed: the send fails with EPIPE (no SIGPIPE: MSG_NOSIGNAL)
  std::vector<char> data(1 << 20, 1);
  Sender sender([] {}, 0);
  Sender::Job job;
  SetPayload(&job, p.writer.get(), data);
  ASSERT_TRUE(sender.Start(&job));
  EXPECT_TRUE(WaitDone(job, 10));
  EXPECT_EQ(job.error, EPIPE);
}

TEST(Config, SendThreadFromTheEnvironment) {
  const char* was = std::getenv("KUNGFU_SEND_THREAD");  // the suite's second pass sets it
  const std::string saved = was ? was : "";
  EngineConfig c;
  EXPECT_EQ(c.send_thread, -1);
  for (const char* v : {"1", "0", "-1"}) {
    setenv("KUNGFU_SEND_THREAD", v, 1);
    EXPECT_OK(ApplyEnvOverrides(&c));
    EXPECT_EQ(c.send_thread, std::atoi(v));
  }
  for (const char* bad : {"yes", "0.5", "2", "-2"}) {
    setenv("KUNGFU_SEND_THREAD", bad, 1);
    EXPECT_EQ(CodeName(ApplyEnvOverrides(&c).code()), CodeName(Code::kInvalidArgument));
  }
  if (was) {
    setenv("KUNGFU_SEND_THREAD", saved.c_str(), 1);
  } else {
    unsetenv("KUNGFU_SEND_THREAD");
  }
}

int SenderThreads() {
  int n = 0;
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string name;
    std::getline(comm, name);
    n += name == "kf_send" ? 1 : 0;
  }
  ::closedir(dir);
  return n;
}

// On: one sender per engine, whatever the machine. Off: none. Auto (-1): where this process may run on
// at least two cores per worker on the host (here every worker is on 127.0.0.1).
TEST(Sender, StartsWhereConfiguredOrWhereCoresAreToSpare) {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  ASSERT_TRUE(sched_getaffinity(0, sizeof(cpus), &cpus) == 0);
  const int before = SenderThreads();
  for (int setting : {1, 0, -1}) {
    auto engines = testing::StartCluster(2, [&](EngineConfig& c) { c.send_thread = setting; });
    const int want = setting == 1 || (setting == -1 && CPU_COUNT(&cpus) >= 4) ? 2 : 0;
    EXPECT_EQ(SenderThreads() - before, want);
    // And the collectives are right either way: a ring whose pieces go to the sender when it is on.
    testing::RunRanks(2, [&](int r) {
      std::vector<float> x((4 << 20) / 4 + 1, static_cast<float>(r + 1));
      testing::Waiter w;
      engines[r]->AllReduce(x.data(), x.data(), static_cast<int64_t>(x.size()), DType::kFloat32, ReduceOp::kSum,
                            "ring", w.Callback());
      EXPECT_OK(w.Wait());
      EXPECT_EQ(x.front(), 3.0f);
      EXPECT_EQ(x.back(), 3.0f);
    });
  }
}

// Rank 1 (a fake) does not read: rank 0's ring piece fills the socket and waits in the sender. At the
// deadline the collective fails, and the sender must have let go of the caller's buffer by the time the
// callback runs: the buffer is freed right after it, and then the fake reads, so a sender still writing
// from it would read freed memory (ASan reports it; checked by removing the Abort from CancelOp).
TEST(Sender, ACollectiveFailsAtItsDeadlineWhileItsPayloadWaitsInTheSender) {
  const PeerList peers = testing::LoopbackPeers(2);
  testing::FakeRank fake1;
  auto engine = testing::StartBesideFakeRank1(peers, &fake1, [](EngineConfig& c) {
    c.send_thread = 1;
    c.timeout_seconds = 0.5;
  });
  ASSERT_OK(engine.status());
  Status s;
  {
    std::vector<float> x((64 << 20) / 4, 1.0f);
    testing::Waiter w;
    engine.value()->AllReduce(x.data(), x.data(), static_cast<int64_t>(x.size()), DType::kFloat32, ReduceOp::kSum,
                              "stalled", w.Callback());
    s = w.Wait();
  }  // x is freed here
  EXPECT_EQ(CodeName(s.code()), CodeName(Code::kDeadlineExceeded));
  // Now the fake reads: the rest of the frame cut short goes out, from the engine's own copy of it. A
  // sender still holding the freed x would read it here.
  const auto drain_until = Clock::now() + std::chrono::milliseconds(500);
  std::vector<char> sink(1 << 20);
  while (Clock::now() < drain_until) {
    pollfd p{fake1.rank0_writes.get(), POLLIN, 0};
    if (::poll(&p, 1, 50) == 1 && ::read(fake1.rank0_writes.get(), sink.data(), sink.size()) <= 0) break;
  }
  const auto t0 = Clock::now();
  engine.value().reset();  // shuts down with a payload still queued for the stalled peer: bounded
  EXPECT_TRUE(Clock::now() - t0 < std::chrono::seconds(5));
}

}  // namespace
}  // namespace kungfu
