// Thin, Status-returning wrappers over BSD sockets. Every blocking call takes a deadline.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/peer.h"
#include "cc/status.h"

namespace kungfu {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline DeadlineAfter(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Listens on 0.0.0.0:port (all interfaces: the token, not the address, is the access control).
StatusOr<Fd> Listen(uint16_t port);
// Connects to peer, retrying refused connections until the deadline (the peer may still be starting).
StatusOr<Fd> ConnectWithRetry(const PeerID& peer, Deadline deadline);
// Blocking exact read/write with a deadline (used by the handshake only; the event loop is non-blocking).
Status ReadFull(int fd, void* buf, size_t len, Deadline deadline);
Status WriteFull(int fd, const void* buf, size_t len, Deadline deadline);
Status SetNonBlocking(int fd, bool on);
// TCP_NODELAY, large buffers: what every data connection wants.
void TuneDataSocket(int fd);
// "127.0.0.1:45678" of the remote end, for logs.
std::string RemoteAddress(int fd);

}  // namespace kungfu
