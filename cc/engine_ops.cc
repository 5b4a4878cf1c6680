// Engine: the op lifecycle (start, dispatch, finish, fail) and frame routing, all on the loop thread;
// what the loop does after each iteration (writes, judging, deadlines) is in engine_deadlines.cc.
#include <algorithm>
#include <chrono>

#include "cc/engine_impl.h"
#include "cc/log.h"

namespace kungfu {

namespace {
constexpr size_t kMaxAbortText = kMaxAbortBytes;
constexpr int kPoisonSource = -1;  // a pending entry the engine made itself (buffer overflow)
// Past max_pending_bytes, a collective whose frame was dropped is marked to fail when it starts (Poison);
// those marks count too, up to this much more. Beyond that (a flood of frames for thousands of names
// never started) frames are dropped unmarked: such a collective fails at its deadline instead.
constexpr int64_t kPoisonAllowance = int64_t{1} << 20;
constexpr int kPoisonLogSeconds = 5;

// What a held frame counts against max_pending_bytes: its payload, and its header and name, which a
// frame with no payload (an abort, an empty tensor's piece) is held for too.
int64_t HeldCost(const FrameHeader& h, const std::string& name) {
  return static_cast<int64_t>(h.payload_bytes + kFrameHeaderSize + name.size());
}
}  // namespace

// "allreduce 'grads'", and from a name's second call on which call it is ("allreduce 'loss' (call 18)"): a
// key that recurs every step, an unnamed eager collective's included, says how far this worker got.
std::string Engine::Impl::Describe(const Op& op) const {
  std::string what = std::string(op.kind()) + " '" + op.name() + "'";
  if (op.generation > 0) what += " (call " + std::to_string(op.generation + 1) + ")";
  return what;
}

void Engine::Impl::StartOp(std::unique_ptr<Op> op) {
  if (stopping_) {  // submitted as shutdown began; may run on the thread that stopped the loop
    op->done()(Cancelled(Describe(*op) + ": the engine is shutting down"));
    return;
  }
  const uint64_t id = next_op_id_++;
  op->id = id;
  const auto [count, fresh] = next_gen_.try_emplace(op->name(), 0);
  op->generation = count->second++;
  if (fresh && next_gen_.size() >= names_warn_at_) {
    KF_LOG(Warning) << "rank " << rank() << ": " << next_gen_.size()
                    << " distinct collective names so far, the latest '" << op->name()
                    << "': the engine keeps a count of each name's calls for the whole run, so names made fresh per "
                    << "call (with the step number in them, say) grow its memory without bound; give a collective "
                    << "that recurs the same name each time (its calls are told apart by that count)";
    names_warn_at_ *= 10;
  }
  const Key key(op->name(), op->generation);
  ++stats_.started;
  const int64_t now_in_flight = ++stats_.in_flight;
  int64_t prev = stats_.max_in_flight.load();
  while (now_in_flight > prev && !stats_.max_in_flight.compare_exchange_weak(prev, now_in_flight)) {
  }
  Op* raw = op.get();
  ops_[key] = ActiveOp{std::move(op), DeadlineAfter(config_.timeout_seconds)};
  op_keys_[id] = key;
  // What arrived before this worker started the collective is this op's now, whether it starts or
  // fails (later frames for the key are dropped as late: next_gen_ has moved past it).
  std::vector<PendingFrame> frames;
  auto pit = pending_.find(key);
  if (pit != pending_.end()) {
    frames = std::move(pit->second);
    pending_.erase(pit);
    for (auto& f : frames) pending_bytes_ -= f.cost;
  }
  if (size() > 1 && !first_dead_.ok()) return Fail(id, first_dead_, false);
  if (Status never = NeverJoined(*raw); !never.ok()) return Fail(id, never, false);
  // A frame dropped for want of buffer space fails the op before it sends anything: a peer that needed
  // only this worker's data (recursive doubling, an all-gather's block) would otherwise finish it while
  // this worker fails it. The abort reaches the peers first.
  for (auto& f : frames) {
    if (f.src == kPoisonSource) return Fail(id, ResourceExhausted(std::string(f.data.get())), true);
  }
  Status s = raw->Start(this);
  if (!s.ok()) return Fail(id, s, s.code() == Code::kInvalidArgument);
  // Deliver them in arrival order.
  for (auto& f : frames) {
    auto it = ops_.find(key);
    if (it == ops_.end()) break;  // failed by an earlier frame: drop the rest
    Dispatch(it->second, f.src, f.h, f.data.get());
  }
  MaybeFinish(id);
}

void Engine::Impl::Dispatch(ActiveOp& a, int src, const FrameHeader& h, const char* data) {
  Op* op = a.op.get();
  const uint64_t id = op->id;
  if (h.kind != FrameKind::kAbort) {  // first: another kind of collective also has another shape signature
    if (Status kind = CheckSameKind(config_.peers, src, h.algo, op->algo()); !kind.ok()) return Fail(id, kind, true);
  }
  if (h.kind != FrameKind::kAbort && h.shape_sig != op->shape_sig) {
    // Before the algorithm's own checks, so this also catches what differs in the element count.
    return Fail(id,
                InvalidArgument("peer " + config_.peers.Describe(src) + " passed a tensor of another shape or dtype (" +
                                std::to_string(h.count) + " elements there" +
                                (std::string(op->kind()) == "allreduce"
                                     ? "; for gradients, a gradient that is None on some workers only, or None for "
                                       "different variables on different workers, does this"
                                     : "") +
                                ")"),
                true);
  }
  Status s;
  switch (h.kind) {
    case FrameKind::kData:
      op->bytes_received += static_cast<int64_t>(h.payload_bytes);
      s = op->OnData(this, src, h, data);
      break;
    case FrameKind::kAck:
      s = op->OnAck(this, src, h);
      break;
    case FrameKind::kRequest:
    case FrameKind::kResponse:
    case FrameKind::kBye:
    case FrameKind::kFinalizing:
    case FrameKind::kTraits:
      return;  // never reach a collective: OnFrame routes them to p2p_, OnPeerLeft, OnPeerFinalizing, OnTraits
    case FrameKind::kAbort: {
      const int code = static_cast<int>(h.tag);
      const Code c = code >= 1 && code <= 14 ? static_cast<Code>(code) : Code::kUnknown;
      const std::string text(data ? data : "", data ? h.payload_bytes : 0);
      std::string why = text + " (reported by peer " + config_.peers.Describe(src) + ")";
      // A peer's deadline passed first: say what this worker was waiting for too, which can name the
      // stalled rank where the peer's view cannot (a star's root knows who is missing, its workers not).
      if (c == Code::kDeadlineExceeded) why += "; here: " + op->Progress();
      return Fail(id, Status(c, why), false);
    }
  }
  if (!s.ok()) return Fail(id, s, s.code() == Code::kInvalidArgument);
  MaybeFinish(id);
}

Engine::Impl::ActiveOp* Engine::Impl::FindById(uint64_t op_id, std::map<Key, ActiveOp>::iterator* out) {
  auto k = op_keys_.find(op_id);
  if (k == op_keys_.end()) return nullptr;
  auto it = ops_.find(k->second);
  if (it == ops_.end()) return nullptr;
  *out = it;
  return &it->second;
}

void Engine::Impl::MaybeFinish(uint64_t op_id) {
  std::map<Key, ActiveOp>::iterator it;
  ActiveOp* a = FindById(op_id, &it);
  if (a && a->op->outstanding_sends == 0 && a->op->ReceivedAll()) Finish(it, Status::OK());
}

void Engine::Impl::Fail(uint64_t op_id, Status s, bool tell_peers) {
  std::map<Key, ActiveOp>::iterator it;
  if (FindById(op_id, &it) == nullptr) return;
  if (tell_peers && size() > 1) SendAbort(it->first, s);
  Finish(it, s);
}

void Engine::Impl::Finish(std::map<Key, ActiveOp>::iterator it, const Status& s) {
  std::unique_ptr<Op> op = std::move(it->second.op);
  ops_.erase(it);
  op_keys_.erase(op->id);
  // No connection may touch the op's buffers once its callback has run.
  for (auto& c : in_) {
    if (c) c->AbandonTarget(op->id);
  }
  if (!s.ok()) {
    for (auto& c : out_) {
      if (c) c->CancelOp(op->id);
    }
  }
  --stats_.in_flight;
  const std::chrono::duration<double, std::milli> latency = Clock::now() - op->submitted;
  collective_stats_.Record(op->name(), s.ok(), op->bytes_sent, op->bytes_received, latency.count());
  if (s.ok()) {
    ++stats_.completed;
    timed_out_ = false;  // a collective that completes after a timeout: the worker has recovered
    op->done()(s);
  } else {
    ++stats_.failed;
    KF_LOG(Debug) << "rank " << rank() << ": " << Describe(*op) << " failed: " << s.ToString();
    op->done()(s.WithContext(Describe(*op)));
  }
}

void Engine::Impl::SendAbort(const Key& key, const Status& s) {
  std::string text = s.message().substr(0, kMaxAbortText);
  for (int d = 0; d < size(); ++d) {
    if (d == rank() || !out_[d] || out_[d]->broken() || left_[d]) continue;
    FrameHeader h;
    h.kind = FrameKind::kAbort;
    h.tag = static_cast<uint32_t>(s.code());
    h.generation = key.second;
    h.cluster_version = config_.peers.version();
    h.payload_bytes = text.size();
    Buffer payload = NewBuffer(text.size() + 1);
    std::copy(text.begin(), text.end(), payload.get());
    out_[d]->EnqueueOwned(h, key.first, std::move(payload), 0);
  }
}

void Engine::Impl::Send(Op* op, int dst, FrameHeader h, const void* data) {
  if (dst == rank() || dst < 0 || dst >= size() || !out_[dst]) {
    KF_LOG(Error) << Describe(*op) << ": no connection to rank " << dst;
    return;
  }
  if (left_[dst]) return;  // it has finished every collective it will take part in: nothing to send
  if (out_[dst]->broken()) return;  // the op fails through OnConnectionError
  h.generation = op->generation;
  h.cluster_version = config_.peers.version();
  h.shape_sig = op->shape_sig;
  out_[dst]->Enqueue(h, op->name(), data, op->id);
  ++op->outstanding_sends;
  op->bytes_sent += static_cast<int64_t>(h.payload_bytes);
  stats_.bytes_sent += static_cast<int64_t>(h.payload_bytes);
  // Write now rather than at the end of the loop iteration: a ring forwards each piece while the
  // next one is still arriving. Completions wait in sent_ until we are outside the op's code.
  if (!writing_[dst]) out_[dst]->Flush(&sent_);
}

void Engine::Impl::ReportSent() {
  while (!sent_.empty()) {
    std::vector<uint64_t> ids;
    ids.swap(sent_);
    for (uint64_t id : ids) OnSendDone(id);
  }
}

void Engine::Impl::OnSendDone(uint64_t op_id) {
  std::map<Key, ActiveOp>::iterator it;
  ActiveOp* a = FindById(op_id, &it);
  if (a == nullptr) return;
  --a->op->outstanding_sends;
  MaybeFinish(op_id);
}

char* Engine::Impl::PayloadTarget(int src, const FrameHeader& h, const std::string& name, bool* discard,
                                  uint64_t* owner) {
  if (h.kind == FrameKind::kResponse) {
    char* target = p2p_.PayloadTarget(src, h, discard, owner);
    // A dropped payload is still read from the socket: it counts in bytes_received (OnFrame counts the rest).
    if (*discard) stats_.bytes_received += static_cast<int64_t>(h.payload_bytes);
    return target;
  }
  if (h.kind != FrameKind::kData) return nullptr;
  const Key key(name, h.generation);
  auto it = ops_.find(key);
  if (it != ops_.end()) {
    char* target = it->second.op->DirectTarget(src, h);
    if (target) *owner = it->second.op->id;
    return target;
  }
  auto g = next_gen_.find(name);
  if (g != next_gen_.end() && h.generation < g->second) {  // the op already ended here
    *discard = true;
    stats_.bytes_received += static_cast<int64_t>(h.payload_bytes);
    return nullptr;
  }
  if (pending_bytes_ + HeldCost(h, name) > config_.max_pending_bytes) {
    *discard = true;
    stats_.bytes_received += static_cast<int64_t>(h.payload_bytes);
    Poison(key);
    return nullptr;
  }
  // The connection buffers it; charged now, while it arrives (OnFrame settles it).
  pending_bytes_ += static_cast<int64_t>(h.payload_bytes);
  receiving_[src] += static_cast<int64_t>(h.payload_bytes);
  return nullptr;
}

void Engine::Impl::Poison(const Key& key) {
  auto it = pending_.find(key);
  if (it != pending_.end()) {
    for (const PendingFrame& f : it->second) {
      if (f.src == kPoisonSource) return;  // said once per collective (a big one comes in many pieces)
    }
  }
  const std::string why = "more than " + std::to_string(config_.max_pending_bytes) +
                          " bytes arrived for collectives this worker had not started (the last for '" + key.first +
                          "'); raise KUNGFU_MAX_PENDING_BYTES or start collectives in a more similar order";
  FrameHeader h;
  h.generation = key.second;
  const int64_t cost = HeldCost(h, key.first) + static_cast<int64_t>(why.size()) + 1;
  if (pending_bytes_ + cost > config_.max_pending_bytes + kPoisonAllowance) {
    if (!poison_full_logged_) {
      KF_LOG(Warning) << "rank " << rank() << ": " << why << "; more frames for collectives not started are dropped";
      poison_full_logged_ = true;
    }
    return;
  }
  Buffer text = NewBuffer(why.size() + 1);
  std::copy(why.begin(), why.end() + 1, text.get());
  pending_[key].push_back(PendingFrame{kPoisonSource, h, std::move(text), cost});
  pending_bytes_ += cost;
  // Said at most once per kPoisonLogSeconds: a peer far ahead may overflow the bound for many names.
  const Deadline now = Clock::now();
  if (poison_logged_at_ && now - *poison_logged_at_ < std::chrono::seconds(kPoisonLogSeconds)) {
    ++poisons_unlogged_;
    return;
  }
  KF_LOG(Warning) << "rank " << rank() << ": " << why
                  << (poisons_unlogged_ ? " (and for " + std::to_string(poisons_unlogged_) +
                                              " more collectives since the last such message)"
                                        : std::string());
  poison_logged_at_ = now;
  poisons_unlogged_ = 0;
}

void Engine::Impl::SettleReceiving(int src) {
  auto r = receiving_.find(src);
  if (r == receiving_.end()) return;
  pending_bytes_ -= r->second;
  receiving_.erase(r);
}

void Engine::Impl::OnFrame(int src, const FrameHeader& h, std::string name, char* data,
                           Buffer owned) {
  if (h.kind == FrameKind::kData || h.kind == FrameKind::kResponse) {
    stats_.bytes_received += static_cast<int64_t>(h.payload_bytes);
  }
  if (h.kind == FrameKind::kRequest) return p2p_.OnRequest(src, h, name);
  if (h.kind == FrameKind::kResponse) return p2p_.OnResponse(src, h, data);
  if (h.kind == FrameKind::kTraits) return OnTraits(src, h, data);
  if (h.kind == FrameKind::kBye || h.kind == FrameKind::kFinalizing) {
    ReadStartedByName(src, data, h.payload_bytes);
    return h.kind == FrameKind::kBye ? OnPeerLeft(src, h.generation) : OnPeerFinalizing(src, h.generation);
  }
  SettleReceiving(src);  // counted again below if it stays pending
  const Key key(std::move(name), h.generation);
  auto it = ops_.find(key);
  if (h.cluster_version != config_.peers.version()) {
    const Status s = Aborted("peer " + config_.peers.Describe(src) + " works under cluster version " +
                             std::to_string(h.cluster_version) + ", this worker under " +
                             std::to_string(config_.peers.version()));
    if (it != ops_.end()) Fail(it->second.op->id, s, false);
    return;
  }
  if (it != ops_.end()) return Dispatch(it->second, src, h, data);
  auto g = next_gen_.find(key.first);
  if (g != next_gen_.end() && h.generation < g->second) return;  // late frame of an ended op
  if (h.payload_bytes > 0 && !owned) return;  // discarded for lack of buffer space (poisoned above)
  auto pit = pending_.find(key);
  if (pit != pending_.end()) {
    std::vector<PendingFrame>& held = pit->second;
    // Once an abort is held, the op will fail here on it when it starts, so data for it is of no use: it
    // is let go (what was held) or not kept (what comes later), rather than held for the life of the
    // process if the op never starts (a caught timeout whose late peer never calls it), counting against
    // the bound.
    const auto is_abort = [](const PendingFrame& f) { return f.src != kPoisonSource && f.h.kind == FrameKind::kAbort; };
    if (h.kind == FrameKind::kData && std::any_of(held.begin(), held.end(), is_abort)) return;
    if (h.kind == FrameKind::kAbort) {
      held.erase(std::remove_if(held.begin(), held.end(),
                                [this](const PendingFrame& f) {
                                  const bool drop = f.src != kPoisonSource && f.h.kind == FrameKind::kData;
                                  if (drop) pending_bytes_ -= f.cost;
                                  return drop;  // counted here, once per element: the tail is moved-from
                                }),
                 held.end());
    }
  }
  const int64_t cost = HeldCost(h, key.first);
  // A data frame's payload was measured against the bound as it arrived (PayloadTarget); every other
  // frame (one with no payload, an abort with its text) is measured here.
  const bool measured = h.kind == FrameKind::kData && h.payload_bytes > 0;
  if (!measured && pending_bytes_ + cost > config_.max_pending_bytes) return Poison(key);
  pending_bytes_ += cost;
  pending_[key].push_back(PendingFrame{src, h, std::move(owned), cost});
}

}  // namespace kungfu
