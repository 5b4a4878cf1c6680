// Engine::Impl's acceptor thread: it takes the connections that peers open to this worker's listener, runs
// their handshakes and hands the authenticated ones to the loop (engine.cc starts it and the connections).
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cc/engine_impl.h"
#include "cc/log.h"

namespace kungfu {

namespace {
constexpr int kRefusalLogSeconds = 5;
constexpr size_t kMaxOpenHandshakes = 64;
}  // namespace

// The acceptor takes connections on the listener and runs their handshakes, many at once: a
// ServerHandshaker each, all driven by one poll(), so that a client that connects and says nothing (a
// port scanner, a health check) or stalls mid-handshake delays no other. Each has min(timeout, 10 s) to
// finish; at most kMaxOpenHandshakes are open at once, and beyond that the oldest is dropped.
void Engine::Impl::AcceptLoop() {
  pthread_setname_np(pthread_self(), "kf_accept");
  struct Open {
    Fd fd;
    std::string from;
    Deadline deadline;
    std::unique_ptr<ServerHandshaker> hs;
  };
  std::deque<Open> open;
  std::vector<pollfd> pfds;
  const double limit = std::min(config_.timeout_seconds, 10.0);
  while (!stopping_) {
    pfds.assign(1, pollfd{listener_.get(), POLLIN, 0});
    int wait_ms = 100;
    for (const Open& o : open) {
      pfds.push_back(pollfd{o.fd.get(), POLLIN, 0});
      wait_ms = std::min(wait_ms, MillisLeft(o.deadline));
    }
    const int ready = ::poll(pfds.data(), pfds.size(), wait_ms);
    if (ready < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    // The handshakes first (pfds[1 + i] is open[i]'s), then the listener, which may add one.
    const Deadline now = Clock::now();
    std::deque<Open> still;
    for (size_t i = 0; i < open.size(); ++i) {
      Open& o = open[i];
      Status s;
      bool done = false;
      if (pfds[1 + i].revents != 0) s = o.hs->Advance(o.fd.get(), &done);
      if (s.ok() && !done && now >= o.deadline) {
        s = DeadlineExceeded("no handshake within " + FormatNumber(limit) + " s");
      }
      if (!s.ok()) {
        Refused(o.from, s);
      } else if (done) {
        Admit(std::move(o.fd), o.hs->rank());
      } else {
        still.push_back(std::move(o));
      }
    }
    open.swap(still);
    if (!(pfds[0].revents & POLLIN)) continue;
    Fd fd = AcceptNext();
    if (!fd.valid()) continue;
    if (open.size() >= kMaxOpenHandshakes) {
      Refused(open.front().from, ResourceExhausted("more than " + std::to_string(kMaxOpenHandshakes) +
                                                   " handshakes at once; the oldest was dropped"));
      open.pop_front();
    }
    std::string from = RemoteAddress(fd.get());
    open.push_back(Open{std::move(fd), std::move(from), DeadlineAfter(limit), std::make_unique<ServerHandshaker>(hs_)});
  }
}

// Acceptor thread: a connection that failed its handshake, logged at most once per kRefusalLogSeconds
// (another job's workers may knock on a reused port again and again).
void Engine::Impl::Refused(const std::string& from, const Status& why) {
  ++stats_.refused;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_refusal_log_ < std::chrono::seconds(kRefusalLogSeconds)) {
    ++refusals_unlogged_;
    return;
  }
  KF_LOG(Warning) << "rank " << config_.rank << " refused a connection from " << from << ": " << why.message()
                  << (refusals_unlogged_
                          ? " (and " + std::to_string(refusals_unlogged_) + " more since the last such message)"
                          : std::string());
  last_refusal_log_ = now;
  refusals_unlogged_ = 0;
}

// Acceptor thread: an authenticated connection from `peer`, handed to the loop.
void Engine::Impl::Admit(Fd fd, int peer) {
  TuneDataSocket(fd.get());
  if (!SetNonBlocking(fd.get(), true).ok()) return;
  auto shared = std::make_shared<Fd>(std::move(fd));
  loop_.Post([this, shared, peer] { AddConnection(std::move(*shared), peer, false); });
}

// Acceptor thread: the listener's next connection, or an invalid Fd when there was none to take. Out of
// file descriptors (EMFILE), say, the connection stays queued and poll() would report it again at once,
// so that is logged once and followed by a short wait rather than a spin.
Fd Engine::Impl::AcceptNext() {
  Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (fd.valid()) {
    accept_failing_ = false;
    return fd;
  }
  const int err = errno;
  if (err != EINTR && err != EAGAIN && err != ECONNABORTED) {
    if (!accept_failing_) {
      KF_LOG(Warning) << "rank " << rank() << ": accept failed: " << std::strerror(err);
    }
    accept_failing_ = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return fd;
}

}  // namespace kungfu
