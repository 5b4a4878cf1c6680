// Engine: how workers leave. A clean leave (BYE after the finalize barrier) and the announcement that
// a worker has begun to finalize (FINALIZING before it), and what peers fail when they hear either; and
// a peer's closed or broken connection, judged a clean leave or a failure (CheckBroken, Judge).
// All on the loop thread.
#include "cc/engine_impl.h"
#include "cc/log.h"

namespace kungfu {

namespace {
// The counts by name are sent only up to this size (a program that makes a fresh name per call, e.g. with
// the step in it, could make tens of MB of them); past it the peers judge from the total alone.
constexpr size_t kMaxStartedByNameBytes = size_t{8} << 20;

// The BYE or FINALIZING frame to one peer: the total in its header, the counts by name as its payload
// (by_name, one buffer shared by every peer's frame; null: none).
void SendLeaving(Connection* c, FrameKind kind, uint64_t total, uint32_t cluster_version,
                 const std::shared_ptr<const std::string>& by_name) {
  FrameHeader h;
  h.kind = kind;
  h.generation = total;
  h.cluster_version = cluster_version;
  h.payload_bytes = by_name ? by_name->size() : 0;
  c->EnqueueShared(h, kind == FrameKind::kBye ? "kungfu/bye" : "kungfu/finalizing", by_name ? by_name->data() : nullptr,
                   by_name);
}

std::shared_ptr<const std::string> StartedByNamePayload(const StartedByName& started) {
  auto bytes = std::make_shared<std::string>(EncodeStartedByName(started));
  if (bytes->empty() || bytes->size() > kMaxStartedByNameBytes) return nullptr;
  return bytes;
}
}  // namespace

void Engine::Impl::SendGoodbyes() {
  const auto by_name = StartedByNamePayload(next_gen_);
  for (int d = 0; d < size(); ++d) {
    if (d == rank() || !out_[d] || out_[d]->broken() || left_[d]) continue;
    SendLeaving(out_[d].get(), FrameKind::kBye, next_op_id_ - 1, config_.peers.version(), by_name);
  }
}

void Engine::Impl::ReadStartedByName(int peer, const char* data, uint64_t bytes) {
  started_by_[peer].reset();  // a frame without counts (too many names) leaves the total alone to judge by
  if (bytes == 0 || data == nullptr) return;
  StartedByName started;
  Status s = DecodeStartedByName(data, bytes, &started);
  if (!s.ok()) {
    KF_LOG(Warning) << "rank " << rank() << ": peer " << config_.peers.Describe(peer) << ": " << s.message();
    return;
  }
  started_by_[peer] = std::move(started);
}

// Counts by name are exact whatever order workers started concurrent collectives in, and whatever
// collectives failed on some workers only (a caught error after which a worker goes on can leave the
// totals unequal). The total alone only compares with this worker's count of collectives started.
bool Engine::Impl::PeerStarted(int peer, uint64_t total, const Op& op) const {
  if (started_by_[peer]) {
    auto it = started_by_[peer]->find(op.name());
    return it != started_by_[peer]->end() && op.generation < it->second;
  }
  return op.id <= total;
}

// A peer that leaves cleanly has finished every collective it started, and sent all it owed for them
// before its goodbye. In-flight collectives here that it took part in need nothing more from it; any
// it never started can never finish, so they fail now.
void Engine::Impl::OnPeerLeft(int peer, uint64_t started) {
  if (!dead_[peer].ok()) return;
  judge_at_[peer].reset();  // a close seen before this goodbye was its leaving, not a crash
  left_[peer] = true;
  dead_[peer] = Unavailable("peer " + config_.peers.Describe(peer) + " has left the cluster (it finalized after " +
                            std::to_string(started) + " collective(s))");
  if (first_dead_.ok()) first_dead_ = dead_[peer];
  KF_LOG(Info) << "rank " << rank() << ": " << dead_[peer].message();
  p2p_.OnPeerGone(peer, dead_[peer]);
  if (out_[peer]) out_[peer]->DropQueued(&sent_);  // frames for collectives it has finished
  std::vector<uint64_t> ids;
  std::string which;
  for (auto& [key, a] : ops_) {
    if (PeerStarted(peer, started, *a.op)) continue;
    ids.push_back(a.op->id);
    if (which.empty()) which = Describe(*a.op);
  }
  if (ids.empty()) return;
  if (!started_by_[peer]) {  // which ones is unknown (see OnPeerFinalizing): all of them
    ids.clear();
    for (auto& [key, a] : ops_) ids.push_back(a.op->id);
  }
  const Status why = Unavailable(dead_[peer].message() + " without starting this worker's " + which +
                                 (ids.size() > 1 ? " and " + std::to_string(ids.size() - 1) + " more" : ""));
  for (uint64_t id : ids) Fail(id, why, false);
}

// Finalizing: this worker will start no collective but the finalize barrier. Peers learn what it
// started before, so one that waits in a collective this worker never started (it left the training
// loop early: sys.exit, a return from main) fails at once instead of at its timeout, while this worker
// waits in the barrier. Posted in order with the barrier's own start, so that one is not counted.
void Engine::Impl::BeginFinalize() {
  if (finalized_after_ >= 0) return;
  finalized_after_ = static_cast<int64_t>(next_op_id_ - 1);
  const auto by_name = StartedByNamePayload(next_gen_);
  for (int d = 0; d < size(); ++d) {
    if (d == rank() || !out_[d] || out_[d]->broken() || left_[d]) continue;
    SendLeaving(out_[d].get(), FrameKind::kFinalizing, static_cast<uint64_t>(finalized_after_), config_.peers.version(),
                by_name);
  }
}

// Totals compare across workers, as for a goodbye, because every worker's engine lives as long as the
// job (membership is fixed) and every collective involves every worker.
Status Engine::Impl::NeverJoined(const Op& op) const {
  // Collectives this worker starts after its own BeginFinalize are the barrier, which every peer joins.
  if (finalized_after_ >= 0 && static_cast<int64_t>(op.id) > finalized_after_) return Status::OK();
  for (int p = 0; p < size(); ++p) {
    if (finalizing_[p] < 0 || PeerStarted(p, static_cast<uint64_t>(finalizing_[p]), op)) continue;
    return Unavailable("peer " + config_.peers.Describe(p) + " has begun to finalize after " +
                       std::to_string(finalizing_[p]) + " collective(s) and will not join this worker's " +
                       Describe(op) +
                       " (did it leave the training loop early: sys.exit, or a callback such as EarlyStopping that "
                       "decided from its own metrics, without MetricAverageCallback?)");
  }
  return Status::OK();
}

void Engine::Impl::OnPeerFinalizing(int peer, uint64_t started) {
  if (!dead_[peer].ok()) return;
  finalizing_[peer] = static_cast<int64_t>(started);
  // Those in flight here that it never started can never finish. With its counts by name, exactly
  // those fail; with its total alone, which ones is unknown (workers may start concurrent collectives
  // in different orders), so all of them fail, as the program has diverged anyway.
  std::vector<uint64_t> ids;
  Status why;
  for (auto& [key, a] : ops_) {
    Status never = NeverJoined(*a.op);
    if (never.ok()) continue;
    if (why.ok()) why = never;
    ids.push_back(a.op->id);
  }
  if (why.ok()) return;
  if (!started_by_[peer]) {
    ids.clear();
    for (auto& [key, a] : ops_) {
      if (finalized_after_ < 0 || static_cast<int64_t>(a.op->id) <= finalized_after_) ids.push_back(a.op->id);
    }
  }
  KF_LOG(Warning) << "rank " << rank() << ": " << why.message();
  for (uint64_t id : ids) Fail(id, why, false);
}

void Engine::Impl::CheckBroken(Connection* c) {
  Status why;
  if (c->TakeError(&why)) OnConnectionError(c->peer(), why);
}

void Engine::Impl::OnConnectionError(int peer, const Status& s) {
  // A peer that leaves cleanly says goodbye on the connection it writes to, then closes both; the
  // close of the other one can be seen first, so read all that is waiting here before judging (one
  // OnReadable() stops after a budget, and the goodbye may sit behind megabytes of data).
  while (dead_[peer].ok() && in_[peer] && !in_[peer]->broken() && in_[peer]->OnReadable()) {
  }
  Connection* out = out_[peer].get();
  if (out && out->broken()) loop_.Remove(out->fd());
  // Only the stream this worker writes to has closed. Across two TCP streams on a real network, that
  // close can arrive before the goodbye on the other one, so wait for the other one's own close (a
  // crashed peer's comes at once) or a short grace, rather than take a clean leave for a crash.
  if (dead_[peer].ok() && in_[peer] && !in_[peer]->broken() && !stopping_) {
    if (!judge_at_[peer]) {
      judge_at_[peer] = DeadlineAfter(std::min(2.0, config_.timeout_seconds));
      judge_why_[peer] = s;
    }
    return;
  }
  Judge(peer, judge_at_[peer] ? judge_why_[peer] : s);
}

void Engine::Impl::Judge(int peer, const Status& s) {
  judge_at_[peer].reset();
  SettleReceiving(peer);  // a frame cut short by the close is never delivered
  const bool judged = !dead_[peer].ok();  // already gone, or left cleanly (OnPeerLeft)
  for (auto* c : {out_[peer].get(), in_[peer].get()}) {
    if (!c) continue;
    // Gone for good: close both directions, so that a peer that is still alive (this worker refused
    // its frame, say) sees the close at once instead of waiting for its timeout.
    if (!judged) c->Close(Unavailable("closed after an error"));
    if (c->broken()) loop_.Remove(c->fd());
  }
  if (judged) return;
  dead_[peer] = Unavailable("peer " + config_.peers.Describe(peer) + ": " + s.message());
  if (first_dead_.ok()) first_dead_ = dead_[peer];
  {
    std::lock_guard<std::mutex> lock(mu_);  // Start may still wait for this peer (AwaitIncoming)
    if (lost_peer_.ok()) lost_peer_ = dead_[peer];
  }
  cv_.notify_all();
  // A peer that leaves while nothing is in flight has simply finished; say more only when it hurts.
  if (!stopping_ && (!ops_.empty() || !p2p_.idle())) {
    KF_LOG(Warning) << "rank " << rank() << ": " << dead_[peer].message() << "; failing " << ops_.size()
                    << " collective(s) and the requests to it in flight";
  } else {
    KF_LOG(Info) << "rank " << rank() << ": " << dead_[peer].message();
  }
  p2p_.OnPeerGone(peer, dead_[peer]);
  std::vector<uint64_t> ids;
  for (auto& [key, a] : ops_) ids.push_back(a.op->id);
  for (uint64_t id : ids) Fail(id, dead_[peer], false);
}

}  // namespace kungfu
