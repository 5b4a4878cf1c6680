// Engine: start-up, connections, shutdown, and the public API (which builds ops and posts them).
// The op lifecycle and frame routing live in engine_ops.cc.
#include "cc/engine.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "cc/engine_impl.h"
#include "cc/log.h"
#include "cc/sha256.h"
#include "cc/wire.h"

namespace kungfu {

Engine::Impl::Impl(const EngineConfig& config) : config_(config) {
  hs_.token = config_.token;
  hs_.cluster_version = config_.peers.version();
  hs_.peers = &config_.peers;
}

Engine::Impl::~Impl() { Shutdown(); }

Status Engine::Impl::Start() {
  const int n = config_.peers.size();
  if (n < 1) return InvalidArgument("the peer list is empty");
  if (config_.rank < 0 || config_.rank >= n) {
    return InvalidArgument("rank " + std::to_string(config_.rank) + " is outside the cluster of " + std::to_string(n));
  }
  if (config_.timeout_seconds <= 0) return InvalidArgument("timeout must be positive");
  if (config_.chunk_bytes < 1 || static_cast<uint64_t>(config_.chunk_bytes) > kMaxPayloadBytes ||
      config_.ring_threshold_bytes < 0 || static_cast<uint64_t>(config_.ring_threshold_bytes) > kMaxPayloadBytes) {
    return InvalidArgument("chunk_bytes and ring_threshold_bytes must be between 1 and " +
                           std::to_string(kMaxPayloadBytes));
  }
  dead_.assign(n, Status::OK());
  left_.assign(n, false);
  judge_at_.assign(n, std::nullopt);
  judge_why_.assign(n, Status::OK());
  out_.resize(n);
  in_.resize(n);
  writing_.assign(n, false);
  RETURN_IF_ERROR(loop_.Init());
  if (n > 1) {
    auto l = Listen(config_.peers.at(config_.rank).port);
    if (!l.ok()) return l.status().WithContext("listening as " + config_.peers.Describe(config_.rank));
    listener_ = std::move(l.value());
  }
  loop_.Start([this] { return AfterEvents(); }, config_.spin_us, [this] { return Busy(); });
  loop_started_ = true;
  if (n == 1) return Status::OK();
  acceptor_ = std::thread([this] { AcceptLoop(); });
  RETURN_IF_ERROR(ConnectToPeers());
  return AwaitIncoming();
}

// Whether the loop has work besides a blocking caller's finished collective (EventLoop::Start's busy).
bool Engine::Impl::Busy() const {
  if (!ops_.empty() || !p2p_.idle() || flushing_) return true;
  for (size_t p = 0; p < writing_.size(); ++p) {
    if (writing_[p] || judge_at_[p]) return true;
  }
  return false;
}

// Start returns once every peer's connection to this worker is registered too, so that the engine is
// connected both ways from its first collective on: a peer that closes a stream right after start-up
// is then judged with both its streams in view, not as a crash because the other was not yet taken in.
Status Engine::Impl::AwaitIncoming() {
  const int want = config_.peers.size() - 1;
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_until(lock, DeadlineAfter(config_.timeout_seconds), [&] { return incoming_ >= want; })) {
    return Status::OK();
  }
  return DeadlineExceeded("only " + std::to_string(incoming_) + " of the " + std::to_string(want) +
                          " other workers connected to " + config_.peers.Describe(config_.rank) + " within " +
                          std::to_string(config_.timeout_seconds) + " s (KUNGFU_TIMEOUT)");
}

Status Engine::Impl::ConnectToPeers() {
  const Deadline deadline = DeadlineAfter(config_.timeout_seconds);
  const PeerID& self = config_.peers.at(config_.rank);
  for (int p = 0; p < config_.peers.size(); ++p) {
    if (p == config_.rank) continue;
    const std::string who = "connecting to peer " + config_.peers.Describe(p);
    // A refused handshake is retried until the deadline too: the port may briefly belong to a
    // process of another job (with another token) before our peer binds it.
    Fd conn;
    Status refused;  // the last refusal: what to report if the deadline passes
    for (;;) {
      auto fd = ConnectWithRetry(config_.peers.at(p), deadline);
      if (!fd.ok()) return (refused.ok() ? fd.status() : refused).WithContext(who);
      conn = std::move(fd.value());
      Status hs = ClientHandshake(conn.get(), hs_, config_.rank, self, deadline);
      if (hs.ok()) break;
      if (hs.code() == Code::kPermissionDenied) refused = hs;
      if (Clock::now() + std::chrono::milliseconds(200) >= deadline) return (refused.ok() ? hs : refused).WithContext(who);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    TuneDataSocket(conn.get());
    RETURN_IF_ERROR(SetNonBlocking(conn.get(), true));
    auto shared = std::make_shared<Fd>(std::move(conn));
    loop_.Post([this, shared, p] { AddConnection(std::move(*shared), p, true); });
  }
  return Status::OK();
}

void Engine::Impl::AcceptLoop() {
  while (!stopping_) {
    pollfd pfd{listener_.get(), POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd.valid()) {
      // Out of file descriptors (EMFILE), say: the connection stays queued and poll() would report it
      // again at once, so say so once and wait a little rather than spin.
      const int err = errno;
      if (err != EINTR && err != EAGAIN && err != ECONNABORTED) {
        if (!accept_failing_) {
          KF_LOG(Warning) << "rank " << rank() << ": accept failed: " << std::strerror(err);
        }
        accept_failing_ = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      continue;
    }
    accept_failing_ = false;
    const std::string from = RemoteAddress(fd.get());
    // A bounded handshake: a silent client cannot hold the acceptor for long.
    const double limit = std::min(config_.timeout_seconds, 10.0);
    auto rank = ServerHandshake(fd.get(), hs_, DeadlineAfter(limit));
    if (!rank.ok()) {
      ++stats_.refused;
      KF_LOG(Warning) << "rank " << config_.rank << " refused a connection from " << from << ": "
                      << rank.status().message();
      continue;
    }
    TuneDataSocket(fd.get());
    if (!SetNonBlocking(fd.get(), true).ok()) continue;
    auto shared = std::make_shared<Fd>(std::move(fd));
    const int peer = *rank;
    loop_.Post([this, shared, peer] { AddConnection(std::move(*shared), peer, false); });
  }
}

void Engine::Impl::AddConnection(Fd fd, int peer, bool outgoing) {
  auto& slot = outgoing ? out_[peer] : in_[peer];
  if (slot) {  // a reconnect replaces the old connection
    loop_.Remove(slot->fd());
    retired_.push_back(std::move(slot));
  }
  slot = std::make_unique<Connection>(std::move(fd), peer, this, static_cast<uint64_t>(config_.read_budget_bytes));
  Connection* c = slot.get();
  loop_.Add(c->fd(), EPOLLIN, [this, c](uint32_t events) {
    if (events & EPOLLOUT) c->Flush(&sent_);
    if (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) c->OnReadable();
    CheckBroken(c);
  });
  if (outgoing) p2p_.OnConnected(peer);  // answer peer-to-peer requests that came before this connection
  if (!outgoing) {
    std::lock_guard<std::mutex> lock(mu_);
    ++incoming_;
    cv_.notify_all();
  }
}

void Engine::Impl::Shutdown() {
  if (stopping_.exchange(true)) return;
  if (!loop_started_) return;  // Start failed before there was anything to drain
  // Let in-flight collectives finish (bounded by the timeout), then cancel what is left, then give
  // queued sends a moment to drain so peers receive what we owe them.
  const Deadline deadline = DeadlineAfter(config_.timeout_seconds);
  while ((stats_.in_flight > 0 || requests_in_flight_ > 0) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::unique_lock<std::mutex> lock(mu_);
  loop_.Post([this] {
    std::vector<uint64_t> ids;
    for (auto& [key, a] : ops_) ids.push_back(a.op->id);
    const bool goodbye = leave_cleanly_ && ids.empty() && p2p_.idle();
    for (uint64_t id : ids) Fail(id, Cancelled("the engine is shutting down"), false);
    p2p_.CancelAll(Cancelled("the engine is shutting down"));
    if (goodbye) SendGoodbyes();  // queued after everything owed, so peers read it last
    flushing_ = true;
  });
  cv_.wait_until(lock, DeadlineAfter(std::min(config_.timeout_seconds, 10.0)), [this] { return flushed_; });
  lock.unlock();
  if (acceptor_.joinable()) acceptor_.join();
  loop_.Stop();
}

void Engine::Impl::Submit(std::unique_ptr<Op> op) {
  if (stopping_) {
    op->done()(Cancelled(Describe(*op) + ": the engine is shutting down"));
    return;
  }
  op->submitted = Clock::now();  // the start of the latency in collective_stats()
  auto shared = std::make_shared<std::unique_ptr<Op>>(std::move(op));
  loop_.Post([this, shared] { StartOp(std::move(*shared)); });
}

void Engine::Impl::Cancel(const std::string& name, const Status& why) {
  loop_.Post([this, name, why] {  // after every op submitted before: posts run in order
    std::vector<uint64_t> ids;
    for (auto it = ops_.lower_bound(Key(name, 0)); it != ops_.end() && it->first.first == name; ++it) {
      ids.push_back(it->second.op->id);
    }
    for (uint64_t id : ids) Fail(id, why, true);
  });
}

EngineStats Engine::Impl::stats() const {
  EngineStats s;
  s.started = stats_.started;
  s.completed = stats_.completed;
  s.failed = stats_.failed;
  s.in_flight = stats_.in_flight;
  s.max_in_flight = stats_.max_in_flight;
  s.bytes_sent = stats_.bytes_sent;
  s.bytes_received = stats_.bytes_received;
  s.refused_handshakes = stats_.refused;
  return s;
}

void Engine::Impl::ResetStats() {
  stats_.max_in_flight = stats_.in_flight.load();
  stats_.started = 0;
  stats_.completed = 0;
  stats_.failed = 0;
  stats_.bytes_sent = 0;
  stats_.bytes_received = 0;
  collective_stats_.Snapshot(true);
}

// ---- public API ----

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() { impl_->Shutdown(); }
void Engine::LeaveCleanly() { impl_->LeaveCleanly(); }

StatusOr<std::unique_ptr<Engine>> Engine::Start(const EngineConfig& config) {
  auto impl = std::make_unique<Impl>(config);
  Status s = impl->Start();
  if (!s.ok()) {
    impl->Shutdown();
    return s;
  }
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

int Engine::rank() const { return impl_->rank(); }
int Engine::size() const { return impl_->size(); }
const EngineConfig& Engine::config() const { return impl_->config(); }
EngineStats Engine::stats() const { return impl_->stats(); }
void Engine::ResetStats() { impl_->ResetStats(); }
std::vector<NamedCollectiveStats> Engine::collective_stats(bool reset) { return impl_->CollectiveStats(reset); }

namespace {
// The limits every peer enforces on each frame it reads (cc/wire.cc), checked before anything is sent:
// a bad argument then fails this call alone, instead of a peer refusing the frame and dropping the
// connection, which would fail every later collective with this worker.
Status CheckCollective(const char* kind, const std::string& name, DType dtype, const std::vector<int64_t>& counts) {
  std::string why;
  if (name.empty() || name.size() > kMaxNameBytes) {
    why = "the name must be 1 to " + std::to_string(kMaxNameBytes) + " bytes long, not " + std::to_string(name.size());
  } else if (!IsValidDType(static_cast<uint8_t>(dtype))) {
    why = "unknown dtype " + std::to_string(static_cast<int>(dtype));
  }
  for (int64_t c : counts) {
    if (why.empty() && (c < 0 || c > kMaxElements)) {
      why = "the element count " + std::to_string(c) + " is out of range [0, 2^40]";
    }
  }
  if (why.empty()) return Status::OK();
  return InvalidArgument(std::string(kind) + (name.size() <= 200 ? " '" + name + "'" : "") + ": " + why);
}
}  // namespace

void Engine::AllReduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, const std::string& name,
                       DoneCallback done, uint32_t shape_sig) {
  Status bad = CheckCollective("allreduce", name, dtype, {count});
  if (bad.ok() && !IsValidReduceOp(static_cast<uint8_t>(op))) {
    bad = InvalidArgument("allreduce '" + name + "': unknown reduce op " + std::to_string(static_cast<int>(op)));
  }
  if (!bad.ok()) return done(bad);
  const int64_t bytes = count * static_cast<int64_t>(DTypeSize(dtype));
  const int n = size();
  // With two workers recursive doubling is one swap, moving the same bytes as the ring in one step
  // instead of two: it wins up to about 4x the threshold that suits larger clusters (measured, README).
  const EngineConfig& c = impl_->config();
  const bool pow2 = n > 1 && (n & (n - 1)) == 0;
  const int64_t threshold = n == 2 ? std::min<int64_t>(4 * c.ring_threshold_bytes, kMaxPayloadBytes)
                                   : c.ring_threshold_bytes;
  const bool ring = n > 1 && bytes >= threshold && count >= n;
  // On 4, 8, ... workers, halving-doubling takes the ring's place while there is nothing to pipeline
  // (each of its steps one piece): 2 log2(n) steps instead of 2(n-1) (docs/engine.md has the figures).
  const bool halving = c.halving && ring && n > 2 && pow2 && bytes <= 2 * c.chunk_bytes;
  auto o = halving    ? NewAllReduceHalving(in, out, count, dtype, op, name, std::move(done))
           : ring     ? NewAllReduceRing(in, out, count, dtype, op, name, std::move(done))
           : pow2     ? NewAllReduceDoubling(in, out, count, dtype, op, name, std::move(done))
                      : NewAllReduceStar(in, out, count, dtype, op, name, std::move(done));
  o->shape_sig = shape_sig;
  impl_->Submit(std::move(o));
}

void Engine::Broadcast(void* buf, int64_t count, DType dtype, int root, const std::string& name, DoneCallback done,
                       uint32_t shape_sig) {
  Status bad = CheckCollective("broadcast", name, dtype, {count});
  if (!bad.ok()) return done(bad);
  const int64_t bytes = count * static_cast<int64_t>(DTypeSize(dtype));
  const bool chain = size() > 2 && bytes >= impl_->config().ring_threshold_bytes;
  auto o = NewBroadcast(buf, count, dtype, root, chain, name, std::move(done));
  o->shape_sig = shape_sig;
  impl_->Submit(std::move(o));
}

void Engine::AllGather(const void* in, void* out, const std::vector<int64_t>& counts, DType dtype,
                       const std::string& name, DoneCallback done) {
  Status bad = CheckCollective("allgather", name, dtype, counts);
  if (!bad.ok()) return done(bad);
  impl_->Submit(NewAllGather(in, out, counts, dtype, name, std::move(done)));
}

void Engine::Cancel(const std::string& name, const Status& why) { impl_->Cancel(name, why); }

void Engine::Barrier(const std::string& name, DoneCallback done) {
  Status bad = CheckCollective("barrier", name, DType::kUInt8, {});
  if (!bad.ok()) return done(bad);
  impl_->Submit(
      NewAllReduceStar(nullptr, nullptr, 0, DType::kUInt8, ReduceOp::kMax, name, std::move(done), "barrier"));
}

void Engine::Consensus(const void* data, int64_t nbytes, bool* same, const std::string& name, DoneCallback done) {
  Status bad = CheckCollective("consensus", name, DType::kUInt8, {nbytes});
  if (!bad.ok()) return done(bad);
  // Compare a digest of fixed size, so inputs of different lengths compare (unequal) instead of
  // failing. One MAX allreduce over [d, ~d] yields max(d) and ~min(d): all equal iff max == min.
  constexpr int kLen = 40;
  auto buf = std::make_shared<std::vector<uint8_t>>(2 * kLen);
  const Digest d = Sha256Of(data, static_cast<size_t>(nbytes));
  std::memcpy(buf->data(), d.data(), 32);
  std::memcpy(buf->data() + 32, &nbytes, 8);
  for (int i = 0; i < kLen; ++i) (*buf)[kLen + i] = static_cast<uint8_t>(~(*buf)[i]);
  auto wrapped = [buf, same, done = std::move(done)](const Status& s) {
    if (s.ok()) {
      bool eq = true;
      for (int i = 0; i < kLen; ++i) eq = eq && (*buf)[i] == static_cast<uint8_t>(~(*buf)[kLen + i]);
      *same = eq;
    }
    done(s);
  };
  impl_->Submit(NewAllReduceStar(buf->data(), buf->data(), 2 * kLen, DType::kUInt8, ReduceOp::kMax, name,
                                 std::move(wrapped), "consensus"));
}

void Engine::RunAndWait(const std::function<void()>& start, const std::function<bool()>& finished) {
  impl_->loop().DriveUntil(finished, start, impl_->config().caller_drives);
}

void Engine::WakeWaiters() { impl_->loop().Notify(); }

void Engine::Progress() {
  if (impl_->config().caller_drives) impl_->loop().PollOnce();
}

Status Engine::AllReduceSync(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                             const std::string& name) {
  std::atomic<bool> finished{false};
  Status result;
  RunAndWait(
      [&] {
        AllReduce(in, out, count, dtype, op, name, [&](const Status& s) {
          result = s;
          finished = true;
          WakeWaiters();
        });
      },
      [&] { return finished.load(); });  // the engine guarantees a callback by the op's deadline
  return result;
}

namespace {
Status ReadEnvNumber(const char* var, double min, double max, double* out) {
  const char* v = std::getenv(var);
  if (v == nullptr || *v == '\0') return Status::OK();
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (*end != '\0' || !(x >= min && x <= max)) {
    return InvalidArgument(std::string(var) + "='" + v + "' is not a number between " + std::to_string(min) +
                           " and " + std::to_string(max));
  }
  *out = x;
  return Status::OK();
}
}  // namespace

Status ApplyEnvOverrides(EngineConfig* c) {
  double spin = c->spin_us, halving = c->halving ? 1 : 0, drives = c->caller_drives ? 1 : 0;
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_SPIN_US", 0, 1e6, &spin));
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_HALVING", 0, 1, &halving));
  if (halving != 0 && halving != 1) return InvalidArgument("KUNGFU_HALVING must be 0 or 1");
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_CALLER_DRIVES", 0, 1, &drives));
  if (drives != 0 && drives != 1) return InvalidArgument("KUNGFU_CALLER_DRIVES must be 0 or 1");
  c->spin_us = static_cast<int>(spin);
  c->halving = halving != 0;
  c->caller_drives = drives != 0;
  double timeout = c->timeout_seconds, ring = static_cast<double>(c->ring_threshold_bytes),
         chunk = static_cast<double>(c->chunk_bytes), pending = static_cast<double>(c->max_pending_bytes);
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_TIMEOUT", 0.001, 1e7, &timeout));
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_RING_THRESHOLD", 0, static_cast<double>(kMaxPayloadBytes), &ring));
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_CHUNK_BYTES", 1, static_cast<double>(kMaxPayloadBytes), &chunk));
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_MAX_PENDING_BYTES", 0, 1e15, &pending));
  c->timeout_seconds = timeout;
  c->ring_threshold_bytes = static_cast<int64_t>(ring);
  c->chunk_bytes = static_cast<int64_t>(chunk);
  c->max_pending_bytes = static_cast<int64_t>(pending);
  return Status::OK();
}

}  // namespace kungfu
