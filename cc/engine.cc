// Engine::Impl: start-up, connections, shutdown, and the submission of ops. The public API, which
// builds ops and hands them here, is in engine_api.cc; the op lifecycle and frame routing in engine_ops.cc;
// the loop's after-events work (writes, judging, deadlines) in engine_deadlines.cc; the acceptor thread
// (incoming connections and their handshakes) in engine_accept.cc.
#include "cc/engine.h"

#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <map>

#include "cc/engine_impl.h"
#include "cc/log.h"
#include "cc/wire.h"

namespace kungfu {

Engine::Impl::Impl(const EngineConfig& config) : config_(config) {
  hs_.token = config_.token;
  hs_.cluster_version = config_.peers.version();
  hs_.peers = &config_.peers;
  hs_.self_rank = config_.rank;
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
    return InvalidArgument("chunk_bytes must be between 1 and " + std::to_string(kMaxPayloadBytes) +
                           ", ring_threshold_bytes between 0 and " + std::to_string(kMaxPayloadBytes));
  }
  dead_.assign(n, Status::OK());
  left_.assign(n, false);
  finalizing_.assign(n, -1);
  started_by_.assign(n, std::nullopt);
  judge_at_.assign(n, std::nullopt);
  judge_why_.assign(n, Status::OK());
  out_.resize(n);
  in_.resize(n);
  writing_.assign(n, false);
  traits_.assign(n, std::nullopt);
  traits_[config_.rank] = WorkerTraits{config_.small_star, OwnCpuMask()};
  RETURN_IF_ERROR(loop_.Init());
  if (n > 1) {
    auto l = Listen(config_.peers.at(config_.rank).port);
    if (!l.ok()) return l.status().WithContext("listening as " + config_.peers.Describe(config_.rank));
    listener_ = std::move(l.value());
  }
  loop_.Start([this] { return AfterEvents(); }, config_.spin_us, [this] { return Busy(); },
              [this](Clock::duration lost) { Postpone(lost); });
  loop_started_ = true;
  if (n == 1) return Status::OK();
  if (WantSender()) {
    // A post wakes whoever drives the loop, a parked loop thread too, to take the finished payload.
    sender_ = std::make_unique<Sender>([this] { loop_.Post([] {}); }, config_.spin_us);
  }
  acceptor_ = std::thread([this] { AcceptLoop(); });
  RETURN_IF_ERROR(ConnectToPeers());
  RETURN_IF_ERROR(AwaitIncoming());
  std::vector<WorkerTraits> traits;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& t : traits_) traits.push_back(*t);
  }
  small_star_ = ChooseSmallStar(config_.peers, traits);
  KF_LOG(Debug) << "rank " << config_.rank << ": small allreduces use "
                << (small_star_ ? "the star" : "recursive doubling on 2, 4, 8, ... workers");
  return Status::OK();
}

std::string OwnCpuMask() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (sched_getaffinity(0, sizeof(cpus), &cpus) != 0) return std::string();
  std::string mask;
  for (int i = 0; i < CPU_SETSIZE; ++i) {
    if (!CPU_ISSET(i, &cpus)) continue;
    if (mask.size() <= static_cast<size_t>(i / 8)) mask.resize(i / 8 + 1, '\0');
    mask[i / 8] = static_cast<char>(static_cast<unsigned char>(mask[i / 8]) | (1u << (i % 8)));
  }
  return mask;
}

bool ChooseSmallStar(const PeerList& peers, const std::vector<WorkerTraits>& traits) {
  bool doubling_asked = false;
  for (const WorkerTraits& t : traits) {
    if (t.small_star == 1) return true;
    if (t.small_star == 0) doubling_asked = true;
  }
  if (doubling_asked) return false;
  struct Host {
    int workers = 0;
    std::string cpus;  // the union of their masks
  };
  std::map<std::string, Host> hosts;
  for (int r = 0; r < peers.size() && r < static_cast<int>(traits.size()); ++r) {
    Host& h = hosts[peers.at(r).host];
    ++h.workers;
    const std::string& m = traits[r].cpu_mask;
    if (h.cpus.size() < m.size()) h.cpus.resize(m.size(), '\0');
    for (size_t i = 0; i < m.size(); ++i) h.cpus[i] = static_cast<char>(h.cpus[i] | m[i]);
  }
  for (const auto& [name, h] : hosts) {
    int cpus = 0;
    for (unsigned char b : h.cpus) cpus += __builtin_popcount(b);
    if (cpus > 0 && h.workers > cpus) return true;
  }
  return false;
}

// Whether the loop has work besides a blocking caller's finished collective (EventLoop::Start's busy).
bool Engine::Impl::Busy() const {
  if (!ops_.empty() || !p2p_.idle() || flushing_) return true;
  for (size_t p = 0; p < writing_.size(); ++p) {
    const Connection* c = out_[p].get();
    if (writing_[p] || judge_at_[p] || (c && !c->broken() && (c->offloaded() || c->has_queued()))) return true;
  }
  return false;
}

bool Engine::Impl::WantSender() const {
  if (config_.send_thread >= 0) return config_.send_thread == 1;
  // Auto: two cores for each worker on this host (one for its loop, one for its sender), counting the
  // cores this process may run on (taskset, a container's cpuset), not the machine's.
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (sched_getaffinity(0, sizeof(cpus), &cpus) != 0) return false;
  const std::string& host = config_.peers.at(config_.rank).host;
  int local = 0;
  for (int p = 0; p < config_.peers.size(); ++p) local += config_.peers.at(p).host == host ? 1 : 0;
  return CPU_COUNT(&cpus) >= 2 * local;
}

// Start returns once every peer's connection to this worker is registered too, so that the engine is
// connected both ways from its first collective on: a peer that closes a stream right after start-up
// is then judged with both its streams in view, not as a crash because the other was not yet taken in.
// It also waits for every peer's TRAITS frame, the first on each peer's connection, so that the choices
// made from them (small_star_) are made before the first collective, alike on every worker. A peer
// judged gone meanwhile (its connections closed before its TRAITS frame came: it crashed just after its
// own start) fails the wait at once.
Status Engine::Impl::AwaitIncoming() {
  const int want = config_.peers.size() - 1;
  std::unique_lock<std::mutex> lock(mu_);
  const auto all_in = [&] { return incoming_ >= want && traits_heard_ >= want; };
  cv_.wait_until(lock, DeadlineAfter(config_.timeout_seconds), [&] { return all_in() || !lost_peer_.ok(); });
  if (all_in()) return Status::OK();
  if (!lost_peer_.ok()) {
    return Unavailable(lost_peer_.message() + " (while this worker was starting: every worker must start together)");
  }
  const std::string within = " within " + FormatNumber(config_.timeout_seconds) + " s (KUNGFU_TIMEOUT)";
  if (incoming_ < want) {
    return DeadlineExceeded("only " + std::to_string(incoming_) + " of the " + std::to_string(want) +
                            " other workers connected to " + config_.peers.Describe(config_.rank) + within);
  }
  std::vector<int> silent;
  for (int p = 0; p < config_.peers.size(); ++p) {
    if (!traits_[p]) silent.push_back(p);
  }
  return DeadlineExceeded("every other worker connected to " + config_.peers.Describe(config_.rank) +
                          ", but nothing came from " + RankList(silent) +
                          " (a worker's first frame says what it runs on)" + within);
}

void Engine::Impl::SendTraits(Connection* c) {
  std::shared_ptr<const std::string> mask;
  FrameHeader h;
  h.kind = FrameKind::kTraits;
  h.cluster_version = config_.peers.version();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const WorkerTraits& own = *traits_[config_.rank];
    h.aux = static_cast<uint32_t>(own.small_star == 1   ? TraitsPreference::kStar
                                  : own.small_star == 0 ? TraitsPreference::kDoubling
                                                        : TraitsPreference::kAuto);
    mask = std::make_shared<const std::string>(own.cpu_mask);
  }
  h.payload_bytes = mask->size();
  c->EnqueueShared(h, "kungfu/traits", mask->empty() ? nullptr : mask->data(), mask);
}

// A peer's first frame; a repeat (after a reconnect) changes nothing, as the choices are made.
void Engine::Impl::OnTraits(int src, const FrameHeader& h, const char* data) {
  std::lock_guard<std::mutex> lock(mu_);
  if (traits_[src]) return;
  const auto preference = static_cast<TraitsPreference>(h.aux);
  WorkerTraits t;
  t.small_star = preference == TraitsPreference::kStar ? 1 : preference == TraitsPreference::kDoubling ? 0 : -1;
  if (data != nullptr) t.cpu_mask.assign(data, h.payload_bytes);
  traits_[src] = std::move(t);
  ++traits_heard_;
  cv_.notify_all();
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
      Status hs = ClientHandshake(conn.get(), hs_, config_.rank, self, p, deadline);
      if (hs.ok()) break;
      // Another of our workers answered, or one of another build or cluster version: retrying cannot help.
      if (hs.code() == Code::kAlreadyExists || hs.code() == Code::kInvalidArgument || hs.code() == Code::kAborted) {
        return hs.WithContext(who);
      }
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
  if (outgoing) SendTraits(c);  // before anything else goes out on it
  if (outgoing && sender_) c->set_sender(sender_.get());
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
  s.loop_wakes = loop_.wakes();
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

}  // namespace kungfu
