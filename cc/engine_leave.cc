// Engine: how workers leave. A clean leave (BYE after the finalize barrier) and the announcement that
// a worker has begun to finalize (FINALIZING before it), and what peers fail when they hear either.
// All on the loop thread.
#include "cc/engine_impl.h"
#include "cc/log.h"

namespace kungfu {

void Engine::Impl::SendGoodbyes() {
  for (int d = 0; d < size(); ++d) {
    if (d == rank() || !out_[d] || out_[d]->broken() || left_[d]) continue;
    FrameHeader h;
    h.kind = FrameKind::kBye;
    h.generation = next_op_id_ - 1;  // the collectives this worker started
    h.cluster_version = config_.peers.version();
    out_[d]->EnqueueOwned(h, "kungfu/bye", nullptr, 0);
  }
}

// A peer that leaves cleanly has finished every collective it started, and sent all it owed for them
// before its goodbye. In-flight collectives here that it took part in need nothing more from it; any
// it never started (this worker has started more) can never finish, so they fail now.
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
  if (next_op_id_ - 1 > started && !ops_.empty()) {
    const Status why = Unavailable(dead_[peer].message() + "; this worker started " +
                                   std::to_string(next_op_id_ - 1) + ", so some collective here never ran there");
    std::vector<uint64_t> ids;
    for (auto& [key, a] : ops_) ids.push_back(a.op->id);
    for (uint64_t id : ids) Fail(id, why, false);
  }
}

// Finalizing: this worker will start no collective but the finalize barrier. Peers learn how many it
// started before, so one that waits in a collective this worker never started (it left the training
// loop early: sys.exit, a return from main) fails at once instead of at its timeout, while this worker
// waits in the barrier. Posted in order with the barrier's own start, so that one is not counted.
void Engine::Impl::BeginFinalize() {
  if (finalized_after_ >= 0) return;
  finalized_after_ = static_cast<int64_t>(next_op_id_ - 1);
  for (int d = 0; d < size(); ++d) {
    if (d == rank() || !out_[d] || out_[d]->broken() || left_[d]) continue;
    FrameHeader h;
    h.kind = FrameKind::kFinalizing;
    h.generation = static_cast<uint64_t>(finalized_after_);
    h.cluster_version = config_.peers.version();
    out_[d]->EnqueueOwned(h, "kungfu/finalizing", nullptr, 0);
  }
}

// Counts compare across workers, as for a goodbye, because every worker's engine lives as long as the
// job (membership is fixed) and every collective involves every worker.
Status Engine::Impl::NeverJoined(uint64_t id) const {
  // Collectives this worker starts after its own BeginFinalize are the barrier, which every peer joins.
  if (finalized_after_ >= 0 && static_cast<int64_t>(id) > finalized_after_) return Status::OK();
  for (int p = 0; p < size(); ++p) {
    if (finalizing_[p] >= 0 && static_cast<int64_t>(id) > finalizing_[p]) {
      return Unavailable("peer " + config_.peers.Describe(p) + " has begun to finalize after " +
                         std::to_string(finalizing_[p]) + " collective(s) and will not join this worker's collective #" +
                         std::to_string(id) +
                         " (did it leave the training loop early: sys.exit, or a callback such as EarlyStopping that "
                         "decided from its own metrics, without MetricAverageCallback?)");
    }
  }
  return Status::OK();
}

void Engine::Impl::OnPeerFinalizing(int peer, uint64_t started) {
  if (!dead_[peer].ok()) return;
  finalizing_[peer] = static_cast<int64_t>(started);
  // Those in flight here that it never started can never finish. Which ones is unknown (workers may
  // start concurrent collectives in different orders), so, as for a goodbye, all of them fail: the
  // program has diverged anyway.
  std::vector<uint64_t> ids;
  Status why;
  for (auto& [key, a] : ops_) {
    Status never = NeverJoined(a.op->id);
    if (!never.ok()) why = never;
  }
  if (why.ok()) return;
  for (auto& [key, a] : ops_) {
    if (finalized_after_ < 0 || static_cast<int64_t>(a.op->id) <= finalized_after_) ids.push_back(a.op->id);
  }
  KF_LOG(Warning) << "rank " << rank() << ": " << why.message();
  for (uint64_t id : ids) Fail(id, why, false);
}

}  // namespace kungfu
