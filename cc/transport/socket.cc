#include "cc/transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace kungfu {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

StatusOr<Fd> Listen(uint16_t port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(Code::kUnavailable, "socket", errno);
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(port);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(Code::kUnavailable, "bind port " + std::to_string(port), errno);
  }
  if (::listen(fd.get(), 128) != 0) return ErrnoStatus(Code::kUnavailable, "listen", errno);
  return fd;
}

namespace {

Status Resolve(const PeerID& peer, sockaddr_in* out) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(peer.host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Unavailable("cannot resolve host '" + peer.host + "': " + gai_strerror(rc));
  }
  std::memcpy(out, res->ai_addr, sizeof(sockaddr_in));
  ::freeaddrinfo(res);
  out->sin_port = htons(peer.port);
  return Status::OK();
}

int MillisLeft(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// Waits for fd to become readable/writable; DeadlineExceeded when the deadline passes first.
Status WaitFor(int fd, short events, Deadline deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, MillisLeft(deadline));
    if (rc > 0) return Status::OK();
    if (rc == 0) return DeadlineExceeded(std::string("timed out waiting to ") + what);
    if (errno != EINTR) return ErrnoStatus(Code::kUnavailable, "poll", errno);
  }
}

}  // namespace

StatusOr<Fd> ConnectWithRetry(const PeerID& peer, Deadline deadline) {
  sockaddr_in addr{};
  RETURN_IF_ERROR(Resolve(peer, &addr));
  int last_errno = 0;
  while (Clock::now() < deadline) {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return ErrnoStatus(Code::kUnavailable, "socket", errno);
    int rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    if (rc != 0 && errno == EINPROGRESS) {
      Status s = WaitFor(fd.get(), POLLOUT, deadline, "connect");
      if (!s.ok()) break;
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) {
      RETURN_IF_ERROR(SetNonBlocking(fd.get(), false));
      return fd;
    }
    last_errno = errno;
    // Refused or unreachable: the peer is probably still starting. Back off briefly.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string why = last_errno ? std::string(": last error: ") + std::strerror(last_errno) : "";
  return DeadlineExceeded("could not connect to peer " + peer.ToString() + " before the deadline" + why);
}

Status ReadFull(int fd, void* buf, size_t len, Deadline deadline) {
  auto* p = static_cast<char*>(buf);
  while (len > 0) {
    RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, "read"));
    const ssize_t n = ::recv(fd, p, len, 0);
    if (n == 0) return Unavailable("connection closed by the remote end");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return ErrnoStatus(Code::kUnavailable, "recv", errno);
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return Status::OK();
}

Status WriteFull(int fd, const void* buf, size_t len, Deadline deadline) {
  const auto* p = static_cast<const char*>(buf);
  while (len > 0) {
    RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, "write"));
    const ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return ErrnoStatus(Code::kUnavailable, "send", errno);
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return Status::OK();
}

Status SetNonBlocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0) return ErrnoStatus(Code::kInternal, "fcntl", errno);
  const int want = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (::fcntl(fd, F_SETFL, want) != 0) return ErrnoStatus(Code::kInternal, "fcntl", errno);
  return Status::OK();
}

void TuneDataSocket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string RemoteAddress(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "unknown";
  char ip[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(addr.sin_port));
}

}  // namespace kungfu
