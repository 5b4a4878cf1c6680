#include "cc/transport/handshake.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "cc/sha256.h"
#include "cc/wire.h"

namespace kungfu {

namespace {

constexpr uint32_t kHelloMagic = 0x5348464b;  // "KFHS"
// The handshake's own version in the high byte, the frames' (wire.h) in the low one: builds whose frames
// differ refuse each other here, with a clear error, instead of breaking at the first frame.
constexpr uint16_t kHandshakeVersion = (2 << 8) | kProtocolVersion;  // 2: CHALLENGE signs the server's rank
constexpr size_t kNonceBytes = 32;
constexpr size_t kMaxIdBytes = 255;

enum Verdict : uint8_t {
  kAccepted = 1,
  kBadToken = 2,
  kNotMember = 3,
  kWrongVersion = 4,  // another protocol: another build of kungfu
  kWrongCluster = 5,  // another cluster version (KUNGFU_CLUSTER_VERSION)
};

const char* VerdictText(uint8_t v) {
  switch (v) {
    case kBadToken: return "the job token did not match";
    case kNotMember: return "this worker is not in its peer list";
    case kWrongVersion: return "it speaks another protocol version: another build of kungfu";
    case kWrongCluster: return "it works under another cluster version";
    default: return "unknown reason";
  }
}

// HELLO layout: magic u32, version u16, id_len u16, cluster_version u32, rank u32, nonce[32], id[id_len].
struct Hello {
  uint16_t version = 0;
  uint32_t cluster_version = 0;
  uint32_t rank = 0;
  uint8_t nonce[kNonceBytes] = {};
  std::string id;
};

std::vector<uint8_t> EncodeHello(const Hello& h) {
  std::vector<uint8_t> out(16 + kNonceBytes + h.id.size());
  const uint32_t magic = kHelloMagic;
  const uint16_t id_len = static_cast<uint16_t>(h.id.size());
  std::memcpy(&out[0], &magic, 4);
  std::memcpy(&out[4], &h.version, 2);
  std::memcpy(&out[6], &id_len, 2);
  std::memcpy(&out[8], &h.cluster_version, 4);
  std::memcpy(&out[12], &h.rank, 4);
  std::memcpy(&out[16], h.nonce, kNonceBytes);
  std::memcpy(&out[16 + kNonceBytes], h.id.data(), h.id.size());
  return out;
}

// CHALLENGE layout: server nonce[32], MAC[32] (the server's rank is under the MAC, not sent: the
// layout stays that of version 1, so the client can still tell a build that predates it).
constexpr size_t kChallengeBytes = kNonceBytes + 32;

std::vector<uint8_t> RankBytes(uint32_t rank) {
  std::vector<uint8_t> out(4);
  std::memcpy(out.data(), &rank, 4);
  return out;
}

Digest Mac(const std::string& token, const char* label, const uint8_t* a, const uint8_t* b,
           const std::vector<uint8_t>& extra) {
  std::vector<uint8_t> msg(label, label + std::strlen(label));
  msg.insert(msg.end(), a, a + kNonceBytes);
  msg.insert(msg.end(), b, b + kNonceBytes);
  msg.insert(msg.end(), extra.begin(), extra.end());
  return HmacSha256(token, msg.data(), msg.size());
}

constexpr size_t kHelloHeadBytes = 16 + kNonceBytes;  // HELLO up to its id

// Reads at most len bytes that fd holds now, never waiting: *got 0 when it holds none yet.
Status ReadSome(int fd, uint8_t* p, size_t len, size_t* got) {
  *got = 0;
  for (;;) {
    const ssize_t n = ::recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      *got = static_cast<size_t>(n);
      return Status::OK();
    }
    if (n == 0) return Unavailable("connection closed by the remote end");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Status::OK();
    return ErrnoStatus(Code::kUnavailable, "recv", errno);
  }
}

// Sends a short answer without waiting: on a connection with nothing else in flight it fits the socket's
// buffer, so a short send means a client that does not read.
Status SendAnswer(int fd, const void* p, size_t len) {
  for (;;) {
    const ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(len)) return Status::OK();
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return ErrnoStatus(Code::kUnavailable, "send", errno);
    return Unavailable("the handshake's answer did not fit the socket's buffer");
  }
}

// Why the address of rank `dialed` led to rank `reached` (maybe this worker itself), naming the address
// the name resolved to here: a name that resolves to a loopback address (a host's own name, which
// Debian's /etc/hosts maps to 127.0.1.1) leads every worker that resolves it so to its own host.
std::string ReachedAnother(int fd, const PeerList& peers, int dialed, int reached, int self_rank) {
  const PeerID& peer = peers.at(dialed);
  std::string ip = RemoteAddress(fd);
  ip = ip.substr(0, ip.rfind(':'));
  const bool named = ip != peer.host;
  const std::string who = reached == self_rank ? "this worker itself" : "rank " + std::to_string(reached);
  std::string text = "the address of rank " + std::to_string(dialed) + ", " + peer.ToString() +
                     (named ? " (" + ip + ")" : "") + ", reached " + who +
                     ": two workers listen where one address leads (two names of one host, each given the same port?";
  if (named && ip.rfind("127.", 0) == 0) {
    text += " or a name that resolves to a loopback address on some host: here " + peer.host + " is " + ip +
            ", as /etc/hosts often makes a host's own name, which leads to this host, not to rank " +
            std::to_string(dialed) + "'s";
  }
  return text + "); name each host once, in one way, by a name or address that leads to it from every host";
}

}  // namespace

Status ClientHandshake(int fd, const HandshakeParams& params, int self_rank, const PeerID& self_id,
                       int expect_rank, Deadline deadline) {
  Hello hello;
  hello.version = kHandshakeVersion;
  hello.cluster_version = params.cluster_version;
  hello.rank = static_cast<uint32_t>(self_rank);
  hello.id = self_id.ToString();
  if (!RandomBytes(hello.nonce, kNonceBytes)) return Internal("getrandom failed");
  const std::vector<uint8_t> raw = EncodeHello(hello);
  RETURN_IF_ERROR(WriteFull(fd, raw.data(), raw.size(), deadline));

  uint8_t challenge[kChallengeBytes];
  RETURN_IF_ERROR(ReadFull(fd, challenge, sizeof(challenge), deadline).WithContext("reading the handshake challenge"));
  const uint8_t* server_nonce = challenge;
  const uint8_t* server_mac = challenge + kNonceBytes;
  auto signed_by = [&](uint32_t rank) {
    const Digest mac = Mac(params.token, "kungfu-server", hello.nonce, server_nonce, RankBytes(rank));
    return ConstantTimeEqual(mac.data(), server_mac, 32);
  };
  const bool genuine = signed_by(static_cast<uint32_t>(expect_rank));
  if (!genuine && params.peers != nullptr) {
    // Another worker of this job (or this one) answering at the address we dialed: say which, and
    // send no proof, so that it does not take the connection in. Not retried.
    for (int r = 0; r < params.peers->size(); ++r) {
      if (r == expect_rank || !signed_by(static_cast<uint32_t>(r))) continue;
      return AlreadyExists(ReachedAnother(fd, *params.peers, expect_rank, r, self_rank));
    }
  }
  // Send our proof before judging the server's, so a server with another token learns (and logs)
  // that the tokens differ instead of seeing a connection that just closed.
  const Digest proof = Mac(params.token, "kungfu-client", server_nonce, hello.nonce, raw);
  RETURN_IF_ERROR(WriteFull(fd, proof.data(), proof.size(), deadline));
  if (!genuine) {
    const Digest v1 = Mac(params.token, "kungfu-server", hello.nonce, server_nonce, {});
    if (ConstantTimeEqual(v1.data(), server_mac, 32)) {
      return InvalidArgument("the peer speaks handshake version 1, this worker " +
                             std::to_string(kHandshakeVersion >> 8) + ": another build of kungfu");
    }
    return PermissionDenied("the peer could not prove it holds the job token");
  }
  uint8_t verdict = 0;
  RETURN_IF_ERROR(ReadFull(fd, &verdict, 1, deadline).WithContext("reading the handshake verdict"));
  // A verdict other than the token's comes from a worker of this job (it checked the token first), so
  // retrying cannot help: another build (InvalidArgument) or another cluster version (Aborted).
  const std::string refused = std::string("the peer refused us: ") + VerdictText(verdict);
  if (verdict == kWrongVersion) return InvalidArgument(refused);
  if (verdict == kWrongCluster) {
    return Aborted(refused + " than this worker's " + std::to_string(params.cluster_version) +
                   " (KUNGFU_CLUSTER_VERSION)");
  }
  if (verdict != kAccepted) return PermissionDenied(refused);
  return Status::OK();
}

static_assert(kChallengeBytes == 64, "ServerHandshaker::challenge_ holds a CHALLENGE");

ServerHandshaker::ServerHandshaker(const HandshakeParams& params)
    : params_(params), buf_(kHelloHeadBytes), want_(kHelloHeadBytes) {}

Status ServerHandshaker::Advance(int fd, bool* done) {
  *done = false;
  for (;;) {
    size_t got = 0;
    RETURN_IF_ERROR(ReadSome(fd, buf_.data() + have_, want_ - have_, &got));
    if (got == 0) return Status::OK();  // more later
    have_ += got;
    if (have_ < want_) continue;
    switch (phase_) {
      case Phase::kHelloHead: {
        uint32_t magic;
        uint16_t id_len;
        std::memcpy(&magic, &buf_[0], 4);
        std::memcpy(&hello_version_, &buf_[4], 2);
        std::memcpy(&id_len, &buf_[6], 2);
        std::memcpy(&hello_cluster_version_, &buf_[8], 4);
        std::memcpy(&hello_rank_, &buf_[12], 4);
        if (magic != kHelloMagic) return InvalidArgument("not a KungFu handshake (bad magic)");
        if (id_len == 0 || id_len > kMaxIdBytes) return InvalidArgument("handshake id length out of bounds");
        hello_raw_ = buf_;
        phase_ = Phase::kHelloId;
        want_ = id_len;
        break;
      }
      case Phase::kHelloId:
        hello_id_.assign(buf_.begin(), buf_.end());
        hello_raw_.insert(hello_raw_.end(), buf_.begin(), buf_.end());
        RETURN_IF_ERROR(OnHello(fd));
        phase_ = Phase::kProof;
        want_ = 32;
        break;
      case Phase::kProof:
        return OnProof(fd, done);
    }
    have_ = 0;
    buf_.assign(want_, 0);
  }
}

// The HELLO is complete: send the CHALLENGE.
Status ServerHandshaker::OnHello(int fd) {
  if (params_.self_rank < 0) return Internal("ServerHandshake: HandshakeParams.self_rank is not set");
  if (!RandomBytes(challenge_, kNonceBytes)) return Internal("getrandom failed");
  const uint8_t* client_nonce = hello_raw_.data() + 16;
  const Digest server_mac = Mac(params_.token, "kungfu-server", client_nonce, challenge_,
                                RankBytes(static_cast<uint32_t>(params_.self_rank)));
  std::memcpy(challenge_ + kNonceBytes, server_mac.data(), 32);
  return SendAnswer(fd, challenge_, sizeof(challenge_));
}

// The PROOF is complete (in buf_): judge it and the HELLO, and send the VERDICT.
Status ServerHandshaker::OnProof(int fd, bool* done) {
  const uint8_t* client_nonce = hello_raw_.data() + 16;
  const Digest expect = Mac(params_.token, "kungfu-client", challenge_, client_nonce, hello_raw_);
  uint8_t verdict = kAccepted;
  Status result;
  int rank = -1;
  if (!ConstantTimeEqual(expect.data(), buf_.data(), 32)) {
    verdict = kBadToken;
    result = PermissionDenied("the job token did not match");
  } else if (hello_version_ != kHandshakeVersion) {
    verdict = kWrongVersion;
    result = InvalidArgument("peer speaks protocol " + std::to_string(hello_version_) + ", this worker " +
                             std::to_string(kHandshakeVersion) + ": another build of kungfu");
  } else if (hello_cluster_version_ != params_.cluster_version) {
    verdict = kWrongCluster;
    result = InvalidArgument("peer works under cluster version " + std::to_string(hello_cluster_version_) +
                             ", this worker under " + std::to_string(params_.cluster_version));
  } else {
    auto id = ParsePeerID(hello_id_);
    rank = id.ok() ? params_.peers->RankOf(*id) : -1;
    if (rank < 0 || rank != static_cast<int>(hello_rank_)) {
      verdict = kNotMember;
      result = PermissionDenied("peer '" + hello_id_ + "' (rank " + std::to_string(hello_rank_) +
                                ") is not in the peer list");
    }
  }
  // Best effort: the client learns why before we close.
  (void)SendAnswer(fd, &verdict, 1);
  if (!result.ok()) return result;
  rank_ = rank;
  *done = true;
  return Status::OK();
}

StatusOr<int> ServerHandshake(int fd, const HandshakeParams& params, Deadline deadline) {
  ServerHandshaker hs(params);
  for (;;) {
    bool done = false;
    RETURN_IF_ERROR(hs.Advance(fd, &done));
    if (done) return hs.rank();
    RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, "read"));
  }
}

}  // namespace kungfu
