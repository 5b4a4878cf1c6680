#include "cc/tests/cluster.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include "cc/tests/testing.h"

namespace kungfu::testing {

std::vector<uint16_t> FreePorts(int n) {
  std::vector<int> fds;
  std::vector<uint16_t> ports;
  for (int i = 0; i < n; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ports.push_back(ntohs(addr.sin_port));
    fds.push_back(fd);  // hold all open so the n ports differ
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

PeerList LoopbackPeers(int n, uint32_t version) {
  std::vector<PeerID> peers;
  for (uint16_t p : FreePorts(n)) peers.push_back(PeerID{"127.0.0.1", p});
  return PeerList(peers, version);
}

std::vector<std::unique_ptr<Engine>> StartCluster(int n, const std::function<void(EngineConfig&)>& tweak) {
  const PeerList peers = LoopbackPeers(n);
  std::vector<std::unique_ptr<Engine>> engines(n);
  std::vector<Status> errors(n);
  RunRanks(n, [&](int r) {
    EngineConfig c;
    c.peers = peers;
    c.rank = r;
    c.token = "test-token";
    c.timeout_seconds = 10;
    // The suite runs twice (Makefile): as configured, and with the sender thread on everywhere.
    if (const char* v = std::getenv("KUNGFU_SEND_THREAD")) c.send_thread = std::atoi(v);
    // Recursive doubling on 2, 4, 8, ... workers whatever the machine's cores (tests of the star on those
    // set small_star); ranks as threads of one process would count as oversubscribed on few cores.
    c.small_star = 0;
    if (tweak) tweak(c);
    auto e = Engine::Start(c);
    if (e.ok()) {
      engines[r] = std::move(e.value());
    } else {
      errors[r] = e.status();
    }
  });
  for (int r = 0; r < n; ++r) {
    if (!errors[r].ok()) Fail(__FILE__, __LINE__, "rank " + std::to_string(r) + " failed to start: " + errors[r].ToString());
  }
  return engines;
}

void RunRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&fn, r] {
      try {
        fn(r);
      } catch (const AssertionAbort&) {
        // An ASSERT_* failed in this rank: already recorded; the thread ends, the others go on.
      }
    });
  }
  for (auto& t : threads) t.join();
}

DoneCallback Waiter::Callback() {
  return [this](const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = s;
    done_ = true;
    cv_.notify_all();
  };
}

Status Waiter::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  return status_;
}

}  // namespace kungfu::testing
