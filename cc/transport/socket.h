// Thin, Status-returning wrappers over BSD sockets. Every blocking call takes a deadline.
#pragma once

#include <netinet/in.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
// Resolves a host name to its IPv4 addresses (the engine listens on IPv4 only), in the resolver's order,
// each once: 0 and *out filled, or getaddrinfo's EAI_* code. ResolveIPv4 asks getaddrinfo; tests pass
// ConnectWithRetry a resolver of their own.
using Resolver = std::function<int(const std::string& host, std::vector<in_addr>* out)>;
int ResolveIPv4(const std::string& host, std::vector<in_addr>* out);
// Connects to peer, retrying until the deadline (the peer may still be starting): each round tries every
// address the host resolves to, in order, and the name is resolved again at most once a second, so a
// DNS answer that changes or a brief failure to resolve (EAI_AGAIN) is waited out. A name that does not
// exist (EAI_NONAME and other permanent failures) fails at once, unless it resolved before. The error
// names the addresses tried: "could not connect to peer nodea:10811 (10.77.1.3) before the deadline: ...".
StatusOr<Fd> ConnectWithRetry(const PeerID& peer, Deadline deadline, const Resolver& resolve = ResolveIPv4);
// Milliseconds from now to the deadline, at least 0 (for poll).
int MillisLeft(Deadline deadline);
// Waits for fd to become readable/writable (POLLIN/POLLOUT); DeadlineExceeded("timed out waiting to "
// + what) when the deadline passes first.
Status WaitFor(int fd, short events, Deadline deadline, const char* what);
// Blocking exact read/write with a deadline (used by the handshake only; the event loop is non-blocking).
Status ReadFull(int fd, void* buf, size_t len, Deadline deadline);
Status WriteFull(int fd, const void* buf, size_t len, Deadline deadline);
Status SetNonBlocking(int fd, bool on);
// TCP_NODELAY, large buffers: what every data connection wants.
void TuneDataSocket(int fd);
// "127.0.0.1:45678" of the remote end, for logs.
std::string RemoteAddress(int fd);
// "127.0.0.1".
std::string AddressText(const in_addr& addr);

}  // namespace kungfu
