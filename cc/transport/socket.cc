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
#include <algorithm>
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
    // A port this host cannot give the engine is a local start-up failure, not a lost peer (Unavailable,
    // which kungfu.errors maps to the recoverable PeerError): AlreadyExists when a socket holds it already.
    const int err = errno;
    const Code code = err == EADDRINUSE                  ? Code::kAlreadyExists
                      : err == EACCES || err == EPERM ? Code::kPermissionDenied
                                                      : Code::kInternal;
    return ErrnoStatus(code, "bind port " + std::to_string(port), err);
  }
  if (::listen(fd.get(), 128) != 0) return ErrnoStatus(Code::kUnavailable, "listen", errno);
  return fd;
}

int MillisLeft(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

Status WaitFor(int fd, short events, Deadline deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, MillisLeft(deadline));
    if (rc > 0) return Status::OK();
    if (rc == 0) return DeadlineExceeded(std::string("timed out waiting to ") + what);
    if (errno != EINTR) return ErrnoStatus(Code::kUnavailable, "poll", errno);
  }
}

namespace {

// A lookup that may succeed if asked again: the DNS server did not answer in time (EAI_AGAIN), or the
// lookup itself failed here (memory, file descriptors). Anything else (EAI_NONAME: no such name) is an
// answer.
bool TransientLookupFailure(int rc) { return rc == EAI_AGAIN || rc == EAI_MEMORY || rc == EAI_SYSTEM; }

std::string LookupError(int rc, int err) { return rc == EAI_SYSTEM ? std::strerror(err) : gai_strerror(rc); }

bool SameAddresses(const std::vector<in_addr>& a, const std::vector<in_addr>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].s_addr != b[i].s_addr) return false;
  }
  return true;
}

// One attempt to connect to ip:port, waiting until `until`. On success *out is a connected blocking
// socket and *err 0; otherwise *err is why (ETIMEDOUT when `until` came first). Not OK only when no
// socket can be made at all.
Status ConnectOnce(const in_addr& ip, uint16_t port, Deadline until, Fd* out, int* err) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus(Code::kUnavailable, "socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr = ip;
  addr.sin_port = htons(port);
  *err = 0;
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    *err = errno;
    if (*err == EINPROGRESS) {
      if (!WaitFor(fd.get(), POLLOUT, until, "connect").ok()) {
        *err = ETIMEDOUT;
        return Status::OK();
      }
      socklen_t len = sizeof(*err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, err, &len);
    }
  }
  if (*err == 0) {
    RETURN_IF_ERROR(SetNonBlocking(fd.get(), false));
    *out = std::move(fd);
  }
  return Status::OK();
}

// " (10.0.0.1, 10.0.0.2) before the deadline: last errors: 10.0.0.1: Connection refused; ..." for the error
// of ConnectWithRetry; no parenthesis when the host is its one address.
std::string DescribeAttempts(const std::string& host, const std::vector<in_addr>& addrs, const std::vector<int>& errs) {
  std::string list, why;
  int tried = 0;
  for (size_t i = 0; i < addrs.size(); ++i) {
    list += (i ? ", " : "") + AddressText(addrs[i]);
    if (errs[i] == 0) continue;
    why += (tried++ ? "; " : "") + (addrs.size() > 1 ? AddressText(addrs[i]) + ": " : "") + std::strerror(errs[i]);
  }
  std::string text = list == host ? "" : " (" + list + ")";
  text += " before the deadline";
  if (tried > 0) text += (addrs.size() > 1 ? ": last errors: " : ": last error: ") + why;
  return text;
}

}  // namespace

int ResolveIPv4(const std::string& host, std::vector<in_addr>* out) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) return rc;
  out->clear();
  for (const addrinfo* a = res; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET || a->ai_addrlen < sizeof(sockaddr_in)) continue;
    const in_addr ip = reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr;
    bool seen = false;
    for (const in_addr& o : *out) seen = seen || o.s_addr == ip.s_addr;
    if (!seen) out->push_back(ip);
  }
  ::freeaddrinfo(res);
  return out->empty() ? EAI_NONAME : 0;
}

StatusOr<Fd> ConnectWithRetry(const PeerID& peer, Deadline deadline, const Resolver& resolve) {
  // The name is looked up again at most this often (every round would load the DNS servers of a large
  // job whose peers are slow to start); sooner while it has not resolved yet.
  constexpr auto kLookupEvery = std::chrono::seconds(1);
  constexpr auto kLookupRetry = std::chrono::milliseconds(250);
  // A silent address (a stale DNS record) must not take the whole deadline.
  constexpr auto kPerAddress = std::chrono::seconds(2);
  std::vector<in_addr> addrs;  // the last answer
  std::vector<int> errs;       // why each of addrs failed last (0: not tried)
  int lookup_rc = 0, lookup_errno = 0;
  Deadline next_lookup = Clock::now();
  do {
    if (Clock::now() >= next_lookup) {
      std::vector<in_addr> fresh;
      lookup_rc = resolve(peer.host, &fresh);
      lookup_errno = errno;
      if (lookup_rc == 0 && fresh.empty()) lookup_rc = EAI_NONAME;
      if (lookup_rc == 0 && !SameAddresses(fresh, addrs)) {
        addrs = std::move(fresh);
        errs.assign(addrs.size(), 0);
      } else if (lookup_rc != 0 && addrs.empty() && !TransientLookupFailure(lookup_rc)) {
        return Unavailable("cannot resolve host '" + peer.host + "': " + LookupError(lookup_rc, lookup_errno));
      }
      next_lookup = Clock::now() + (addrs.empty() ? std::chrono::duration_cast<Clock::duration>(kLookupRetry)
                                                  : std::chrono::duration_cast<Clock::duration>(kLookupEvery));
    }
    for (size_t i = 0; i < addrs.size() && Clock::now() < deadline; ++i) {
      // Bounded even for one address: one that drops SYNs (a stale record) would hold the attempt past the
      // next lookup, which may give the right one.
      const Deadline until = std::min(deadline, Clock::now() + kPerAddress);
      Fd fd;
      RETURN_IF_ERROR(ConnectOnce(addrs[i], peer.port, until, &fd, &errs[i]));
      if (errs[i] == 0) return fd;
    }
    // Refused or unreachable: the peer is probably still starting. Back off briefly.
    std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(50), deadline - Clock::now()));
  } while (Clock::now() < deadline);
  if (addrs.empty()) {
    return DeadlineExceeded("could not resolve host '" + peer.host + "' before the deadline: " +
                            LookupError(lookup_rc, lookup_errno));
  }
  std::string text = "could not connect to peer " + peer.ToString() + DescribeAttempts(peer.host, addrs, errs);
  if (lookup_rc != 0) text += "; the last lookup of '" + peer.host + "' failed: " + LookupError(lookup_rc, lookup_errno);
  return DeadlineExceeded(text);
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

std::string AddressText(const in_addr& addr) {
  char ip[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &addr, ip, sizeof(ip));
  return ip;
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
